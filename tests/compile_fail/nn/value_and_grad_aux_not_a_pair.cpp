// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// value_and_grad with nn::has_aux of a function that returns only its loss: one error saying to
// return (loss, aux) or drop has_aux, not errors from unpacking the result.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using x_t = meshlib::local_tensor<float, 2, mesh_t>;

void check(const x_t& x) {
  namespace nn = meshlib::nn;
  (void)nn::value_and_grad([](const auto& a) { return nn::sum<0>(nn::sum<1>(a)); }, nn::has_aux)(x);
}

int main() {}

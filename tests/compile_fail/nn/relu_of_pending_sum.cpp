// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// relu of a product whose contraction is sharded over "model" (a pending sum over "model", before
// its psum): relu(a + b) is not relu(a) + relu(b). One error naming relu and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;
using w_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"model", meshlib::none>>>;

void check(meshlib::nn::relu<float>& act, const x_t& x, const w_t& w) {
  auto z = meshlib::matmul(x, w);  // a pending sum over "model"
  act.forward(z);
}

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A loss that is still a pending sum over "data" (the psum forgotten): value_and_grad needs one
// value every device agrees on. One error naming the loss's layout, not errors from the backward.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
constexpr meshlib::axis_mask data = mesh_t::mask_of<"data">();
using x_t = meshlib::local_tensor<float, 2, mesh_t, data, 0, meshlib::dim_masks<data, 0>>;

void check(const x_t& x) {
  (void)meshlib::nn::value_and_grad([](const auto& a) { return meshlib::nn::sum<0>(meshlib::nn::sum<1>(a)); })(x);
}

int main() {}

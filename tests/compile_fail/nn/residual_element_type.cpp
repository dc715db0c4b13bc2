// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A residual declared for float given doubles: one error naming residual and both element types,
// before its branches see the input (before, errors inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::residual<float, meshlib::nn::identity<float>>& res, const x_t& x) { (void)res.forward(x); }

int main() {}

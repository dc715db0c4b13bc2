// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A dropout declared for float given doubles: one error naming dropout and both element types
// (before, errors inside the layer or its inner layers).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::dropout<float>& dropout, const x_t& x) { (void)dropout.forward(x); }

int main() {}

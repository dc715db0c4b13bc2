// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A dense declared for float given doubles: one error naming dense and both element types (before, the
// layout error, whose layout looked right, said nothing of the element type).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::dense<float, mesh_t>& layer, const x_t& x) { (void)layer.forward(x); }

int main() {}

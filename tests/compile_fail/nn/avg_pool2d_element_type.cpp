// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// An avg_pool2d declared for float given doubles: one error naming avg_pool2d and both element
// types (before, the layout error said nothing of the element type).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::avg_pool2d<float, mesh_t>& pool, const x_t& x) { pool.forward(x); }

int main() {}

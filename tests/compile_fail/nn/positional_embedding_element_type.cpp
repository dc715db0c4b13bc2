// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A positional_embedding declared for float given doubles: one error naming the layer and both
// element types (before, a pointer conversion error inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::positional_embedding<float, mesh_t>& pos, const x_t& x) { pos.forward(x); }

int main() {}

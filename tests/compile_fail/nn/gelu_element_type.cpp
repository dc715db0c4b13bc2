// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A gelu declared for float given doubles: one error naming gelu and both element types (before, an
// assignment error inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::gelu<float>& act, const x_t& x) { act.forward(x); }

int main() {}

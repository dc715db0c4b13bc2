// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// dropout given a rank-3 (batch, sequence, features) block: one error naming dropout, the input's
// layout (three dims<...> entries) and what it needs, rank<2> (before, errors inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 3, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none, meshlib::none>>>;

void check(meshlib::nn::dropout<float>& drop, const x_t& x) { (void)drop.forward(x); }

int main() {}

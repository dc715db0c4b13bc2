// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// positional_embedding adds a replicated table row to every token: given features sharded over
// "model" it would add the wrong columns. One error naming the layer and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::positional_embedding<float, mesh_t>& pos, const x_t& x) { pos.forward(x); }

int main() {}

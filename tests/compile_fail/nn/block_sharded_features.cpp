// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// transformer_block given features sharded over its model axis: one error naming the block, the
// input's layout and what it needs (before, errors naming its inner layer_norm and dense layers).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::transformer_block<float, mesh_t>& blk, const x_t& x) { (void)blk.forward(x); }

int main() {}

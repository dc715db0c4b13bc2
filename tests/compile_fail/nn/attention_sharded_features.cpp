// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// causal_self_attention given features sharded over its model axis: one error naming the layer, the
// input's layout and what it needs (before, two errors naming its inner column_dense and row_dense).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::causal_self_attention<float, mesh_t>& attn, const x_t& x) { (void)attn.forward(x); }

int main() {}

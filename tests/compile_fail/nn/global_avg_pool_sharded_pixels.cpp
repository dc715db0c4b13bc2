// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// global_avg_pool given images whose pixels are sharded over "model": each device would average a
// slice of every channel's pixels. One error naming global_avg_pool and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::global_avg_pool<float, mesh_t>& gap, const x_t& x) { gap.forward(x); }

int main() {}

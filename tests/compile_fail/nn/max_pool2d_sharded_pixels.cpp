// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// max_pool2d given images whose pixels (the features) are sharded over "model" would pool a slice of
// every image: refused at compile time, in one error naming max_pool2d and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"batch">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"batch", "model">>>;

void check(meshlib::nn::max_pool2d<float, mesh_t>& pool, const x_t& x) { pool.forward(x); }

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// rms_norm over features sharded over "model" (the output of a column-parallel layer) would
// normalise each shard by its own root mean square: refused at compile time, in one error naming
// rms_norm and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::column_dense<float, mesh_t>& fc, meshlib::nn::rms_norm<float, mesh_t>& norm, const x_t& x) {
  auto h = fc.forward(x);  // (B, H/m), features sharded over "model"
  norm.forward(h);
}

int main() {}

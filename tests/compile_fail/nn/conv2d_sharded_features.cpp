// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// conv2d fed features sharded over "model" (the output of a column-parallel layer) would convolve
// a slice of every image's pixels: refused at compile time.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::column_dense<float, mesh_t>& fc, meshlib::nn::conv2d<float, mesh_t>& conv, const x_t& x) {
  auto h = fc.forward(x);  // (B, F/m), features sharded over "model"
  conv.forward(h);
}

int main() {}

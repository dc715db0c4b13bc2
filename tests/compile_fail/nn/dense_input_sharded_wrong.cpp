// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A column_dense used on its own, fed features sharded over "model" (the output of another
// column_dense): its weight needs complete features. One error from the layer, naming its kind,
// the input's layout and what it needs, instead of errors from inside matmul.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using h_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::column_dense<float, mesh_t>& fc, const h_t& h) {
  auto y = fc.forward(h);
  fc.backward(y);
}

int main() {}

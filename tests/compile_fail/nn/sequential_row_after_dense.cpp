// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// dense -> row_dense -> column_dense: the row_dense (layer 1) receives the dense's complete
// features where it needs them sharded over "model". One error, naming both layers.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;
using net_t = meshlib::nn::sequential<meshlib::nn::dense<float, mesh_t>, meshlib::nn::row_dense<float, mesh_t>,
                                      meshlib::nn::column_dense<float, mesh_t>>;

void check(net_t& net, const x_t& x) {
  auto y = net.forward(x);
  net.backward<x_t>(y);
}

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A tied_head given features sharded over its model axis "vocab" (the output of a column-parallel
// layer): its product with the vocabulary-sharded table needs complete features. One error naming
// tied_head, its model axis and the input's layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"vocab">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::column_dense<float, mesh_t, "vocab">& fc, meshlib::nn::tied_head<float, mesh_t, "vocab">& head,
           const x_t& x) {
  auto h = fc.forward(x);  // (B, H/v), features sharded over "vocab"
  (void)head.forward(h);
}

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A residual whose main branch, a column_dense, returns features sharded over "model" where its
// input's are complete: the sum is not elementwise. One error naming residual, the branch and its
// kind, the input's layout and the branch's output layout.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::residual<float, meshlib::nn::column_dense<float, mesh_t>>& res, const x_t& x) {
  (void)res.forward(x);
}

int main() {}

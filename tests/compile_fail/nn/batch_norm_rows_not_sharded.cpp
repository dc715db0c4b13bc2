// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// batch_norm fed a batch replicated over "data" would count every row once per data device in its
// synchronised statistics: refused at compile time.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<meshlib::none, meshlib::none>>>;

void check(meshlib::nn::batch_norm<float, mesh_t>& bn, const x_t& x) { bn.forward(x); }

int main() {}

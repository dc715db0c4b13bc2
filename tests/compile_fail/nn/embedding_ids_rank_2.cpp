// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// An embedding given (batch, sequence) ids rather than batch * sequence of them: one error naming the
// layer, its model axis and the ids' layout (two dims<...> entries).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using ids_t = meshlib::entry_local_t<std::int32_t, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::embedding<float, mesh_t>& tok, const ids_t& ids) { (void)tok.forward(ids); }

int main() {}

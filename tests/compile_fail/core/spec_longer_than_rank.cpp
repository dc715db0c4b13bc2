// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A two-entry spec cannot lay out a 1-D array.
#include <array>
#include <meshlib/core.hpp>
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using sharding_t = meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>;
int main() { meshlib::shard_layout<sharding_t, 1> l{sharding_t{mesh_t{2, 2}}, std::array<std::size_t, 1>{4}}; (void)l; }

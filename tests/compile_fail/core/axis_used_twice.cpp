// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A mesh axis may split at most one dimension.
#include <meshlib/core.hpp>
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
int main() { meshlib::named_sharding<mesh_t, meshlib::P<"data", "data">> s{mesh_t{2, 2}}; (void)s; }

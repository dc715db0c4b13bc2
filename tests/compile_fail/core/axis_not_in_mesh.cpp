// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A spec that names an axis the mesh does not have ("modle" for "model") must not compile.
#include <meshlib/core.hpp>
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
int main() { meshlib::named_sharding<mesh_t, meshlib::P<"data", "modle">> s{mesh_t{2, 2}}; (void)s; }

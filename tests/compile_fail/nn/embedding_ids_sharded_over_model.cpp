// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A vocabulary-parallel embedding whose ids are sharded over the model axis would look up different
// tokens on the devices whose partial rows its psum adds: refused at compile time, in one error.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using ids_t = meshlib::entry_local_t<std::int32_t, 1, meshlib::named_sharding<mesh_t, meshlib::P<"model">>>;

void check(meshlib::nn::embedding<float, mesh_t>& tok, const ids_t& ids) { (void)tok.forward(ids); }

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A vocabulary-parallel embedding given 64-bit ids (a tokenizer's default): one error naming the
// layer, its model axis, the ids' layout and their element type (before, a plain static_assert whose
// axes Clang printed as numbers).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using ids_t = meshlib::entry_local_t<std::int64_t, 1, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::embedding<float, mesh_t>& tok, const ids_t& ids) { (void)tok.forward(ids); }

int main() {}

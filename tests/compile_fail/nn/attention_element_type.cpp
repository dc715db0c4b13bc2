// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A causal_self_attention declared for float given doubles: one error naming causal_self_attention
// and both element types (before, errors inside the layer or its inner layers).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::causal_self_attention<float, mesh_t>& attn, const x_t& x) { (void)attn.forward(x); }

int main() {}

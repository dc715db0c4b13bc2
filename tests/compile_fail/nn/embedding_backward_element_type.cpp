// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// An embedding declared for float given a double cotangent by hand: one error naming embedding and
// both element types (before, a pointer conversion error inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using dy_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;

void check(meshlib::nn::embedding<float, mesh_t>& tok, const dy_t& dy) { (void)tok.backward(dy); }

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A tied_head declared for float given a double cotangent by hand: one error naming tied_head and
// both element types (before, errors from the matmuls inside the layer). The backwards of rms_norm,
// layer_norm, the pools, positional_embedding and the activations check the same.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using dy_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>>;

void check(meshlib::nn::tied_head<float, mesh_t>& head, const dy_t& dy) { (void)head.backward(dy); }

int main() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// An rms_norm declared for float given doubles: refused at compile time, in one error naming the
// layer and both element types (not a Kokkos constructor error from inside the layer).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x_t = meshlib::entry_local_t<double, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;

void check(meshlib::nn::rms_norm<float, mesh_t>& norm, const x_t& x) { norm.forward(x); }

int main() {}

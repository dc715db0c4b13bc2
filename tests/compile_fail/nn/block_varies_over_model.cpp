// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// transformer_block given complete features that vary over its model axis (pvary'd): the block adds
// its input to the attention's output, which the attention's psum makes the same on every device of
// "model". One error naming the block, the input's layout and what it needs (before, a plain
// static_assert naming no axis).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <utility>

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using x0_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>>>;
using x_t = decltype(meshlib::pvary<"model">(std::declval<const x0_t&>()));

void check(meshlib::nn::transformer_block<float, mesh_t>& blk, const x_t& x) { (void)blk.forward(x); }

int main() {}

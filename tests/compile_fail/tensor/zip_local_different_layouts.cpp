// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Inside shard_map: a value varying over 'data' and one varying over 'model' cannot be zipped.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using a_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"data">>>;
using b_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"model">>>;
void f(const a_t& a, const b_t& b) { (void)zip([](float x, float y) { return x * y; }, a, b); }

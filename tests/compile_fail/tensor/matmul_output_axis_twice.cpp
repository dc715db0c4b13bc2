// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// One axis cannot shard both the rows and the columns of the product.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using a_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"data">>>;
using b_t = entry_local_t<float, 2, named_sharding<mesh_t, P<none, "data">>>;
void f(const a_t& a, const b_t& b) { (void)matmul(a, b); }

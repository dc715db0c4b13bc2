// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The max of the parts of a pending sum is not the max of the sum.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using a_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"data", "model">>>;
void f(const a_t& a) { (void)max<0>(sum<1>(a)); }

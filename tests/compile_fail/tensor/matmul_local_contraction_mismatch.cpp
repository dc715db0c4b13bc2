// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Local view: the diagnostic names the contraction axes of both sides ('model' and none).
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using a_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"data", "model">>>;
using b_t = entry_local_t<float, 2, named_sharding<mesh_t, P<>>>;
void f(const a_t& a, const b_t& b) { (void)matmul(a, b); }

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Global view: lhs contraction dimension sharded on 'model', rhs contraction dimension replicated.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
void f(const sharded_tensor<float, 2, named_sharding<mesh_t, P<"data", "model">>>& a,
       const sharded_tensor<float, 2, named_sharding<mesh_t, P<none, "model">>>& b) {
  (void)matmul(a, b);
}

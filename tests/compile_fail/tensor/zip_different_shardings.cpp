// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// zip of two tensors with different specs must not compile, and must point to reshard.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
void f(const sharded_tensor<float, 2, named_sharding<mesh_t, P<"data">>>& a,
       const sharded_tensor<float, 2, named_sharding<mesh_t, P<"model">>>& b) {
  (void)(a + b);
}

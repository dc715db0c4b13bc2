// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// transpose<P...> needs a permutation of 0 .. rank-1.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">>;
void f(const sharded_tensor<float, 3, named_sharding<mesh_t, P<"data">>>& x) { (void)transpose<0, 2, 2>(x); }

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A pending sum plus a scalar would add the scalar once per part: psum first.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using a_t = entry_local_t<float, 2, named_sharding<mesh_t, P<"data", "model">>>;
void f(const a_t& a) { (void)(sum<1>(a) + 1.0f); }

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// slice<D> needs dimension D whole on every device: slicing the rows of a row-sharded block does not compile.
#include "meshlib/tensor.hpp"
using namespace meshlib;
using mesh_t = mesh<axis<"data">>;
constexpr axis_mask data = mesh_t::mask_of<"data">();
void f(const local_tensor<float, 2, mesh_t, data, 0, dim_masks<data, 0>>& x) { (void)slice<0>(x, 0, 1); }

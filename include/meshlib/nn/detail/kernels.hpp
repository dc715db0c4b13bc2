// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The small Kokkos kernels the training layers share: fill, converting copy, and a launch
/// over blocks of columns for column sums (bias gradients, norm parameters). Each is one RangePolicy
/// `parallel_for` on the running device's execution-space instance (`meshlib::launch`, the one
/// launch safe from concurrent device threads on Kokkos 3.4.1, see tensor/view.hpp), over memory
/// `Space`; the bodies are the plain loops they replaced, so the compiler vectorises them as before.
///
/// Column sums are deterministic: a work item owns a block of columns and adds the rows into them
/// in row order, so every column's sum is the same chain of additions on every mesh and backend
/// (bitwise), with no atomics and no `parallel_reduce` (unsafe from several device threads on
/// Kokkos 3.4.1). Within a block the rows are added a row at a time, contiguous over the block's
/// columns: the vectorised loop of the row-by-row sum it replaced.
/// @code
/// detail::fill_values<Space>(g, n, 0.0f);
/// detail::for_column_blocks<Space>(cols, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
///   for (std::size_t i = 0; i < rows; ++i)
///     for (std::size_t j = j0; j < j1; ++j) s[j] += x[i * cols + j];   // s = column sums of x
/// });
/// @endcode

#include <cstddef>
#include <type_traits>

#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// `p[i] = v` for `[0, n)` of memory `Space`, as a Kokkos kernel on the running device's instance.
template <class Space, class T>
void fill_values(T* p, std::size_t n, std::type_identity_t<T> v) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = v; });
}

/// `to[i] = To(from[i])` for `[0, n)` of memory `Space` (a copy, or a conversion such as float to
/// bfloat16), as a Kokkos kernel on the running device's instance.
template <class Space, class To, class From>
void convert_copy(To* to, const From* from, std::size_t n) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t i) { to[i] = static_cast<To>(from[i]); });
}

/// Columns per work item of `for_column_blocks`: a layer of up to 1024 outputs is one work item,
/// the row-by-row loop it replaced (its rows stream through memory in order); narrower blocks were
/// measured slower there (256 columns: 10-30% on a 256 x 1024 bias gradient, GCC 12 -O2, Serial),
/// and a wider layer still splits over a device's cores.
inline constexpr std::size_t column_block = 1024;

/// The work item of `for_column_blocks`: block `b` of `column_block` columns calls `f(j0, j1)`. A
/// class rather than a lambda: nvcc refuses an extended device lambda in a function templated on a
/// type local to another function (the caller's lambda `F`).
template <class F>
struct column_blocks_kernel {
  std::size_t cols;
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    const std::size_t j0 = b * column_block, j1 = j0 + column_block < cols ? j0 + column_block : cols;
    f(j0, j1);
  }
};

/// Calls `f(j0, j1)` for the blocks `[j0, j1)` of `[0, cols)`, `column_block` wide, as a Kokkos
/// kernel on memory `Space` on the running device's instance, one work item per block (see the
/// file comment). `f` is a `KOKKOS_LAMBDA` (it runs in the kernel), written outside code templated
/// on a mesh (nn/detail/layer_kernels.hpp says why).
template <class Space, class F>
void for_column_blocks(std::size_t cols, const F& f) {
  meshlib::launch<Space>((cols + column_block - 1) / column_block, column_blocks_kernel<F>{cols, f});
}

}  // namespace meshlib::nn::detail

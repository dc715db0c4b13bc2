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

/// Columns per work item of `for_column_blocks` on the host: a layer of up to 1024 outputs is one
/// work item, the row-by-row loop it replaced (its rows stream through memory in order); narrower
/// blocks were measured slower there (256 columns: 10-30% on a 256 x 1024 bias gradient, GCC 12
/// -O2, Serial), and a wider layer still splits over a device's cores.
inline constexpr std::size_t column_block = 1024;

/// Columns per work item of `for_column_blocks` in memory `Space`: `column_block` where the host
/// runs the kernel, one column on a GPU. There a 1024-column block made a layer's whole bias
/// gradient (and the activation's cotangent fused with it) one GPU thread; one column per thread
/// spreads the columns over the GPU's cores and lets neighbouring threads read neighbouring
/// elements of a row together. The sums are the same either way: every column's rows are added in
/// row order by one work item (not measured on a GPU yet).
template <class Space>
inline constexpr std::size_t column_block_for = host_accessible_v<Space> ? column_block : 1;

/// The work item of `for_column_blocks`: block `b` of `width` columns calls `f(j0, j1)`. A class
/// rather than a lambda: nvcc refuses an extended device lambda in a function templated on a type
/// local to another function (the caller's lambda `F`).
template <class F>
struct column_blocks_kernel {
  std::size_t cols, width;
  F f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t b) const {
    const std::size_t j0 = b * width, j1 = j0 + width < cols ? j0 + width : cols;
    f(j0, j1);
  }
};

/// Calls `f(j0, j1)` for the blocks `[j0, j1)` of `[0, cols)`, `column_block_for<Space>` wide, as
/// a Kokkos kernel on memory `Space` on the running device's instance, one work item per block (see
/// the file comment). `f` is a `KOKKOS_LAMBDA` (it runs in the kernel), written outside code
/// templated on a mesh (nn/detail/layer_kernels.hpp says why). An element-wise kernel over `n`
/// values uses it too: on the host its blocks of 1024 run on vectors (`for_each_lane`), on a GPU one
/// value per thread.
template <class Space, class F>
void for_column_blocks(std::size_t cols, const F& f) {
  constexpr std::size_t width = column_block_for<Space>;
  meshlib::launch<Space>((cols + width - 1) / width, column_blocks_kernel<F>{cols, width, f});
}

}  // namespace meshlib::nn::detail

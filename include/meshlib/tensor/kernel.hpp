// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The public kernel face: what a user writing a layer (and meshlib's own nn layer) needs to
/// run a kernel on a device's block and to hold device memory, without reaching into the tensor
/// layer's `detail` namespace:
/// - `launch<Space>(n, f)` runs `f(i)` for `i` in `[0, n)` on the running device's execution-space
///   instance for memory `Space`, and waits: a RangePolicy `parallel_for`, the one kind of launch
///   that is safe from many device threads (tensor/view.hpp says why); `f` captures raw pointers
///   (`block.data()`), never views;
/// - `allocate<T, Rank, Space>(extent, label)` makes a zero-filled block, safe from any device thread;
/// - `block_view<T, Rank, Space>` is the (owning) view of a block, `unmanaged_block_view` one that
///   does not count references (safe to copy between device threads);
/// - `copy_to_host<Space>`, `copy_from_host<Space>`, `read_back<Space>`, `host_readable<Space>` and
///   `edit_on_host<Space>` move a kernel's result to host code and caller data to a kernel;
///   `host_accessible_v<Space>` says whether host code may touch `Space` directly.
/// They are the tensor layer's own functions (the same entities, so a call that finds both by
/// argument-dependent lookup is not ambiguous).
/// @code
/// // y = 2 x on the running device (inside spmd / shard_map)
/// float* y = out.data();
/// const float* x = in.data();
/// meshlib::launch<meshlib::default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { y[i] = 2 * x[i]; });
/// auto scratch = meshlib::allocate<float, 1>({n}, "my_layer::scratch");   // zero-filled
/// @endcode

#include <cstddef>

#include "meshlib/tensor/view.hpp"

namespace meshlib {

/// @brief The view of a rank-`Rank` block of `T` in memory `Space`: row-major, as NumPy and JAX lay
/// arrays out; owns its memory (reference-counted: copy or drop it only on its device's thread).
template <class T, std::size_t Rank, class Space = default_memory_space>
using block_view = tensor::detail::block_view_t<T, Rank, Space>;

/// @brief A `block_view` that does not own its memory (no reference count: safe to copy between
/// device threads; the owner must outlive it).
template <class T, std::size_t Rank, class Space = default_memory_space>
using unmanaged_block_view = tensor::detail::unmanaged_view_t<T, Rank, Space>;

using tensor::detail::allocate;
using tensor::detail::copy_from_host;
using tensor::detail::copy_to_host;
using tensor::detail::edit_on_host;
using tensor::detail::host_accessible_v;
using tensor::detail::host_readable;
using tensor::detail::launch;
using tensor::detail::read_back;

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Copies of rectangular boxes between row-major buffers: what every collective does to
/// pack what it sends and unpack what it receives. Kernels in the blocks' memory space (issue 9:
/// no `std::vector` staging and host loops, so that device memory works unchanged), one index per
/// row: RangePolicy `parallel_for` through `launch`, the only launch that is safe from several
/// device threads on Kokkos 3.4.1 (tensor/view.hpp), over plain pointers.

#include <array>
#include <cstddef>
#include <span>

#include "meshlib/tensor/view.hpp"

namespace meshlib::collectives::detail {

/// Number of elements of a box of shape `e`.
template <std::size_t Rank>
constexpr std::size_t box_size(const std::array<std::size_t, Rank>& e) noexcept {
  std::size_t n = 1;
  for (auto x : e) n *= x;
  return n;
}

/// One row (the last dimension) per index of a box copy between row-major buffers: plain
/// pointers and fixed arrays, so it runs on any execution space and copies no View (view.hpp).
template <class T, std::size_t Rank>
struct box_copy_kernel {
  static constexpr std::size_t n = Rank == 0 ? 1 : Rank;
  const T* src;
  T* dst;
  std::size_t src_shape[n], src_off[n], dst_shape[n], dst_off[n], ext[n];

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t row) const {
    if constexpr (Rank == 0) {
      dst[0] = src[0];
    } else {
      std::size_t idx[n] = {};
      for (std::size_t k = Rank - 1; k-- > 0;) {  // row -> position in the box, last dimension excluded
        idx[k] = row % ext[k];
        row /= ext[k];
      }
      std::size_t s = 0, d = 0;
      for (std::size_t k = 0; k < Rank; ++k) {
        s = s * src_shape[k] + src_off[k] + idx[k];
        d = d * dst_shape[k] + dst_off[k] + idx[k];
      }
      for (std::size_t e = 0; e < ext[Rank - 1]; ++e) dst[d + e] = src[s + e];
    }
  }
};

/// Copies the box of extent `ext` at `src_off` in `src` (shape `src_shape`) to `dst_off` in `dst`
/// (shape `dst_shape`), both row-major and contiguous in memory `Space`: a kernel over the box's
/// rows on the running device's execution-space instance (`launch`).
template <class Space, class T, std::size_t Rank>
void copy_box(const T* src, const std::array<std::size_t, Rank>& src_shape, const std::array<std::size_t, Rank>& src_off,
              T* dst, const std::array<std::size_t, Rank>& dst_shape, const std::array<std::size_t, Rank>& dst_off,
              const std::array<std::size_t, Rank>& ext) {
  box_copy_kernel<T, Rank> k{src, dst, {}, {}, {}, {}, {}};
  if constexpr (Rank == 0) {
    launch<Space>(1, k);
  } else {
    if (box_size(ext) == 0) return;
    for (std::size_t d = 0; d < Rank; ++d) {
      k.src_shape[d] = src_shape[d];
      k.src_off[d] = src_off[d];
      k.dst_shape[d] = dst_shape[d];
      k.dst_off[d] = dst_off[d];
      k.ext[d] = ext[d];
    }
    launch<Space>(box_size(ext) / ext[Rank - 1], k);
  }
}

/// `n` contiguous elements from `src` to `dst` in memory `Space`, as a kernel.
template <class Space, class T>
void copy_elements(const T* src, std::size_t n, T* dst) {
  copy_box<Space>(src, std::array<std::size_t, 1>{n}, std::array<std::size_t, 1>{}, dst, std::array<std::size_t, 1>{n},
                  std::array<std::size_t, 1>{}, std::array<std::size_t, 1>{n});
}

/// `shape` with dimension `d` replaced by `v`.
template <std::size_t Rank>
constexpr std::array<std::size_t, Rank> with_extent(std::array<std::size_t, Rank> shape, std::size_t d, std::size_t v) noexcept {
  shape[d] = v;
  return shape;
}

/// Offset `o` along dimension `d`, zero elsewhere.
template <std::size_t Rank>
constexpr std::array<std::size_t, Rank> offset_along(std::size_t d, std::size_t o) noexcept {
  std::array<std::size_t, Rank> r{};
  r[d] = o;
  return r;
}

/// Which chunk block `r` of a packed buffer is: `order[r]`, or `r` when `order` is empty (the
/// group's rank order is the order written; see `written_order` in axis_group.hpp).
inline std::size_t chunk_of(std::span<const std::size_t> order, std::size_t r) noexcept {
  return order.empty() ? r : order[r];
}

/// Packs `src` (shape `shape`, memory `Space`) as `parts` consecutive blocks split along dimension
/// `d`: block r is chunk `chunk_of(order, r)`, the slab `[j*c, (j+1)*c)` of `d` for that j,
/// `c = shape[d] / parts`. (Packing and reordering are one pass: no staging buffer.)
template <class Space, class T, std::size_t Rank>
void pack_chunks(const T* src, const std::array<std::size_t, Rank>& shape, std::size_t d, std::size_t parts, T* dst,
                 std::span<const std::size_t> order = {}) {
  const std::size_t c = shape[d] / parts;
  const auto chunk = with_extent(shape, d, c);
  const std::size_t n = box_size(chunk);
  for (std::size_t r = 0; r < parts; ++r)
    copy_box<Space>(src, shape, offset_along<Rank>(d, chunk_of(order, r) * c), dst + r * n, chunk,
                    std::array<std::size_t, Rank>{}, chunk);
}

/// The inverse: `parts` consecutive blocks of shape `chunk` in `src`, block r placed as chunk
/// `chunk_of(order, r)` along dimension `d` of `dst` (whose extent along `d` is `parts * chunk[d]`).
template <class Space, class T, std::size_t Rank>
void unpack_chunks(const T* src, const std::array<std::size_t, Rank>& chunk, std::size_t d, std::size_t parts, T* dst,
                   std::span<const std::size_t> order = {}) {
  const auto shape = with_extent(chunk, d, chunk[d] * parts);
  const std::size_t n = box_size(chunk);
  for (std::size_t r = 0; r < parts; ++r)
    copy_box<Space>(src + r * n, chunk, std::array<std::size_t, Rank>{}, dst, shape,
                    offset_along<Rank>(d, chunk_of(order, r) * chunk[d]), chunk);
}

}  // namespace meshlib::collectives::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Copies of rectangular boxes between row-major buffers: what every collective does to
/// pack what it sends and unpack what it receives. Plain host loops on purpose: they run on the
/// device threads, and only RangePolicy kernels are safe to launch from them on Kokkos 3.4.1
/// (see tensor/view.hpp); a row-by-row `std::copy` is as fast as a kernel for a copy anyway.

#include <algorithm>
#include <array>
#include <cstddef>

namespace meshlib::detail {

/// Number of elements of a box of shape `e`.
template <std::size_t Rank>
constexpr std::size_t box_size(const std::array<std::size_t, Rank>& e) noexcept {
  std::size_t n = 1;
  for (auto x : e) n *= x;
  return n;
}

/// Copies the box of extent `ext` at `src_off` in `src` (shape `src_shape`) to `dst_off` in `dst`
/// (shape `dst_shape`). Both row-major and contiguous.
template <class T, std::size_t Rank>
void copy_box(const T* src, const std::array<std::size_t, Rank>& src_shape, const std::array<std::size_t, Rank>& src_off,
              T* dst, const std::array<std::size_t, Rank>& dst_shape, const std::array<std::size_t, Rank>& dst_off,
              const std::array<std::size_t, Rank>& ext) {
  if constexpr (Rank == 0) {
    *dst = *src;
  } else {
    if (box_size(ext) == 0) return;
    std::array<std::size_t, Rank> idx{};  // position within the box, last dimension excluded
    const std::size_t row = ext[Rank - 1];
    while (true) {
      std::size_t s = 0, d = 0;
      for (std::size_t k = 0; k < Rank; ++k) {
        s = s * src_shape[k] + src_off[k] + idx[k];
        d = d * dst_shape[k] + dst_off[k] + idx[k];
      }
      std::copy_n(src + s, row, dst + d);
      // Advance over every dimension but the last.
      std::size_t k = Rank - 1;
      while (k > 0) {
        --k;
        if (++idx[k] < ext[k]) break;
        idx[k] = 0;
        if (k == 0) return;
      }
      if constexpr (Rank == 1) return;
    }
  }
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

/// Packs `src` (shape `shape`) as `parts` consecutive chunks split along dimension `d`: chunk j is
/// the slab `[j*c, (j+1)*c)` of `d`, `c = shape[d] / parts`.
template <class T, std::size_t Rank>
void pack_chunks(const T* src, const std::array<std::size_t, Rank>& shape, std::size_t d, std::size_t parts, T* dst) {
  const std::size_t c = shape[d] / parts;
  const auto chunk = with_extent(shape, d, c);
  const std::size_t n = box_size(chunk);
  for (std::size_t j = 0; j < parts; ++j)
    copy_box(src, shape, offset_along<Rank>(d, j * c), dst + j * n, chunk, std::array<std::size_t, Rank>{}, chunk);
}

/// The inverse: `parts` consecutive chunks of shape `chunk` in `src` placed side by side along
/// dimension `d` of `dst` (whose extent along `d` is `parts * chunk[d]`).
template <class T, std::size_t Rank>
void unpack_chunks(const T* src, const std::array<std::size_t, Rank>& chunk, std::size_t d, std::size_t parts, T* dst) {
  const auto shape = with_extent(chunk, d, chunk[d] * parts);
  const std::size_t n = box_size(chunk);
  for (std::size_t j = 0; j < parts; ++j)
    copy_box(src + j * n, chunk, std::array<std::size_t, Rank>{}, dst, shape, offset_along<Rank>(d, j * chunk[d]), chunk);
}

}  // namespace meshlib::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The kernels of max, average and global average pooling over NHWC images (rows of
/// `height * width * channels` values): one work item per output pixel forward, one per input pixel
/// backward (each gathers from the windows that contain it: no atomics, the same bits on every
/// backend). Free functions over pointers, templated on the element type and the memory space only,
/// for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// Max (`Max`, with the winning pixel in `arg`) or average pooling of `n` images `h x wd x c` with
/// `k x k` windows at stride `s` into `ho x wo` outputs (`inv` = 1 / (k * k)).
template <class Space, bool Max, class T>
void pool_forward(T* y, std::uint32_t* arg, const T* xp, std::size_t n, std::size_t h, std::size_t wd, std::size_t c,
                  std::size_t ho, std::size_t wo, std::size_t k, std::size_t s, T inv) {
  meshlib::launch<Space>(n * ho * wo, KOKKOS_LAMBDA(std::size_t r) {
    // Plain `if` on Max below, not `if constexpr`: nvcc refuses a device lambda whose first use
    // of a captured variable is inside an `if constexpr`. Max is a constant: the same code results.
    const std::size_t img = r / (ho * wo), oh = r / wo % ho, ow = r % wo;
    const T* x0 = xp + img * h * wd * c;  // the image's first value
    // Channels in lanes (`for_each_lane`), each lane comparing (or adding) over the window in the
    // window's order as one channel's loop did: the same maximum, the same first winner on ties.
    // Winners are 32-bit pixel indices: lanes of them match float lanes only.
    for_each_lane<T, std::is_same_v<T, float>>(0, c, [&](std::size_t ch, auto lane) {
      using L = decltype(lane);
      using U = lane_index_t<L>;
      const std::size_t first = (oh * s) * wd + ow * s;
      L acc = Max ? load_as(x0 + first * c, ch, lane) : L{};
      U best = splat_as<U>(static_cast<std::uint32_t>(first));
      for (std::size_t i = 0; i < k; ++i)
        for (std::size_t j = 0; j < k; ++j) {
          const std::size_t pix = (oh * s + i) * wd + ow * s + j;
          const L v = load_as(x0 + pix * c, ch, lane);
          if (Max) {
            const auto wins = v > acc;
            acc = wins ? v : acc;
            best = wins ? splat_as<U>(static_cast<std::uint32_t>(pix)) : best;
          } else {
            acc += v;
          }
        }
      if (Max) {
        store_at(y + r * c, ch, acc);
        store_at(arg + r * c, ch, best);
      } else {
        store_at(y + r * c, ch, acc * splat_as<L>(inv));
      }
    });
  });
}

/// The input cotangent of `pool_forward` from the output cotangent `d`.
template <class Space, bool Max, class T>
void pool_backward(T* dx, const std::uint32_t* arg, const T* d, std::size_t n, std::size_t h, std::size_t wd,
                   std::size_t c, std::size_t ho, std::size_t wo, std::size_t k, std::size_t s, T inv) {
  meshlib::launch<Space>(n * h * wd, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t img = q / (h * wd), ih = q / wd % h, iw = q % wd, pix = ih * wd + iw;
    T* dst = dx + q * c;
    // The windows containing (ih, iw): oh * s <= ih < oh * s + k.
    const std::size_t oh0 = ih + 1 > k ? (ih + 1 - k + s - 1) / s : 0, ow0 = iw + 1 > k ? (iw + 1 - k + s - 1) / s : 0;
    // Channels in lanes, each adding its windows' terms in the windows' order as one channel's loop
    // did; a max-pooling lane adds only where this pixel won (a select: no branch to mispredict).
    for_each_lane<T, std::is_same_v<T, float>>(0, c, [&](std::size_t ch, auto lane) {
      using L = decltype(lane);
      using U = lane_index_t<L>;
      L acc{};
      for (std::size_t oh = oh0; oh < ho && oh * s <= ih; ++oh)
        for (std::size_t ow = ow0; ow < wo && ow * s <= iw; ++ow) {
          const std::size_t r = (img * ho + oh) * wo + ow;
          const L dv = load_as(d + r * c, ch, lane);
          if (Max) {
            const auto won = load_as(arg + r * c, ch, U{}) == splat_as<U>(static_cast<std::uint32_t>(pix));
            acc = won ? acc + dv : acc;
          } else {
            acc += dv * splat_as<L>(inv);
          }
        }
      store_at(dst, ch, acc);
    });
  });
}

/// Global average pooling of `n` images of `hw` pixels and `c` channels (`inv` = 1 / hw).
template <class Space, class T>
void global_pool_forward(T* y, const T* xp, std::size_t n, std::size_t hw, std::size_t c, T inv) {
  meshlib::launch<Space>(n, KOKKOS_LAMBDA(std::size_t img) {
    T* yi = y + img * c;
    const T* xi = xp + img * hw * c;
    for (std::size_t ch = 0; ch < c; ++ch) yi[ch] = T{0};
    for (std::size_t q = 0; q < hw; ++q)  // pixels in order, each a contiguous run of channels
      for (std::size_t ch = 0; ch < c; ++ch) yi[ch] += xi[q * c + ch];
    for (std::size_t ch = 0; ch < c; ++ch) yi[ch] *= inv;
  });
}

/// `dx = dy / (H * W)` on every pixel.
template <class Space, class T>
void global_pool_backward(T* dx, const T* d, std::size_t n, std::size_t hw, std::size_t c, T inv) {
  meshlib::launch<Space>(n * hw, KOKKOS_LAMBDA(std::size_t q) {
    const T* di = d + q / hw * c;
    for (std::size_t ch = 0; ch < c; ++ch) dx[q * c + ch] = di[ch] * inv;
  });
}

}  // namespace meshlib::nn::detail

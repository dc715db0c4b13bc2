// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The Kokkos kernels of `conv2d` (NHWC images, HWIO weight flattened to
/// `kernel*kernel*C_in x C_out`): im2col over a range of output pixels (and the 1x1 row gather), the
/// direct convolution and its weight gradient, and col2im as a gather.
///
/// Why: the convolution is the product `patches (M x K) x W (K x C_out)` with `M = N*Ho*Wo`,
/// `K = kernel*kernel*C_in`. im2col into one `M x K` buffer writes (and the product reads back) K
/// values per output pixel through memory; for `K = 144` that buffer is larger than the product's
/// output. `conv2d` therefore runs im2col on blocks of output pixels whose patches fit in the cache
/// and multiplies each block at once; and where the product is thin (`K` of 9 or 27: the first layer
/// of an image network) or narrow (at most 16 output channels), `direct_conv` computes each output
/// pixel from the input, 16 output channels at a time in vector registers, with no patch at all.
/// (`conv2d::algorithm()` has the rule and what was measured.)
///
/// Every kernel is one RangePolicy `parallel_for` on the running device's instance
/// (`meshlib::launch`, see tensor/view.hpp), over raw pointers, one work item per output
/// image row (or input pixel, or block of values) that writes only its own part: no atomics, the
/// same bits on every run. The host's vector forms (`MESHLIB_NN_ROW_LANES`) are compiled out for
/// device code, which runs the plain loops.
/// @code
/// detail::conv_geometry g{h, w, cin, ho, wo, cout, k, s, p};
/// detail::im2col<Space>(cols, x, g, r0, r1);   // rows r0..r1 of the patch matrix, cols holds (r1 - r0) x K
/// @endcode

#include <cstddef>
#include <cstring>

#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// The sizes of one convolution: input `h x w x cin`, output `ho x wo x cout`, a `k x k` kernel,
/// stride `s`, zero padding `p` (a plain aggregate: it is copied into the kernels).
struct conv_geometry {
  std::size_t h, w, cin, ho, wo, cout, k, s, p;

  /// `K`: values in one patch (a row of the patch matrix, a row of the weight).
  KOKKOS_INLINE_FUNCTION std::size_t patch() const { return k * k * cin; }
  /// The kernel offsets `[lo, hi)` along one axis whose input coordinate `o * s + i - p` lies in
  /// `[0, extent)` for output coordinate `o` (empty when the window lies in the padding).
  KOKKOS_INLINE_FUNCTION void window(std::size_t o, std::size_t extent, std::size_t& lo, std::size_t& hi) const {
    const std::size_t start = o * s;  // the window's first row, in padded coordinates
    lo = start < p ? p - start : 0;
    hi = extent + p > start ? (extent + p - start < k ? extent + p - start : k) : 0;
    if (lo > hi) lo = hi;
  }
};

/// `dst[e] = src[e]` (or `T{0}` when `src` is null) for `e < n`, in native vectors (`for_each_lane`):
/// GCC turns a plain copy loop of unknown length into a `memcpy` / `memset` call, which costs more
/// than the copy for the short runs of a patch (16 values in a 1x1 convolution: measured a third of
/// that layer's forward), and at -O2 keeps a loop of constant chunks scalar (the pointers might overlap).
template <class T>
KOKKOS_INLINE_FUNCTION void copy_run(T* dst, const T* src, std::size_t n) {
  if (src != nullptr)
    for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, load_as(src, e, lane)); });
  else
    for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, decltype(lane){}); });
}

/// `dst[e] += src[e]` for `e < n`, in native vectors (`for_each_lane`).
template <class T>
KOKKOS_INLINE_FUNCTION void add_run(T* dst, const T* src, std::size_t n) {
  for_each_lane<T>(0, n, [&](std::size_t e, auto lane) { store_at(dst, e, load_as(dst, e, lane) + load_as(src, e, lane)); });
}

/// Rows `[r0, r1)` of `y` (`cout` wide) set to `bias`.
template <class Space, class T>
void bias_rows(T* y, const T* bias, std::size_t cout, std::size_t r0, std::size_t r1) {
  meshlib::launch<Space>(r1 - r0, KOKKOS_LAMBDA(std::size_t q) { copy_run(y + (r0 + q) * cout, bias, cout); });
}

/// Rows `[r0, r1)` of the patch matrix into `cols` (`(r1 - r0) x K`, row-major): the `k x k` window
/// of each output pixel, zeros where it hangs over the padding. The window's `k` rows are runs of
/// `k * cin` contiguous input values (NHWC), copied straight. Also sets rows `[r0, r1)` of `y`
/// (`M x cout`) to `bias` when `bias` is not null, so the product can add to them while they are
/// still in the cache. One work item per output image row (the part of it in `[r0, r1)`): the
/// pixel's coordinates come from one division per row, not three per pixel (64-bit divisions
/// cost more than a small patch's copy).
template <class Space, class T>
void im2col(T* cols, const T* x, const conv_geometry g, std::size_t r0, std::size_t r1, T* y = nullptr,
            const T* bias = nullptr) {
  if (r1 <= r0) return;
  const std::size_t t0 = r0 / g.wo, t1 = (r1 - 1) / g.wo + 1;  // output image rows (img * ho + oh)
  meshlib::launch<Space>(t1 - t0, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t t = t0 + q, img = t / g.ho, oh = t % g.ho, run = g.k * g.cin, kk = g.patch();
    const std::size_t ow0 = t * g.wo < r0 ? r0 - t * g.wo : 0, ow1 = (t + 1) * g.wo > r1 ? r1 - t * g.wo : g.wo;
    if (g.k == 1 && g.p == 0) {  // a 1x1 window: a gather of every s-th pixel's channels
      const T* src = x + ((img * g.h + oh * g.s) * g.w + ow0 * g.s) * g.cin;
      for (std::size_t ow = ow0; ow < ow1; ++ow, src += g.s * g.cin) {
        const std::size_t r = t * g.wo + ow;
        copy_run(cols + (r - r0) * g.cin, src, g.cin);
        if (bias != nullptr) copy_run(y + r * g.cout, bias, g.cout);
      }
      return;
    }
    std::size_t i0, i1;
    g.window(oh, g.h, i0, i1);
    for (std::size_t ow = ow0; ow < ow1; ++ow) {
      std::size_t j0, j1;
      g.window(ow, g.w, j0, j1);
      const std::size_t r = t * g.wo + ow;
      T* dst = cols + (r - r0) * kk;
      for (std::size_t i = 0; i < g.k; ++i, dst += run) {
        if (i < i0 || i >= i1 || j0 == j1) {
          copy_run(dst, static_cast<const T*>(nullptr), run);
          continue;
        }
        const T* src = x + ((img * g.h + (oh * g.s + i - g.p)) * g.w + (ow * g.s + j0 - g.p)) * g.cin;
        const std::size_t a = j0 * g.cin, b = j1 * g.cin;
        copy_run(dst, static_cast<const T*>(nullptr), a);
        copy_run(dst + a, src, b - a);
        copy_run(dst + b, static_cast<const T*>(nullptr), run - b);
      }
      if (bias != nullptr) copy_run(y + r * g.cout, bias, g.cout);
    }
  });
}

/// Output channels one pass of `direct_conv` keeps in registers per pixel.
inline constexpr std::size_t direct_lanes = 16;

// The direct kernel's lanes as the host's native vectors (`simd_of<T>`, nn/detail/simd.hpp): left
// to the auto-vectoriser, GCC vectorises a tile of pixels across the pixels (4-wide, with shuffles)
// instead of across the output channels, and at -O2 keeps the accumulators in memory; measured 4-8x
// slower than these explicit vectors (docs/benchmarks.md). Device compilers take the plain loop.
#if MESHLIB_NN_ROW_LANES
#if defined(__clang__)
#define MESHLIB_CONV_UNROLL _Pragma("unroll")
#else
#define MESHLIB_CONV_UNROLL _Pragma("GCC unroll 16")
#endif
/// Native vectors per `direct_lanes` values of `T`.
template <class T>
inline constexpr std::size_t direct_vectors = direct_lanes * sizeof(T) / simd_bytes;
/// Pixels per tile: accumulators in about 12 vector registers (16 on SSE and AVX, 32 on AVX-512),
/// the rest for the weight row; at most 8.
template <class T>
inline constexpr std::size_t direct_pixels =
    direct_vectors<T> >= 12 ? 1 : (12 / direct_vectors<T> > 8 ? 8 : 12 / direct_vectors<T>);
#else
template <class T>
inline constexpr std::size_t direct_pixels = 1;
#endif

/// `out[o] = (bias ? bias[o0 + o] : 0) + sum over the window of x * W` for the `n` (at most
/// `direct_lanes`) output channels from `o0` of one output pixel whose window is `[i0, i1) x
/// [j0, j1)` from input value `src` (its first in-image window row), in the window's order (kernel
/// row, column, input channel): the accumulation order of the patch product. The portable form.
template <class T>
KOKKOS_INLINE_FUNCTION void direct_scalar(T* out, const T* src, const T* wt, const T* bias, const conv_geometry& g,
                                          std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1,
                                          std::size_t o0, std::size_t n) {
  T acc[direct_lanes];
  for (std::size_t o = 0; o < n; ++o) acc[o] = bias != nullptr ? bias[o0 + o] : T{0};
  for (std::size_t i = i0; i < i1; ++i, src += g.w * g.cin) {
    const T* wrow = wt + ((i * g.k + j0) * g.cin) * g.cout + o0;
    for (std::size_t e = 0, end = (j1 - j0) * g.cin; e < end; ++e, wrow += g.cout) {
      const T v = src[e];
      for (std::size_t o = 0; o < n; ++o) acc[o] += v * wrow[o];
    }
  }
  for (std::size_t o = 0; o < n; ++o) out[o] = acc[o];
}

#if MESHLIB_NN_ROW_LANES
/// `direct_scalar` for `direct_lanes` channels of `Pixels` consecutive output pixels with the same
/// window (pixel `q` reads from `src + q * s * cin`, writes `out + q * cout`), in native vectors:
/// independent accumulators, so the FMAs of the pixels overlap instead of waiting on one pixel's
/// chain of dependent additions, and each weight row is loaded once for all of them. The same
/// operations in the same order per value as `direct_scalar` (the compiler contracts `a * b + c`
/// into an FMA in both forms alike).
template <std::size_t Pixels, class T>
inline void direct_vector_tile(T* out, const T* src, const T* wt, const T* bias, const conv_geometry& g,
                               std::size_t i0, std::size_t i1, std::size_t j0, std::size_t j1, std::size_t o0) {
  using vec = typename simd_of<T>::type;
  constexpr std::size_t nv = direct_vectors<T>, per = simd_bytes / sizeof(T);
  const std::size_t step = g.s * g.cin;
  vec acc[Pixels][nv];
  vec init[nv];
  MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
    init[v] = vec{};
    if (bias != nullptr) std::memcpy(&init[v], bias + o0 + v * per, sizeof(vec));
  }
  MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v)
    acc[q][v] = init[v];
  for (std::size_t i = i0; i < i1; ++i, src += g.w * g.cin) {
    const T* wrow = wt + ((i * g.k + j0) * g.cin) * g.cout + o0;
    for (std::size_t e = 0, end = (j1 - j0) * g.cin; e < end; ++e, wrow += g.cout) {
      vec wv[nv];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) std::memcpy(&wv[v], wrow + v * per, sizeof(vec));
      MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) {
        const T a = src[q * step + e];
        MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) acc[q][v] += a * wv[v];
      }
    }
  }
  MESHLIB_CONV_UNROLL for (std::size_t q = 0; q < Pixels; ++q) MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v)
    std::memcpy(out + q * g.cout + v * per, &acc[q][v], sizeof(vec));
}
#endif

/// `Pixels` consecutive output pixels from `ow` of output image row `t` (with the same window),
/// every output channel: `direct_lanes` at a time, the rest of them (fewer) in the portable form.
template <std::size_t Pixels, class T>
KOKKOS_INLINE_FUNCTION void direct_pixels_of(T* y, const T* x, const T* wt, const T* bias, const conv_geometry& g,
                                             std::size_t t, std::size_t ow, std::size_t i0, std::size_t i1,
                                             std::size_t j0, std::size_t j1) {
  const std::size_t img = t / g.ho, oh = t % g.ho;
  const bool empty = j0 == j1 || i0 == i1;  // a window in the padding: the bias only
  if (empty) i1 = i0;
  const T* src = empty ? x : x + ((img * g.h + (oh * g.s + i0 - g.p)) * g.w + (ow * g.s + j0 - g.p)) * g.cin;
  T* out = y + (t * g.wo + ow) * g.cout;
  std::size_t o0 = 0;
#if MESHLIB_NN_ROW_LANES
  for (; o0 + direct_lanes <= g.cout; o0 += direct_lanes)
    direct_vector_tile<Pixels>(out + o0, src, wt, bias, g, i0, i1, j0, j1, o0);
#endif
  for (std::size_t q = 0; q < Pixels; ++q)
    for (std::size_t c = o0; c < g.cout; c += direct_lanes)
      direct_scalar(out + q * g.cout + c, src + q * g.s * g.cin, wt, bias, g, i0, i1, j0, j1, c,
                    g.cout - c < direct_lanes ? g.cout - c : direct_lanes);
}

/// The direct convolution: `y (M x cout) = patches x wt (+ bias)` without forming the patches, one
/// work item per output image row (one division per row, as `im2col`): the pixels whose window
/// lies inside the image `direct_pixels<T>` at a time, the others (at the padding) one by one.
template <class Space, class T>
void direct_conv(T* y, const T* x, const T* wt, const T* bias, const conv_geometry g, std::size_t images) {
  // Output columns whose window lies inside the image: ow * s >= p and ow * s + k <= w + p.
  const std::size_t lo = (g.p + g.s - 1) / g.s, hi_end = g.w + g.p >= g.k ? (g.w + g.p - g.k) / g.s + 1 : 0;
  const std::size_t hi = hi_end < g.wo ? hi_end : g.wo;
  meshlib::launch<Space>(images * g.ho, KOKKOS_LAMBDA(std::size_t t) {
    constexpr std::size_t tile = direct_pixels<T>;
    std::size_t i0, i1, j0, j1;
    g.window(t % g.ho, g.h, i0, i1);
    std::size_t ow = 0;
    for (; ow < lo && ow < g.wo; ++ow) {  // the left edge (and all of a row narrower than a tile)
      g.window(ow, g.w, j0, j1);
      direct_pixels_of<1>(y, x, wt, bias, g, t, ow, i0, i1, j0, j1);
    }
    for (; ow + tile <= hi; ow += tile) direct_pixels_of<tile>(y, x, wt, bias, g, t, ow, i0, i1, 0, g.k);
    for (; ow < g.wo; ++ow) {
      g.window(ow, g.w, j0, j1);
      direct_pixels_of<1>(y, x, wt, bias, g, t, ow, i0, i1, j0, j1);
    }
  });
}

/// `out[o] = sum over q < count of a[q * stride] * d[q * n + o]` for `o < n`: one tap's row of the
/// weight gradient over a run of output pixels. On the host, `direct_lanes` columns at a time in
/// native vectors with two accumulators (even and odd pixels, added at the end: a fixed order), so
/// the sum stays in registers instead of a load and store per pixel.
template <class T>
KOKKOS_INLINE_FUNCTION void tap_gradient(T* out, const T* a, std::size_t stride, const T* d, std::size_t n,
                                         std::size_t count) {
  std::size_t o = 0;
#if MESHLIB_NN_ROW_LANES
  using vec = typename simd_of<T>::type;
  constexpr std::size_t nv = direct_vectors<T>, per = simd_bytes / sizeof(T);
  for (; o + direct_lanes <= n; o += direct_lanes) {
    vec even[nv], odd[nv];
    MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) even[v] = odd[v] = vec{};
    std::size_t q = 0;
    for (; q + 2 <= count; q += 2) {
      const T a0 = a[q * stride], a1 = a[(q + 1) * stride];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
        vec d0, d1;
        std::memcpy(&d0, d + q * n + o + v * per, sizeof(vec));
        std::memcpy(&d1, d + (q + 1) * n + o + v * per, sizeof(vec));
        even[v] += a0 * d0;
        odd[v] += a1 * d1;
      }
    }
    if (q < count) {
      const T a0 = a[q * stride];
      MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
        vec d0;
        std::memcpy(&d0, d + q * n + o + v * per, sizeof(vec));
        even[v] += a0 * d0;
      }
    }
    MESHLIB_CONV_UNROLL for (std::size_t v = 0; v < nv; ++v) {
      const vec sum = even[v] + odd[v];
      std::memcpy(out + o + v * per, &sum, sizeof(vec));
    }
  }
#endif
  for (; o < n; ++o) {
    T sum{0};
    for (std::size_t q = 0; q < count; ++q) sum += a[q * stride] * d[q * n + o];
    out[o] = sum;
  }
}

/// The weight gradient of the direct convolution without patches, first half: `part[t]` (`K x
/// cout`, row-major) `= sum over the output pixels of image row t of patch^T dy`, one work item per
/// output image row (it owns its block of `part`, so no atomics): for each tap `(i, j, c)` of the
/// window, the output pixels whose window reads the image there. `direct_grad_w_sum` adds the blocks.
template <class Space, class T>
void direct_grad_w_rows(T* part, const T* x, const T* dy, const conv_geometry g, std::size_t images) {
  meshlib::launch<Space>(images * g.ho, KOKKOS_LAMBDA(std::size_t t) {
    const std::size_t img = t / g.ho, oh = t % g.ho, kc = g.patch() * g.cout;
    T* acc = part + t * kc;
    copy_run(acc, static_cast<const T*>(nullptr), kc);
    std::size_t i0, i1;
    g.window(oh, g.h, i0, i1);
    for (std::size_t i = i0; i < i1; ++i) {
      const T* xrow = x + (img * g.h + (oh * g.s + i - g.p)) * g.w * g.cin;  // the input row tap i reads
      for (std::size_t j = 0; j < g.k; ++j) {
        // Output columns whose tap j lies in the image: 0 <= ow * s + j - p < w.
        const std::size_t lo = j < g.p ? (g.p - j + g.s - 1) / g.s : 0;
        std::size_t hi = g.w + g.p > j ? (g.w + g.p - j - 1) / g.s + 1 : 0;
        if (hi > g.wo) hi = g.wo;
        if (lo >= hi) continue;
        const T* a = xrow + (lo * g.s + j - g.p) * g.cin;
        for (std::size_t c = 0; c < g.cin; ++c)
          tap_gradient(acc + ((i * g.k + j) * g.cin + c) * g.cout, a + c, g.s * g.cin, dy + (t * g.wo + lo) * g.cout,
                       g.cout, hi - lo);
      }
    }
  });
}

/// Second half: `gw = (overwrite ? 0 : gw) + sum over rows t of part[t]`, the rows in order (the same
/// bits on every run), one work item per block of `gw`'s values.
template <class Space, class T>
void direct_grad_w_sum(T* gw, const T* part, std::size_t values, std::size_t rows, bool overwrite) {
  constexpr std::size_t block = 64;
  meshlib::launch<Space>((values + block - 1) / block, KOKKOS_LAMBDA(std::size_t b) {
    const std::size_t c0 = b * block, c1 = c0 + block < values ? c0 + block : values;
    if (overwrite) copy_run(gw + c0, static_cast<const T*>(nullptr), c1 - c0);
    for (std::size_t t = 0; t < rows; ++t) add_run(gw + c0, part + t * values + c0, c1 - c0);
  });
}

/// col2im as a gather: `dx` (`images x h x w x cin`) from the patch cotangents `dcols` (`M x K`).
/// Input pixel `(img, ih, iw)` adds, for every kernel offset `(i, j)` whose output pixel exists, that
/// patch entry, in kernel order (no atomics: the same bits on every run and mesh).
template <class Space, class T>
void col2im(T* dx, const T* dcols, const conv_geometry g, std::size_t images) {
  meshlib::launch<Space>(images * g.h * g.w, KOKKOS_LAMBDA(std::size_t q) {
    const std::size_t img = q / (g.h * g.w), ih = q / g.w % g.h, iw = q % g.w, kk = g.patch();
    T* dst = dx + q * g.cin;
    copy_run(dst, static_cast<const T*>(nullptr), g.cin);
    for (std::size_t i = 0; i < g.k; ++i) {
      const std::size_t th = ih + g.p;  // = oh * s + i
      if (th < i || (th - i) % g.s != 0 || (th - i) / g.s >= g.ho) continue;
      const std::size_t oh = (th - i) / g.s;
      for (std::size_t j = 0; j < g.k; ++j) {
        const std::size_t tw = iw + g.p;
        if (tw < j || (tw - j) % g.s != 0 || (tw - j) / g.s >= g.wo) continue;
        const std::size_t ow = (tw - j) / g.s;
        const T* src = dcols + ((img * g.ho + oh) * g.wo + ow) * kk + (i * g.k + j) * g.cin;
        add_run(dst, src, g.cin);
      }
    }
  });
}

}  // namespace meshlib::nn::detail

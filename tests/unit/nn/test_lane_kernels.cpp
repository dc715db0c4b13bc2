// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The layers' row kernels that run on native vectors (`for_each_lane`, nn/detail/simd.hpp) give
// the bits of the plain scalar loops they replaced: copies and sums of runs (im2col, col2im), batch
// norm, layer norm, RMSNorm, max and average pooling (ties, NaN, signed zeros), the bias add and
// gradient, relu forward and backward (fused with the bias gradient too), and the element-wise sums
// and products. The references are the loops as they were written before (one element at a time,
// in the same order), here; every width from 0 to past a few vectors, so both the vector bulk and
// the scalar tail run, in float and in double.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;
namespace nd = meshlib::nn::detail;
using space = Kokkos::HostSpace;

/// `count` irregular values in about [-2, 2], with the special values a kernel must carry through
/// unchanged where `specials` is set: +0, -0, infinities, a NaN, a denormal.
template <class T>
std::vector<T> values(std::size_t count, double phase, bool specials = false) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<T>(2.0 * std::sin(0.37 * static_cast<double>(i) + phase));
  if (specials) {
    const T sp[] = {T{0}, -T{0}, std::numeric_limits<T>::infinity(), -std::numeric_limits<T>::infinity(),
                    std::numeric_limits<T>::quiet_NaN(), std::numeric_limits<T>::denorm_min()};
    for (std::size_t i = 0; i < count; i += 7) v[i] = sp[(i / 7) % 6];
  }
  return v;
}

/// Whether `a` and `b` hold the same bits, element by element (+0 is not -0), except that any NaN
/// equals any NaN: which of two NaN operands an addition returns depends on the order the compiler
/// gives the operands of a commutative instruction, in the scalar loop as in the vector one.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(&a[i], &b[i], sizeof(T)) != 0) return false;
  return true;
}

/// Widths that cover empty, below one vector, exact vectors and every tail length of AVX's 8 lanes.
const std::size_t widths[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33};

template <class T>
void check_runs() {
  for (std::size_t n : widths) {
    CAPTURE(n);
    const auto src = values<T>(n, 0.1, true);
    auto dst = values<T>(n, 0.7, true), want = dst;
    nd::copy_run(dst.data(), src.data(), n);
    CHECK(same_bits(dst, src));
    nd::copy_run(dst.data(), static_cast<const T*>(nullptr), n);
    CHECK(same_bits(dst, std::vector<T>(n, T{0})));
    dst = want;
    nd::add_run(dst.data(), src.data(), n);
    for (std::size_t e = 0; e < n; ++e) want[e] += src[e];
    CHECK(same_bits(dst, want));
  }
}

template <class T>
void check_batch_norm() {
  for (std::size_t c : widths) {
    if (c == 0) continue;
    CAPTURE(c);
    const std::size_t np = 6;
    const auto x = values<T>(np * c, 0.2), d = values<T>(np * c, 1.3), mean = values<T>(c, 0.5), gv = values<T>(c, 0.9),
               bv = values<T>(c, 2.1);
    std::vector<T> rstd(c);
    for (std::size_t j = 0; j < c; ++j) rstd[j] = T{1} / (T{1} + static_cast<T>(j % 3));
    const T count = T{12}, inv = T{1} / count;
    // channel_sums, plain and centred
    std::vector<T> s(c, T{9}), want(c, T{0});
    nd::channel_sums<space>(s.data(), x.data(), static_cast<const T*>(nullptr), np, c, T{1});
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j) want[j] += x[i * c + j];
    CHECK(same_bits(s, want));
    nd::channel_sums<space>(s.data(), x.data(), mean.data(), np, c, count);
    std::fill(want.begin(), want.end(), T{0});
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        const T dv = x[i * c + j] - mean[j] / count;
        want[j] += dv * dv;
      }
    CHECK(same_bits(s, want));
    // batch_normalize
    std::vector<T> y(np * c), xh(np * c), wy(np * c), wxh(np * c);
    nd::batch_normalize<space>(y.data(), xh.data(), x.data(), mean.data(), rstd.data(), gv.data(), bv.data(), np, c);
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        wxh[i * c + j] = (x[i * c + j] - mean[j]) * rstd[j];
        wy[i * c + j] = wxh[i * c + j] * gv[j] + bv[j];
      }
    CHECK(same_bits(xh, wxh));
    CHECK(same_bits(y, wy));
    // batch_grad_sums
    std::vector<T> sums(2 * c, T{5}), wsums(2 * c, T{0});
    nd::batch_grad_sums<space>(sums.data(), d.data(), xh.data(), np, c);
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j) {
        wsums[j] += d[i * c + j];
        wsums[c + j] += d[i * c + j] * xh[i * c + j];
      }
    CHECK(same_bits(sums, wsums));
    // batch_norm_dx and its evaluation form
    std::vector<T> dx(np * c), wdx(np * c);
    nd::batch_norm_dx<space>(dx.data(), d.data(), xh.data(), sums.data(), gv.data(), rstd.data(), np, c, inv);
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j)
        wdx[i * c + j] = gv[j] * rstd[j] * (d[i * c + j] - sums[j] * inv - xh[i * c + j] * sums[c + j] * inv);
    CHECK(same_bits(dx, wdx));
    nd::batch_norm_dx_affine<space>(dx.data(), d.data(), gv.data(), rstd.data(), np, c);
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = 0; j < c; ++j) wdx[i * c + j] = gv[j] * rstd[j] * d[i * c + j];
    CHECK(same_bits(dx, wdx));
  }
}

template <class T>
void check_row_norms() {
  for (std::size_t n : widths) {
    if (n == 0) continue;
    CAPTURE(n);
    const std::size_t rows = 3;
    const auto x = values<T>(rows * n, 0.4), d = values<T>(rows * n, 1.1), gv = values<T>(n, 0.8), bv = values<T>(n, 1.9);
    const T eps = T(1e-5);
    // layer norm forward
    std::vector<T> y(rows * n), xh(rows * n), rstd(rows), wy(rows * n), wxh(rows * n), wrstd(rows);
    nd::layer_norm_forward<space>(y.data(), xh.data(), rstd.data(), x.data(), gv.data(), bv.data(), rows, n, eps);
    for (std::size_t i = 0; i < rows; ++i) {
      const T* xi = x.data() + i * n;
      T mean = 0, var = 0;
      for (std::size_t j = 0; j < n; ++j) mean += xi[j];
      mean /= static_cast<T>(n);
      for (std::size_t j = 0; j < n; ++j) var += (xi[j] - mean) * (xi[j] - mean);
      var /= static_cast<T>(n);
      wrstd[i] = T{1} / std::sqrt(var + eps);
      for (std::size_t j = 0; j < n; ++j) {
        wxh[i * n + j] = (xi[j] - mean) * wrstd[i];
        wy[i * n + j] = wxh[i * n + j] * gv[j] + bv[j];
      }
    }
    CHECK(same_bits(rstd, wrstd));
    CHECK(same_bits(xh, wxh));
    CHECK(same_bits(y, wy));
    // layer norm backward
    std::vector<T> dx(rows * n), gg = values<T>(n, 3.0), gb = values<T>(n, 3.3), wdx(rows * n), wgg = gg, wgb = gb;
    nd::layer_norm_backward<space>(dx.data(), gg.data(), gb.data(), d.data(), xh.data(), rstd.data(), gv.data(), rows, n);
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = d.data() + i * n;
      T s1 = 0, s2 = 0;
      for (std::size_t j = 0; j < n; ++j) {
        const T dxh = di[j] * gv[j];
        s1 += dxh;
        s2 += dxh * xh[i * n + j];
      }
      s1 /= static_cast<T>(n);
      s2 /= static_cast<T>(n);
      for (std::size_t j = 0; j < n; ++j) wdx[i * n + j] = rstd[i] * (di[j] * gv[j] - s1 - xh[i * n + j] * s2);
    }
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < n; ++j) {
        wgg[j] += d[i * n + j] * xh[i * n + j];
        wgb[j] += d[i * n + j];
      }
    CHECK(same_bits(dx, wdx));
    CHECK(same_bits(gg, wgg));
    CHECK(same_bits(gb, wgb));
    // RMSNorm forward and backward
    std::vector<T> rinv(rows), wrinv(rows);
    nd::rms_norm_forward<space>(y.data(), xh.data(), rinv.data(), x.data(), gv.data(), rows, n, eps);
    for (std::size_t i = 0; i < rows; ++i) {
      const T* xi = x.data() + i * n;
      T ms = 0;
      for (std::size_t j = 0; j < n; ++j) ms += xi[j] * xi[j];
      ms /= static_cast<T>(n);
      const T r = T{1} / std::sqrt(ms + eps);
      wrinv[i] = r;
      for (std::size_t j = 0; j < n; ++j) {
        wxh[i * n + j] = xi[j] * r;
        wy[i * n + j] = wxh[i * n + j] * gv[j];
      }
    }
    CHECK(same_bits(rinv, wrinv));
    CHECK(same_bits(xh, wxh));
    CHECK(same_bits(y, wy));
    wgg = gg;
    nd::rms_norm_backward<space>(dx.data(), gg.data(), d.data(), xh.data(), rinv.data(), gv.data(), rows, n);
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = d.data() + i * n;
      T s = 0;
      for (std::size_t j = 0; j < n; ++j) s += di[j] * gv[j] * xh[i * n + j];
      s /= static_cast<T>(n);
      for (std::size_t j = 0; j < n; ++j) wdx[i * n + j] = rinv[i] * (di[j] * gv[j] - xh[i * n + j] * s);
    }
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < n; ++j) wgg[j] += d[i * n + j] * xh[i * n + j];
    CHECK(same_bits(dx, wdx));
    CHECK(same_bits(gg, wgg));
  }
}

/// Pooling of 2 images of 5 x 6 pixels, 3 x 3 windows at stride 2 (overlapping), and 2 x 2 at 2,
/// against the loops over one channel at a time as the kernels ran them.
template <class T, bool Max>
void check_pool() {
  const std::size_t n = 2, h = 5, wd = 6;
  for (std::size_t c : widths) {
    if (c == 0) continue;
    for (std::size_t k : {std::size_t{2}, std::size_t{3}}) {
      CAPTURE(c, k, Max);
      const std::size_t s = 2, ho = (h - k) / s + 1, wo = (wd - k) / s + 1;
      auto x = values<T>(n * h * wd * c, 0.3, true);
      for (std::size_t i = 3; i < x.size(); i += 11) x[i] = x[i - 3];  // ties inside windows
      const T inv = T{1} / static_cast<T>(k * k);
      std::vector<T> y(n * ho * wo * c), wy(y.size());
      std::vector<std::uint32_t> arg(y.size(), 77u), warg(y.size(), 77u);
      nd::pool_forward<space, Max>(y.data(), arg.data(), x.data(), n, h, wd, c, ho, wo, k, s, inv);
      for (std::size_t r = 0; r < n * ho * wo; ++r) {
        const std::size_t img = r / (ho * wo), oh = r / wo % ho, ow = r % wo;
        for (std::size_t ch = 0; ch < c; ++ch) {
          T acc = Max ? x[((img * h + oh * s) * wd + ow * s) * c + ch] : T{0};
          auto best = static_cast<std::uint32_t>((oh * s) * wd + ow * s);
          for (std::size_t i = 0; i < k; ++i)
            for (std::size_t j = 0; j < k; ++j) {
              const std::size_t pix = (oh * s + i) * wd + ow * s + j;
              const T v = x[(img * h * wd + pix) * c + ch];
              if (Max) {
                if (v > acc) {
                  acc = v;
                  best = static_cast<std::uint32_t>(pix);
                }
              } else {
                acc += v;
              }
            }
          if (Max) {
            wy[r * c + ch] = acc;
            warg[r * c + ch] = best;
          } else {
            wy[r * c + ch] = acc * inv;
          }
        }
      }
      CHECK(same_bits(y, wy));
      if (Max) CHECK(arg == warg);
      const auto d = values<T>(y.size(), 2.2, true);
      std::vector<T> dx(x.size(), T{5}), wdx(x.size());
      nd::pool_backward<space, Max>(dx.data(), warg.data(), d.data(), n, h, wd, c, ho, wo, k, s, inv);
      for (std::size_t q = 0; q < n * h * wd; ++q) {
        const std::size_t img = q / (h * wd), ih = q / wd % h, iw = q % wd, pix = ih * wd + iw;
        T* dst = wdx.data() + q * c;
        for (std::size_t ch = 0; ch < c; ++ch) dst[ch] = T{0};
        const std::size_t oh0 = ih + 1 > k ? (ih + 1 - k + s - 1) / s : 0, ow0 = iw + 1 > k ? (iw + 1 - k + s - 1) / s : 0;
        for (std::size_t oh = oh0; oh < ho && oh * s <= ih; ++oh)
          for (std::size_t ow = ow0; ow < wo && ow * s <= iw; ++ow) {
            const std::size_t r = (img * ho + oh) * wo + ow;
            for (std::size_t ch = 0; ch < c; ++ch) {
              if (Max) {
                if (warg[r * c + ch] == pix) dst[ch] += d[r * c + ch];
              } else {
                dst[ch] += d[r * c + ch] * inv;
              }
            }
          }
      }
      CHECK(same_bits(dx, wdx));
    }
  }
}

template <class T>
void check_dense_and_relu() {
  using relu_fn = nd::relu_fn;
  for (std::size_t out : widths) {
    CAPTURE(out);
    const std::size_t rows = 5;
    const auto x = values<T>(rows * out, 0.6, true), dy = values<T>(rows * out, 1.7, true), bias = values<T>(out, 0.9);
    // add_bias, both ways
    auto y = values<T>(rows * out, 2.5), wy = y;
    nd::add_bias<space>(y.data(), bias.data(), rows, out, true);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) wy[i * out + j] += bias[j];
    CHECK(same_bits(y, wy));
    nd::add_bias<space>(y.data(), bias.data(), rows, out, false);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) wy[i * out + j] = bias[j];
    CHECK(same_bits(y, wy));
    // bias_grad, fresh and accumulating
    std::vector<T> gb(out, T{4}), wgb(out, T{0});
    nd::bias_grad<space>(gb.data(), dy.data(), rows, out, true);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) wgb[j] += dy[i * out + j];
    CHECK(same_bits(gb, wgb));
    nd::bias_grad<space>(gb.data(), x.data(), rows, out, false);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) wgb[j] += x[i * out + j];
    CHECK(same_bits(gb, wgb));
    // relu forward and backward: the scalar forms are the reference (their bits are pinned elsewhere)
    const std::size_t n = rows * out;
    std::vector<T> f(n), wf(n), dx(n), wdx(n);
    nd::activation_forward<space, relu_fn>(f.data(), x.data(), n);
    for (std::size_t i = 0; i < n; ++i) wf[i] = relu_fn::f(x[i]);
    CHECK(same_bits(f, wf));
    for (std::size_t i = 0; i < n; ++i)  // relu keeps x > 0, +0 elsewhere (NaN and -0 included)
      CHECK(std::bit_cast<std::uint64_t>(static_cast<double>(f[i])) ==
            std::bit_cast<std::uint64_t>(static_cast<double>(x[i] > T{0} ? x[i] : T{0})));
    nd::activation_backward<space, relu_fn>(dx.data(), dy.data(), x.data(), n);
    for (std::size_t i = 0; i < n; ++i) wdx[i] = x[i] > T{0} ? dy[i] : T{0};
    CHECK(same_bits(dx, wdx));
    // the fused backward: the same cotangent, and its column sums
    std::vector<T> fd(n, T{3}), fgb(out, T{8}), wfgb(out, T{0});
    nd::activation_bias_backward<space, relu_fn>(fd.data(), fgb.data(), dy.data(), x.data(), rows, out, true);
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = 0; j < out; ++j) wfgb[j] += wdx[i * out + j];
    CHECK(same_bits(fd, wdx));
    CHECK(same_bits(fgb, wfgb));
    // element-wise sums and products
    std::vector<T> o(n), wo(n);
    nd::sum_values<space>(o.data(), x.data(), dy.data(), n);
    for (std::size_t i = 0; i < n; ++i) wo[i] = x[i] + dy[i];
    CHECK(same_bits(o, wo));
    nd::multiply_values<space>(o.data(), x.data(), dy.data(), n);
    for (std::size_t i = 0; i < n; ++i) wo[i] = x[i] * dy[i];
    CHECK(same_bits(o, wo));
  }
  // A long run: several element blocks of the element-wise kernels and their tail.
  const std::size_t n = 2 * 1024 + 37;
  const auto a = values<T>(n, 0.05, true), b = values<T>(n, 0.55, true);
  std::vector<T> o(n), wo(n);
  nd::sum_values<space>(o.data(), a.data(), b.data(), n);
  for (std::size_t i = 0; i < n; ++i) wo[i] = a[i] + b[i];
  CHECK(same_bits(o, wo));
}

/// col2im of a 3x3 convolution at stride 2 with padding 1 and of a 1x1 at stride 1, against the
/// gather written one channel at a time.
template <class T>
void check_col2im() {
  for (std::size_t cin : {std::size_t{1}, std::size_t{3}, std::size_t{5}, std::size_t{16}, std::size_t{17}}) {
    for (const auto& [k, s, p] : {std::array<std::size_t, 3>{3, 2, 1}, std::array<std::size_t, 3>{1, 1, 0}}) {
      CAPTURE(cin, k, s, p);
      const std::size_t h = 5, w = 4, images = 2, ho = (h + 2 * p - k) / s + 1, wo = (w + 2 * p - k) / s + 1;
      const nd::conv_geometry g{h, w, cin, ho, wo, 3, k, s, p};
      const auto dcols = values<T>(images * ho * wo * g.patch(), 0.8, true);
      std::vector<T> dx(images * h * w * cin, T{6}), wdx(dx.size(), T{0});
      nd::col2im<space>(dx.data(), dcols.data(), g, images);
      for (std::size_t q = 0; q < images * h * w; ++q) {
        const std::size_t img = q / (h * w), ih = q / w % h, iw = q % w;
        for (std::size_t i = 0; i < k; ++i) {
          const std::size_t th = ih + p;
          if (th < i || (th - i) % s != 0 || (th - i) / s >= ho) continue;
          const std::size_t oh = (th - i) / s;
          for (std::size_t j = 0; j < k; ++j) {
            const std::size_t tw = iw + p;
            if (tw < j || (tw - j) % s != 0 || (tw - j) / s >= wo) continue;
            const std::size_t ow = (tw - j) / s;
            for (std::size_t c = 0; c < cin; ++c)
              wdx[q * cin + c] += dcols[((img * ho + oh) * wo + ow) * g.patch() + (i * k + j) * cin + c];
          }
        }
      }
      CHECK(same_bits(dx, wdx));
    }
  }
}

}  // namespace

TEST_CASE("the layers' vector kernels give the scalar loops' bits: runs of copies and sums", "[lanes]") {
  check_runs<float>();
  check_runs<double>();
  check_col2im<float>();
  check_col2im<double>();
}

TEST_CASE("the layers' vector kernels give the scalar loops' bits: batch norm, layer norm, RMSNorm", "[lanes]") {
  check_batch_norm<float>();
  check_batch_norm<double>();
  check_row_norms<float>();
  check_row_norms<double>();
}

TEST_CASE("the layers' vector kernels give the scalar loops' bits: max and average pooling", "[lanes]") {
  check_pool<float, true>();
  check_pool<float, false>();
  check_pool<double, true>();
  check_pool<double, false>();
}

TEST_CASE("the layers' vector kernels give the scalar loops' bits: bias, relu, element-wise", "[lanes]") {
  check_dense_and_relu<float>();
  check_dense_and_relu<double>();
}

}  // namespace MESHLIB_TEST_UNIT

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The kernels of the transforms that read a whole parameter (nn/optim/factored_rms.hpp,
/// nn/optim/block_rms.hpp): a deterministic sum of squares, and the row and column statistics of
/// Adafactor's factored second moment, of a whole parameter or of a run of a device's block of it
/// (a tensor-parallel block, an FSDP shard, a piece in a ZeRO-1 slice). Classes, not lambdas: nvcc refuses extended lambdas in
/// functions whose return type is deduced, and these are called from such code.
///
/// A parameter is a row-major array; its factored statistics are the arrays optax keeps, laid out
/// row-major too: `v_row` is the parameter's shape without dimension `d0`, `v_col` without `d1`.
/// `drop_dim` and `insert_dim` move between an element's index and the index of its statistic, so
/// any pair of dimensions of any rank goes through one code path.

#include <cmath>
#include <cstddef>
#include <vector>

#include "meshlib/tensor/kernel.hpp"

namespace meshlib::nn::detail {

/// The index in the array without one dimension (stride `s`, extent `n`) of element `i`.
KOKKOS_INLINE_FUNCTION std::size_t drop_dim(std::size_t i, std::size_t s, std::size_t n) noexcept {
  return (i / (s * n)) * s + i % s;
}
/// The inverse of `drop_dim`: the element whose coordinate along the dropped dimension is `c`.
KOKKOS_INLINE_FUNCTION std::size_t insert_dim(std::size_t j, std::size_t s, std::size_t n, std::size_t c) noexcept {
  return (j / s) * (s * n) + c * s + j % s;
}

/// `sqrt(x)` on the host and in device kernels: `Kokkos::sqrt` (Kokkos 4), `std::sqrt` on Kokkos 3,
/// which has no `Kokkos::sqrt` (its builds run meshlib on the host only).
KOKKOS_INLINE_FUNCTION float sqrt_in_kernel(float x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

/// `out[c]` = the sum of squares of chunk `c` of `x`, in double (fixed chunks: the same bits on
/// every run and any number of threads).
struct chunk_squares {
  const float* x;
  double* out;
  std::size_t n, chunks;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t c) const {
    const std::size_t b = c * n / chunks, e = (c + 1) * n / chunks;
    double s = 0;
    for (std::size_t i = b; i < e; ++i) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    out[c] = s;
  }
};

/// The sum of the squares of the `n` floats at `x` (in the running device's memory).
inline double block_sum_of_squares(const float* x, std::size_t n) {
  if (n == 0) return 0;
  const std::size_t chunks = n < 256 ? n : 256;
  auto part = ::meshlib::allocate<double, 1>({chunks}, "meshlib::nn::block_sum_of_squares");
  ::meshlib::launch<default_memory_space>(chunks, chunk_squares{x, part.data(), n, chunks});
  std::vector<double> host(chunks);
  ::meshlib::copy_to_host<default_memory_space>(host.data(), part.data(), chunks);
  double s = 0;
  for (double v : host) s += v;
  return s;
}

/// A statistic of the factored second moment: `v[j] = beta v[j] + (1 - beta) mean_c (g^2 + eps)`,
/// the mean over the `n` elements along the dimension of stride `s` that statistic `j` sums.
struct factored_moment {
  const float* g;
  float* v;
  std::size_t s, n;
  float beta, eps;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    double acc = 0;
    for (std::size_t c = 0; c < n; ++c) {
      const float x = g[insert_dim(j, s, n, c)];
      acc += static_cast<double>(x * x + eps);
    }
    v[j] = beta * v[j] + (1.0f - beta) * static_cast<float>(acc / static_cast<double>(n));
  }
};

/// `mean[o]`: the mean of `v_row` over dimension `d1` (stride `s` in `v_row`, extent `n`).
struct row_mean {
  const float* v_row;
  float* mean;
  std::size_t s, n;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t o) const {
    double acc = 0;
    for (std::size_t c = 0; c < n; ++c) acc += static_cast<double>(v_row[insert_dim(o, s, n, c)]);
    mean[o] = static_cast<float>(acc / static_cast<double>(n));
  }
};

/// The factored update: `u = g / sqrt(v_row / mean(v_row)) / sqrt(v_col)` (`u` may be `g`).
struct factored_scale {
  float* u;
  const float* v_row;
  const float* v_col;
  const float* mean;
  std::size_t s0, n0;  ///< stride and extent of `d0` (the largest dimension) in the parameter
  std::size_t s1, n1;  ///< of `d1` in the parameter
  std::size_t s1_row;  ///< of `d1` in `v_row`
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t r = drop_dim(i, s0, n0);
    const float row = 1.0f / sqrt_in_kernel(v_row[r] / mean[drop_dim(r, s1_row, n1)]);
    const float col = 1.0f / sqrt_in_kernel(v_col[drop_dim(i, s1, n1)]);
    u[i] = u[i] * row * col;
  }
};

/// The unfactored update: `v = beta v + (1 - beta) (g^2 + eps)`, `u = g / sqrt(v)`.
struct unfactored_scale {
  float* u;
  float* v;
  float beta, eps;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const float g = u[i];
    const float vi = beta * v[i] + (1.0f - beta) * (g * g + eps);
    v[i] = vi;
    u[i] = g / sqrt_in_kernel(vi);
  }
};

/// Where the elements of a device's block of a parameter lie in the parameter: block element `i`
/// (row-major over the block's extents) to its row-major index in the whole parameter. Up to
/// `max_rank` dimensions (a fixed array: a kernel functor copies it by value).
struct block_map {
  static constexpr std::size_t max_rank = 8;  ///< the most dimensions a mapped parameter has
  std::size_t rank = 0;
  std::size_t extent[max_rank] = {};   ///< the block's extents
  std::size_t offset[max_rank] = {};   ///< where it starts in the parameter
  std::size_t stride[max_rank] = {};   ///< the parameter's row-major strides
  KOKKOS_INLINE_FUNCTION std::size_t global(std::size_t i) const noexcept {
    std::size_t g = 0;
    for (std::size_t d = rank; d-- > 0;) {
      g += (i % extent[d] + offset[d]) * stride[d];
      i /= extent[d];
    }
    return g;
  }
};

/// The partial sums of a factored statistic over a run of a block: for each of the block's lines
/// along the dimension of block stride `s` and extent `n` (line `j`: the block without that
/// dimension), `sums[statistic of the line] = sum (g^2 + eps)` over the line's elements in the run
/// (block elements `[lo, hi)`, at `g[0, hi - lo)`), the statistic's index in the whole parameter's
/// statistic (global stride `gs`, extent `gn` of that dimension), in double as `factored_moment`
/// sums a whole line (so the statistics of a parameter in pieces round to the same floats as its
/// unsharded ones but where the order of the double sums moves a rounding). `sums` starts at zero;
/// a line is one statistic, so no two lines write one entry. A whole block (`lo` 0, `hi` its size)
/// sums every line whole, in the same order; a ZeRO-1 run may hold a line in part or not at all
/// (then 0).
struct factored_partial_sums {
  const float* g;
  double* sums;
  block_map map;
  std::size_t s, n, gs, gn;
  float eps;
  std::size_t lo, hi;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    const std::size_t first = insert_dim(j, s, n, 0);
    // The line's elements `first + c s` in `[lo, hi)`: `c` in `[c0, c1)`.
    const std::size_t c0 = first >= lo ? 0 : (lo - first + s - 1) / s;
    const std::size_t above = first >= hi ? 0 : (hi - first + s - 1) / s;
    const std::size_t c1 = above < n ? above : n;
    double acc = 0;
    for (std::size_t c = c0; c < c1; ++c) {
      const float x = g[first + c * s - lo];
      acc += static_cast<double>(x * x + eps);
    }
    sums[drop_dim(map.global(first), gs, gn)] = acc;
  }
};

/// `v[j] = beta v[j] + (1 - beta) sums[j] / n`: a statistic from the summed lines of every piece,
/// rounded as `factored_moment` rounds it.
struct moment_from_sums {
  float* v;
  const double* sums;
  std::size_t n;
  float beta;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const {
    v[j] = beta * v[j] + (1.0f - beta) * static_cast<float>(sums[j] / static_cast<double>(n));
  }
};

/// `factored_scale` of a run of a block (`u[i]` is block element `first + i`): each element reads
/// the statistics of its place in the parameter.
struct factored_scale_block {
  float* u;
  const float* v_row;
  const float* v_col;
  const float* mean;
  block_map map;
  std::size_t s0, n0;  ///< stride and extent of `d0` in the whole parameter
  std::size_t s1, n1;  ///< of `d1` in the whole parameter
  std::size_t s1_row;  ///< of `d1` in `v_row`
  std::size_t first;   ///< the run's first element in the block
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    const std::size_t gi = map.global(first + i);
    const std::size_t r = drop_dim(gi, s0, n0);
    const float row = 1.0f / sqrt_in_kernel(v_row[r] / mean[drop_dim(r, s1_row, n1)]);
    const float col = 1.0f / sqrt_in_kernel(v_col[drop_dim(gi, s1, n1)]);
    u[i] = u[i] * row * col;
  }
};

/// The unfactored second moment of a run of a block (`g[i]` is block element `first + i`):
/// `sums[global(first + i)] = g^2 + eps` (the rest stay zero).
struct squares_to_global {
  const float* g;
  float* sums;
  block_map map;
  float eps;
  std::size_t first;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { sums[map.global(first + i)] = g[i] * g[i] + eps; }
};

/// `v = beta v + (1 - beta) sums` over the whole parameter (the summed squares of every block).
struct unfactored_moment {
  float* v;
  const float* sums;
  float beta;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t j) const { v[j] = beta * v[j] + (1.0f - beta) * sums[j]; }
};

/// `u[i] = u[i] / sqrt(v[global(first + i)])`: the unfactored update of a run of a block.
struct unfactored_scale_block {
  float* u;
  const float* v;
  block_map map;
  std::size_t first;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    u[i] = u[i] / sqrt_in_kernel(v[map.global(first + i)]);
  }
};

/// `u[i] *= f`.
struct scale_by_factor {
  float* u;
  float f;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { u[i] = u[i] * f; }
};

}  // namespace meshlib::nn::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The kernels of layer norm, RMSNorm and batch norm: per-row statistics and normalisation
/// (one work item per row), per-channel statistics (one work item per channel), and the parameters'
/// gradients as sums over rows (`for_column_blocks`, rows added in row order: the same bits on every
/// mesh and backend). Free functions over pointers, templated on the element type and the memory
/// space only, for the reason nn/detail/layer_kernels.hpp gives (nvcc and kernels in mesh-templated code).

#include <cmath>
#include <cstddef>

#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// Layer norm's forward over `rows x n`: `rstd[i]` = 1 / std of row `i`, `xh` the normalised rows,
/// `y = xh * g + b`.
template <class Space, class T>
void layer_norm_forward(T* y, T* xh, T* rstd, const T* xp, const T* gv, const T* bv, std::size_t rows, std::size_t n,
                        T eps) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* xi = xp + i * n;
    T mean = 0, var = 0;
    for (std::size_t j = 0; j < n; ++j) mean += xi[j];
    mean /= static_cast<T>(n);
    for (std::size_t j = 0; j < n; ++j) var += (xi[j] - mean) * (xi[j] - mean);
    var /= static_cast<T>(n);
    rstd[i] = T{1} / std::sqrt(var + eps);
    for (std::size_t j = 0; j < n; ++j) {
      xh[i * n + j] = (xi[j] - mean) * rstd[i];
      y[i * n + j] = xh[i * n + j] * gv[j] + bv[j];
    }
  });
}

/// Layer norm's backward: `dx` from `dy`, and `gg += sum_rows dy * xhat`, `gb += sum_rows dy`.
template <class Space, class T>
void layer_norm_backward(T* dx, T* gg, T* gb, const T* dyp, const T* xh, const T* rstd, const T* gv, std::size_t rows,
                         std::size_t n) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* d = dyp + i * n;
    T s1 = 0, s2 = 0;  // mean of dxhat and of dxhat * xhat
    for (std::size_t j = 0; j < n; ++j) {
      const T dxh = d[j] * gv[j];
      s1 += dxh;
      s2 += dxh * xh[i * n + j];
    }
    s1 /= static_cast<T>(n);
    s2 /= static_cast<T>(n);
    for (std::size_t j = 0; j < n; ++j) dx[i * n + j] = rstd[i] * (d[j] * gv[j] - s1 - xh[i * n + j] * s2);
  });
  // dg += sum_rows dy * xhat, db += sum_rows dy: each column's rows in row order, as the loop added them.
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // locals: the stores below cannot be taken to change them
    T* sb = gb;
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = j0; j < j1; ++j) {
        sg[j] += dyp[i * n + j] * xh[i * n + j];
        sb[j] += dyp[i * n + j];
      }
  });
}

/// RMSNorm's forward over `rows x n`: `rinv[i]` = 1 / rms of row `i`, `xh = x / rms`, `y = xh * g`.
template <class Space, class T>
void rms_norm_forward(T* y, T* xh, T* rinv, const T* xp, const T* gv, std::size_t rows, std::size_t n, T eps) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* xi = xp + i * n;
    T ms = 0;
    for (std::size_t j = 0; j < n; ++j) ms += xi[j] * xi[j];
    ms /= static_cast<T>(n);
    const T r = T{1} / std::sqrt(ms + eps);
    rinv[i] = r;
    for (std::size_t j = 0; j < n; ++j) {
      xh[i * n + j] = xi[j] * r;
      y[i * n + j] = xh[i * n + j] * gv[j];
    }
  });
}

/// RMSNorm's backward: `dx` from `dy`, and `gg += sum_rows dy * xhat`.
template <class Space, class T>
void rms_norm_backward(T* dx, T* gg, const T* dyp, const T* xh, const T* rinv, const T* gv, std::size_t rows,
                       std::size_t n) {
  meshlib::launch<Space>(rows, KOKKOS_LAMBDA(std::size_t i) {
    const T* d = dyp + i * n;
    T s = 0;  // mean of dxhat * xhat
    for (std::size_t j = 0; j < n; ++j) s += d[j] * gv[j] * xh[i * n + j];
    s /= static_cast<T>(n);
    for (std::size_t j = 0; j < n; ++j) dx[i * n + j] = rinv[i] * (d[j] * gv[j] - xh[i * n + j] * s);
  });
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < rows; ++i)
      for (std::size_t j = j0; j < j1; ++j) sg[j] += dyp[i * n + j] * xh[i * n + j];
  });
}

/// `s[j] = sum_i x[i, j]` (`centre` null) or `sum_i (x[i, j] - centre[j] / count)^2` over `rows x c`,
/// rows in order (batch norm's statistics, before their psum over the data axis).
template <class Space, class T>
void channel_sums(T* s, const T* x, const T* centre, std::size_t rows, std::size_t c, T count) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sj = s;
    for (std::size_t j = j0; j < j1; ++j) sj[j] = T{0};
    if (centre == nullptr) {
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = j0; j < j1; ++j) sj[j] += x[i * c + j];
    } else {
      for (std::size_t i = 0; i < rows; ++i)
        for (std::size_t j = j0; j < j1; ++j) {
          const T dv = x[i * c + j] - centre[j] / count;
          sj[j] += dv * dv;
        }
    }
  });
}

/// Batch norm in training: from the global sums `s` and squared deviations `q` of `count` rows, the
/// channels' `mean` and `rstd`, and the running statistics moved by `mom` (the variance unbiased).
template <class Space, class T>
void batch_statistics(T* mean, T* rstd, T* run_mean, T* run_var, const T* s, const T* q, std::size_t c, T count,
                      T eps, T mom, T unbias) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    mean[j] = s[j] / count;
    const T var = q[j] / count;
    rstd[j] = T{1} / std::sqrt(var + eps);
    run_mean[j] = (T{1} - mom) * run_mean[j] + mom * mean[j];
    run_var[j] = (T{1} - mom) * run_var[j] + mom * var * unbias;
  });
}

/// Batch norm in evaluation: the channels' `mean` and `rstd` from the running statistics.
template <class Space, class T>
void running_statistics(T* mean, T* rstd, const T* run_mean, const T* run_var, std::size_t c, T eps) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    mean[j] = run_mean[j];
    rstd[j] = T{1} / std::sqrt(run_var[j] + eps);
  });
}

/// Batch norm's normalisation of `np x c`: `xh = (x - mean) * rstd`, `y = xh * g + b`.
template <class Space, class T>
void batch_normalize(T* y, T* xh, const T* xp, const T* mean, const T* rstd, const T* gv, const T* bv, std::size_t np,
                     std::size_t c) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t j = 0; j < c; ++j) {
      xh[i * c + j] = (xp[i * c + j] - mean[j]) * rstd[j];
      y[i * c + j] = xh[i * c + j] * gv[j] + bv[j];
    }
  });
}

/// Per channel, rows in order: `sums[j] = sum dy`, `sums[c + j] = sum dy * xhat`.
template <class Space, class T>
void batch_grad_sums(T* sums, const T* d, const T* xh, std::size_t np, std::size_t c) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sa = sums;
    T* sb = sums + c;
    for (std::size_t j = j0; j < j1; ++j) sa[j] = sb[j] = T{0};
    for (std::size_t i = 0; i < np; ++i)
      for (std::size_t j = j0; j < j1; ++j) {
        sa[j] += d[i * c + j];
        sb[j] += d[i * c + j] * xh[i * c + j];
      }
  });
}

/// `gg = beta_g gg + sum dy * xhat`, `gb = beta_b gb + sum dy` (batch norm's parameter gradients).
template <class Space, class T>
void batch_param_grads(T* gg, T* gb, const T* sums, std::size_t c, T beta_g, T beta_b) {
  meshlib::launch<Space>(c, KOKKOS_LAMBDA(std::size_t j) {
    gg[j] = beta_g * gg[j] + sums[c + j];
    gb[j] = beta_b * gb[j] + sums[j];
  });
}

/// Batch norm's input cotangent in training, from the global sums (`inv` = 1 / rows of the batch):
/// `dx = g / std * (dy - mean(dy) - xhat * mean(dy * xhat))`.
template <class Space, class T>
void batch_norm_dx(T* dx, const T* d, const T* xh, const T* sums, const T* gv, const T* rstd, std::size_t np,
                   std::size_t c, T inv) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t j = 0; j < c; ++j)
      dx[i * c + j] = gv[j] * rstd[j] * (d[i * c + j] - sums[j] * inv - xh[i * c + j] * sums[c + j] * inv);
  });
}

/// Batch norm's input cotangent in evaluation (constant statistics): `dx = g * rstd * dy`.
template <class Space, class T>
void batch_norm_dx_affine(T* dx, const T* d, const T* gv, const T* rstd, std::size_t np, std::size_t c) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    for (std::size_t j = 0; j < c; ++j) dx[i * c + j] = gv[j] * rstd[j] * d[i * c + j];
  });
}

}  // namespace meshlib::nn::detail

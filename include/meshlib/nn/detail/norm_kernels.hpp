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
#include "meshlib/nn/detail/simd.hpp"
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
    const T r = T{1} / std::sqrt(var + eps);
    rstd[i] = r;
    T* xhi = xh + i * n;
    T* yi = y + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L h = (load_as(xi, j, lane) - splat_as<L>(mean)) * splat_as<L>(r);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane) + load_as(bv, j, lane));
    });
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
    const T r = rstd[i];
    const T* xhi = xh + i * n;
    T* dxi = dx + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      store_at(dxi, j,
               splat_as<L>(r) * (load_as(d, j, lane) * load_as(gv, j, lane) - splat_as<L>(s1) -
                                 load_as(xhi, j, lane) * splat_as<L>(s2)));
    });
  });
  // dg += sum_rows dy * xhat, db += sum_rows dy: each column's rows in row order, as the loop added them.
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // locals: the stores below cannot be taken to change them
    T* sb = gb;
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = dyp + i * n;
      const T* hi = xh + i * n;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dv = load_as(di, j, lane);
        store_at(sg, j, load_as(sg, j, lane) + dv * load_as(hi, j, lane));
        store_at(sb, j, load_as(sb, j, lane) + dv);
      });
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
    T* xhi = xh + i * n;
    T* yi = y + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L h = load_as(xi, j, lane) * splat_as<L>(r);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane));
    });
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
    const T r = rinv[i];
    const T* xhi = xh + i * n;
    T* dxi = dx + i * n;
    for_each_lane<T>(0, n, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      store_at(dxi, j,
               splat_as<L>(r) * (load_as(d, j, lane) * load_as(gv, j, lane) - load_as(xhi, j, lane) * splat_as<L>(s)));
    });
  });
  for_column_blocks<Space>(n, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sg = gg;  // a local: the stores below cannot be taken to change it
    for (std::size_t i = 0; i < rows; ++i) {
      const T* di = dyp + i * n;
      const T* hi = xh + i * n;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        store_at(sg, j, load_as(sg, j, lane) + load_as(di, j, lane) * load_as(hi, j, lane));
      });
    }
  });
}

/// `s[j] = sum_i x[i, j]` (`centre` null) or `sum_i (x[i, j] - centre[j] / count)^2` over `rows x c`,
/// rows in order (batch norm's statistics, before their psum over the data axis).
template <class Space, class T>
void channel_sums(T* s, const T* x, const T* centre, std::size_t rows, std::size_t c, T count) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sj = s;
    for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) { store_at(sj, j, decltype(lane){}); });
    if (centre == nullptr) {
      for (std::size_t i = 0; i < rows; ++i) {
        const T* xi = x + i * c;
        for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
          store_at(sj, j, load_as(sj, j, lane) + load_as(xi, j, lane));
        });
      }
    } else {
      for (std::size_t i = 0; i < rows; ++i) {
        const T* xi = x + i * c;
        for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
          using L = decltype(lane);
          const L dv = load_as(xi, j, lane) - load_as(centre, j, lane) / splat_as<L>(count);
          store_at(sj, j, load_as(sj, j, lane) + dv * dv);
        });
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
    const T* xi = xp + i * c;
    T* xhi = xh + i * c;
    T* yi = y + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      const auto h = (load_as(xi, j, lane) - load_as(mean, j, lane)) * load_as(rstd, j, lane);
      store_at(xhi, j, h);
      store_at(yi, j, h * load_as(gv, j, lane) + load_as(bv, j, lane));
    });
  });
}

/// Per channel, rows in order: `sums[j] = sum dy`, `sums[c + j] = sum dy * xhat`.
template <class Space, class T>
void batch_grad_sums(T* sums, const T* d, const T* xh, std::size_t np, std::size_t c) {
  for_column_blocks<Space>(c, KOKKOS_LAMBDA(std::size_t j0, std::size_t j1) {
    T* sa = sums;
    T* sb = sums + c;
    for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
      store_at(sa, j, decltype(lane){});
      store_at(sb, j, decltype(lane){});
    });
    for (std::size_t i = 0; i < np; ++i) {
      const T* di = d + i * c;
      const T* hi = xh + i * c;
      for_each_lane<T>(j0, j1, [&](std::size_t j, auto lane) {
        const auto dv = load_as(di, j, lane);
        store_at(sa, j, load_as(sa, j, lane) + dv);
        store_at(sb, j, load_as(sb, j, lane) + dv * load_as(hi, j, lane));
      });
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
    const T* di = d + i * c;
    const T* hi = xh + i * c;
    const T* sdy = sums;
    const T* sdyh = sums + c;
    T* dxi = dx + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      using L = decltype(lane);
      const L iv = splat_as<L>(inv);
      store_at(dxi, j,
               load_as(gv, j, lane) * load_as(rstd, j, lane) *
                   (load_as(di, j, lane) - load_as(sdy, j, lane) * iv - load_as(hi, j, lane) * load_as(sdyh, j, lane) * iv));
    });
  });
}

/// Batch norm's input cotangent in evaluation (constant statistics): `dx = g * rstd * dy`.
template <class Space, class T>
void batch_norm_dx_affine(T* dx, const T* d, const T* gv, const T* rstd, std::size_t np, std::size_t c) {
  meshlib::launch<Space>(np, KOKKOS_LAMBDA(std::size_t i) {
    const T* di = d + i * c;
    T* dxi = dx + i * c;
    for_each_lane<T>(0, c, [&](std::size_t j, auto lane) {
      store_at(dxi, j, load_as(gv, j, lane) * load_as(rstd, j, lane) * load_as(di, j, lane));
    });
  });
}

}  // namespace meshlib::nn::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Optimizers as elementwise update rules (optax's `sgd(momentum)`, `adam`, `adamw`): the
/// update of one element depends only on that element's gradient and state, which is what lets the
/// same rule run on a replicated state or on a ZeRO-1 shard of it with identical numbers.
/// @code
/// meshlib::nn::optimizer opt = meshlib::nn::adamw(meshlib::nn::warmup_cosine(1e-3f, 100, 2000), 1e-4f);
/// @endcode

#include <cmath>
#include <cstddef>
#include <string>

#include "meshlib/nn/schedule.hpp"

namespace meshlib::nn {

/// @brief Which rule `optimizer` applies.
enum class optimizer_kind { sgd, adam, adamw };

/// @brief An optimizer's rule and hyperparameters (see the factories below).
struct optimizer {
  optimizer_kind kind = optimizer_kind::adam;
  schedule lr = constant(1e-3f);
  float momentum = 0.0f;      ///< sgd
  float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  float weight_decay = 0.0f;  ///< adamw (decoupled), on parameters marked `decay`
  float clip_norm = 0.0f;     ///< > 0: clip the gradient to this global norm (over every shard)

  /// State slots per element: sgd 1 (velocity), adam/adamw 2 (first and second moments).
  [[nodiscard]] std::size_t slots() const noexcept { return kind == optimizer_kind::sgd ? 1 : 2; }

  [[nodiscard]] std::string name() const {
    switch (kind) {
      case optimizer_kind::sgd: return "sgd(momentum " + std::to_string(momentum) + ")";
      case optimizer_kind::adam: return "adam";
      case optimizer_kind::adamw: return "adamw(weight decay " + std::to_string(weight_decay) + ")";
    }
    return "?";
  }

  /// Updates `n` elements: `p -= lr * rule(g * scale, state)` at (0-based) step `step`.
  /// `m`, `v`: the state slots of these elements (`v` unused by sgd).
  void update(float* p, const float* g, float* m, float* v, std::size_t n, std::size_t step, float scale,
              bool decay) const noexcept {
    const float rate = lr(step);
    if (kind == optimizer_kind::sgd) {
      for (std::size_t i = 0; i < n; ++i) {
        m[i] = momentum * m[i] + g[i] * scale;
        p[i] -= rate * m[i];
      }
      return;
    }
    const double t = static_cast<double>(step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
    const float wd = kind == optimizer_kind::adamw && decay ? weight_decay : 0.0f;
    for (std::size_t i = 0; i < n; ++i) {
      const float gi = g[i] * scale;
      m[i] = b1 * m[i] + (1.0f - b1) * gi;
      v[i] = b2 * v[i] + (1.0f - b2) * gi * gi;
      p[i] -= rate * ((m[i] * c1) / (std::sqrt(v[i] * c2) + eps) + wd * p[i]);
    }
  }
};

/// @brief SGD with (heavy-ball) momentum (`optax.sgd(lr, momentum)`).
inline optimizer sgd(schedule lr, float momentum = 0.9f) {
  optimizer o;
  o.kind = optimizer_kind::sgd;
  o.lr = lr;
  o.momentum = momentum;
  return o;
}
/// @brief Adam (`optax.adam`).
inline optimizer adam(schedule lr, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f) {
  optimizer o;
  o.kind = optimizer_kind::adam;
  o.lr = lr;
  o.b1 = b1;
  o.b2 = b2;
  o.eps = eps;
  return o;
}
/// @brief AdamW, decoupled weight decay (`optax.adamw`).
inline optimizer adamw(schedule lr, float weight_decay = 1e-4f, float b1 = 0.9f, float b2 = 0.999f, float eps = 1e-8f) {
  optimizer o = adam(lr, b1, b2, eps);
  o.kind = optimizer_kind::adamw;
  o.weight_decay = weight_decay;
  return o;
}

}  // namespace meshlib::nn

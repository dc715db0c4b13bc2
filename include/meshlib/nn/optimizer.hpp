// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Optimizers as elementwise update rules (optax's `sgd(momentum)`, `adam`, `adamw`): the
/// update of one element depends only on that element's gradient and state, which is what lets the
/// same rule run on a replicated state or on a ZeRO-1 shard of it with identical numbers.
/// @code
/// meshlib::nn::optimizer opt = meshlib::nn::adamw(meshlib::nn::warmup_cosine(1e-3f, 100, 2000), 1e-4f);
/// meshlib::nn::optimizer simple = meshlib::nn::adam(1e-3f);   // a number is a constant schedule
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <string>
#include <string_view>

#include "meshlib/nn/detail/number_text.hpp"
#include "meshlib/nn/detail/simd.hpp"
#include "meshlib/nn/schedule.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

namespace detail {

/// SGD with momentum on the elements a `for_lanes` work item gives (`K` = `float` or `simd_float`):
/// constants `{momentum, scale, rate}`. Classes with a templated call operator, not generic lambdas,
/// which nvcc refuses in device code.
struct sgd_update {
  float* p;
  const float* g;
  float* m;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    const auto mi = k[0] * load_as(m, i, k[0]) + load_as(g, i, k[0]) * k[1];
    store_at(m, i, mi);
    store_at(p, i, load_as(p, i, k[0]) - k[2] * mi);
  }
};

/// Adam / AdamW on the elements a `for_lanes` work item gives: constants `{scale, b1, 1 - b1, b2,
/// 1 - b2, rate, c1, c2, eps, weight decay}` (c1, c2: the bias corrections).
struct adam_update {
  float* p;
  const float* g;
  float* m;
  float* v;
  template <class K>
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i, const K& k) const {
    const auto [scale_, b1_, one_b1, b2_, one_b2, rate_, c1_, c2_, eps_, wd_] = k;
    const auto gi = load_as(g, i, scale_) * scale_;
    const auto mi = b1_ * load_as(m, i, scale_) + one_b1 * gi;
    const auto vi = b2_ * load_as(v, i, scale_) + one_b2 * gi * gi;
    const auto pi = load_as(p, i, scale_);
    store_at(m, i, mi);
    store_at(v, i, vi);
    store_at(p, i, pi - rate_ * ((mi * c1_) / (sqrt_of(vi * c2_) + eps_) + wd_ * pi));
  }
};

}  // namespace detail

/// @brief Which rule `optimizer` applies.
enum class optimizer_kind { sgd, adam, adamw };

/// @brief The rule's name as its factory is spelled (`"sgd"`, `"adam"`, `"adamw"`): what a
/// checkpoint stores and what its messages name.
[[nodiscard]] constexpr std::string_view to_string(optimizer_kind kind) noexcept {
  switch (kind) {
    case optimizer_kind::sgd: return "sgd";
    case optimizer_kind::adam: return "adam";
    case optimizer_kind::adamw: return "adamw";
  }
  return "?";
}

/// @brief An optimizer's rule and hyperparameters (see the factories below).
struct optimizer {
  /// The update rule.
  optimizer_kind kind = optimizer_kind::adam;
  /// The learning rate per step.
  schedule lr = constant(1e-3f);
  float momentum = 0.0f;      ///< sgd
  /// adam/adamw: decay rate of the first moment (the gradient's running mean).
  float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
  /// @var b2
  /// adam/adamw: decay rate of the second moment (the squared gradient's running mean).
  /// @var eps
  /// adam/adamw: added to the denominator's square root so the update stays finite.
  float weight_decay = 0.0f;  ///< adamw (decoupled), on parameters marked `decay`
  float clip_norm = 0.0f;     ///< > 0: clip the gradient to this global norm (over every shard)

  /// State slots per element: sgd 1 (velocity), adam/adamw 2 (first and second moments).
  [[nodiscard]] std::size_t slots() const noexcept { return kind == optimizer_kind::sgd ? 1 : 2; }

  /// The rule for logs, its numbers as a user writes them: `sgd(momentum 0.9)`, `adam` or
  /// `adamw(weight decay 1e-4)`.
  [[nodiscard]] std::string name() const {
    switch (kind) {
      case optimizer_kind::sgd: return "sgd(momentum " + detail::number_text(momentum) + ")";
      case optimizer_kind::adam: return "adam";
      case optimizer_kind::adamw: return "adamw(weight decay " + detail::number_text(weight_decay) + ")";
    }
    return "?";
  }

  /// Updates `n` elements: `p -= lr * rule(g * scale, state)` at (0-based) step `step`.
  /// `m`, `v`: the state slots of these elements (`v` unused by sgd), in memory `Space`. One Kokkos
  /// kernel over the arrays on the running device's instance, vectorised (nn/detail/simd.hpp: the
  /// same numbers, bitwise, as the element-by-element rule).
  template <class Space = default_memory_space>
  void update(float* p, const float* g, float* m, float* v, std::size_t n, std::size_t step, float scale,
              bool decay) const {
    const float rate = lr(step);
    if (kind == optimizer_kind::sgd) {
      detail::for_lanes<Space>(n, std::array<float, 3>{momentum, scale, rate}, detail::sgd_update{p, g, m});
      return;
    }
    const double t = static_cast<double>(step + 1);
    const float c1 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b1), t)));
    const float c2 = static_cast<float>(1.0 / (1.0 - std::pow(static_cast<double>(b2), t)));
    const float wd = kind == optimizer_kind::adamw && decay ? weight_decay : 0.0f;
    const std::array<float, 10> ks{scale, b1, 1.0f - b1, b2, 1.0f - b2, rate, c1, c2, eps, wd};
    detail::for_lanes<Space>(n, ks, detail::adam_update{p, g, m, v});
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

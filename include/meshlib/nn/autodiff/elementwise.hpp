// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Differentiable elementwise operations on traced values: `+`, `-`, `*`, `/` between two
/// operands (traced, or a plain `local_tensor` as a constant) and with a scalar, negation, and the
/// maps `tanh`, `exp`, `log`, `square`, `sqrt`, `rsqrt`, `maximum(x, s)` (`maximum(x, 0)` is
/// relu). The primal is
/// meshlib's own operation, so the layout rules (same layout on both sides, only linear
/// operations on pending sums) are the untraced ones.
/// @code
/// auto h = meshlib::nn::tanh(x * 2.0 + 1.0);   // x traced: records three nodes
/// auto r = meshlib::nn::maximum(h - b, 0.0);   // relu; b a plain local_tensor (a constant)
/// @endcode

#include <cmath>
#include <type_traits>

#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/tensor/elementwise.hpp"

namespace meshlib::nn {

namespace detail {

template <class T>
KOKKOS_INLINE_FUNCTION T ad_tanh(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::tanh(x);
#else
  return std::tanh(x);
#endif
}
template <class T>
KOKKOS_INLINE_FUNCTION T ad_exp(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::exp(x);
#else
  return std::exp(x);
#endif
}
template <class T>
KOKKOS_INLINE_FUNCTION T ad_log(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::log(x);
#else
  return std::log(x);
#endif
}

template <class T>
KOKKOS_INLINE_FUNCTION T ad_sqrt(T x) {
#if KOKKOS_VERSION >= 40000
  return Kokkos::sqrt(x);
#else
  return std::sqrt(x);
#endif
}

// Forward and backward element bodies: function objects, which nvcc compiles for the device where
// a lambda in a deduced-return function would not be.
struct tanh_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_tanh(x); }
};
struct tanh_back_fn {  // (ct, y = tanh x) -> ct (1 - y^2)
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return g * (T(1) - y * y); }
};
struct exp_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_exp(x); }
};
struct log_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_log(x); }
};
struct square_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x * x; }
};
struct square_back_fn {  // (ct, x) -> 2 x ct
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const { return T(2) * x * g; }
};
struct quotient_rhs_fn {  // (ct y, b) -> -ct y / b: the cotangent of b in y = a / b
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T gy, T b) const { return -gy / b; }
};
struct sqrt_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return ad_sqrt(x); }
};
struct sqrt_back_fn {  // (ct, y = sqrt x) -> ct / (2 y)
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return g / (T(2) * y); }
};
struct rsqrt_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return T(1) / ad_sqrt(x); }
};
struct rsqrt_back_fn {  // (ct, y = x^(-1/2)) -> -ct y^3 / 2
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T y) const { return -g * y * y * y / T(2); }
};
template <class S>
struct maximum_fn {
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x > static_cast<T>(s) ? x : static_cast<T>(s); }
};
template <class S>
struct maximum_back_fn {  // (ct, x) -> ct where x > s, else 0 (the subgradient 0 at the kink, as jax.nn.relu)
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T g, T x) const { return x > static_cast<T>(s) ? g : T(0); }
};

template <class X, class S>
concept ad_scalar_for = traced_type<X> && std::is_arithmetic_v<S>;

}  // namespace detail

/// @brief `a + b` (either operand may be a constant `local_tensor`); backward: `ct` to both.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator+(const A& a, const B& b) {
  auto y = detail::primal_of(a) + detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    detail::send(t, a, ct);
    detail::send(t, b, ct);
  });
}

/// @brief `a - b`; backward: `ct` to `a`, `-ct` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator-(const A& a, const B& b) {
  auto y = detail::primal_of(a) - detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    detail::send(t, a, ct);
    if constexpr (traced_type<B>) detail::send(t, b, -ct);
  });
}

/// @brief `a * b` elementwise; backward: `ct * b` to `a`, `ct * a` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator*(const A& a, const B& b) {
  auto y = detail::primal_of(a) * detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    if constexpr (traced_type<A>) detail::send(t, a, ct * detail::primal_of(b));
    if constexpr (traced_type<B>) detail::send(t, b, ct * detail::primal_of(a));
  });
}

/// @brief `a / b` elementwise; backward: `ct / b` to `a`, `-ct a / b^2` to `b`.
template <class A, class B>
  requires detail::ad_binary<A, B>
auto operator/(const A& a, const B& b) {
  auto y = detail::primal_of(a) / detail::primal_of(b);
  return detail::record(detail::tape_of(a, b), y, [a, b, y](detail::tape& t, const auto& ct) {
    if constexpr (traced_type<A>) detail::send(t, a, ct / detail::primal_of(b));
    if constexpr (traced_type<B>) detail::send(t, b, meshlib::zip(detail::quotient_rhs_fn{}, ct * y, detail::primal_of(b)));
  });
}

/// @brief `-x`; backward: `-ct`.
template <traced_type X>
auto operator-(const X& x) {
  auto y = -x.primal();
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, -ct); });
}

/// @brief `x * s` (linear: allowed on pending sums); backward: `ct * s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator*(const X& x, S s) {
  auto y = x.primal() * s;
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) { detail::send(t, x, ct * s); });
}
/// @brief `s * x`; backward: `ct * s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator*(S s, const X& x) {
  return x * s;
}
/// @brief `x / s`; backward: `ct / s`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator/(const X& x, S s) {
  auto y = x.primal() / s;
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) { detail::send(t, x, ct / s); });
}
/// @brief `x + s` (not on pending sums, as untraced); backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator+(const X& x, S s) {
  auto y = x.primal() + s;
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}
/// @brief `s + x`; backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator+(S s, const X& x) {
  return x + s;
}
/// @brief `x - s`; backward: `ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator-(const X& x, S s) {
  auto y = x.primal() - s;
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}
/// @brief `s - x`; backward: `-ct`.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto operator-(S s, const X& x) {
  auto y = s - x.primal();
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, -ct); });
}

/// @brief `tanh(x)` elementwise; backward: `ct (1 - tanh(x)^2)`.
template <traced_type X>
auto tanh(const X& x) {
  auto y = meshlib::map(detail::tanh_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::tanh_back_fn{}, ct, y));
  });
}

/// @brief `exp(x)` elementwise; backward: `ct exp(x)`.
template <traced_type X>
auto exp(const X& x) {
  auto y = meshlib::map(detail::exp_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) { detail::send(t, x, ct * y); });
}

/// @brief `log(x)` elementwise; backward: `ct / x`.
template <traced_type X>
auto log(const X& x) {
  auto y = meshlib::map(detail::log_fn{}, x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct / x.primal()); });
}

/// @brief `x * x` elementwise; backward: `2 x ct`.
template <traced_type X>
auto square(const X& x) {
  auto y = meshlib::map(detail::square_fn{}, x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::square_back_fn{}, ct, x.primal()));
  });
}

/// @brief `sqrt(x)` elementwise (`jnp.sqrt`); backward: `ct / (2 sqrt(x))` (infinite at 0, as JAX's).
template <traced_type X>
auto sqrt(const X& x) {
  auto y = meshlib::map(detail::sqrt_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::sqrt_back_fn{}, ct, y));
  });
}

/// @brief `1 / sqrt(x)` elementwise (`jax.lax.rsqrt`: a norm's scale `rsqrt(mean(x^2) + eps)`);
/// backward: `-ct x^(-3/2) / 2`.
template <traced_type X>
auto rsqrt(const X& x) {
  auto y = meshlib::map(detail::rsqrt_fn{}, x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::rsqrt_back_fn{}, ct, y));
  });
}

/// @brief `max(x, s)` elementwise (`maximum(x, 0)`: relu); backward: `ct` where `x > s`, else 0.
template <class X, class S>
  requires detail::ad_scalar_for<X, S>
auto maximum(const X& x, S s) {
  auto y = meshlib::map(detail::maximum_fn<S>{s}, x.primal());
  return detail::record(x.tape(), y, [x, s](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::zip(detail::maximum_back_fn<S>{s}, ct, x.primal()));
  });
}

}  // namespace meshlib::nn

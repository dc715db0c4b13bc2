// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Differentiable shape operations on traced values: `reshape`, `forget_dims`, `slice<D>`,
/// `pad<D>`, `concatenate<D>` and `broadcast_in_dim<D>`. The primal is the tensor layer's operation (tensor/reshape.hpp,
/// tensor/slice.hpp), with its sharding rules and diagnostics; each backward is the transpose of a
/// linear map, so it moves the cotangent and communicates nothing:
/// - `reshape(x, s)`: `reshape(ct, x.shape())`; `forget_dims<a>(x)`: `ct`;
/// - `slice<D>(x, start, stop)`: `pad<D>(ct, start, n - stop)` (zeros where `x` was cut off);
/// - `pad<D>(x, before, after)`: `slice<D>(ct, before, before + n)`;
/// - `concatenate<D>(xs...)`: each operand its own slice of `ct`;
/// - `broadcast_in_dim<D>(x, n)`: `sum<D>(ct)` (the new dimension is not sharded: no pending sum).
/// @code
/// auto q = meshlib::nn::slice<1>(qkv, 0, c);                                   // qkv traced
/// auto heads = meshlib::nn::reshape(q, std::array<std::size_t, 3>{t, h, c / h});
/// @endcode

#include <array>
#include <cstddef>
#include <tuple>
#include <type_traits>

#include "meshlib/collectives/relabel.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/tensor/broadcast_in_dim.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/reduce.hpp"
#include "meshlib/tensor/reshape.hpp"
#include "meshlib/tensor/slice.hpp"

namespace meshlib::nn {

namespace detail {

/// The tape of `x` when it is traced, else `t`.
template <ad_operand X>
tape* tape_or(const X& x, tape* t) {
  if constexpr (traced_type<X>) return t != nullptr ? t : x.tape();
  else return t;
}

/// Sends operand `x` of a `concatenate<D>` its slice of `ct`, from `at` along `D`; advances `at`.
template <std::size_t D, ad_operand X, local_tensor_type C>
void send_slice(tape& t, const X& x, const C& ct, std::size_t& at) {
  const std::size_t n = primal_of(x).extent(D);
  if constexpr (traced_type<X>) send(t, x, meshlib::slice<D>(ct, at, at + n));
  at += n;
}

}  // namespace detail

/// @brief `meshlib::reshape(x, shape)` on a traced value; backward: `ct` reshaped back to `x`'s shape.
template <traced_type X, std::size_t R>
auto reshape(const X& x, const std::array<std::size_t, R>& shape) {
  auto y = meshlib::reshape(x.primal(), shape);
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::reshape(ct, x.primal().shape()));
  });
}

/// @brief `meshlib::broadcast_in_dim<D>(x, n)` on a traced value (a bias row over a batch: `y =
/// matmul(x, w) + broadcast_in_dim<0>(b, x.extent(0))`); backward: `sum<D>(ct)`.
template <std::size_t D, traced_type X>
auto broadcast_in_dim(const X& x, std::size_t n) {
  auto y = meshlib::broadcast_in_dim<D>(x.primal(), n);
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, meshlib::sum<D>(ct)); });
}

/// @brief `meshlib::broadcast_in_dim<D>(x, like)` with `x` traced (`like`, traced or not, gives the
/// new dimension's extent and sharding record; it takes no cotangent); backward: `sum<D>(ct)` over
/// this device's block. Where that dimension is a block of axes (which `x` varies over), each
/// device's `x` filled only its own rows, so the local sum, a pending sum by its type, is `x`'s
/// cotangent as it stands.
template <std::size_t D, traced_type X, ad_operand Like>
auto broadcast_in_dim(const X& x, const Like& like) {
  auto y = meshlib::broadcast_in_dim<D>(x.primal(), detail::primal_of(like));
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, detail::retype<cotangent_t<typename X::primal_type>>(meshlib::sum<D>(ct)));
  });
}

/// @brief `meshlib::forget_dims<Names...>(x)` on a traced value (to combine a reshaped value with
/// one that still records its sharded dimensions); backward: `ct` itself, retyped.
template <fixed_string... Names, traced_type X>
auto forget_dims(const X& x) {
  auto y = meshlib::forget_dims<Names...>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) { detail::send(t, x, ct); });
}

/// @brief `meshlib::slice<D>(x, start, stop)` on a traced value; backward: `ct` padded with zeros
/// back to `x`'s extent along `D`.
template <std::size_t D, traced_type X>
auto slice(const X& x, std::size_t start, std::size_t stop) {
  auto y = meshlib::slice<D>(x.primal(), start, stop);
  return detail::record(x.tape(), y, [x, start, stop](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::pad<D>(ct, start, x.primal().extent(D) - stop));
  });
}

/// @brief `meshlib::pad<D>(x, before, after)` on a traced value; backward: the slice of `ct` that
/// `x` occupies.
template <std::size_t D, traced_type X>
auto pad(const X& x, std::size_t before, std::size_t after) {
  auto y = meshlib::pad<D>(x.primal(), before, after);
  return detail::record(x.tape(), y, [x, before](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::slice<D>(ct, before, before + x.primal().extent(D)));
  });
}

/// @brief `meshlib::concatenate<D>(xs...)` over operands of which at least one is traced (the
/// others plain `local_tensor`s, constants); backward: each traced operand gets its slice of `ct`.
template <std::size_t D, ad_operand... Xs>
  requires(traced_type<Xs> || ...)
auto concatenate(const Xs&... xs) {
  auto y = meshlib::concatenate<D>(detail::primal_of(xs)...);
  detail::tape* tp = nullptr;
  ((tp = detail::tape_or(xs, tp)), ...);
  return detail::record(tp, y, [ops = std::make_tuple(xs...)](detail::tape& t, const auto& ct) {
    std::size_t at = 0;
    std::apply([&](const auto&... x) { (detail::send_slice<D>(t, x, ct, at), ...); }, ops);
  });
}

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Differentiable reductions and products on traced values: `sum<D>`, `mean<D>`, `max<D>`,
/// `matmul`, `transpose` (rank 2). The primal is meshlib's own operation with its sharding rules.
///
/// Backward rules, with the layouts they imply:
/// - `sum<D>` / `mean<D>`: `ct` broadcast along `D` (divided by `D`'s global extent for `mean`).
///   Reducing a dimension sharded over `a` leaves a pending sum over `a`, whose cotangent is
///   invariant over `a` (autodiff/traced.hpp); broadcast, it is the cotangent of every block.
/// - `max<D>`: `ct` to the elements equal to the max along `D`, split equally between ties (JAX's
///   rule for `jnp.max`); 0 elsewhere. Over a dimension sharded on `a` the result is this block's
///   max (still varying over `a`, as untraced), and so is the rule.
/// - `matmul(a, b)`: `ct b^T` to `a`, `a^T ct` to `b` (one `matmul_into` each, the transposes read
///   in place). Where the product varies over an axis (or contracts a pending sum over it) that an
///   operand does not vary over, the operand was used by every device of that axis (JAX inserts a
///   `pvary` there), so its cotangent is `psum`med over the axis: data parallelism's gradient sum
///   and Megatron's `f` / `g` pair come out of this one rule.
/// @code
/// auto loss = meshlib::nn::mean<0>(meshlib::nn::sum<1>(meshlib::nn::square(matmul(x, w) - y)));
/// @endcode

#include <cstddef>

#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/nn/axis_mask_group.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/matmul.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/reduce.hpp"
#include "meshlib/tensor/transpose.hpp"

namespace meshlib::nn {

namespace detail {

/// `out[o, k, j] = in[o, j] * scale` for `o < outer`, `k < n`, `j < inner`, on `Space`. A named
/// function: nvcc refuses an extended device lambda inside a function whose return type is deduced.
template <class Space, class T>
void broadcast_along(T* out, const T* in, std::size_t outer, std::size_t n, std::size_t inner, T scale) {
  meshlib::launch<Space>(outer * n * inner, KOKKOS_LAMBDA(std::size_t i) {
    const std::size_t j = i % inner, o = i / (n * inner);
    out[i] = in[o * inner + j] * scale;
  });
}

/// One iteration per output element `(o, j)` of a max along a dimension of extent `n`: `out[o, k,
/// j] = ct[o, j] / c` where `x[o, k, j]` equals the max `y[o, j]` (`c` such `k`), else 0.
template <class T>
struct max_back_functor {
  const T* x;
  const T* y;
  const T* ct;
  T* out;
  std::size_t n, inner;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t idx) const {
    const std::size_t base = (idx / inner) * n * inner + idx % inner;
    std::size_t c = 0;
    for (std::size_t k = 0; k < n; ++k) c += x[base + k * inner] == y[idx] ? 1 : 0;
    const T share = c == 0 ? T(0) : ct[idx] / static_cast<T>(c);
    for (std::size_t k = 0; k < n; ++k) out[base + k * inner] = x[base + k * inner] == y[idx] ? share : T(0);
  }
};

/// The cotangent of `x` for `y = max<D>(x)` with cotangent `ct` of `y`.
template <std::size_t D, local_tensor_type X, local_tensor_type Y, local_tensor_type C>
cotangent_t<X> max_backward(const X& x, const Y& y, const C& ct) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d != D; ++d) outer *= x.extent(d);
  for (std::size_t d = D + 1; d < X::rank; ++d) inner *= x.extent(d);
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  meshlib::launch<space>(outer * inner, max_back_functor<T>{x.data(), y.data(), ct.data(), out.data(), x.extent(D), inner});
  return cotangent_t<X>(out, x.mesh(), x.device());
}

/// The cotangent of `x` (of type `X`) for `sum<D>`/`mean<D>` with cotangent `ct` of the result.
template <std::size_t D, local_tensor_type X, local_tensor_type C>
cotangent_t<X> reduce_backward(const X& x, const C& ct, typename X::value_type scale) {
  using T = typename X::value_type;
  using space = typename X::memory_space;
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d != D; ++d) outer *= x.extent(d);  // (d < D warns under nvcc for D = 0)
  for (std::size_t d = D + 1; d < X::rank; ++d) inner *= x.extent(d);
  auto out = meshlib::allocate<T, X::rank, space>(x.shape(), "meshlib::nn::autodiff", false);
  broadcast_along<space, T>(out.data(), ct.data(), outer, x.extent(D), inner, scale);
  return cotangent_t<X>(out, x.mesh(), x.device());
}

/// The cotangent of the operand `X` of a product whose other operand is `O` and whose cotangent is
/// `C`, from its local contribution `view` (see the file comment for the sum).
template <local_tensor_type X, local_tensor_type O, local_tensor_type C, class V>
auto product_cotangent(const V& view, const X& x) {
  using ct_t = cotangent_t<X>;
  constexpr axis_mask extra = (O::vary | O::partial | C::vary) & ~X::vary & ~X::partial;
  if constexpr (extra == 0) {
    return ct_t(view, x.mesh(), x.device());
  } else {
    using local_t = with_vary_t<ct_t, ct_t::vary | extra>;
    return retype<ct_t>(psum_over<extra>(local_t(view, x.mesh(), x.device())));  // nn/axis_mask_group.hpp
  }
}

}  // namespace detail

/// @brief Sum over dimension `D` (the layout of `meshlib::sum<D>`); backward: `ct` broadcast along `D`.
template <std::size_t D, traced_type X>
auto sum(const X& x) {
  auto y = meshlib::sum<D>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    t.accumulate<cotangent_t<typename X::primal_type>>(
        x.id(), detail::reduce_backward<D>(x.primal(), ct, typename X::value_type(1)));
  });
}

/// @brief Mean over dimension `D` (the layout of `meshlib::mean<D>`); backward: `ct / n` broadcast
/// along `D`, `n` its global extent.
template <std::size_t D, traced_type X>
auto mean(const X& x) {
  auto y = meshlib::mean<D>(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    using T = typename X::value_type;
    const T scale = T(1) / static_cast<T>(x.primal().global_extent(D));
    t.accumulate<cotangent_t<typename X::primal_type>>(x.id(), detail::reduce_backward<D>(x.primal(), ct, scale));
  });
}

/// @brief Max over dimension `D` (the layout of `meshlib::max<D>`: over a sharded dimension, this
/// block's max); backward: `ct` to the maximal elements along `D`, split equally between ties
/// (JAX's rule), 0 elsewhere. A numerically safe softmax shifts by it through `stop_gradient`:
/// `exp(x - broadcast_in_dim<1>(stop_gradient(max<1>(x)), x))`.
template <std::size_t D, traced_type X>
auto max(const X& x) {
  auto y = meshlib::max<D>(x.primal());
  return detail::record(x.tape(), y, [x, y](detail::tape& t, const auto& ct) {
    t.accumulate<cotangent_t<typename X::primal_type>>(x.id(), detail::max_backward<D>(x.primal(), y, ct));
  });
}

/// @brief The product of two rank-2 operands (either may be a constant `local_tensor`), with
/// `meshlib::matmul`'s layout; backward: `ct b^T` to `a`, `a^T ct` to `b`, each `psum`med over the
/// axes the product used it across (see the file comment).
template <class A, class B>
  requires detail::ad_binary<A, B>
auto matmul(const A& a, const B& b) {
  auto y = meshlib::matmul(detail::primal_of(a), detail::primal_of(b));
  return detail::record(detail::tape_of(a, b), y, [a, b](detail::tape& t, const auto& ct) {
    using C = std::remove_cvref_t<decltype(ct)>;
    const auto& pa = detail::primal_of(a);
    const auto& pb = detail::primal_of(b);
    using PA = std::remove_cvref_t<decltype(pa)>;
    using PB = std::remove_cvref_t<decltype(pb)>;
    if constexpr (traced_type<A>) {
      auto da = meshlib::allocate<typename PA::value_type, 2, typename PA::memory_space>(pa.shape(), "meshlib::nn::autodiff", false);
      meshlib::matmul_into(da, ct.view(), pb.view(), {.transpose_b = true});
      t.accumulate<cotangent_t<PA>>(a.id(), detail::product_cotangent<PA, PB, C>(da, pa));
    }
    if constexpr (traced_type<B>) {
      auto db = meshlib::allocate<typename PB::value_type, 2, typename PB::memory_space>(pb.shape(), "meshlib::nn::autodiff", false);
      meshlib::matmul_into(db, pa.view(), ct.view(), {.transpose_a = true});
      t.accumulate<cotangent_t<PB>>(b.id(), detail::product_cotangent<PB, PA, C>(db, pb));
    }
  });
}

/// @brief The transpose of a rank-2 traced value; backward: the transpose of `ct`.
template <traced_type X>
auto transpose(const X& x) {
  auto y = meshlib::transpose(x.primal());
  return detail::record(x.tape(), y, [x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::transpose(ct));
  });
}

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Reductions along one dimension: `sum<D>`, `mean<D>`, `max<D>`, on local values and on
/// global `sharded_tensor`s. The result has rank `Rank - 1`.
///
/// Sharding propagation, local view (inside `shard_map` / `spmd`), when dimension `D` is a block of
/// the axes `a` (its `dims` entry), following what JAX's shard_map gives for the same program:
/// | reduction | local result | to complete it |
/// | --- | --- | --- |
/// | `sum<D>`  | partial over `a` (no longer varying over `a`) | `psum` over `a` |
/// | `mean<D>` | partial over `a`: the local sum divided by the *global* extent of `D`, so that the sum of the parts is the global mean | `psum` over `a` |
/// | `max<D>`  | still varying over `a`: the max of this block only (a max is no sum) | `pmax` over `a` |
/// A dimension not sharded (`a` empty) reduces completely on each device. `sum` and `mean` are
/// linear, so they also accept partial inputs; `max` does not.
/// `mean` of an integer tensor returns `double` (as `jnp.mean` returns a float).
///
/// Global view: the reduction is complete (an "automatic psum"): the result's spec is the input's
/// with dimension `D` removed, so the axes that split `D` now replicate the result. It needs every
/// block of each reduced group in this process (the thread communicator case); otherwise it
/// throws `sharding_error` (use the local view and a collective).
///
/// All loops are meshlib's own (one output element per RangePolicy iteration, the reduced
/// dimension summed in index order): deterministic, and safe from concurrent device threads on
/// Kokkos 3.4.1, whose parallel_reduce is not (see view.hpp).

#include <array>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
#include "meshlib/tensor/spec_algebra.hpp"
#include "meshlib/tensor/for_each_device.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

/// The reductions of the local kernels (named apart from the comm layer's `reduce_op`, which
/// `<meshlib.hpp>` also includes).
enum class reduce_kind { sum, max, mean };

namespace tensor::detail {

/// `Spec` of a rank-`Rank` array without entry `D`.
template <class Spec, std::size_t Rank, std::size_t D>
constexpr std::array<dim_spec, Rank - 1> remove_spec_entry() {
  std::array<dim_spec, Rank - 1> out{};
  for (std::size_t i = 0; i + 1 < Rank; ++i) out[i] = Spec::dim(i < D ? i : i + 1);
  return out;
}

template <class Dim, class Rank>
consteval bool reduction_over_missing_dim() {
  static_assert(diagnostic::always_false<Dim, Rank>,
                "meshlib: reduction over a dimension the tensor does not have (the dimension and the rank are spelled "
                "out in the condition)");
  return false;
}

template <class Op, class PartialAxes, class Value>
consteval bool max_of_partial_value() {
  static_assert(diagnostic::always_false<Op, PartialAxes, Value>,
                "meshlib: max over a value that is a pending sum over the axes spelled out in the condition: the max "
                "of the parts is not the max of the sum; psum over those axes first");
  return false;
}

/// True when dimension `D` exists; otherwise fires `reduction_over_missing_dim`.
template <std::size_t D, std::size_t Rank>
consteval bool check_reduce_dim() {
  if constexpr (D < Rank) return true;
  else return reduction_over_missing_dim<diagnostic::dim<D>, diagnostic::size<Rank>>();
}

template <class T>
using mean_result_t = std::conditional_t<std::is_floating_point_v<T>, T, double>;

template <reduce_kind Op, class T>
using reduce_result_t = std::conditional_t<Op == reduce_kind::mean, mean_result_t<T>, T>;

template <class T>
KOKKOS_INLINE_FUNCTION constexpr T lowest_of() {
  if constexpr (std::numeric_limits<T>::has_infinity) return -std::numeric_limits<T>::infinity();
  else return std::numeric_limits<T>::lowest();
}

/// One output element per iteration: out[o * inner + j] = reduce over k of in[(o * n + k) * inner + j].
template <reduce_kind Op, class T, class U>
struct reduce_functor {
  const T* in;
  U* out;
  std::size_t n, inner;
  U scale;  // mean: 1 / global extent
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t idx) const {
    const std::size_t o = idx / inner, j = idx % inner;
    const T* p = in + o * n * inner + j;
    if constexpr (Op == reduce_kind::max) {
      T acc = lowest_of<T>();
      for (std::size_t k = 0; k < n; ++k) acc = p[k * inner] > acc ? p[k * inner] : acc;
      out[idx] = acc;
    } else {
      U acc = U{};
      for (std::size_t k = 0; k < n; ++k) acc += static_cast<U>(p[k * inner]);
      out[idx] = Op == reduce_kind::mean ? static_cast<U>(acc * scale) : acc;
    }
  }
};

/// Reduces dimension `D` of `in`; `mean_extent` is the extent `mean` divides by.
template <reduce_kind Op, std::size_t D, class Space, class U = void, class View>
auto reduce_view(const View& in, std::size_t mean_extent) {
  constexpr std::size_t rank = View::rank;
  using T = typename View::value_type;
  using R = std::conditional_t<std::is_void_v<U>, reduce_result_t<Op, T>, U>;
  std::array<std::size_t, rank - 1> shape{};
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d < rank; ++d) {
    if (d < D) outer *= in.extent(d);
    if (d > D) inner *= in.extent(d);
    if (d != D) shape[d < D ? d : d - 1] = in.extent(d);
  }
  auto out = allocate<R, rank - 1, Space>(shape, "meshlib::reduce", false);
  const R scale = mean_extent == 0 ? R{} : static_cast<R>(R{1} / static_cast<R>(mean_extent));
  launch<Space>(outer * inner, reduce_functor<Op, T, R>{in.data(), out.data(), in.extent(D), inner, scale});
  return out;
}

/// True when reducing dimension `D` of local value `L` with `Op` is allowed; otherwise fires the
/// one diagnostic that says why.
template <reduce_kind Op, std::size_t D, class L>
consteval bool check_reduce_local() {
  if constexpr (!check_reduce_dim<D, L::rank>()) return false;
  else if constexpr (Op == reduce_kind::max && L::partial != 0)
    return max_of_partial_value<diagnostic::op_t<"max">, diagnostic::axes_t<typename L::mesh_type, L::partial>, diag_value_t<L>>();
  else return true;
}

template <reduce_kind Op, std::size_t D, local_tensor_type L>
auto reduce_local(const L& x) {
  if constexpr (!check_reduce_local<Op, D, L>()) {
    return x;  // the diagnostic above has fired
  } else {
  using T = typename L::value_type;
  using U = reduce_result_t<Op, T>;
  constexpr axis_mask a = L::dims_type::at(D);
  constexpr axis_mask vary = Op == reduce_kind::max ? L::vary : (L::vary & ~a);
  constexpr axis_mask partial = Op == reduce_kind::max ? L::partial : (L::partial | a);
  using out_t = rebind_local_t<L, U, L::rank - 1, vary, partial, remove_dim_t<typename L::dims_type, D>>;
  return out_t(reduce_view<Op, D, typename L::memory_space>(x.view(), x.global_extent(D)), x.mesh(), x.device());
  }
}

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global_checked(const X& x);

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global(const X& x) {
  if constexpr (!check_reduce_dim<D, X::rank>()) return x;  // the diagnostic has fired
  else return reduce_global_checked<Op, D>(x);
}

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global_checked(const X& x) {
  using S = typename X::sharding_type;
  using mesh_t = typename X::mesh_type;
  using T = typename X::value_type;
  using U = reduce_result_t<Op, T>;
  using out_spec = spec_from_array_t<remove_spec_entry<typename X::spec_type, X::rank, D>()>;
  using out_sharding = named_sharding<mesh_t, out_spec>;
  using space = typename X::memory_space;
  using out_t = sharded_tensor<U, X::rank - 1, out_sharding, space>;
  constexpr axis_mask a = S::dim_mask(D);
  const auto& m = x.mesh();
  const std::size_t n = x.num_devices();
  // Partial results per local device, over its own block.
  using view_u = block_view_t<U, X::rank - 1, space>;
  std::vector<view_u> part(n);
  for_each_device<space>(x.local_devices(), n, x.size(), [&](std::size_t dev) {
    part[dev] = reduce_view<Op == reduce_kind::max ? reduce_kind::max : reduce_kind::sum, D, space, U>(x.local(dev), 0);
  });
  if constexpr (a == 0) {
    if constexpr (Op == reduce_kind::mean) {
      std::vector<view_u> out(n);
      const U scale = x.extent(D) == 0 ? U{} : static_cast<U>(U{1} / static_cast<U>(x.extent(D)));
      for (std::size_t dev : x.local_devices()) {
        out[dev] = part[dev];
        U* p = out[dev].data();
        for (std::size_t i = 0; i < out[dev].span(); ++i) p[i] = static_cast<U>(p[i] * scale);
      }
      part = std::move(out);
    }
    std::vector<bool> local(n);
    for (std::size_t d = 0; d < n; ++d) local[d] = x.is_local(d);
    std::array<std::size_t, X::rank - 1> shape{};
    for (std::size_t d = 0, k = 0; d < X::rank; ++d)
      if (d != D) shape[k++] = x.extent(d);
    return out_t(out_sharding(m, x.sharding().rule()), shape, std::move(part), std::move(local));
  } else {
    // Complete the reduction over each group along `a`, in group-rank order (deterministic).
    std::array<std::size_t, X::rank - 1> shape{};
    for (std::size_t d = 0, k = 0; d < X::rank; ++d)
      if (d != D) shape[k++] = x.extent(d);
    out_t out(out_sharding(m, x.sharding().rule()), shape, std::span<const std::size_t>(x.local_devices()));
    const U scale = x.extent(D) == 0 ? U{} : static_cast<U>(U{1} / static_cast<U>(x.extent(D)));
    for (std::size_t dev : x.local_devices()) {
      U* dst = out.local(dev).data();
      const std::size_t len = out.local(dev).span();
      const auto group = m.group(dev, a);
      bool first = true;
      for (std::size_t g : group) {
        if (!x.is_local(g))
          throw sharding_error("meshlib: global " + std::string(Op == reduce_kind::max ? "max" : Op == reduce_kind::sum ? "sum" : "mean") +
                               " over dimension " + std::to_string(D) + " of " + x.to_string() + " needs device " +
                               std::to_string(g) + "'s block, which is not local; reduce in the local view and complete with a collective");
        const U* src = part[g].data();
        if (x.local_shape(g)[D] == 0) continue;  // an empty block (uneven rule) contributes nothing
        for (std::size_t i = 0; i < len; ++i) {
          if (first) dst[i] = src[i];
          else if constexpr (Op == reduce_kind::max) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
          else dst[i] += src[i];
        }
        first = false;
      }
      if (first && Op == reduce_kind::max)
        for (std::size_t i = 0; i < len; ++i) dst[i] = lowest_of<U>();
      if constexpr (Op == reduce_kind::mean)
        for (std::size_t i = 0; i < len; ++i) dst[i] = static_cast<U>(dst[i] * scale);
    }
    return out;
  }
}

}  // namespace tensor::detail

/// @brief Sum over dimension `D` (local view: partial over `D`'s axes; global view: complete).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto sum(const X& x) {
  if constexpr (local_tensor_type<X>) return tensor::detail::reduce_local<reduce_kind::sum, D>(x);
  else return tensor::detail::reduce_global<reduce_kind::sum, D>(x);
}

/// @brief Mean over dimension `D` (local view: partial over `D`'s axes, scaled by the global extent).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto mean(const X& x) {
  if constexpr (local_tensor_type<X>) return tensor::detail::reduce_local<reduce_kind::mean, D>(x);
  else return tensor::detail::reduce_global<reduce_kind::mean, D>(x);
}

/// @brief Max over dimension `D` (local view: the block's max, still varying over `D`'s axes: pmax completes it).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto max(const X& x) {
  if constexpr (local_tensor_type<X>) return tensor::detail::reduce_local<reduce_kind::max, D>(x);
  else return tensor::detail::reduce_global<reduce_kind::max, D>(x);
}

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `psum`, `pmean`, `pmax`, `pmin`: all-reduce over one or more mesh axes, as `jax.lax.psum`
/// and friends. The result is invariant over the axes (and no longer partial over them). Results
/// are written out of place into the device's workspace (collectives/workspace.hpp): after the
/// first call of a shape, a call allocates and copies nothing, and never overwrites a result
/// that is still held.
/// @code
/// // inside shard_map over mesh<axis<"data">, axis<"model">>, x varies over both:
/// auto s = meshlib::psum<"model">(x);          // the sum over the model group; varies over data only
/// auto m = meshlib::pmean<"data", "model">(x); // the mean over every device
/// @endcode

#include <algorithm>
#include <any>
#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "meshlib/collectives/collective_request.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/config.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace collectives::detail {

/// A fresh, uninitialised block of `shape` for the result of a collective on `L`.
template <class L, std::size_t R = L::rank>
auto result_view(const std::array<std::size_t, R>& shape) {
  return allocate<typename L::value_type, R, typename L::memory_space>(shape, "meshlib::collective", false);
}

/// A block of `shape` for the result of a collective, from the running device's workspace
/// (collectives/workspace.hpp): reused when nobody holds it any more, so a repeated call allocates nothing.
template <class T, std::size_t R, class Space>
block_view<T, R, Space> workspace_view(device_context& ctx, const std::array<std::size_t, R>& shape) {
  return ctx.workspace().template acquire<T, R, Space>(shape);
}

/// The contiguous data of `x` (collectives move whole blocks; a strided view must be copied first).
/// A block in device memory needs a stream backend (NCCL, shared-GPU: `gpu_runner`): without NCCL
/// compiled in (`MESHLIB_ENABLE_NCCL`) that is a compile-time error, with it the running device's
/// communicator is checked (a host one, thread or MPI, cannot read device memory).
template <class L>
const typename L::value_type* contiguous_data(const L& x, std::string_view op) {
  using space_t = typename L::memory_space;
  static_assert(host_accessible_v<space_t> || config::nccl,
                "meshlib: the host collectives need host-accessible blocks; use the NCCL backend for device memory");
  if constexpr (!host_accessible_v<space_t>) {
    if (!current_device(op).takes_device_memory())
      throw sharding_error("meshlib: " + std::string(op) + " on a block in device memory (" +
                           std::string(space_t::name()) +
                           "), but this device's communicator is a host one (thread or MPI), which reads host memory; "
                           "run on meshlib::gpu_runner (NCCL or shared-GPU communicators; default_runner picks it "
                           "when a GPU is present), or copy the block to host memory first");
  }
  if (x.size() != 0 && !x.view().span_is_contiguous())
    throw sharding_error("meshlib: " + std::string(op) + " needs a contiguous block; copy the strided view first");
  return x.data();
}

template <fixed_string Op, class L, bool AllowPartial, fixed_string Axis>
consteval bool check_reduction_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) {
    return check_axis_in_mesh<Op, Axis, mesh_t>();
  } else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    using op_t = diagnostic::op_t<Op>;
    using axis_t = diagnostic::axis_t<Axis>;
    if constexpr (!AllowPartial && L::partial != 0) return extremum_of_partial_value<op_t, axis_t, diagnostic::value_t<L>>();
    else if constexpr (AllowPartial && ((L::vary | L::partial) & bit) == 0)
      return psum_over_invariant_axis<op_t, axis_t, diagnostic::value_t<L>>();
    else if constexpr (!AllowPartial && (L::vary & bit) == 0)
      return reduction_over_invariant_axis<op_t, axis_t, diagnostic::value_t<L>>();
    else return true;
  }
}

template <fixed_string Op, class L, bool AllowPartial, fixed_string... Names>
consteval bool check_reduction() {
  static_assert(sizeof...(Names) > 0, "meshlib: psum / pmean / pmax / pmin need at least one axis: psum<\"data\">(x)");
  if constexpr (!check_element_type<Op, typename L::value_type>()) return false;
  else return (check_reduction_axis<Op, L, AllowPartial, Names>() && ...);
}

/// The element type of `pmean`'s result: JAX's true division, so an integer mean is a floating
/// value (int32 -> float, as JAX's float32; int64 -> double), never a truncated integer.
template <class T>
using mean_value_t = std::conditional_t<std::is_integral_v<T>, std::conditional_t<(sizeof(T) <= 4), float, double>, T>;

/// `m[i] = s[i] / n` for `i < count`, on `Space`. A named function rather than a lambda in
/// `all_reduce_over`: nvcc refuses an extended device lambda inside a function whose return type is
/// deduced.
template <class Space, class T, class U>
void divide_into(U* m, const T* s, U n, std::size_t count) {
  launch<Space>(count, KOKKOS_LAMBDA(std::size_t i) { m[i] = static_cast<U>(s[i]) / n; });
}

/// Runs `op` on the communicator of `mask` and returns `result`: now (`Async` false), or started on
/// the device's communication worker, returning the `collective_request` of `result`; `keep` holds
/// what the operation reads until it is complete. One function, so the synchronous form is the
/// asynchronous one minus the worker, with the same types, checks and buffers.
template <bool Async, class Result, class F>
auto issue(device_context& ctx, axis_mask mask, Result result, F op, std::any keep = {}) {
  if constexpr (Async) {
    auto started = ctx.start(mask, std::move(op));
    return collective_request<Result>(ctx.stream(), std::move(started), std::move(result), std::move(keep));
  } else {
    op(ctx.comm(mask));
    return result;
  }
}

/// The all-reduce `op` over the axes `Names...` of `x` (`Async`: started, see `issue`).
template <fixed_string Op, reduce_op ROp, bool AllowPartial, fixed_string... Names, class L, bool Async = false>
auto all_reduce_over(const L& x, std::bool_constant<Async> = {}) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_reduction<Op, L, AllowPartial, Names...>();
  constexpr axis_mask mask = safe_mask_v<mesh_t, Names...>;
  using T = typename L::value_type;
  // An integer mean is a sum in T (wrapping, as JAX's int32 psum) then a true division.
  constexpr bool int_mean = ROp == reduce_op::mean && std::is_integral_v<T>;
  using U = std::conditional_t<int_mean, mean_value_t<T>, T>;
  using result_t = rebind_local_t<L, U, L::rank, L::vary & ~mask, L::partial & ~mask,
                                  dims_without_t<typename L::dims_type, mask>>;
  if constexpr (!ok) {
    if constexpr (Async) return collective_request<result_t>{};
    else return result_t{};
  } else if constexpr (Async) {
    static_assert(!int_mean, "meshlib: the asynchronous form of an integer pmean is not provided; psum_start and divide");
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, Op.view());
    device_context& ctx = current_device(Op.view());
    auto out = workspace_view<T, L::rank, space_t>(ctx, x.shape());
    T* dst = out.data();
    const std::size_t count = x.size();
    return issue<true>(ctx, mask, result_t(out, x.mesh(), x.device()),
                       [src, dst, count](device_comm& c) { c.all_reduce(src, dst, count, datatype_of<T>, ROp); },
                       std::any(x));
  } else {
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, Op.view());
    device_context& ctx = current_device(Op.view());
    auto& comm = ctx.comm(mask);
    if constexpr (int_mean) {
      // The integer sum in a staging buffer, then the true division into the result.
      auto sum = ctx.workspace().template scratch<T, space_t>(x.size());
      comm.all_reduce(src, sum.data(), x.size(), datatype_of<T>, reduce_op::sum);
      auto mean = workspace_view<U, L::rank, space_t>(ctx, x.shape());
      divide_into<space_t>(mean.data(), static_cast<const T*>(sum.data()), static_cast<U>(comm.size()), x.size());
      return result_t(mean, x.mesh(), x.device());
    } else {
      // Out of place: the backend reads x where it lies and writes the workspace's buffer.
      auto out = workspace_view<T, L::rank, space_t>(ctx, x.shape());
      comm.all_reduce(src, out.data(), x.size(), datatype_of<T>, ROp);
      return result_t(out, x.mesh(), x.device());
    }
  }
}

/// The all-reduce of a donated `x` (an rvalue): in `x`'s own buffer when `x` is its only holder,
/// or when `x` is a view over a caller's buffer (an unmanaged view: no holder count, the caller
/// owns the buffer and gave it up by moving it), and contiguous, so the call allocates and copies
/// nothing; otherwise as `all_reduce_over`.
template <fixed_string Op, reduce_op ROp, bool AllowPartial, fixed_string... Names, class L, bool Async = false>
auto all_reduce_donated(L&& x, std::bool_constant<Async> async = {}) {
  constexpr bool ok = check_reduction<Op, L, AllowPartial, Names...>();
  if constexpr (!ok) {
    return all_reduce_over<Op, ROp, AllowPartial, Names...>(x, async);  // fires the same diagnostic
  } else {
    // One holder: the handle is this device's own block (view.hpp's rule), so the count is exact.
    // A result of an earlier collective is held by the workspace too, which counts as no holder.
    // A caller's buffer (use_count 0) is the caller's to give.
    device_context& ctx = current_device(Op.view());
    const long count = x.view().use_count();
    const bool borrowed = count == 0 && x.data() != nullptr;
    const long holders = count - (ctx.workspace().holds(x.view()) ? 1 : 0);
    if ((!borrowed && holders != 1) || (x.size() != 0 && !x.view().span_is_contiguous()))
      return all_reduce_over<Op, ROp, AllowPartial, Names...>(x, async);
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = safe_mask_v<mesh_t, Names...>;
    using result_t = with_vary_partial_t<with_dims_t<L, dims_without_t<typename L::dims_type, mask>>, L::vary & ~mask,
                                         L::partial & ~mask>;
    using T = typename L::value_type;
    auto buffer = x.view();
    T* data = buffer.data();
    const std::size_t elements = x.size();
    return issue<Async>(ctx, mask, result_t(std::move(buffer), x.mesh(), x.device()),
                        [data, elements](device_comm& c) { c.all_reduce(data, elements, datatype_of<T>, ROp); });
  }
}

}  // namespace collectives::detail

namespace experimental {
/// A view of a device's reusable scratch memory of the given extent.
using collectives::detail::workspace_view;
}  // namespace experimental

/// @brief Sum over the devices of the axes `Names...` (JAX `lax.psum`). `x` must vary over, or be
/// partial over, each axis; the result is invariant over them. Sums in rank order: bitwise
/// reproducible.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum(const L& x) {
  return collectives::detail::all_reduce_over<"psum", reduce_op::sum, true, Names...>(x);
}

/// @brief `psum` of a donated value (JAX's `donate_argnums`): `psum<"x">(std::move(x))` sums in
/// `x`'s buffer when nothing else holds it, with no allocation or copy, and the result takes the
/// buffer over (`x` must not be read afterwards). A block something else still holds (an input of
/// `shard_map`, a copy) is copied first, as the lvalue overload does. A value over a caller's
/// buffer (a view made from a pointer, which counts no holders) is summed in that buffer: the
/// caller owns it and donates it by moving (a temporary that wraps a buffer still to be read must
/// be passed as an lvalue, which copies).
/// @code
/// auto g = meshlib::psum<"data">(std::move(grad));   // grad's buffer now holds the sum
/// // a bucket of a caller's flat buffer, summed where it lies:
/// using B = meshlib::local_tensor<float, 1, mesh_t, 0, mesh_t::mask_of<"data">()>;
/// (void)meshlib::psum<"data">(B(B::view_type(flat + offset, len), mesh, dev));
/// @endcode
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto psum(L&& x) {
  return collectives::detail::all_reduce_donated<"psum", reduce_op::sum, true, Names...>(std::move(x));
}

/// @brief `psum` started asynchronously: returns at once a `collective_request` whose `wait()`
/// returns what `psum<Names...>(x)` returns (same type, same bits: the same reduction in the same
/// order), while the sum runs on the device's communication worker (collectives/comm_stream.hpp).
/// The same compile-time checks as `psum`. `x` is kept alive by the request; every device of the
/// group must start the same collectives in the same order (as for every collective).
/// @code
/// auto r = meshlib::psum_start<"data">(x);
/// auto other = local_work();        // overlaps the sum
/// auto s = r.wait();                // == psum<"data">(x); errors (comm_aborted, ...) surface here
/// @endcode
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum_start(const L& x) {
  return collectives::detail::all_reduce_over<"psum", reduce_op::sum, true, Names...>(x, std::true_type{});
}

/// @brief `psum_start` of a donated value: summed in `x`'s buffer under `psum`'s donation rule, which
/// the request's result takes over; nothing is allocated or copied. The training layer's gradient
/// buckets are started this way, as soon as backward has completed them.
/// @code
/// auto r = meshlib::psum_start<"data">(std::move(grad));  // grad must not be read afterwards
/// auto g = r.wait();                                      // grad's buffer, now the sum
/// @endcode
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto psum_start(L&& x) {
  return collectives::detail::all_reduce_donated<"psum", reduce_op::sum, true, Names...>(std::move(x), std::true_type{});
}

/// @brief Mean over the devices of the axes `Names...` (JAX `lax.pmean`); the type rule of `psum`.
/// The mean of integers is a true division, as in JAX: `float` for 32-bit integers (JAX's float32),
/// `double` for 64-bit ones; for a truncated integer mean write `psum` and divide.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmean(const L& x) {
  return collectives::detail::all_reduce_over<"pmean", reduce_op::mean, true, Names...>(x);
}

/// @brief Elementwise maximum over the devices of the axes `Names...` (JAX `lax.pmax`). `x` must
/// vary over each axis and be partial over none.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmax(const L& x) {
  return collectives::detail::all_reduce_over<"pmax", reduce_op::max, false, Names...>(x);
}

/// @brief Elementwise minimum over the devices of the axes `Names...` (JAX `lax.pmin`); the type rule of `pmax`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmin(const L& x) {
  return collectives::detail::all_reduce_over<"pmin", reduce_op::min, false, Names...>(x);
}

/// @brief `pmax` of a donated value: in `x`'s buffer under `psum`'s donation rule.
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto pmax(L&& x) {
  return collectives::detail::all_reduce_donated<"pmax", reduce_op::max, false, Names...>(std::move(x));
}

/// @brief `pmin` of a donated value: in `x`'s buffer under `psum`'s donation rule.
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto pmin(L&& x) {
  return collectives::detail::all_reduce_donated<"pmin", reduce_op::min, false, Names...>(std::move(x));
}

}  // namespace meshlib

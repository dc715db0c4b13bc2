// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The backward (transpose) of every collective, written on the typed local tensors so the
/// compiler checks the backward pass's shardings as it checks the forward's. A cotangent has its
/// primal's type (JAX's `check_vma` convention: the cotangent of an invariant value is invariant),
/// except where noted.
///
/// | forward | backward of the cotangent `ct` |
/// | --- | --- |
/// | `psum<a>(x)` (varying -> invariant) | `pvary<a>(ct)`: no data moves |
/// | `pvary<a>(x)` (invariant -> varying) | `psum<a>(ct)` |
/// | `all_gather<a, d>(x)` | `psum_scatter<a, d>(ct)` when `ct` is a pending sum over `a` (each device's contribution); the device's own chunk of `ct` when `ct` is invariant over `a` |
/// | `psum_scatter<a, d>(x)` | `all_gather<a, d>(ct)` |
/// | `all_to_all<a, split, concat>(x)` | `all_to_all<a, concat, split>(ct)` |
/// | `ppermute<a>(x, perm)` | `ppermute<a>(ct, inverse(perm))` |
///
/// The laws `<f(x), y> = <x, f^T(y)>` are tested for each pair in tests/unit/nn/test_collective_transpose.cpp.
/// @code
/// auto y = meshlib::psum<"model">(x);                    // forward
/// auto dx = meshlib::nn::psum_transpose<"model">(dy);    // backward: pvary, the type of x
/// @endcode

#include <cstddef>
#include <utility>
#include <vector>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/gathers.hpp"
#include "meshlib/collectives/permutes.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn {

namespace detail {
/// `to[o * run + k] = from[o * stride + at + k]` for `o < outer`, `k < run`, on `Space`: one work
/// item per run. A named function: nvcc refuses an extended device lambda inside a function whose
/// return type is deduced.
template <class Space, class V>
void copy_runs(V* to, const V* from, std::size_t outer, std::size_t run, std::size_t stride, std::size_t at) {
  meshlib::launch<Space>(outer, KOKKOS_LAMBDA(std::size_t o) {
    for (std::size_t k = 0; k < run; ++k) to[o * run + k] = from[o * stride + at + k];
  });
}
}  // namespace detail

/// @brief Backward of `psum<Names...>`: `pvary<Names...>(ct)`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum_transpose(const L& ct) {
  return meshlib::pvary<Names...>(ct);
}

/// @brief Backward of `pvary<Names...>`: `psum<Names...>(ct)`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pvary_transpose(const L& ct) {
  return meshlib::psum<Names...>(ct);
}

/// @brief Backward of `all_gather<Axis, Dim>` (see the file comment for the two cotangent forms).
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto all_gather_transpose(const L& ct) {
  constexpr axis_mask bit = L::mesh_type::template mask_of<Axis>();
  if constexpr ((L::partial & bit) != 0) {
    return meshlib::psum_scatter<Axis, Dim>(ct);
  } else {
    // Invariant cotangent: the gathered value's derivative with respect to this device's chunk is
    // the chunk of ct at this device's position; the result varies over Axis, sharded on Dim.
    using R = decltype(meshlib::psum_scatter<Axis, Dim>(meshlib::pvary<Axis>(ct)));
    const std::size_t n = meshlib::axis_size<Axis>(), i = meshlib::axis_index<Axis>();
    auto shape = ct.shape();
    const std::size_t outer = [&] {
      std::size_t o = 1;
      for (std::size_t d = 0; d < Dim; ++d) o *= shape[d];
      return o;
    }();
    const std::size_t inner = ct.size() / (outer * shape[Dim]);
    const std::size_t chunk = shape[Dim] / n;
    shape[Dim] = chunk;
    auto out = meshlib::allocate<typename L::value_type, L::rank, typename L::memory_space>(shape, "meshlib::nn", false);
    // One work item per outer index: a contiguous run of chunk * inner elements.
    using V = typename L::value_type;
    V* to = out.data();
    const V* from = ct.data();
    const std::size_t run = chunk * inner, stride = shape[Dim] * n * inner, at = i * chunk * inner;
    detail::copy_runs<typename L::memory_space>(to, from, outer, run, stride, at);
    return R(out, ct.mesh(), ct.device());
  }
}

/// @brief Backward of `psum_scatter<Axis, Dim>`: `all_gather<Axis, Dim>(ct)`.
template <fixed_string Axis, std::size_t Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter_transpose(const L& ct) {
  return meshlib::all_gather<Axis, Dim>(ct);
}

/// @brief Backward of `all_to_all<Axis, Split, Concat>`: the reverse all-to-all.
template <fixed_string Axis, std::size_t Split, std::size_t Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all_transpose(const L& ct) {
  return meshlib::all_to_all<Axis, Concat, Split>(ct);
}

/// @brief The inverse of a permutation given as (source, destination) pairs.
[[nodiscard]] inline std::vector<std::pair<std::size_t, std::size_t>> inverse_permutation(
    const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  std::vector<std::pair<std::size_t, std::size_t>> inv;
  inv.reserve(perm.size());
  for (const auto& [src, dst] : perm) inv.emplace_back(dst, src);
  return inv;
}

/// @brief Backward of `ppermute<Axis>(x, perm)`: `ppermute<Axis>(ct, inverse(perm))`.
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto ppermute_transpose(const L& ct, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return meshlib::ppermute<Axis>(ct, inverse_permutation(perm));
}

}  // namespace meshlib::nn

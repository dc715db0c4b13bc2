// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `matmul` of rank-2 tensors with GSPMD's sharding rules, on local values and on global
/// `sharded_tensor`s.
///
/// For `C = A . B` with `A` split as `P<r, k>` and `B` as `P<k2, c>`:
/// | case | requirement | result |
/// | --- | --- | --- |
/// | batch (rows) sharded x replicated | `k == k2 == none` | `P<r, c>`, no communication |
/// | column-sharded weights | `B = P<none, c>` | columns sharded over `c` |
/// | contraction sharded on both sides | `k == k2` (same axes, same order) | local view: partial over `k` (complete with `psum`, or `psum_scatter` to get it sharded); global view: summed, replicated over `k` |
/// | contraction sharded differently | `k != k2` | does not compile: reshard one side |
/// | one axis on both output dimensions | `r` and `c` share an axis | does not compile |
/// Local view only: a pending sum times a value is a pending sum (matmul is linear in each side),
/// unless the other side varies over (or is partial over) the same axis: that does not compile.
///
/// Kernel: `matmul_into` (tensor/matmul_into.hpp) into a fresh block: `KokkosBlas::gemm` for
/// `float` / `double` when meshlib is built with Kokkos Kernels, otherwise meshlib's own Kokkos
/// kernel; it also sets the BLAS to one thread per device (`set_blas_threads_per_device`).

#include <array>
#include <cstddef>
#include <string>
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
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

/// C = A . B for row-major blocks, into a fresh view (`matmul_into` with `beta = 0` writes every
/// element, so the block is not zero-filled first).
template <class Space, class VA, class VB>
auto gemm_view(const VA& a, const VB& b) {
  using T = typename VA::non_const_value_type;
  const std::size_t m = a.extent(0), k = a.extent(1), n = b.extent(1);
  if (b.extent(0) != k)
    throw sharding_error("meshlib: matmul: local blocks of shapes (" + std::to_string(m) + ", " + std::to_string(k) +
                         ") and (" + std::to_string(b.extent(0)) + ", " + std::to_string(n) +
                         ") do not chain; the contraction dimensions differ in size");
  auto c = allocate<T, 2, Space>({m, n}, "meshlib::matmul", /*zero=*/false);
  matmul_into(unmanaged(c), unmanaged(a), unmanaged(b));
  return c;
}

// ---- diagnostics --------------------------------------------------------------------------------
// Each is a function whose one static_assert names, in its failing condition, the axes or specs at
// fault spelled out with axis names (core/diagnostics.hpp): one error on GCC and Clang.

template <class LhsContractionAxes, class RhsContractionAxes>
consteval bool matmul_contraction_sharded_differently() {
  static_assert(diagnostic::always_false<LhsContractionAxes, RhsContractionAxes>,
                "meshlib: matmul: the contraction dimension must be sharded over the same mesh axes on both sides, "
                "but lhs dimension 1 and rhs dimension 0 are sharded over the axes spelled out in the condition "
                "(lhs, rhs); reshard (or all_gather) one operand so that they match");
  return false;
}

template <class SharedAxes>
consteval bool matmul_output_dims_share_an_axis() {
  static_assert(diagnostic::always_false<SharedAxes>,
                "meshlib: matmul: the same mesh axis would shard both the rows (lhs dimension 0) and the columns "
                "(rhs dimension 1) of the result (the axis is spelled out in the condition); reshard one operand "
                "to replicate that dimension");
  return false;
}

template <class Axes>
consteval bool matmul_of_partial_value() {
  static_assert(diagnostic::always_false<Axes>,
                "meshlib: matmul: one operand is a pending sum over the axes spelled out in the condition and the "
                "other varies over (or is also partial over) them, so the product is not a pending sum of anything; "
                "psum the partial operand first");
  return false;
}

template <class LhsSpec, class RhsSpec>
consteval bool matmul_incompatible_shardings() {
  static_assert(diagnostic::always_false<LhsSpec, RhsSpec>,
                "meshlib: matmul: incompatible shardings: the contraction dimension (lhs dimension 1, rhs dimension "
                "0) must be sharded over the same mesh axes on both sides, and no axis may shard both output "
                "dimensions (the specs are spelled out in the condition); reshard one operand with "
                "meshlib::reshard<Spec>(x) first");
  return false;
}

template <class Op, class LhsRank, class RhsRank>
consteval bool matmul_needs_rank_2() {
  static_assert(diagnostic::always_false<Op, LhsRank, RhsRank>, "meshlib: matmul needs two rank-2 operands");
  return false;
}

template <class Op, class LhsMesh, class RhsMesh>
consteval bool matmul_of_different_meshes() {
  static_assert(diagnostic::always_false<Op, LhsMesh, RhsMesh>, "meshlib: matmul of operands over different mesh types");
  return false;
}

template <class Op, class LhsType, class RhsType>
consteval bool matmul_of_different_element_types() {
  static_assert(diagnostic::always_false<Op, LhsType, RhsType>, "meshlib: matmul operands must have the same element type");
  return false;
}

/// The checks both views share: ranks, mesh and element type.
template <class A, class B>
consteval bool diagnose_matmul_operands() {
  using op_t = diagnostic::op_t<"matmul">;
  if constexpr (A::rank != 2 || B::rank != 2)
    return matmul_needs_rank_2<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return matmul_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (!std::is_same_v<typename A::value_type, typename B::value_type>)
    return matmul_of_different_element_types<op_t, typename A::value_type, typename B::value_type>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_matmul_local() {
  if constexpr (!diagnose_matmul_operands<A, B>()) {
    return false;
  } else {
    using M = typename A::mesh_type;
    constexpr axis_mask a1 = A::dims_type::at(1), b0 = B::dims_type::at(0);
    constexpr axis_mask shared = A::dims_type::at(0) & B::dims_type::at(1);
    constexpr axis_mask bad_partial = (A::partial & B::partial) | (A::partial & B::vary) | (B::partial & A::vary);
    if constexpr (a1 != b0) return matmul_contraction_sharded_differently<diagnostic::axes_t<M, a1>, diagnostic::axes_t<M, b0>>();
    else if constexpr (shared != 0) return matmul_output_dims_share_an_axis<diagnostic::axes_t<M, shared>>();
    else if constexpr (bad_partial != 0) return matmul_of_partial_value<diagnostic::axes_t<M, bad_partial>>();
    else return true;
  }
}

template <class A, class B>
consteval bool diagnose_matmul_global() {
  if constexpr (!diagnose_matmul_operands<A, B>()) {
    return false;
  } else {
    using SA = typename A::spec_type;
    using SB = typename B::spec_type;
    using shA = typename A::sharding_type;
    using shB = typename B::sharding_type;
    if constexpr (SA::dim(1) == SB::dim(0) && (shA::dim_mask(0) & shB::dim_mask(1)) == 0) return true;
    else return matmul_incompatible_shardings<diagnostic::spec_t<SA>, diagnostic::spec_t<SB>>();
  }
}

}  // namespace tensor::detail

/// @brief The product of two rank-2 local values (see the file comment for the result's layout).
template <local_tensor_type A, local_tensor_type B>
auto matmul(const A& a, const B& b) {
  constexpr bool ok = tensor::detail::diagnose_matmul_local<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
  constexpr axis_mask partial = A::partial | B::partial | A::dims_type::at(1);
  constexpr axis_mask vary = (A::vary | B::vary) & ~partial;
  using out_t = rebind_local_t<A, typename A::value_type, 2, vary, partial,
                               dim_masks<A::dims_type::at(0), B::dims_type::at(1)>>;
  return out_t(tensor::detail::gemm_view<typename A::memory_space>(a.view(), b.view()), a.mesh(), a.device());
  }
}

/// @brief The product of two rank-2 sharded tensors: spec `P<r, k> . P<k, c> = P<r, c>`, the
/// contraction over `k`'s axes completed (summed over each group, in group-rank order).
template <sharded_tensor_type A, sharded_tensor_type B>
auto matmul(const A& a, const B& b) {
  constexpr bool ok = tensor::detail::diagnose_matmul_global<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
  using T = typename A::value_type;
  using SA = typename A::spec_type;
  using SB = typename B::spec_type;
  using M = typename A::mesh_type;
  using space = typename A::memory_space;
  using out_spec = tensor::detail::spec_from_array_t<std::array<dim_spec, 2>{SA::dim(0), SB::dim(1)}>;
  using out_sharding = named_sharding<M, out_spec>;
  using out_t = sharded_tensor<T, 2, out_sharding, space>;
  constexpr axis_mask c = A::sharding_type::dim_mask(1);
  if (!(a.mesh() == b.mesh()) || a.sharding().rule() != b.sharding().rule() || a.extent(1) != b.extent(0))
    throw sharding_error("meshlib: matmul: " + a.to_string() + " and " + b.to_string() +
                         " need the same mesh sizes and shard rule and a common contraction size");
  const std::size_t n = a.num_devices();
  std::vector<typename out_t::view_type> prod(n);
  std::vector<bool> local(n);
  for (std::size_t dev : a.local_devices()) {
    if (!b.is_local(dev))
      throw sharding_error("meshlib: matmul: device " + std::to_string(dev) + " holds a block of the lhs but not of the rhs");
    local[dev] = true;
  }
  // Every device's block product at once, each on its own instance (for_each_device.hpp).
  const std::size_t flops = a.extent(0) * a.extent(1) * b.extent(1);
  tensor::detail::for_each_device<space>(a.local_devices(), n, flops, [&](std::size_t dev) {
    prod[dev] = tensor::detail::gemm_view<space>(a.local(dev), b.local(dev));
  });
  out_sharding s(a.mesh(), a.sharding().rule());
  if constexpr (c == 0) {
    return out_t(s, {a.extent(0), b.extent(1)}, std::move(prod), std::move(local));
  } else {
    std::vector<typename out_t::view_type> sum(n);
    for (std::size_t dev : a.local_devices())
      for (std::size_t g : a.mesh().group(dev, c))
        if (!local[g])
          throw sharding_error("meshlib: matmul: completing the contraction over " + describe_axes<M>(c) +
                               " needs device " + std::to_string(g) +
                               "'s block, which is not local; use the local view and psum");
    // Each device sums its group's products in group-rank order (the same bits on every device).
    tensor::detail::for_each_device<space>(a.local_devices(), n, a.extent(0) * b.extent(1) * n, [&](std::size_t dev) {
      const auto& first = prod[dev];
      sum[dev] = tensor::detail::allocate<T, 2, space>({first.extent(0), first.extent(1)}, "meshlib::matmul", true);
      T* dst = sum[dev].data();
      for (std::size_t g : a.mesh().group(dev, c)) {
        const T* src = prod[g].data();
        for (std::size_t i = 0; i < sum[dev].span(); ++i) dst[i] += src[i];
      }
    });
    return out_t(s, {a.extent(0), b.extent(1)}, std::move(sum), std::move(local));
  }
  }
}

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `transpose`: `transpose(x)` swaps the two dimensions of a rank-2 tensor;
/// `transpose<P0, P1, ...>(x)` permutes the dimensions of any rank as `np.transpose(x, axes)`
/// (result dimension `i` is input dimension `Pi`). Sharding propagation: dimensions carry their
/// sharding with them (local view: `dims` permuted, vary and partial unchanged; global view: the
/// spec entries permuted, `P<"data", none>` becomes `P<none, "data">`). No data moves between devices.

#include <array>
#include <cstddef>
#include <vector>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
#include "meshlib/tensor/spec_algebra.hpp"
#include "meshlib/tensor/for_each_device.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

template <class T>
struct transpose_functor {
  const T* in;
  T* out;
  std::size_t rows, cols;  // of `in`
  static constexpr std::size_t tile = 32;
  // One iteration per tile of `in`, so reads and writes both stay in cache.
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t t) const {
    const std::size_t tiles_c = (cols + tile - 1) / tile;
    const std::size_t r0 = (t / tiles_c) * tile, c0 = (t % tiles_c) * tile;
    const std::size_t r1 = r0 + tile < rows ? r0 + tile : rows, c1 = c0 + tile < cols ? c0 + tile : cols;
    for (std::size_t r = r0; r < r1; ++r)
      for (std::size_t c = c0; c < c1; ++c) out[c * rows + r] = in[r * cols + c];
  }
};

template <class Space, class View>
auto transpose_view(const View& in) {
  using T = typename View::value_type;
  const std::size_t rows = in.extent(0), cols = in.extent(1);
  auto out = allocate<T, 2, Space>({cols, rows}, "meshlib::transpose", false);
  constexpr std::size_t tile = transpose_functor<T>::tile;
  launch<Space>(((rows + tile - 1) / tile) * ((cols + tile - 1) / tile), transpose_functor<T>{in.data(), out.data(), rows, cols});
  return out;
}

template <class Op, class Rank>
consteval bool transpose_needs_rank_2() {
  static_assert(diagnostic::always_false<Op, Rank>,
                "meshlib: transpose(x) without indices swaps the two dimensions of a rank-2 tensor; for other ranks "
                "name the permutation: transpose<1, 0, 2>(x) (the rank is spelled out in the condition)");
  return false;
}

/// Result element `i` (row-major over the output) reads input offset sum_d idx_d * stride[d], where
/// `stride[d]` is the input stride of the input dimension that output dimension `d` comes from.
template <class T, std::size_t R>
struct permute_functor {
  const T* in;
  T* out;
  std::array<std::size_t, R> out_extent;
  std::array<std::size_t, R> stride;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    std::size_t rem = i, off = 0;
    for (std::size_t d = R; d-- > 0;) {
      off += (rem % out_extent[d]) * stride[d];
      rem /= out_extent[d];
    }
    out[i] = in[off];
  }
};

template <auto Perm>
consteval bool is_permutation() {
  for (std::size_t i = 0; i < Perm.size(); ++i) {
    if (Perm[i] >= Perm.size()) return false;
    for (std::size_t j = i + 1; j < Perm.size(); ++j)
      if (Perm[i] == Perm[j]) return false;
  }
  return true;
}

template <class Op, class Rank, class... Indices>
consteval bool transpose_needs_a_permutation() {
  static_assert(diagnostic::always_false<Op, Rank, Indices...>,
                "meshlib: transpose<P...>: the indices must be a permutation of 0 .. rank-1, one per dimension (the "
                "rank and the indices are spelled out in the condition)");
  return false;
}

template <class Space, std::size_t... Perm, class View>
auto permute_view(const View& in) {
  using T = typename View::non_const_value_type;
  constexpr std::size_t R = View::rank;
  constexpr std::array<std::size_t, R> perm{Perm...};
  std::array<std::size_t, R> in_stride{}, out_extent{}, stride{};
  std::size_t st = 1;
  for (std::size_t d = R; d-- > 0;) {
    in_stride[d] = st;
    st *= in.extent(d);
  }
  for (std::size_t d = 0; d < R; ++d) {
    out_extent[d] = in.extent(perm[d]);
    stride[d] = in_stride[perm[d]];
  }
  auto out = allocate<T, R, Space>(out_extent, "meshlib::transpose", false);
  launch<Space>(in.span(), permute_functor<T, R>{in.data(), out.data(), out_extent, stride});
  return out;
}

}  // namespace tensor::detail

/// @brief `x` with its dimensions permuted (`transpose<1, 0, 2>(x)`), or, with no indices, the
/// transpose of a rank-2 `x`. Local values and sharded tensors alike.
template <std::size_t... Perm, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto transpose(const X& x) {
  if constexpr (sizeof...(Perm) == 0) {
    if constexpr (X::rank != 2) return tensor::detail::transpose_needs_rank_2<diagnostic::op_t<"transpose">, diagnostic::size<X::rank>>(), x;
    else return transpose<1, 0>(x);
  } else if constexpr (sizeof...(Perm) != X::rank ||
                       !tensor::detail::is_permutation<std::array<std::size_t, sizeof...(Perm)>{Perm...}>()) {
    // the diagnostic fires; x is returned so that the caller sees one error only
    return tensor::detail::transpose_needs_a_permutation<diagnostic::op_t<"transpose">, diagnostic::size<X::rank>,
                                                 diagnostic::dim<Perm>...>(),
           x;
  } else {
    constexpr std::array<std::size_t, X::rank> perm{Perm...};
    using space = typename X::memory_space;
    auto kernel = [](const auto& v) {
      if constexpr (X::rank == 2 && std::array<std::size_t, X::rank>{Perm...}[0] == 1) return tensor::detail::transpose_view<space>(v);  // cache-tiled
      else return tensor::detail::permute_view<space, Perm...>(v);
    };
    if constexpr (local_tensor_type<X>) {
      using out_t = with_dims_t<X, permute_dims_t<typename X::dims_type, perm>>;
      return out_t(kernel(x.view()), x.mesh(), x.device());
    } else {
      using spec = typename X::spec_type;
      using out_spec = tensor::detail::spec_from_array_t<std::array<dim_spec, X::rank>{spec::dim(Perm)...}>;
      using out_sharding = named_sharding<typename X::mesh_type, out_spec>;
      using out_t = sharded_tensor<typename X::value_type, X::rank, out_sharding, space>;
      std::vector<typename out_t::view_type> blocks(x.num_devices());
      std::vector<bool> local(x.num_devices());
      tensor::detail::for_each_device<space>(x.local_devices(), x.num_devices(), x.size(), [&](std::size_t d) { blocks[d] = kernel(x.local(d)); });
      for (std::size_t d : x.local_devices()) local[d] = true;
      typename out_t::shape_type shape{};
      for (std::size_t d = 0; d < X::rank; ++d) shape[d] = x.extent(perm[d]);
      return out_t(out_sharding(x.mesh(), x.sharding().rule()), shape, std::move(blocks), std::move(local));
    }
  }
}

}  // namespace meshlib

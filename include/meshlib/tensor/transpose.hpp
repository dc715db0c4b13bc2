#pragma once
/// @file
/// @brief `transpose` of rank-2 tensors. Sharding propagation: the dimensions swap and carry their
/// sharding with them (local view: `dims` swap, vary and partial unchanged; global view: the spec
/// entries swap, `P<"data", none>` becomes `P<none, "data">`). No data moves between devices.

#include <array>
#include <cstddef>
#include <vector>

#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"
#include "meshlib/tensor/spec_algebra.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace detail {

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

template <std::size_t Rank>
struct transpose_needs_rank_2 {
  static_assert(Rank == 2, "meshlib: transpose is defined for rank-2 tensors (see transpose_needs_rank_2<rank>)");
  static constexpr bool value = true;
};

}  // namespace detail

/// @brief The transpose of a rank-2 local value.
template <local_tensor_type L>
auto transpose(const L& x) {
  static_assert(detail::transpose_needs_rank_2<L::rank>::value);
  using out_t = with_dims_t<L, dim_masks<L::dims_type::at(1), L::dims_type::at(0)>>;
  return out_t(detail::transpose_view<typename L::memory_space>(x.view()), x.mesh(), x.device());
}

/// @brief The transpose of a rank-2 sharded tensor: spec `P<a, b>` becomes `P<b, a>`.
template <sharded_tensor_type X>
auto transpose(const X& x) {
  static_assert(detail::transpose_needs_rank_2<X::rank>::value);
  using spec = typename X::spec_type;
  using out_spec = detail::spec_from_array_t<std::array<dim_spec, 2>{spec::dim(1), spec::dim(0)}>;
  using out_sharding = named_sharding<typename X::mesh_type, out_spec>;
  using out_t = sharded_tensor<typename X::value_type, 2, out_sharding, typename X::memory_space>;
  std::vector<typename out_t::view_type> blocks(x.num_devices());
  std::vector<bool> local(x.num_devices());
  for (std::size_t d : x.local_devices()) {
    blocks[d] = detail::transpose_view<typename X::memory_space>(x.local(d));
    local[d] = true;
  }
  return out_t(out_sharding(x.mesh(), x.sharding().rule()), {x.extent(1), x.extent(0)}, std::move(blocks), std::move(local));
}

}  // namespace meshlib

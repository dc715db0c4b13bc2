// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `local_tensor`: the value one device sees inside `shard_map` / `spmd`, its block of a
/// sharded array, with the layout facts the type system tracks, as JAX's `vma` (varying manual axes)
/// plus a pending-sum set.
///
/// Three compile-time facts ride in the type:
/// - `Vary`: the mesh axes the value may differ over. Invariant over an axis means every device of
///   that axis group holds the same value (JAX: not in `vma`).
/// - `Partial`: the mesh axes over which the value is a pending sum: the true value is the sum of
///   the blocks over that axis group (what `psum` completes). Disjoint from `Vary`.
/// - `Dims`: for each dimension, the mesh axes of which that dimension is a block (its entry in the
///   partition spec the value came in with). Kernels use it to propagate sharding (GSPMD's rules):
///   reducing a dimension sharded over `a` makes the result partial over `a`; a matmul whose
///   contraction dimension is sharded over `a` on both sides is partial over `a`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// // a block of a P<"data", none> array, entering shard_map:
/// using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;
/// static_assert(x_t::vary == mesh_t::mask_of<"data">() && x_t::partial == 0);
/// @endcode

#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/core/checked_size.hpp"
#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

/// @brief For each dimension of a local block, the mask of mesh axes that dimension is a block of.
template <axis_mask... M>
struct dim_masks {
  /// Tag by which `local_tensor` checks that its `Dims` is a `dim_masks`.
  using is_dim_masks = void;
  /// The rank: one mask per dimension.
  static constexpr std::size_t size = sizeof...(M);
  /// The masks, in dimension order.
  static constexpr std::array<axis_mask, sizeof...(M)> values{M...};
  /// Every axis some dimension is sharded over.
  static constexpr axis_mask all = (axis_mask{0} | ... | M);
  /// The mask of dimension `d`; 0 (not sharded) for `d` past the rank.
  static constexpr axis_mask at(std::size_t d) noexcept { return d < size ? values[d] : axis_mask{0}; }
};

namespace tensor::detail {

template <class T>
concept dim_masks_type = requires { typename T::is_dim_masks; };

template <std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct replicated_dims_impl;
template <std::size_t Rank, std::size_t... I>
struct replicated_dims_impl<Rank, std::index_sequence<I...>> {
  using type = dim_masks<(static_cast<void>(I), axis_mask{0})...>;
};

template <class S, std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct dims_of_impl;
template <class S, std::size_t Rank, std::size_t... I>
struct dims_of_impl<S, Rank, std::index_sequence<I...>> {
  using type = dim_masks<S::dim_mask(I)...>;
};

/// `Dims` without dimension `D`.
template <class Dims, std::size_t D, class Seq = std::make_index_sequence<Dims::size - 1>>
struct remove_dim_impl;
template <class Dims, std::size_t D, std::size_t... I>
struct remove_dim_impl<Dims, D, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(I < D ? I : I + 1)...>;
};

/// `Dims` permuted: entry `i` of the result is entry `Perm[i]` of `Dims`.
template <class Dims, auto Perm, class Seq = std::make_index_sequence<Dims::size>>
struct permute_dims_impl;
template <class Dims, auto Perm, std::size_t... I>
struct permute_dims_impl<Dims, Perm, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(Perm[I])...>;
};

}  // namespace tensor::detail

namespace experimental {
/// The local layout with dimension `D` removed (a reduction over a dimension computes its result type with it).
using tensor::detail::remove_dim_impl;
}  // namespace experimental

/// @brief `dim_masks` of rank `Rank` with no sharded dimension.
template <std::size_t Rank>
using replicated_dims = typename tensor::detail::replicated_dims_impl<Rank>::type;

/// @brief The `dim_masks` of a rank-`Rank` array laid out by sharding `S`.
template <sharding_type S, std::size_t Rank>
using dims_of_t = typename tensor::detail::dims_of_impl<S, Rank>::type;

/// @brief The value of type `T` one device holds inside `shard_map` / `spmd`.
/// @tparam Vary    mesh axes the value varies over (see the file comment).
/// @tparam Partial mesh axes over which the value is a pending sum; disjoint from `Vary`.
/// @tparam Dims    `dim_masks<...>`: per dimension, the axes it is a block of; each within `Vary | Partial`.
/// @tparam Space   the Kokkos memory space of the block.
/// A `local_tensor` is a handle: copies share the block, as `Kokkos::View` copies do.
template <class T, std::size_t Rank, mesh_type Mesh, axis_mask Vary = 0, axis_mask Partial = 0,
          class Dims = replicated_dims<Rank>, class Space = default_memory_space>
class local_tensor {
  static_assert(tensor::detail::dim_masks_type<Dims> && Dims::size == Rank,
                "meshlib: local_tensor: Dims must be a dim_masks<...> with one mask per dimension");
  static_assert((Vary & Partial) == 0,
                "meshlib: local_tensor: a value cannot both vary over an axis and be a pending sum over it");
  static_assert((Vary & ~Mesh::all_axes) == 0 && (Partial & ~Mesh::all_axes) == 0,
                "meshlib: local_tensor: Vary / Partial name axes the mesh does not have");

 public:
  /// Tag that opts the type into the `local_tensor_type` concept.
  using is_local_tensor = void;
  /// The element type.
  using value_type = T;
  /// The mesh the block belongs to.
  using mesh_type = Mesh;
  /// Per dimension, the mesh axes it is a block of (`dim_masks`).
  using dims_type = Dims;
  /// The Kokkos memory space the block lives in.
  using memory_space = Space;
  /// The block's storage: a row-major `Kokkos::View` in `Space`.
  using view_type = tensor::detail::block_view_t<T, Rank, Space>;
  /// A shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// The number of dimensions.
  static constexpr std::size_t rank = Rank;
  /// The mesh axes over which the value differs from device to device.
  static constexpr axis_mask vary = Vary;
  /// The mesh axes over which the value is a pending sum (a `psum` is still due).
  static constexpr axis_mask partial = Partial;

  local_tensor() = default;
  /// Wraps `view`, device `device`'s block on `mesh` (no copy).
  local_tensor(view_type view, const Mesh& mesh, std::size_t device) : view_(std::move(view)), mesh_(mesh), device_(device) {}
  /// A zero block of `shape` on `device`. Throws `sharding_error` naming the dimension and its size
  /// when the element or byte count overflows (a wrapped count would allocate a small block).
  local_tensor(const shape_type& shape, const Mesh& mesh, std::size_t device)
      : view_(tensor::detail::allocate<T, Rank, Space>(checked_shape(shape), "meshlib::local_tensor")), mesh_(mesh),
        device_(device) {}

  /// The block's storage (shared, not copied).
  [[nodiscard]] const view_type& view() const noexcept { return view_; }
  /// The mesh the block belongs to.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  /// The device whose block this is.
  [[nodiscard]] std::size_t device() const noexcept { return device_; }
  /// The block's shape.
  [[nodiscard]] shape_type shape() const { return tensor::detail::extents_of(view_); }
  /// The block's extent in dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return view_.extent(d); }
  /// The number of elements of the block.
  [[nodiscard]] std::size_t size() const noexcept { return view_.size(); }
  /// The first element; the block is contiguous, row-major.
  [[nodiscard]] T* data() const noexcept { return view_.data(); }
  /// Size of dimension `d` of the global array this block belongs to (even rule: every block of a
  /// dimension has the same size, as `shard_map` requires).
  [[nodiscard]] std::size_t global_extent(std::size_t d) const noexcept {
    return view_.extent(d) * mesh_.axes_size(Dims::at(d));
  }

  /// Element access (host-accessible spaces).
  template <class... I>
    requires(sizeof...(I) == Rank)
  [[nodiscard]] T& operator()(I... i) const {
    return view_(i...);
  }

  /// Prints `local_tensor<(4, 6) on device 3, vary {'data'}, partial {}>`.
  friend std::ostream& operator<<(std::ostream& os, const local_tensor& t) {
    return os << "local_tensor<" << experimental::describe_shape(t.shape()) << " on device " << t.device_
              << ", vary " << describe_axes<Mesh>(Vary) << ", partial " << describe_axes<Mesh>(Partial) << '>';
  }
  /// The block as `operator<<` prints it.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  static const shape_type& checked_shape(const shape_type& shape) {
    (void)experimental::checked_bytes<T>(experimental::checked_product(shape, "the local_tensor block shape"),
                                   "the byte count of the local_tensor block");
    return shape;
  }

  view_type view_{};
  Mesh mesh_{[] {
    if constexpr (Mesh::num_dynamic == 0) return Mesh{};
    else return Mesh{typename Mesh::coord_type{[] {
      typename Mesh::coord_type c{};
      for (auto& x : c) x = 1;
      return c;
    }()}};
  }()};
  std::size_t device_ = 0;
};

/// @brief A type that is a `local_tensor<...>`.
template <class T>
concept local_tensor_type = requires { typename std::remove_cvref_t<T>::is_local_tensor; };

/// @brief True for `local_tensor` types (the `local_tensor_type` concept as a value).
template <class T>
inline constexpr bool is_local_tensor_v = local_tensor_type<T>;

/// @brief A device's block read back into host memory, row-major (a copy on the running device's
/// instance where the block is device memory; a plain copy on a host space): for host code that
/// needs a kernel's result, such as sampling the next token from a model's logits.
template <local_tensor_type L>
[[nodiscard]] std::vector<std::remove_const_t<typename L::value_type>> to_host(const L& x) {
  std::vector<std::remove_const_t<typename L::value_type>> out(x.size());
  tensor::detail::copy_to_host<typename L::memory_space>(out.data(), x.data(), x.size());
  return out;
}

namespace tensor::detail {
/// The layout of local value `L`, spelled out for a diagnostic (core/diagnostics.hpp).
template <class L, class Seq = std::make_index_sequence<L::rank>>
struct diag_value_impl;
template <class L, std::size_t... I>
struct diag_value_impl<L, std::index_sequence<I...>> {
  using mesh_t = typename L::mesh_type;
  using type = diagnostic::value<diagnostic::vary<diagnostic::axes_t<mesh_t, L::vary>>,
                                 diagnostic::partial<diagnostic::axes_t<mesh_t, L::partial>>,
                                 diagnostic::dims<diagnostic::axes_t<mesh_t, L::dims_type::at(I)>...>>;
};
/// `diagnostic::value<vary<...>, partial<...>, dims<...>>` of a local value `L`.
template <class L>
using diag_value_t = typename diag_value_impl<L>::type;
}  // namespace tensor::detail

namespace diagnostic {
/// The layout of local value `L` spelled out for a compile-time error: `value<vary<...>, partial<...>, dims<...>>`.
template <class L>
using value_t = tensor::detail::diag_value_t<L>;
}  // namespace diagnostic

namespace tensor::detail {
template <class L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
struct rebind_local;
template <class T, std::size_t Rank, class M, axis_mask V0, axis_mask P0, class D0, class S, class U, std::size_t R,
          axis_mask V, axis_mask P, class D>
struct rebind_local<local_tensor<T, Rank, M, V0, P0, D0, S>, U, R, V, P, D> {
  using type = local_tensor<U, R, M, V, P, D, S>;
};
}  // namespace tensor::detail

/// @brief `L` with every field but the named ones kept: the result types collectives and kernels compute.
template <local_tensor_type L, axis_mask NewVary>
using with_vary_t = typename tensor::detail::rebind_local<L, typename L::value_type, L::rank, NewVary, L::partial,
                                                  typename L::dims_type>::type;
/// @brief `L` with its partial axes replaced.
template <local_tensor_type L, axis_mask NewPartial>
using with_partial_t = typename tensor::detail::rebind_local<L, typename L::value_type, L::rank, L::vary, NewPartial,
                                                     typename L::dims_type>::type;
/// @brief `L` with vary and partial both replaced (collectives move axes from one to the other).
template <local_tensor_type L, axis_mask NewVary, axis_mask NewPartial>
using with_vary_partial_t =
    typename tensor::detail::rebind_local<L, typename L::value_type, L::rank, NewVary, NewPartial, typename L::dims_type>::type;
/// @brief `L` with its per-dimension sharding masks replaced.
template <local_tensor_type L, class NewDims>
using with_dims_t =
    typename tensor::detail::rebind_local<L, typename L::value_type, NewDims::size, L::vary, L::partial, NewDims>::type;
/// @brief `L` with element type `U`.
template <local_tensor_type L, class U>
using with_value_t = typename tensor::detail::rebind_local<L, U, L::rank, L::vary, L::partial, typename L::dims_type>::type;
/// @brief The general form: element type, rank, vary, partial and dims all given.
template <local_tensor_type L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
using rebind_local_t = typename tensor::detail::rebind_local<L, U, R, V, P, D>::type;

/// @brief `Dims` without dimension `D`, and `Dims` permuted (`Perm[i]`: the source of entry `i`).
template <class Dims, std::size_t D>
using remove_dim_t = typename tensor::detail::remove_dim_impl<Dims, D>::type;
/// @brief `Dims` permuted: entry `i` is `Dims`' entry `Perm[i]`.
template <class Dims, auto Perm>
using permute_dims_t = typename tensor::detail::permute_dims_impl<Dims, Perm>::type;

/// @brief The local type of a block of a rank-`Rank` array laid out by `S`, entering `shard_map`:
/// varying over every axis the spec uses, partial over none.
template <class T, std::size_t Rank, sharding_type S, class Space = default_memory_space>
using entry_local_t = local_tensor<T, Rank, typename S::mesh_type, S::sharded_axes, 0, dims_of_t<S, Rank>, Space>;

}  // namespace meshlib

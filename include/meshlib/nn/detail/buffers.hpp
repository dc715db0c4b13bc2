// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Per-device scratch buffers of the training layers, so a training step allocates nothing
/// after its first iteration.
///
/// A layer owns one buffer slot per device; only that device's thread grows or reads its slot (the
/// reference-count rule of docs/tensors.md: a device copies and drops only its own handles). The
/// tensors a layer returns wrap these buffers (unmanaged views): they stay valid until the layer's
/// next forward / backward on that device.

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/permutes.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::nn::detail {

/// One growable buffer per device (see the file comment).
template <class T>
class device_buffers {
 public:
  device_buffers() = default;
  explicit device_buffers(std::size_t devices) : bufs_(devices) {}
  void resize_devices(std::size_t devices) { bufs_.resize(devices); }
  /// Device `dev`'s buffer of at least `n` elements (contents unspecified when it grew).
  T* get(std::size_t dev, std::size_t n) {
    auto& b = bufs_.at(dev);
    if (b.extent(0) < n) b = meshlib::detail::allocate<T, 1>({n}, "meshlib::nn::buffer", false);
    return b.data();
  }
  /// Device `dev`'s buffer of `n` elements, zero-filled (a Kokkos kernel on the running device's instance).
  T* zeros(std::size_t dev, std::size_t n) {
    T* p = get(dev, n);
    meshlib::detail::launch<default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
    return p;
  }
  /// `n` values of the caller's host memory at `src`, readable by kernels in the buffers' memory
  /// space: `src` itself where the host's memory is that space's, else a copy in device `dev`'s buffer.
  const T* readable(std::size_t dev, const T* src, std::size_t n) {
    if constexpr (meshlib::detail::host_accessible_v<default_memory_space>) {
      return src;
    } else {
      T* p = get(dev, n);
      meshlib::detail::copy_from_host<default_memory_space>(p, src, n);
      return p;
    }
  }

 private:
  std::vector<meshlib::detail::block_view_t<T, 1, default_memory_space>> bufs_;
};

/// A rank-1 local tensor of type `L` over `n` elements at `data` (not owned: a caller's buffer,
/// which the donated collectives reduce in place).
template <local_tensor_type L>
L wrap1(typename L::value_type* data, std::size_t n, const typename L::mesh_type& mesh, std::size_t dev) {
  return L(typename L::view_type(data, n), mesh, dev);
}

/// A local tensor of type `L` over `data` (not owned), `rows x cols`.
template <local_tensor_type L>
L wrap2(typename L::value_type* data, std::size_t rows, std::size_t cols, const typename L::mesh_type& mesh,
        std::size_t dev) {
  return L(typename L::view_type(data, rows, cols), mesh, dev);
}

/// The type `psum<Names...>` gives `L` (the compiler checks the rule; nothing runs).
template <class L, fixed_string... Names>
using psum_t = decltype(meshlib::psum<Names...>(std::declval<const L&>()));
/// The type `pvary<Names...>` gives `L`.
template <class L, fixed_string... Names>
using pvary_t = decltype(meshlib::pvary<Names...>(std::declval<const L&>()));

/// `psum_t<L, Names...>` when `B`, else `L`, without naming the psum otherwise (its axes may not
/// exist on this mesh).
template <bool B, class L, fixed_string... Names>
struct psum_if {
  using type = L;
};
template <class L, fixed_string... Names>
struct psum_if<true, L, Names...> {
  using type = psum_t<L, Names...>;
};
/// `pvary_t<L, Names...>` when `B`, else `L`.
template <bool B, class L, fixed_string... Names>
struct pvary_if {
  using type = L;
};
template <class L, fixed_string... Names>
struct pvary_if<true, L, Names...> {
  using type = pvary_t<L, Names...>;
};

/// `pvary<Names...>(x)` without a copy (pvary moves no data; only the type changes).
template <fixed_string... Names, local_tensor_type L>
pvary_t<L, Names...> pvary_view(const L& x) {
  using R = pvary_t<L, Names...>;
  return R(x.view(), x.mesh(), x.device());
}

/// Global offset of this device's block along dimension `d` of `L` (its rank in the group of the
/// axes that shard `d`, times the block extent).
template <local_tensor_type L>
std::size_t global_offset(const L& x, std::size_t d) {
  return x.mesh().group_rank(x.device(), L::dims_type::at(d)) * x.extent(d);
}

}  // namespace meshlib::nn::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reshape(x, shape)`: a device's block with a new shape and rank, its elements in the same
/// row-major order (`jnp.reshape` on the block inside `shard_map`), copied into a new block by a
/// kernel on the device's instance (device memory too).
///
/// Sharding propagation, as JAX inside `shard_map`: a reshape is a local step on the block, so the
/// per-dimension record of which dimension is a block of which axis is dropped (as after
/// `forget_dims`: a reshaped dimension is no longer a block of the global array), and `vary` and
/// `partial` are kept (a reshape is linear: a pending sum reshaped is the reshaped pending sum). A
/// reduction over a dimension of the result is therefore a local one (the result varies; `psum` it
/// yourself), and a `mean` divides by the local extent.
/// @pre the product of `shape` is `x.size()` (a `sharding_error` otherwise).
/// @post `reshape(reshape(x, s), x.shape())` equals `x` element for element.
/// @code
/// // x: a (2, 8, 16) block
/// auto heads = meshlib::reshape(x, std::array<std::size_t, 4>{2, 8, 4, 4});   // split 16 into 4 x 4
/// auto flat = meshlib::reshape(x, std::array<std::size_t, 1>{x.size()});      // flatten
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <string>

#include "meshlib/core/checked_size.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib {

namespace tensor::detail {

/// `out[i] = in[i]`: a reshape moves no element.
template <class T>
struct copy_functor {
  const T* in;
  T* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = in[i]; }
};

}  // namespace tensor::detail

/// @brief A copy of the local block `x` with local shape `shape` (row-major order kept, as
/// `jnp.reshape`). The per-dimension record is dropped (as after `forget_dims`); `vary` and
/// `partial` are kept (see the file comment).
/// @throws sharding_error when `shape` does not hold exactly `x.size()` elements.
template <std::size_t R, local_tensor_type L>
[[nodiscard]] auto reshape(const L& x, const std::array<std::size_t, R>& shape) {
  using T = typename L::value_type;
  using space = typename L::memory_space;
  using result_t = rebind_local_t<L, T, R, L::vary, L::partial, replicated_dims<R>>;
  const std::size_t n = experimental::checked_product(std::span<const std::size_t>(shape), "reshape: the new shape");
  if (n != x.size())
    throw sharding_error("meshlib: reshape of a local block of shape " + experimental::describe_shape(x.shape()) + " (" +
                         std::to_string(x.size()) + " elements) to shape " + experimental::describe_shape(shape) + " (" +
                         std::to_string(n) + " elements); the element counts must agree");
  auto out = tensor::detail::allocate<T, R, space>(shape, "meshlib::reshape", false);
  tensor::detail::launch<space>(n, tensor::detail::copy_functor<T>{x.data(), out.data()});
  return result_t(out, x.mesh(), x.device());
}

}  // namespace meshlib

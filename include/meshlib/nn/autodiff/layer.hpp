// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `apply_layer(layer, x)`: an `nn` layer (anything with `forward(x)` and
/// `backward(dy, need_dx)`: `dense`, `column_dense`, `row_dense`, activations, norms, ...) used
/// inside `value_and_grad` as one primitive whose backward is the layer's own hand-written one.
///
/// The layer's parameter gradients go where its backward always puts them, the layer's
/// `parameter::grad` blocks (added, as in `train_step`; nothing is summed over the data axis: that
/// is the data-parallel policy's work); the input's cotangent flows on through the tape. A layer
/// keeps one forward's state per device, so apply it once per loss evaluation.
///
/// An input of integers (`embedding`'s token ids, traced so that the embedding is recorded on a
/// tape) has no cotangent: its gradient comes back as zeros, as JAX's `grad(..., allow_int=True)`
/// gives integer inputs a zero (`float0`) gradient; the layer's backward still runs for its
/// parameter gradients. (What `embedding::backward` returns, the ids it looked up so that
/// `sequential`'s type check holds, is no gradient and goes nowhere.)
/// @code
/// nn::dense<float, mesh_t> fc(mesh, "fc", 16, 4, nn::rng_key{0});
/// auto [loss, dx] = nn::value_and_grad([&](const auto& x) {
///   return nn::pmean<"data">(nn::mean<0>(nn::mean<1>(nn::square(nn::apply_layer(fc, x)))));
/// })(x);                                     // fc.w.grad / fc.b.grad hold this device's dW, db
/// @endcode

#include <type_traits>

#include "meshlib/nn/autodiff/traced.hpp"
#include "meshlib/tensor/elementwise.hpp"

namespace meshlib::nn {

namespace detail {
struct copy_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(T x) const { return x; }
};
}  // namespace detail

/// @brief `layer.forward(x)` recorded as one node; backward: `layer.backward(ct, true)` (the
/// parameter gradients into the layer, `dx` copied out of the layer's reused buffer onto the tape;
/// an integer input takes none: see the file comment).
/// @code
/// auto h = meshlib::nn::apply_layer(tok, ids);   // ids: traced int32 token ids; tok.table.grad gets dE
/// @endcode
template <class Layer, traced_type X>
auto apply_layer(Layer& layer, const X& x) {
  auto y = layer.forward(x.primal());
  Layer* l = &layer;
  return detail::record(x.tape(), y, [l, x](detail::tape& t, const auto& ct) {
    if constexpr (std::is_integral_v<typename X::value_type>)
      static_cast<void>(l->backward(ct, true));  // the parameter gradients only
    else
      detail::send(t, x, meshlib::map(detail::copy_fn{}, l->backward(ct, true)));
  });
}

}  // namespace meshlib::nn

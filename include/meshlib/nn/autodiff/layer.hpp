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
/// @code
/// nn::dense<float, mesh_t> fc(mesh, "fc", 16, 4, nn::rng_key{0});
/// auto [loss, dx] = nn::value_and_grad([&](const auto& x) {
///   return nn::pmean<"data">(nn::mean<0>(nn::mean<1>(nn::square(nn::apply_layer(fc, x)))));
/// })(x);                                     // fc.w.grad / fc.b.grad hold this device's dW, db
/// @endcode

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
/// parameter gradients into the layer, `dx` copied out of the layer's reused buffer onto the tape).
template <class Layer, traced_type X>
auto apply_layer(Layer& layer, const X& x) {
  auto y = layer.forward(x.primal());
  Layer* l = &layer;
  return detail::record(x.tape(), y, [l, x](detail::tape& t, const auto& ct) {
    detail::send(t, x, meshlib::map(detail::copy_fn{}, l->backward(ct, true)));
  });
}

}  // namespace meshlib::nn

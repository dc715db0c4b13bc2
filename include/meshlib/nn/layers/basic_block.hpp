// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `basic_block`: ResNet's basic block (He et al. 2016; torchvision's `BasicBlock`):
/// `relu(bn2(conv2(relu(bn1(conv1(x))))) + shortcut(x))`, 3x3 convolutions without bias (batch norm
/// follows each), the first with the block's stride. The shortcut is the identity when the block
/// keeps the image shape, else a projection (a 1x1 convolution with the stride, then batch norm),
/// option B of the paper. Batch norms are synchronised over the data axis (batch_norm.hpp), so a
/// data-parallel ResNet trains as on one device.
///
/// It is a layer of the `sequential` protocol (widths, `begin_step`, `collect`), built from
/// `conv2d`, `batch_norm`, `relu` and `residual`, so it composes with `sequential`, pooling and `dense`.
/// @code
/// meshlib::nn::sequential net(
///     meshlib::nn::conv2d<float, mesh_t>(m, "stem", {28, 28, 1}, 16, 3, key, {.padding = 1, .use_bias = false}),
///     meshlib::nn::batch_norm<float, mesh_t>(m, "stem_bn", {28, 28, 16}), meshlib::nn::relu<float>(m),
///     meshlib::nn::basic_block<float, mesh_t>(m, "b1", {28, 28, 16}, 32, 2, key),   // -> 14x14x32
///     meshlib::nn::global_avg_pool<float, mesh_t>(m, "gap", {14, 14, 32}),
///     meshlib::nn::dense<float, mesh_t>(m, "fc", 32, 10, key));
/// @endcode

#include <cstddef>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/nn/layers/activation.hpp"
#include "meshlib/nn/layers/batch_norm.hpp"
#include "meshlib/nn/layers/conv2d.hpp"
#include "meshlib/nn/layers/image_shape.hpp"
#include "meshlib/nn/layers/residual.hpp"
#include "meshlib/nn/sequential.hpp"

namespace meshlib::nn {

namespace detail {
/// The shortcut of a basic block: the identity, or a 1x1 convolution with the block's stride and a
/// batch norm (chosen at construction: whether the shape changes is known only then).
template <class T, mesh_type Mesh, fixed_string Data>
class block_shortcut {
 public:
  using projection_type = sequential<conv2d<T, Mesh>, batch_norm<T, Mesh, Data>>;
  block_shortcut(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t stride,
                 rng_key key, std::span<const std::size_t> local_devices)
      : in_(in) {
    if (stride != 1 || out_channels != in.channels) {
      conv2d<T, Mesh> c(mesh, name + ".proj", in, out_channels, 1, key, {.stride = stride, .use_bias = false}, local_devices);
      const image_shape out = c.output_shape();
      proj_.emplace(std::move(c), batch_norm<T, Mesh, Data>(mesh, name + ".proj_bn", out, T(0.1), T(1e-5), local_devices));
    }
  }
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  [[nodiscard]] std::size_t out_features() const noexcept {
    return proj_ ? std::get<0>(proj_->layers).out_features() : in_.size();
  }
  [[nodiscard]] bool projects() const noexcept { return proj_.has_value(); }
  template <local_tensor_type X>
  X forward(const X& x) {
    return proj_ ? proj_->forward(x) : x;
  }
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    return proj_ ? proj_->template backward<DY>(dy, need_dx) : dy;
  }
  void begin_step(rng_key key, bool train) {
    if (proj_) proj_->begin_step(key, train);
  }
  void collect(std::vector<param_ref<T>>& out) {
    if (proj_) proj_->collect(out);
  }
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    if (proj_) proj_->collect_buffers(out);
  }

 private:
  image_shape in_;
  std::optional<projection_type> proj_;
};
}  // namespace detail

/// @brief ResNet's basic block (see the file comment).
template <class T, mesh_type Mesh, fixed_string Data = "data">
class basic_block {
 public:
  /// conv1 (3x3, stride), bn1, relu, conv2 (3x3), bn2.
  using main_type = sequential<conv2d<T, Mesh>, batch_norm<T, Mesh, Data>, relu<T>, conv2d<T, Mesh>, batch_norm<T, Mesh, Data>>;
  /// The main branch plus the shortcut.
  residual<T, main_type, detail::block_shortcut<T, Mesh, Data>> body;

  /// A block from images of shape `in` to `out_channels` channels, the first convolution (and the
  /// projection, when the shape changes) with `stride`. Parameters are named `name + ".conv1.w"`,
  /// `".bn1.g"`, ..., `".proj.w"`, `".proj_bn.g"`; weights He-uniform from `key`.
  /// @throws sharding_error as `conv2d` does (a kernel larger than the padded input, zero sizes).
  basic_block(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t stride,
              rng_key key, std::span<const std::size_t> local_devices = {})
      : body(mesh, make_main(mesh, name, in, out_channels, stride, key, local_devices),
             detail::block_shortcut<T, Mesh, Data>(mesh, name, in, out_channels, stride, key, local_devices)),
        act_(mesh),
        name_(name),
        in_(in),
        out_(std::get<0>(body.main.layers).output_shape()) {}

  /// The block's name, the prefix of its parameters' names.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// `ceil(H / stride) x ceil(W / stride) x out_channels`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"b1 (basic_block 28x28x16 -> 14x14x32, projection shortcut)"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (basic_block " + in_.to_string() + " -> " + out_.to_string() + ", " +
           (body.shortcut.projects() ? "projection" : "identity") + " shortcut)";
  }
  /// What its first convolution accepts.
  template <class X>
  static constexpr bool accepts_input = conv2d<T, Mesh>::template accepts_input<X>;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"basic_block">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// Training or evaluation, for its batch norms.
  void begin_step(rng_key key, bool train) { body.begin_step(key, train); }

  /// `relu(main(x) + shortcut(x))`.
  template <local_tensor_type X>
  X forward(const X& x) {
    return act_.forward(body.forward(x));
  }
  /// The cotangent of the input (when `need_dx`); accumulates every parameter's gradient.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    return body.backward(act_.backward(dy), need_dx);
  }
  /// Appends the main branch's parameters (conv1, bn1, conv2, bn2), then the projection's.
  void collect(std::vector<param_ref<T>>& out) { body.collect(out); }
  /// Appends its batch norms' running statistics (bn1, bn2, then the projection's), for checkpoints.
  void collect_buffers(std::vector<param_ref<T>>& out) const { body.collect_buffers(out); }

 private:
  static main_type make_main(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels,
                             std::size_t stride, rng_key key, std::span<const std::size_t> local_devices) {
    conv2d<T, Mesh> c1(mesh, name + ".conv1", in, out_channels, 3, key, {.stride = stride, .padding = 1, .use_bias = false},
                       local_devices);
    const image_shape mid = c1.output_shape();
    conv2d<T, Mesh> c2(mesh, name + ".conv2", mid, out_channels, 3, key, {.stride = 1, .padding = 1, .use_bias = false},
                       local_devices);
    return main_type(std::move(c1), batch_norm<T, Mesh, Data>(mesh, name + ".bn1", mid, T(0.1), T(1e-5), local_devices),
                     relu<T>(mesh), std::move(c2),
                     batch_norm<T, Mesh, Data>(mesh, name + ".bn2", mid, T(0.1), T(1e-5), local_devices));
  }

  relu<T> act_;
  std::string name_;
  image_shape in_, out_;
};

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `batch_norm` with batch statistics synchronised over the data axis (PyTorch's
/// `SyncBatchNorm`, `flax.linen.BatchNorm(axis_name="data")`): per channel,
/// `y = (x - mean) / sqrt(var + eps) * g + b`, the mean and (biased) variance taken over every
/// pixel of every image of the *global* batch, so a data-parallel run normalises exactly as one
/// device does over the whole batch, and the per-step losses do not depend on the mesh.
///
/// How: each device sums its block's rows per channel, one `psum` over the data axis gives the
/// global sums (the mean), a second pass and `psum` the global sum of squared deviations (two
/// passes, not `E[x^2] - mean^2`, whose cancellation in float would differ between meshes beyond
/// rounding). The backward pass needs two global sums per channel, `sum dy` and `sum dy * xhat`:
/// one `psum` of both. The gradients of `g` and `b` are the local sums, a pending sum over the data
/// axis that the gradient synchronisation completes, as for every replicated weight.
///
/// Input: a rank-2 block of rows whose rows are the batch sharded over `Data` (what `train_step`
/// feeds), each row an NHWC image of shape `in` (channels-last, see image_shape.hpp); a plain
/// `N x C` activation is the image shape `1 x 1 x C`. The element count the statistics divide by
/// is the global batch times the pixels.
///
/// Evaluation (`begin_step(key, false)`, as `evaluate` calls it): the running mean and variance,
/// updated in training as PyTorch does (`running = (1 - momentum) running + momentum batch`, the
/// unbiased variance), replace the batch statistics; every device updates its copy with the same
/// global statistics, so the copies stay equal. They are not trained parameters (optimizers and the
/// gradient synchronisation do not see them) but buffers, as PyTorch calls them (flax: the
/// `batch_stats` collection): `running_mean()` and `running_var()` read them, and `collect_buffers`
/// shows them, as `name + ".running_mean"` and `name + ".running_var"`, to `save_checkpoint`, which
/// saves and restores them with the parameters (on any mesh: they are replicated).
/// @code
/// meshlib::nn::batch_norm<float, mesh_t> bn(m, "bn1", {28, 28, 16});   // over the 16 channels
/// // inside spmd: auto y = bn.forward(x);  ...  auto dx = bn.backward(dy);
/// @endcode

#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/reductions.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/norm_kernels.hpp"
#include "meshlib/nn/layers/conv2d.hpp"
#include "meshlib/nn/layers/image_shape.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/nn/random.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::nn {

namespace detail {
template <class Layer, class Receives, class NeedsRows, class NeedsFeatures>
consteval bool batch_norm_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, NeedsRows, NeedsFeatures>,
                "meshlib::nn: batch_norm takes a complete rank-2 block of rows of its mesh and element type whose "
                "rows (the batch) are sharded over exactly its data axis and whose features are not sharded (the "
                "condition spells out the layer, the input's layout and what its rows and features need)");
  return false;
}
}  // namespace detail

/// @brief Batch normalisation over the channels of NHWC images, statistics synchronised over the
/// data axis `Data` (see the file comment). Scale `g` (init 1) and shift `b` (init 0) are replicated.
template <class T, mesh_type Mesh, fixed_string Data = "data">
class batch_norm {
 public:
  /// Scale, shift and running statistics are replicated on every device.
  using sharding = named_sharding<Mesh, P<none>>;
  /// The scale `g` (named `name + ".g"`, initially 1), one per channel.
  parameter<T, 1, sharding> g;
  /// The shift `b` (named `name + ".b"`, initially 0), one per channel.
  parameter<T, 1, sharding> b;

  /// Normalises images of shape `in` per channel. `momentum`: PyTorch's (the weight of the new
  /// batch in the running statistics); `eps` keeps the division finite. `local_devices`: this
  /// process's devices (empty: all).
  batch_norm(const Mesh& mesh, const std::string& name, image_shape in, T momentum = T(0.1), T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : g(name + ".g", sharding{mesh}, {checked(name, in)}, rng_key{}, init::constant(1.0f), false, local_devices),
        b(name + ".b", sharding{mesh}, {in.channels}, rng_key{}, init::zeros(), false, local_devices),
        name_(name),
        in_(in),
        momentum_(momentum),
        eps_(eps),
        running_mean_(full<T>(sharding{mesh}, std::array<std::size_t, 1>{in.channels}, T{0}, local_devices)),
        running_var_(full<T>(sharding{mesh}, std::array<std::size_t, 1>{in.channels}, T{1}, local_devices)),
        saved_(mesh.size()),
        stats_(mesh.size()),
        st_back_(mesh.size()),
        xhat_(mesh.size()),
        out_(mesh.size()),
        dx_(mesh.size()) {}
  /// Normalises `features` values per row (images of shape `1 x 1 x features`), as `BatchNorm1d`.
  batch_norm(const Mesh& mesh, const std::string& name, std::size_t features, T momentum = T(0.1), T eps = T(1e-5),
             std::span<const std::size_t> local_devices = {})
      : batch_norm(mesh, name, image_shape{1, 1, features}, momentum, eps, local_devices) {}

  /// The layer's name: its parameters are `name() + ".g"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes and returns.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// @copydoc input_shape
  [[nodiscard]] image_shape output_shape() const noexcept { return in_; }
  /// Features per row, in and out.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// @copydoc in_features
  [[nodiscard]] std::size_t out_features() const noexcept { return in_.size(); }
  /// The channels it normalises.
  [[nodiscard]] std::size_t channels() const noexcept { return in_.channels; }
  /// `"bn1 (batch_norm over 16 channels of 28x28x16, synchronised over 'data')"`.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (batch_norm over " + std::to_string(in_.channels) + " channels of " + in_.to_string() +
           ", synchronised over '" + std::string(Data.view()) + "')";
  }
  /// Whether the layer normalises with the batch's statistics (training, the default) or the running ones.
  [[nodiscard]] bool training() const noexcept { return train_; }
  /// The running mean per channel (PyTorch's `running_mean`), replicated; initially 0.
  [[nodiscard]] const sharded_tensor<T, 1, sharding>& running_mean() const noexcept { return running_mean_; }
  /// The running (unbiased) variance per channel (PyTorch's `running_var`), replicated; initially 1.
  [[nodiscard]] const sharded_tensor<T, 1, sharding>& running_var() const noexcept { return running_var_; }

  /// The data axis's mask: the rows must be sharded over exactly it.
  static constexpr axis_mask data_mask = Mesh::template mask_of<Data>();
  /// A complete rank-2 block of rows sharded over `Data`, with unsharded features.
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>() && X::dims_type::at(0) == data_mask;
  /// For compile-time messages.
  using diagnostic_name = meshlib::diagnostic::op_t<"batch_norm">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// Training or evaluation (called by `sequential::begin_step`: `train_step` passes true, `evaluate` false).
  void begin_step(rng_key, bool train) noexcept { train_ = train; }

  /// Normalises every channel with the global batch's statistics (training) or the running ones.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"batch_norm.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      using rows_need = meshlib::diagnostic::rows_sharded_over<meshlib::diagnostic::axes_t<Mesh, data_mask>>;
      static_cast<void>(detail::batch_norm_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>,
                                                              rows_need, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device(), rows = x.extent(0);
      if (x.extent(1) != in_.size()) throw sharding_error(width_error(x.extent(1)));
      const std::size_t c = in_.channels, np = rows * in_.pixels();
      const T count = static_cast<T>(x.global_extent(0) * in_.pixels());
      saved_[dev] = {rows, true, train_, count};
      T* st = stats_.get(dev, 4 * c);  // sums, squared deviations, mean, 1 / std
      T* mean = st + 2 * c;
      T* rstd = st + 3 * c;
      const T* xp = x.data();
      const T eps = eps_;
      T* run_mean = running_mean_.local(dev).data();
      T* run_var = running_var_.local(dev).data();
      if (train_) {
        T* s = st;
        T* q = st + c;
        detail::channel_sums<default_memory_space>(s, xp, static_cast<const T*>(nullptr), np, c, T{1});
        (void)meshlib::psum<Data>(detail::wrap1<sums_t>(s, c, x.mesh(), dev));  // donated: summed in place
        detail::channel_sums<default_memory_space>(q, xp, s, np, c, count);
        (void)meshlib::psum<Data>(detail::wrap1<sums_t>(q, c, x.mesh(), dev));
        const T mom = momentum_;
        const T unbias = count > T{1} ? count / (count - T{1}) : T{1};
        detail::batch_statistics<default_memory_space>(mean, rstd, run_mean, run_var, s, q, c, count, eps, mom, unbias);
      } else {
        detail::running_statistics<default_memory_space>(mean, rstd, run_mean, run_var, c, eps);
      }
      T* xh = xhat_.get(dev, np * c);
      T* y = out_.get(dev, np * c);
      const T* gv = g.value.local(dev).data();
      const T* bv = b.value.local(dev).data();
      detail::batch_normalize<default_memory_space>(y, xh, xp, mean, rstd, gv, bv, np, c);
      return X(typename X::view_type(y, rows, in_.size()), x.mesh(), dev);
    }
  }

  /// The cotangent of the input (when `need_dx`; otherwise its contents are unspecified); accumulates
  /// (or, as `grad_beta` says, writes) the gradients of `g` and `b`.
  /// @throws sharding_error when `dy` is not shaped as this device's last forward input.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"batch_norm.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const saved sv = saved_[dev];
    detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), sv.ran, sv.rows, in_.size());
    const std::size_t c = in_.channels, np = sv.rows * in_.pixels();
    const T* st = stats_.get(dev, 4 * c);
    const T* rstd = st + 3 * c;
    const T* xh = xhat_.get(dev, np * c);
    T* sums = st_back_.get(dev, 2 * c);  // sum dy, sum dy * xhat
    const T* d = dy.data();
    // Per channel, rows in order (the same bits on every run).
    detail::batch_grad_sums<default_memory_space>(sums, d, xh, np, c);
    T* gg = g.grad.local(dev).data();
    T* gb = b.grad.local(dev).data();
    const T beta_g = g.grad_beta(dev), beta_b = b.grad_beta(dev);
    detail::batch_param_grads<default_memory_space>(gg, gb, sums, c, beta_g, beta_b);
    T* dx = dx_.get(dev, np * c);
    if (!need_dx) return DY(typename DY::view_type(dx, sv.rows, in_.size()), dy.mesh(), dev);
    const T* gv = g.value.local(dev).data();
    if (sv.train) {
      // dx = g / std * (dy - mean(dy) - xhat * mean(dy * xhat)), the means over the global batch.
      (void)meshlib::psum<Data>(detail::wrap1<sums_t>(sums, 2 * c, dy.mesh(), dev));
      const T inv = T{1} / sv.count;
      detail::batch_norm_dx<default_memory_space>(dx, d, xh, sums, gv, rstd, np, c, inv);
    } else {  // the statistics are constants: an affine map per channel
      detail::batch_norm_dx_affine<default_memory_space>(dx, d, gv, rstd, np, c);
    }
    return DY(typename DY::view_type(dx, sv.rows, in_.size()), dy.mesh(), dev);
  }

  /// Appends `g` and `b` (the running statistics are not trained).
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(g.ref(true));  // backward writes them with grad_beta
    out.push_back(b.ref(true));
  }
  /// Appends the running statistics, `name() + ".running_mean"` and `name() + ".running_var"`
  /// (`channels()` values each): what checkpoints save beside the parameters.
  void collect_buffers(std::vector<param_ref<T>>& out) const {
    out.push_back(detail::tensor_ref(name_ + ".running_mean", running_mean_));
    out.push_back(detail::tensor_ref(name_ + ".running_var", running_var_));
  }

 private:
  /// A device's per-channel sums, varying over the data axis until the `psum`.
  using sums_t = local_tensor<T, 1, Mesh, data_mask, 0, replicated_dims<1>, default_memory_space>;

  static std::size_t checked(const std::string& name, const image_shape& in) {
    if (in.size() == 0)
      throw sharding_error("meshlib::nn: " + name + " (batch_norm on " + in.to_string() +
                           " images): the image's height, width and channels must be at least 1");
    return in.channels;
  }

  std::string width_error(std::size_t got) const {
    if (in_.pixels() == 1)
      return "meshlib::nn: " + to_string() + " received " + std::to_string(got) + " features per row, but it normalises " +
             std::to_string(in_.channels) + "; declare " + name_ + " with " + std::to_string(got) +
             " features (or the image shape of the layer before it), or feed it " + std::to_string(in_.channels);
    return detail::image_width_error(to_string(), name_, got, in_);
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false, train = true;
    T count = T{1};  // elements per channel in the global batch
  };
  std::string name_;
  image_shape in_;
  T momentum_, eps_;
  bool train_ = true;
  sharded_tensor<T, 1, sharding> running_mean_, running_var_;
  std::vector<saved> saved_;
  detail::device_buffers<T> stats_, st_back_, xhat_, out_, dx_;
};

}  // namespace meshlib::nn

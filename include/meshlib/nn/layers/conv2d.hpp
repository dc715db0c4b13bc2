// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `conv2d`: a 2-D convolution (`flax.linen.Conv` / `torch.nn.Conv2d`, dilation 1, one
/// group) with stride and zero padding, forward and backward, on channels-last images (NHWC).
///
/// Why NHWC and im2col: with the channels of a pixel contiguous, the `kernel x kernel` window of
/// one output pixel is `kernel` runs of `kernel * C_in` contiguous values, so im2col writes each
/// patch row with straight copies, and the convolution is one plain GEMM
/// `Y (N*Ho*Wo x C_out) = patches (N*Ho*Wo x kernel*kernel*C_in) x W (kernel*kernel*C_in x C_out)`
/// whose output is already NHWC (no transpose on either side), TensorFlow's and JAX's default layout.
/// The weight is `W[(i * kernel + j) * C_in + c][o]`: HWIO (flax's layout) flattened to rank 2.
/// - forward: one of three algorithms (`conv2d_algorithm`, chosen by a fixed rule, see
///   `algorithm()`): im2col (a Kokkos kernel) in cache-sized blocks of output pixels, each block
///   multiplied at once, `Y = b; Y += patches W` (`matmul_into`); a 1x1 kernel's patches are the
///   input rows (stride 1) or a row gather; a small patch (the stem, `C_in` 1 or 3) is computed
///   directly from the input, without patches (nn/detail/conv2d_kernels.hpp);
/// - backward: `dW (+)= patches^T dY` (the patches made again block by block; the direct kernel's
///   sum per output image row, then the rows in order), `db (+)= column sums of dY`, `dpatches = dY W^T`,
///   then col2im as a gather: one work item per input pixel adds the patch entries that read it, in
///   a fixed order (no atomics: the same bits on every run and mesh); a 1x1 kernel at stride 1 needs
///   no col2im (`dX = dY W^T`).
///
/// Data parallel: the input on each device is its block of rows (images) of the batch, as for
/// `dense`; the weight is replicated, so its gradient is a pending sum over the data axis that the
/// gradient synchronisation of `train_step` completes. No communication in forward or backward.
/// (Output channels sharded over a model axis do not fit rank-2 rows: in a flattened NHWC row a
/// device's channels are not one contiguous block of the features, so such an output could not be
/// typed as a feature-sharded block. A ResNet is trained data-parallel, which this layer is.)
///
/// Sizes are checked: a kernel larger than the padded input is refused at construction, an input
/// whose width is not `height * width * C_in` (say, another channel count) in forward; each
/// `sharding_error` names the layer, the sizes and the fix.
/// @code
/// meshlib::nn::conv2d<float, mesh_t> c1(m, "c1", {28, 28, 1}, 16, 3, meshlib::nn::rng_key{0}, {.padding = 1});
/// // c1.output_shape() == {28, 28, 16}; inside spmd: auto y = c1.forward(x);  ...  c1.backward(dy);
/// @endcode

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/core/partition_spec.hpp"
#include "meshlib/nn/buffers.hpp"
#include "meshlib/nn/detail/conv2d_kernels.hpp"
#include "meshlib/nn/detail/kernels.hpp"
#include "meshlib/nn/detail/layer_kernels.hpp"
#include "meshlib/nn/layers/image_shape.hpp"
#include "meshlib/nn/layers/shape_checks.hpp"
#include "meshlib/nn/parameter.hpp"
#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/matmul_into.hpp"
#include "meshlib/tensor/pointer_check.hpp"

namespace meshlib::diagnostic {
/// An image shape known at compile time, `height x width x channels`, in a compile-time error.
template <std::size_t Height, std::size_t Width, std::size_t Channels>
struct image {};
/// A convolution's kernel size (`kernel<3>`: 3 x 3), in a compile-time error.
template <std::size_t Size>
struct kernel {};
/// The zeros a convolution adds on every side of its input, in a compile-time error.
template <std::size_t Size>
struct padding {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn {

/// @brief How `conv2d` computes its forward (and the patches its weight gradient needs); every
/// algorithm gives the same convolution up to float rounding, and the same bits on every run.
enum class conv2d_algorithm {
  automatic,  ///< the rule of `conv2d::algorithm()`: pointwise, else direct for small patches, else im2col
  im2col,     ///< im2col in cache-sized blocks of output pixels, each multiplied at once (`matmul_into`)
  direct,     ///< each output pixel straight from the input, 16 output channels at a time (no patches)
  pointwise,  ///< a 1x1 kernel without padding: the input pixels (every `stride`-th) are the patches
};

namespace detail {
template <class Image, class Kernel, class Padding>
consteval bool conv2d_kernel_larger_than_input() {
  static_assert(meshlib::diagnostic::always_false<Image, Kernel, Padding>,
                "meshlib::nn: conv2d: the input image (In, with O.padding on every side) is smaller than the Kernel x "
                "Kernel kernel (the condition spells out the image, the kernel and the padding); use a smaller "
                "kernel, pad by more, or remove a pooling layer before it");
  return false;
}
}  // namespace detail

/// @brief The options of `conv2d` (flax's names): stride and zero padding on both spatial
/// dimensions, whether the layer adds a bias (off before a `batch_norm`, which cancels it), and
/// the algorithm (leave it `automatic` unless you measured otherwise; tests force each one).
struct conv2d_options {
  std::size_t stride = 1;   ///< step between output pixels, in input pixels
  std::size_t padding = 0;  ///< zeros added on every side of the image
  bool use_bias = true;     ///< add a learned bias per output channel
  conv2d_algorithm algorithm = conv2d_algorithm::automatic;  ///< how the forward is computed
};

/// @brief The shape of the images `conv2d` makes from images of shape `In`, computed at compile
/// time for sizes that are compile-time constants: a kernel larger than the padded input, or a zero
/// size, is then one compile error (the instantiation names the sizes) instead of the
/// `sharding_error` the constructor throws at run time. The same arithmetic as `output_shape()`.
/// @code
/// namespace nn = meshlib::nn;
/// constexpr auto s1 = nn::conv2d_output_shape<nn::image_shape{28, 28, 1}, 16, 3, nn::conv2d_options{.padding = 1}>();
/// static_assert(s1 == nn::image_shape{28, 28, 16});
/// @endcode
template <image_shape In, std::size_t OutChannels, std::size_t Kernel, conv2d_options O = conv2d_options{}>
consteval image_shape conv2d_output_shape() {
  constexpr bool sizes = Kernel >= 1 && O.stride >= 1 && OutChannels >= 1 && In.size() >= 1;
  static_assert(sizes,
                "meshlib::nn: conv2d: kernel, stride, output channels and the image's height, width and channels "
                "must be at least 1");
  if constexpr (sizes && In.height + 2 * O.padding >= Kernel && In.width + 2 * O.padding >= Kernel) {
    return {(In.height + 2 * O.padding - Kernel) / O.stride + 1, (In.width + 2 * O.padding - Kernel) / O.stride + 1,
            OutChannels};
  } else {
    if constexpr (sizes)  // one error: the sizes' own above, else this one
      static_cast<void>(detail::conv2d_kernel_larger_than_input<meshlib::diagnostic::image<In.height, In.width, In.channels>,
                                                                meshlib::diagnostic::kernel<Kernel>,
                                                                meshlib::diagnostic::padding<O.padding>>());
    return {};
  }
}

namespace detail {
/// Whether a layer of images (conv2d, pooling, batch_norm) takes `X`: a complete rank-2 block of
/// rows with unsharded features, of this mesh and element type.
template <class X, class Mesh, class T>
consteval bool image_layer_accepts() {
  if constexpr (!std::is_same_v<typename X::mesh_type, Mesh> || !std::is_same_v<typename X::value_type, T>) return false;
  else if constexpr (X::rank != 2) return false;
  else return X::partial == 0 && X::dims_type::at(1) == 0;
}

template <class Layer, class Receives, class Needs>
consteval bool conv2d_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: conv2d takes a complete rank-2 block of rows (images, NHWC, flattened) of its mesh and "
                "element type, with unsharded features: shard the batch over the data axis, not the pixels (the "
                "condition spells out the layer, the input's layout and what it needs)");
  return false;
}

}  // namespace detail

/// @brief A 2-D convolution on NHWC images (see the file comment); weight and bias replicated.
template <class T, mesh_type Mesh>
class conv2d {
 public:
  /// Weight and bias are replicated on every device (data parallel).
  using w_sharding = named_sharding<Mesh, P<none, none>>;
  /// @copydoc w_sharding
  using b_sharding = named_sharding<Mesh, P<none>>;

  /// The weight, `kernel*kernel*C_in x C_out` (HWIO flattened); named `name + ".w"`.
  parameter<T, 2, w_sharding> w;
  /// The bias, `C_out` (zero, and not trained, without `use_bias`); named `name + ".b"`.
  parameter<T, 1, b_sharding> b;

  /// Images of shape `in` to `out_channels` channels with a `kernel x kernel` window. W ~ He
  /// (Kaiming) uniform, limit `sqrt(6 / (kernel*kernel*C_in))`, from `key` (mesh-invariant); b = 0.
  /// @throws sharding_error when the kernel is larger than the padded input, or a size is zero.
  conv2d(const Mesh& mesh, const std::string& name, image_shape in, std::size_t out_channels, std::size_t kernel,
         rng_key key, conv2d_options o = {}, std::span<const std::size_t> local_devices = {})
      : w(name + ".w", w_sharding{mesh}, {checked(name, in, out_channels, kernel, o) * in.channels, out_channels}, key,
          init::uniform(static_cast<float>(std::sqrt(6.0 / static_cast<double>(kernel * kernel * in.channels)))), true,
          local_devices),
        b(name + ".b", b_sharding{mesh}, {out_channels}, key, init::zeros(), false, local_devices),
        name_(name),
        in_(in),
        out_{(in.height + 2 * o.padding - kernel) / o.stride + 1, (in.width + 2 * o.padding - kernel) / o.stride + 1,
             out_channels},
        kernel_(kernel),
        opt_(o),
        algo_(choose(name, in, out_channels, kernel, o)),
        saved_(mesh.size()),
        cols_(mesh.size()),
        out_buf_(mesh.size()),
        dcols_(mesh.size()),
        dx_(mesh.size()) {}

  /// The layer's name: its parameters are `name() + ".w"` and `name() + ".b"`.
  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  /// The shape of the images it takes.
  [[nodiscard]] image_shape input_shape() const noexcept { return in_; }
  /// The shape of the images it returns: `((H + 2p - k) / s + 1) x ((W + 2p - k) / s + 1) x C_out`.
  [[nodiscard]] image_shape output_shape() const noexcept { return out_; }
  /// Features per input row: `H * W * C_in`.
  [[nodiscard]] std::size_t in_features() const noexcept { return in_.size(); }
  /// Features per output row: `Ho * Wo * C_out`.
  [[nodiscard]] std::size_t out_features() const noexcept { return out_.size(); }
  /// `"c1 (conv2d 3x3, 28x28x1 -> 28x28x16, stride 1, padding 1)"`: how messages name the layer.
  [[nodiscard]] std::string to_string() const {
    return name_ + " (conv2d " + std::to_string(kernel_) + "x" + std::to_string(kernel_) + ", " + in_.to_string() +
           " -> " + out_.to_string() + ", stride " + std::to_string(opt_.stride) + ", padding " +
           std::to_string(opt_.padding) + ")";
  }

  /// A complete rank-2 block of rows with unsharded features (shard the batch, not the pixels).
  template <class X>
  static constexpr bool accepts_input = detail::image_layer_accepts<X, Mesh, T>();
  /// For compile-time messages: the kind, and what the input's features must be.
  using diagnostic_name = meshlib::diagnostic::op_t<"conv2d">;
  /// @copydoc diagnostic_name
  using input_requirement = diagnostic::features_sharded_over<diagnostic::axes<>>;

  /// The algorithm the forward runs (the options' choice, or the rule for `automatic`, fixed at
  /// construction so every step and every device computes alike):
  /// - `pointwise` for a 1x1 kernel without padding: at stride 1 the input rows are the patches (no
  ///   copy at all), at a larger stride a row gather (im2col of a 1x1 window) in cache-sized blocks;
  /// - `direct` when a patch has at most `direct_max_patch` values (`kernel*kernel*C_in`: the 3x3 stem
  ///   of a grey or colour image), or when `C_out` is at most `direct_lanes` (16: one pass of the
  ///   kernel's vector lanes per pixel): measured (GCC 12, OpenBLAS 0.3.21, one thread; at -O3 with
  ///   AVX-512, with AVX2, and at -O2 with SSE2 alone) faster than blocked im2col + sgemm in every
  ///   build for those shapes (the stem 1.9-6x, C_in = 3 1.1-3.4x, 14x14x16 -> 16 1.1-1.7x), and
  ///   1.7-2x slower from C_out = 32 up (AVX-512; docs/benchmarks.md, "ResNet"). Its weight gradient is summed
  ///   straight from the input for patches of at most `direct_max_patch` values, and through blocked
  ///   im2col and `matmul_into` above (where that was measured faster);
  /// - `im2col` otherwise: im2col in blocks of output pixels whose patches fill `im2col_block_bytes`,
  ///   each block multiplied by the weight right away (`matmul_into`), so the patches stay in the
  ///   cache (measured faster, forward and backward, than keeping a whole patch matrix for `dW`).
  [[nodiscard]] conv2d_algorithm algorithm() const noexcept { return algo_; }
  /// The largest patch (`kernel*kernel*C_in` values) for which `automatic` picks `direct` whatever
  /// `C_out`, and for which `direct`'s weight gradient skips im2col.
  static constexpr std::size_t direct_max_patch = 27;
  /// The most output channels for which `automatic` picks `direct` whatever the patch size.
  static constexpr std::size_t direct_max_out_channels = detail::direct_lanes;
  /// The patch bytes of one im2col block (about half of a 1 MiB L2 cache, so the block and the
  /// product's working set stay there); at least `im2col_min_rows` rows, so each product is not tiny.
  static constexpr std::size_t im2col_block_bytes = std::size_t{256} * 1024;
  /// @copydoc im2col_block_bytes
  static constexpr std::size_t im2col_min_rows = 64;

  /// The convolution of this device's images (rows of `x`, NHWC), plus the bias.
  /// @throws sharding_error when a row of `x` is not `input_shape().size()` features.
  template <local_tensor_type X>
  X forward(const X& x) {
    static_cast<void>(require_kernel_can_read<"conv2d.forward", "x", X>());
    if constexpr (!std::is_same_v<typename X::value_type, T>) {
      static_cast<void>(detail::layer_input_element_type_differs<diagnostic_name, T, typename X::value_type>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else if constexpr (!accepts_input<X>) {
      static_cast<void>(detail::conv2d_input_does_not_fit<diagnostic_name, meshlib::diagnostic::value_t<X>, input_requirement>());
      return x;  // the one diagnostic above has fired; nothing else may
    } else {
      const std::size_t dev = x.device(), n = x.extent(0);
      if (x.extent(1) != in_.size())
        throw sharding_error(detail::image_width_error(to_string(), name_, x.extent(1), in_));
      const detail::conv_geometry g = geometry();
      const std::size_t m = n * g.ho * g.wo, kk = g.patch(), cout = g.cout;
      saved_[dev] = {n, true, x.data()};
      T* y = out_buf_.get(dev, m * cout);
      const T* xp = x.data();
      const T* wp = w.value.local(dev).data();
      const T* bias = opt_.use_bias ? b.value.local(dev).data() : nullptr;
      if (algo_ == conv2d_algorithm::direct) {
        detail::direct_conv<default_memory_space>(y, xp, wp, bias, g, n);
      } else {
        // Blocks of output pixels: their patches (im2col into a block buffer, or the input rows
        // themselves), then at once `Y[r0:r1] = bias; Y[r0:r1] += patches W`, while both are in the cache.
        T* cols = unpacked() ? nullptr : cols_.get(dev, std::min(m, block_rows(m)) * kk);
        for (std::size_t r0 = 0, rows = block_rows(m); r0 < m; r0 += rows) {
          const std::size_t r1 = std::min(m, r0 + rows);
          const T* patches = xp + r0 * kk;
          if (unpacked()) {
            if (bias != nullptr) detail::bias_rows<default_memory_space>(y, bias, cout, r0, r1);
          } else {
            detail::im2col<default_memory_space>(cols, xp, g, r0, r1, y, bias);
            patches = cols;
          }
          matmul_into(view(y + r0 * cout, r1 - r0, cout), cview(patches, r1 - r0, kk), cview(wp, kk, cout),
                      {.beta = bias != nullptr ? 1.0 : 0.0});
        }
      }
      return X(typename X::view_type(y, n, g.ho * g.wo * cout), x.mesh(), dev);
    }
  }

  /// Accumulates `dW += patches^T dy` and `db += column sums of dy` (overwrites them when
  /// `grad_beta` says so) and returns `dx` (when `need_dx`; otherwise its contents are unspecified).
  /// The forward keeps no patch matrix: `dW` makes the patches again from the forward's input, block
  /// by block as the forward did (the input rows themselves for `pointwise` at stride 1), adding the
  /// blocks' products in order; `direct` with patches of at most `direct_max_patch` values sums
  /// `patch^T dy` per output image row from the input, then the rows in order (the same bits on every
  /// run either way).
  /// @throws sharding_error when `dy` is not shaped as this device's last forward output.
  template <local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    static_cast<void>(require_kernel_can_read<"conv2d.backward", "dy", DY>());
    const std::size_t dev = dy.device();
    const auto [n, ran, xp] = saved_[dev];
    detail::check_output_cotangent(to_string(), dev, dy.extent(0), dy.extent(1), ran, n, out_.size());
    const detail::conv_geometry g = geometry();
    const std::size_t m = n * g.ho * g.wo, kk = g.patch(), cout = g.cout;
    const T* d = dy.data();
    const T* wp = w.value.local(dev).data();
    T* gw = w.grad.local(dev).data();
    const double beta = static_cast<double>(w.grad_beta(dev));
    if (algo_ == conv2d_algorithm::direct && kk <= direct_max_patch) {  // per output image row, then the rows in order
      T* part = dcols_.get(dev, n * g.ho * kk * cout);
      detail::direct_grad_w_rows<default_memory_space>(part, xp, d, g, n);
      detail::direct_grad_w_sum<default_memory_space>(gw, part, kk * cout, n * g.ho, beta == 0.0);
    } else if (unpacked()) {  // the patches are the input rows: one product
      matmul_into(view(gw, kk, cout), cview(xp, m, kk), cview(d, m, cout), {.transpose_a = true, .beta = beta});
    } else {  // the patches again, block by block as the forward made them, each block's product added
      T* cols = cols_.get(dev, std::min(m, block_rows(m)) * kk);
      for (std::size_t r0 = 0, rows = block_rows(m); r0 < m; r0 += rows) {
        const std::size_t r1 = std::min(m, r0 + rows);
        detail::im2col<default_memory_space>(cols, xp, g, r0, r1);
        matmul_into(view(gw, kk, cout), cview(cols, r1 - r0, kk), cview(d + r0 * cout, r1 - r0, cout),
                    {.transpose_a = true, .beta = r0 == 0 ? beta : 1.0});
      }
    }
    if (opt_.use_bias) {
      T* gb = b.grad.local(dev).data();
      const bool fresh = b.grad_beta(dev) == T{0};
      // Column sums of dy seen as (N*Ho*Wo) x C_out, rows in order (the same bits on every mesh).
      detail::bias_grad<default_memory_space>(gb, d, m, cout, fresh);  // as dense: column sums, rows in order
    }
    T* dx = dx_.get(dev, n * in_.size());
    if (need_dx) {
      if (unpacked()) {  // the patches are the input rows: dx = dy W^T directly
        matmul_into(view(dx, m, kk), cview(d, m, cout), cview(wp, kk, cout), {.transpose_b = true});
      } else {
        T* dc = dcols_.get(dev, m * kk);
        matmul_into(view(dc, m, kk), cview(d, m, cout), cview(wp, kk, cout), {.transpose_b = true});
        detail::col2im<default_memory_space>(dx, dc, g, n);
      }
    }
    return DY(typename DY::view_type(dx, n, in_.size()), dy.mesh(), dev);
  }

  /// Appends the weight, and the bias when the layer uses one.
  void collect(std::vector<param_ref<T>>& out) {
    out.push_back(w.ref(true));  // backward writes them with grad_beta
    if (opt_.use_bias) out.push_back(b.ref(true));
  }

 private:
  using cview = meshlib::unmanaged_block_view<const T, 2, default_memory_space>;
  using view = meshlib::unmanaged_block_view<T, 2, default_memory_space>;

  /// The constructor's checks; returns `kernel * kernel` (the weight's rows per input channel).
  static std::size_t checked(const std::string& name, const image_shape& in, std::size_t out_channels,
                             std::size_t kernel, const conv2d_options& o) {
    const std::string head = "meshlib::nn: " + name + " (conv2d " + std::to_string(kernel) + "x" +
                             std::to_string(kernel) + " on " + in.to_string() + " images)";
    if (kernel == 0 || o.stride == 0 || out_channels == 0 || in.size() == 0)
      throw sharding_error(head + ": kernel, stride, output channels and the image's height, width and channels must "
                                  "be at least 1 (kernel " + std::to_string(kernel) + ", stride " +
                           std::to_string(o.stride) + ", " + std::to_string(out_channels) + " output channels)");
    detail::check_window_fits(head, in, kernel, o.padding, true, "kernel");
    return kernel * kernel;
  }

  /// The sizes the kernels take.
  [[nodiscard]] detail::conv_geometry geometry() const noexcept {
    return {in_.height, in_.width, in_.channels, out_.height, out_.width, out_.channels, kernel_, opt_.stride,
            opt_.padding};
  }
  /// Whether the patches are the input rows themselves (pointwise at stride 1: no im2col).
  [[nodiscard]] bool unpacked() const noexcept { return algo_ == conv2d_algorithm::pointwise && opt_.stride == 1; }
  /// Output pixels per im2col block (see `im2col_block_bytes`): all `m` of them in a memory space the
  /// host cannot read (a GPU wants one large product, not a cache-sized one).
  [[nodiscard]] std::size_t block_rows(std::size_t m) const noexcept {
    if constexpr (!meshlib::host_accessible_v<default_memory_space>) return m;
    const std::size_t rows = im2col_block_bytes / (kernel_ * kernel_ * in_.channels * sizeof(T));
    return std::max<std::size_t>(rows, im2col_min_rows);
  }
  /// The algorithm of `algorithm()` for these sizes and options.
  /// @throws sharding_error when `pointwise` is asked for a kernel other than 1x1 or with padding.
  static conv2d_algorithm choose(const std::string& name, const image_shape& in, std::size_t out_channels,
                                 std::size_t kernel, const conv2d_options& o) {
    const bool one_by_one = kernel == 1 && o.padding == 0;
    switch (o.algorithm) {
      case conv2d_algorithm::automatic:
        if (one_by_one) return conv2d_algorithm::pointwise;
        return kernel * kernel * in.channels <= direct_max_patch || out_channels <= direct_max_out_channels
                   ? conv2d_algorithm::direct
                   : conv2d_algorithm::im2col;
      case conv2d_algorithm::pointwise:
        if (!one_by_one)
          throw sharding_error("meshlib::nn: " + name + " (conv2d " + std::to_string(kernel) + "x" +
                               std::to_string(kernel) + ", padding " + std::to_string(o.padding) +
                               "): the pointwise algorithm needs a 1x1 kernel without padding; use "
                               "conv2d_algorithm::im2col, direct or automatic");
        return o.algorithm;
      default:
        return o.algorithm;
    }
  }

  struct saved {
    std::size_t rows = 0;
    bool ran = false;
    const T* x = nullptr;  // the forward's input: backward makes the patches again from it
  };
  std::string name_;
  image_shape in_, out_;
  std::size_t kernel_;
  conv2d_options opt_;
  conv2d_algorithm algo_;
  std::vector<saved> saved_;  // per device: the last forward's number of images and input
  detail::device_buffers<T> cols_, out_buf_, dcols_, dx_;
};

}  // namespace meshlib::nn

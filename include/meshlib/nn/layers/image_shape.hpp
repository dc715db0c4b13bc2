// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `image_shape`: the height, width and channels of one image, as the convolutional layers
/// (conv2d, pooling, batch_norm, basic_block) read their rank-2 input.
///
/// Why rank 2 and channels-last (NHWC, flattened): every layer of `nn` takes a rank-2 block of rows
/// (the batch, sharded over the data axis) by features, and `train_step` feeds exactly that; an
/// image row is its pixels in NHWC order, `features = height * width * channels`, so a convolutional
/// stack composes with `dense` and `sequential` (their width checks included) with no reshape, and
/// Fashion-MNIST's 784 features are a 28x28x1 image as they come. Channels-last is also what makes
/// the convolution a plain GEMM (see conv2d.hpp), as in TensorFlow's and JAX's default layout.
/// @code
/// meshlib::nn::image_shape in{28, 28, 1};   // in.size() == 784 features per row
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>

#include "meshlib/core/errors.hpp"

namespace meshlib::nn {

/// @brief One image's shape, NHWC without the N: `height x width x channels`.
struct image_shape {
  std::size_t height = 0;    ///< rows of pixels
  std::size_t width = 0;     ///< columns of pixels
  std::size_t channels = 0;  ///< values per pixel, contiguous (channels-last)

  /// The features of one row: `height * width * channels`.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return height * width * channels; }
  /// The pixels of one image: `height * width`.
  [[nodiscard]] constexpr std::size_t pixels() const noexcept { return height * width; }
  /// `"28x28x1"`, as messages print it.
  [[nodiscard]] std::string to_string() const {
    return std::to_string(height) + "x" + std::to_string(width) + "x" + std::to_string(channels);
  }
  /// Equal when height, width and channels are.
  friend constexpr bool operator==(const image_shape&, const image_shape&) = default;
};

namespace detail {
/// The message of a layer that received `got` features per row but takes images of shape `want`
/// (`who`: `"conv1 (conv2d ...)"`, `name`: `"conv1"`): when `got` is a whole number of `want`'s
/// pixels it names the channel count it found, the usual mistake (a layer declared with the wrong
/// `C_in`).
inline std::string image_width_error(const std::string& who, const std::string& name, std::size_t got,
                                     const image_shape& want) {
  std::string s = "meshlib::nn: " + who + " received " + std::to_string(got) + " features per row, but it takes " +
                  want.to_string() + " images (height x width x channels, NHWC) = " + std::to_string(want.size()) +
                  " features";
  if (want.pixels() != 0 && got % want.pixels() == 0 && got != 0) {
    const std::size_t c = got / want.pixels();
    return s + ": that is " + std::to_string(c) + " channels where " + name + " takes " +
           std::to_string(want.channels) + "; declare " + name + " with " + std::to_string(c) +
           " input channels, or feed it " + std::to_string(want.channels) + "-channel images";
  }
  return s + "; declare " + name + " with the image shape of the layer before it (its output_shape())";
}

/// Refuses a `window` x `window` kernel or pooling window (`what`: `"kernel"`, `"window"`) larger
/// than the image `in` padded by `padding` on every side (`pads`: whether the layer can pad, so
/// that the message offers padding as a fix). `head` names the layer: `"meshlib::nn: c (conv2d
/// 5x5 on 2x3x1 images)"`. The one check conv2d and the pooling layers share.
/// @throws sharding_error naming the sizes and the fixes.
inline void check_window_fits(const std::string& head, const image_shape& in, std::size_t window, std::size_t padding,
                              bool pads, const std::string& what) {
  const std::size_t h = in.height + 2 * padding, w = in.width + 2 * padding;
  if (h >= window && w >= window) return;
  const std::string square = std::to_string(window) + "x" + std::to_string(window);
  std::string input = std::to_string(in.height) + "x" + std::to_string(in.width);
  std::string fixes = "use a " + what + " of at most " + std::to_string(std::min(h, w));
  if (pads) {
    input += " with padding " + std::to_string(padding) + " (" + std::to_string(h) + "x" + std::to_string(w) + ")";
    fixes += ", pad by at least " + std::to_string((window - std::min(in.height, in.width) + 1) / 2) + ",";
  }
  throw sharding_error(head + ": the input, " + input + ", is smaller than the " + square + " " + what + "; " + fixes +
                       " or remove a pooling layer before it");
}
}  // namespace detail

}  // namespace meshlib::nn

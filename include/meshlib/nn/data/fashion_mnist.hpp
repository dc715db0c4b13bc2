// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Fashion-MNIST (Zalando's 28x28 grey images of clothes, 10 classes; 60,000 for training and
/// 10,000 for test) from the IDX files Debian's `dataset-fashion-mnist` installs under
/// /usr/share/datasets/fashion-mnist, or from any directory that holds them.
///
/// @code
/// auto data = meshlib::nn::load_fashion_mnist();      // or load_fashion_mnist("/my/dir")
/// // data.train.count == 60000, data.test.count == 10000, features 784, classes 10
/// @endcode

#include <array>
#include <filesystem>
#include <string>

#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/errors.hpp"
#include "meshlib/nn/data/idx.hpp"

namespace meshlib::nn {

/// @brief The training and test splits of Fashion-MNIST.
struct fashion_mnist {
  dataset train;  ///< 60,000 examples
  dataset test;   ///< 10,000 examples
};

/// @brief Where Debian's package `dataset-fashion-mnist` installs the files.
[[nodiscard]] inline std::filesystem::path default_fashion_mnist_dir() {
  return "/usr/share/datasets/fashion-mnist";
}

namespace detail {

/// `dir/name`, or `dir/name.gz` when only the compressed file is there (Debian ships `.gz`; a user
/// may have gunzipped them). Neither: data_error saying which package or path provides them.
inline std::filesystem::path find_fashion_mnist_file(const std::filesystem::path& dir,
                                                     const std::string& name) {
  const std::filesystem::path plain = dir / name;
  std::filesystem::path gz = plain;
  gz += ".gz";
  std::error_code ec;
  if (std::filesystem::is_regular_file(plain, ec)) return plain;
  if (std::filesystem::is_regular_file(gz, ec)) return gz;
  throw data_error("meshlib: Fashion-MNIST: neither '" + plain.string() + "' nor '" + gz.string() +
                   "' exists; install Debian's package dataset-fashion-mnist (apt-get install "
                   "dataset-fashion-mnist, files under " + default_fashion_mnist_dir().string() +
                   ") or give the directory that holds the four IDX files");
}

}  // namespace detail

/// @brief Reads Fashion-MNIST's four IDX files (`train-images-idx3-ubyte`, `train-labels-idx1-ubyte`,
/// `t10k-images-idx3-ubyte`, `t10k-labels-idx1-ubyte`, each plain or `.gz`) from `dir`.
/// @throws meshlib::data_error when a file is missing (naming the package that provides it) or
///         malformed (see read_idx), or when the data is not 28x28 images in 10 classes.
[[nodiscard]] inline fashion_mnist load_fashion_mnist(
    const std::filesystem::path& dir = default_fashion_mnist_dir()) {
  auto split = [&](const char* prefix) {
    const auto images = detail::find_fashion_mnist_file(dir, std::string(prefix) + "-images-idx3-ubyte");
    const auto labels = detail::find_fashion_mnist_file(dir, std::string(prefix) + "-labels-idx1-ubyte");
    dataset ds = read_idx(images, labels, 10);
    if (ds.features != 28 * 28) {
      throw data_error(detail::file_label("IDX file", images) + " holds images of " +
                       std::to_string(ds.features) + " pixels, expected Fashion-MNIST's 28 x 28 = 784");
    }
    return ds;
  };
  fashion_mnist data;
  data.train = split("train");
  data.test = split("t10k");
  return data;
}

}  // namespace meshlib::nn

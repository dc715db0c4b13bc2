// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Reads a classification data set from a pair of IDX files (the format of MNIST and
/// Fashion-MNIST: an image file of unsigned bytes with dimensions (count, rows, columns) and a
/// label file of unsigned bytes with dimension (count)), plain or gzip-compressed.
///
/// @code
/// auto train = meshlib::nn::read_idx("data/train-images-idx3-ubyte.gz",
///                                    "data/train-labels-idx1-ubyte.gz", 10);
/// // train.count == 60000, train.features == 784, train.classes == 10
/// @endcode
///
/// Every defect gives a meshlib::data_error that names the file and says what was expected and
/// what was found: a missing file, a bad magic number (not IDX, not unsigned bytes, or the wrong
/// number of dimensions), a file shorter or longer than its header promises, label and image
/// counts that disagree, a label outside [0, classes), a header whose dimensions multiply past
/// 2^64. Every size is checked against the file before anything is allocated by it.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "meshlib/nn/data/dataset.hpp"
#include "meshlib/nn/data/detail/read_bytes.hpp"
#include "meshlib/nn/data/errors.hpp"

namespace meshlib::nn {
namespace detail {

inline std::string hex32(std::uint32_t v) {
  char text[11];
  std::snprintf(text, sizeof text, "0x%08X", static_cast<unsigned>(v));
  return text;
}

inline std::uint32_t big_endian32(const std::uint8_t* p) {
  return (std::uint32_t{p[0]} << 24) | (std::uint32_t{p[1]} << 16) | (std::uint32_t{p[2]} << 8) |
         std::uint32_t{p[3]};
}

/// The dimensions of an IDX file of unsigned bytes with `rank` dimensions, after checking its magic
/// number and that its size is exactly header + product of dimensions. `layout` names the
/// dimensions for messages ("count, rows, columns").
inline std::vector<std::size_t> idx_dims(const std::filesystem::path& path,
                                         const std::vector<std::uint8_t>& bytes, std::uint8_t rank,
                                         const char* layout) {
  const std::size_t header = 4 + 4 * std::size_t{rank};
  const std::uint32_t expected_magic = 0x0800u | rank;  // 0x00 0x00, type 0x08 (ubyte), rank
  const std::string what = file_label("IDX file", path);
  if (bytes.size() < 4) {
    throw data_error(what + " is " + std::to_string(bytes.size()) +
                     " bytes long, too short for the 4-byte magic number " + hex32(expected_magic));
  }
  const std::uint32_t magic = big_endian32(bytes.data());
  if (magic != expected_magic) {
    throw data_error(what + " has magic number " + hex32(magic) + ", expected " +
                     hex32(expected_magic) + " (unsigned bytes, " + std::to_string(rank) +
                     " dimensions: " + layout + ")");
  }
  if (bytes.size() < header) {
    throw data_error(what + " is truncated: " + std::to_string(bytes.size()) +
                     " bytes, shorter than its " + std::to_string(header) + "-byte header");
  }
  std::vector<std::size_t> dims(rank);
  for (std::size_t d = 0; d < rank; ++d) dims[d] = big_endian32(bytes.data() + 4 + 4 * d);
  std::string shape;
  for (std::size_t d = 0; d < rank; ++d) shape += (d ? " x " : "") + std::to_string(dims[d]);
  // Three 32-bit dimensions can multiply past 2^64 and wrap to a small count that the size check
  // below would accept (2^22 x 2^21 x 2^21 wraps to 0: a 16-byte file "holding" 4.4e12-pixel
  // images), so the count is checked before anything is sized by it.
  std::size_t payload = 1;
  bool overflow = false;
  for (std::size_t d = 0; d < rank; ++d) overflow = overflow || __builtin_mul_overflow(payload, dims[d], &payload);
  std::size_t total = 0;
  overflow = overflow || __builtin_add_overflow(header, payload, &total);
  if (overflow) {
    throw data_error(what + " has a corrupted header: it promises " + shape + " bytes (" + layout +
                     "), a count that does not fit in 64 bits, but the file has " +
                     std::to_string(bytes.size()) + " bytes; it is not an IDX file or its header is damaged");
  }
  if (bytes.size() != total) {
    throw data_error(what + (bytes.size() < header + payload ? " is truncated" : " is too long") +
                     ": its header promises " + shape + " bytes (" + layout + "), so " +
                     std::to_string(header + payload) + " bytes in all, but it has " +
                     std::to_string(bytes.size()));
  }
  return dims;
}

}  // namespace detail

/// @brief Reads images and labels from two IDX files into a dataset with pixels scaled to [0, 1].
/// @param images an IDX file of unsigned bytes with dimensions (count, rows, columns), plain or
///        gzip-compressed (`.gz` needs meshlib built with zlib).
/// @param labels an IDX file of unsigned bytes with dimension (count).
/// @param classes the number of classes; a label outside [0, classes) is an error. When not given,
///        it is the largest label + 1.
/// @throws meshlib::data_error naming the file and what was expected and found.
[[nodiscard]] inline dataset read_idx(const std::filesystem::path& images,
                                      const std::filesystem::path& labels,
                                      std::optional<std::size_t> classes = std::nullopt) {
  if (classes && *classes == 0) {
    throw data_error("meshlib: read_idx: classes is 0, expected at least 1");
  }
  const std::vector<std::uint8_t> image_bytes = detail::read_bytes("IDX file", images);
  const std::vector<std::size_t> image_dims =
      detail::idx_dims(images, image_bytes, 3, "count, rows, columns");
  const std::vector<std::uint8_t> label_bytes = detail::read_bytes("IDX file", labels);
  const std::vector<std::size_t> label_dims = detail::idx_dims(labels, label_bytes, 1, "count");

  if (image_dims[0] != label_dims[0]) {
    throw data_error("meshlib: IDX files disagree: '" + images.string() + "' holds " +
                     std::to_string(image_dims[0]) + " images but '" + labels.string() +
                     "' holds " + std::to_string(label_dims[0]) + " labels");
  }
  if (image_dims[1] == 0 || image_dims[2] == 0) {
    throw data_error(detail::file_label("IDX file", images) + " has images of " +
                     std::to_string(image_dims[1]) + " x " + std::to_string(image_dims[2]) +
                     " pixels, expected at least 1 x 1");
  }

  dataset ds;
  ds.count = image_dims[0];
  ds.features = image_dims[1] * image_dims[2];
  ds.y.resize(ds.count);
  const std::uint8_t* label_data = label_bytes.data() + 8;
  std::size_t largest = 0;
  for (std::size_t i = 0; i < ds.count; ++i) {
    const std::size_t label = label_data[i];
    if (classes && label >= *classes) {
      throw data_error(detail::file_label("IDX file", labels) + ": label " +
                       std::to_string(label) + " at index " + std::to_string(i) +
                       " is out of range, expected 0.." + std::to_string(*classes - 1) + " (" +
                       std::to_string(*classes) + " classes)");
    }
    largest = label > largest ? label : largest;
    ds.y[i] = static_cast<std::int32_t>(label);
  }
  ds.classes = classes ? *classes : (ds.count ? largest + 1 : 0);

  const std::uint8_t* pixels = image_bytes.data() + 16;
  ds.x.resize(ds.count * ds.features);
  // Divided, not multiplied by 1/255: p / 255.0f is the correctly rounded value a user expects.
  for (std::size_t i = 0; i < ds.x.size(); ++i) ds.x[i] = static_cast<float>(pixels[i]) / 255.0f;
  return ds;
}

}  // namespace meshlib::nn

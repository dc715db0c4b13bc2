// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Small IDX files written by hand for the data tests: good ones, and each kind of damage.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#if defined(MESHLIB_ENABLE_ZLIB)
#include <zlib.h>
#endif

namespace meshlib_test {

/// A fresh directory under the system's temporary directory, removed with everything in it.
class temp_dir {
 public:
  explicit temp_dir(const std::string& tag) {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("meshlib_" + tag + "_" + std::to_string(::getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~temp_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  [[nodiscard]] std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

using bytes = std::vector<std::uint8_t>;

inline void put32(bytes& b, std::uint32_t v) {
  b.push_back(static_cast<std::uint8_t>(v >> 24));
  b.push_back(static_cast<std::uint8_t>(v >> 16));
  b.push_back(static_cast<std::uint8_t>(v >> 8));
  b.push_back(static_cast<std::uint8_t>(v));
}

/// The pixel (r, c) of image i in the test images: 7 times its position in the file, mod 256, so
/// 256 pixels or more hold every value 0..255 (0 first, 255 at position 73).
inline std::uint8_t test_pixel(std::size_t i, std::size_t r, std::size_t c, std::size_t rows, std::size_t cols) {
  return static_cast<std::uint8_t>(((i * rows + r) * cols + c) * 7 % 256);
}

inline bytes idx_images(std::size_t count, std::size_t rows, std::size_t cols) {
  bytes b;
  put32(b, 0x00000803);
  put32(b, static_cast<std::uint32_t>(count));
  put32(b, static_cast<std::uint32_t>(rows));
  put32(b, static_cast<std::uint32_t>(cols));
  for (std::size_t i = 0; i < count; ++i)
    for (std::size_t r = 0; r < rows; ++r)
      for (std::size_t c = 0; c < cols; ++c) b.push_back(test_pixel(i, r, c, rows, cols));
  return b;
}

inline bytes idx_labels(const std::vector<std::uint8_t>& labels) {
  bytes b;
  put32(b, 0x00000801);
  put32(b, static_cast<std::uint32_t>(labels.size()));
  b.insert(b.end(), labels.begin(), labels.end());
  return b;
}

inline void write_file(const std::filesystem::path& path, const bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

#if defined(MESHLIB_ENABLE_ZLIB)
/// The gzip-compressed bytes of `b` (written through zlib's gz interface to a scratch file).
inline bytes gzip(const bytes& b, const std::filesystem::path& scratch) {
  gzFile f = gzopen(scratch.c_str(), "wb");
  gzwrite(f, b.data(), static_cast<unsigned>(b.size()));
  gzclose(f);
  std::ifstream in(scratch, std::ios::binary);
  bytes out((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::filesystem::remove(scratch);
  return out;
}
#endif

}  // namespace meshlib_test

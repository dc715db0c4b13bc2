// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Reads a whole data file into memory, gunzipping it on the fly when it is gzip-compressed
/// (Debian's dataset-fashion-mnist ships `.gz` files) and meshlib was built with zlib.

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#if defined(MESHLIB_ENABLE_ZLIB)
#include <zlib.h>
#endif

#include "meshlib/nn/data/errors.hpp"

namespace meshlib::nn::detail {

/// "meshlib: <what> '<path>'": the start of every message about one file.
inline std::string file_label(const char* what, const std::filesystem::path& path) {
  return std::string("meshlib: ") + what + " '" + path.string() + "'";
}

inline void check_readable(const char* what, const std::filesystem::path& path) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    throw data_error(file_label(what, path) + " does not exist");
  }
  if (std::filesystem::is_directory(status)) {
    throw data_error(file_label(what, path) + " is a directory, expected a file");
  }
}

inline bool starts_with_gzip_magic(const std::vector<std::uint8_t>& bytes) {
  return bytes.size() >= 2 && bytes[0] == 0x1f && bytes[1] == 0x8b;
}

/// The bytes of `path`, decompressed when it is a gzip file. Throws data_error naming the file when
/// it is missing, unreadable, or a damaged gzip stream; `what` says what the file is for
/// ("IDX file").
inline std::vector<std::uint8_t> read_bytes(const char* what, const std::filesystem::path& path) {
  check_readable(what, path);
  std::vector<std::uint8_t> bytes;
#if defined(MESHLIB_ENABLE_ZLIB)
  // gzread reads a file that is not gzip-compressed as it is, so one path serves both.
  gzFile file = gzopen(path.c_str(), "rb");
  if (file == nullptr) {
    throw data_error(file_label(what, path) + " cannot be opened: " + std::strerror(errno));
  }
  gzbuffer(file, 1u << 17);
  constexpr std::size_t chunk = std::size_t{1} << 22;
  for (;;) {
    const std::size_t old = bytes.size();
    bytes.resize(old + chunk);
    const int got = gzread(file, bytes.data() + old, static_cast<unsigned>(chunk));
    if (got < 0) {
      int code = 0;
      const std::string message = gzerror(file, &code);
      gzclose(file);
      throw data_error(file_label(what, path) + " is not a valid gzip file: " + message);
    }
    bytes.resize(old + static_cast<std::size_t>(got));
    if (static_cast<std::size_t>(got) < chunk) break;
  }
  int code = Z_OK;
  const std::string message = gzerror(file, &code);
  gzclose(file);
  // Z_BUF_ERROR at the end: the compressed stream stopped before its end marker.
  if (code == Z_BUF_ERROR) {
    throw data_error(file_label(what, path) +
                     " is a truncated gzip file (the compressed stream ends early after " +
                     std::to_string(bytes.size()) + " bytes)");
  }
  if (code != Z_OK) {
    throw data_error(file_label(what, path) + " is not a valid gzip file: " + message);
  }
#else
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw data_error(file_label(what, path) + " cannot be opened: " + std::strerror(errno));
  }
  bytes.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (starts_with_gzip_magic(bytes)) {
    throw data_error(file_label(what, path) +
                     " is gzip-compressed, but this meshlib was built without zlib; decompress it "
                     "(gunzip) or rebuild with zlib (Debian: zlib1g-dev)");
  }
#endif
  return bytes;
}

}  // namespace meshlib::nn::detail

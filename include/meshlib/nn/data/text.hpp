// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Plain text for byte-level language models: a file, or a directory's text files in name
/// order, read into one byte string (`load_text`), and the held-out tail that validation reads
/// (`split_text`), as nanoGPT's character models cut their corpus.
///
/// A byte-level vocabulary (256 values) needs no tokenizer and no vocabulary file, and reads any
/// text (UTF-8 included) without an unknown token; it is what a character model over a corpus with
/// non-ASCII bytes amounts to.
/// @code
/// auto corpus = meshlib::nn::load_text("/usr/share/games/fortunes");   // Debian's fortunes
/// auto [train, validation] = meshlib::nn::split_text(corpus, 0.1);     // the last 10% held out
/// @endcode

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <span>
#include <string>
#include <system_error>
#include <vector>

#include "meshlib/nn/data/errors.hpp"

namespace meshlib::nn {

/// @brief A text corpus in memory: the bytes of every file read, concatenated in `files` order.
struct text_corpus {
  std::vector<std::uint8_t> bytes{};            ///< the text, one byte per token
  std::vector<std::filesystem::path> files{};  ///< the files read, in order
};

/// @brief The training part and the held-out tail of a corpus (views into it).
struct text_split {
  std::span<const std::uint8_t> train;       ///< the first part
  std::span<const std::uint8_t> validation;  ///< the held-out tail
};

namespace detail {
/// Whether a directory entry is read as text: a regular file (or a link to one) whose name has no
/// extension. In Debian's fortunes directory that keeps the text files and skips their `.dat`
/// indexes and the `.u8` links to the same text (read once, not twice).
inline bool is_text_entry(const std::filesystem::directory_entry& e) {
  std::error_code ec;
  const auto name = e.path().filename().string();
  return e.is_regular_file(ec) && !name.empty() && name[0] != '.' && name.find('.') == std::string::npos;
}

inline void append_file(const std::filesystem::path& p, std::vector<std::uint8_t>& out) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw data_error("meshlib::nn::load_text: cannot open " + p.string() + " for reading");
  out.insert(out.end(), std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  if (in.bad()) throw data_error("meshlib::nn::load_text: reading " + p.string() + " failed");
}
}  // namespace detail

/// @brief Reads `path`: a file, or every file without an extension directly in a directory, in
/// name order (see `detail::is_text_entry`), concatenated.
/// @throws data_error naming the path when it does not exist, cannot be read, holds no such file,
/// or the text is empty; for a missing path the message says how to get Debian's `fortunes`.
inline text_corpus load_text(const std::filesystem::path& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  text_corpus c;
  if (!fs::exists(path, ec))
    throw data_error("meshlib::nn::load_text: " + path.string() +
                     " does not exist; give a text file or a directory of text files (Debian's fortunes: "
                     "apt-get install fortunes, text under /usr/share/games/fortunes; scripts/install_deps.sh installs it)");
  if (fs::is_directory(path, ec)) {
    for (const auto& e : fs::directory_iterator(path, ec))
      if (detail::is_text_entry(e)) c.files.push_back(e.path());
    if (ec) throw data_error("meshlib::nn::load_text: cannot list " + path.string() + ": " + ec.message());
    std::sort(c.files.begin(), c.files.end());
    if (c.files.empty())
      throw data_error("meshlib::nn::load_text: " + path.string() +
                       " holds no text file (a regular file whose name has no extension); give a file or such a directory");
  } else {
    c.files.push_back(path);
  }
  for (const auto& f : c.files) detail::append_file(f, c.bytes);
  if (c.bytes.empty()) throw data_error("meshlib::nn::load_text: " + path.string() + " holds no text (0 bytes)");
  return c;
}

/// @brief Splits `c` into its first part and its last `holdout` fraction (rounded down to a byte).
/// @throws data_error when `holdout` is outside (0, 1) or either part is shorter than `min_bytes`
/// (what one window of a model's context needs: context + 1).
inline text_split split_text(const text_corpus& c, double holdout = 0.1, std::size_t min_bytes = 2) {
  if (!(holdout > 0.0 && holdout < 1.0))
    throw data_error("meshlib::nn::split_text: holdout " + std::to_string(holdout) +
                     " is not a fraction in (0, 1); 0.1 holds out the last 10%");
  const std::size_t n = c.bytes.size();
  const auto held = static_cast<std::size_t>(static_cast<double>(n) * holdout);
  if (held < min_bytes || n - held < min_bytes)
    throw data_error("meshlib::nn::split_text: " + std::to_string(n) + " bytes split " + std::to_string(n - held) +
                     " / " + std::to_string(held) + " leaves a part shorter than " + std::to_string(min_bytes) +
                     " bytes (one window: context + 1); give more text or a shorter context");
  const std::span<const std::uint8_t> all(c.bytes);
  return {all.first(n - held), all.last(held)};
}

}  // namespace meshlib::nn

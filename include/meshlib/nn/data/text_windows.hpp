// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Batches for next-token training on a byte string: `rows` windows of `context + 1` bytes,
/// inputs the first `context`, targets the same shifted by one (token `t + 1` is the label of
/// position `t`). Training windows start at random offsets drawn from a key (nanoGPT's `get_batch`,
/// made reproducible and independent of the mesh: window `r` of step `s` depends only on the key,
/// `s` and `r`); evaluation windows tile the text in order.
/// @code
/// auto b = meshlib::nn::sample_windows(split.train, 32, 64, key.fold_in(step));   // 32 x 64 tokens
/// b.inputs[r * 64 + t];   // byte t of window r; b.targets[r * 64 + t] is the byte after it
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshlib/nn/data/errors.hpp"
#include "meshlib/nn/random.hpp"

namespace meshlib::nn {

/// @brief `rows` windows of `context` token ids and their next-token targets, row-major.
struct token_batch {
  std::size_t rows = 0;                 ///< windows
  std::size_t context = 0;              ///< tokens per window
  std::vector<std::int32_t> inputs{};   ///< rows * context ids (bytes: 0..255)
  std::vector<std::int32_t> targets{};  ///< rows * context ids: each input's next byte
};

namespace detail {
inline void require_windows(std::span<const std::uint8_t> text, std::size_t rows, std::size_t context,
                            const char* who) {
  if (rows == 0 || context == 0)
    throw data_error(std::string("meshlib::nn::") + who + ": rows and context must be positive (rows " +
                     std::to_string(rows) + ", context " + std::to_string(context) + ")");
  if (text.size() < context + 1)
    throw data_error(std::string("meshlib::nn::") + who + ": a window needs context + 1 = " +
                     std::to_string(context + 1) + " bytes, the text has " + std::to_string(text.size()) +
                     "; give more text or a shorter context");
}

inline void copy_window(std::span<const std::uint8_t> text, std::size_t start, std::size_t r, token_batch& b) {
  for (std::size_t t = 0; t < b.context; ++t) {
    b.inputs[r * b.context + t] = text[start + t];
    b.targets[r * b.context + t] = text[start + t + 1];
  }
}
}  // namespace detail

/// @brief `rows` windows at random starts in `[0, size - context - 1]`, window `r`'s start drawn from
/// `key` and `r` alone (pass `key.fold_in(step)` for a new batch each step).
/// @throws data_error when `rows` or `context` is 0, or the text is shorter than `context + 1`.
inline token_batch sample_windows(std::span<const std::uint8_t> text, std::size_t rows, std::size_t context,
                                  rng_key key) {
  detail::require_windows(text, rows, context, "sample_windows");
  token_batch b{rows, context, std::vector<std::int32_t>(rows * context), std::vector<std::int32_t>(rows * context)};
  const std::uint64_t starts = text.size() - context;  // start s reads s .. s + context
  for (std::size_t r = 0; r < rows; ++r) {
    // Two 24-bit draws give 48 bits, so every start of a text up to 2^48 bytes can come up; the
    // modulo bias is below 2^-24 for texts under 2^24 bytes and small beyond.
    const auto hi = static_cast<std::uint64_t>(uniform(key, 2 * r) * 16777216.0f);
    const auto lo = static_cast<std::uint64_t>(uniform(key, 2 * r + 1) * 16777216.0f);
    detail::copy_window(text, static_cast<std::size_t>(((hi << 24) | lo) % starts), r, b);
  }
  return b;
}

/// @brief Windows `first` to `first + rows - 1` of the text cut into consecutive windows of
/// `context` targets (window `w` reads bytes `w * context` to `(w + 1) * context`): evaluation over
/// the whole text in order. `count_windows` says how many there are.
/// @throws data_error when the text is shorter than `context + 1` or the windows run past its end.
inline token_batch tile_windows(std::span<const std::uint8_t> text, std::size_t context, std::size_t first,
                                std::size_t rows) {
  detail::require_windows(text, rows, context, "tile_windows");
  const std::size_t total = (text.size() - 1) / context;
  if (first + rows > total)
    throw data_error("meshlib::nn::tile_windows: windows " + std::to_string(first) + " .. " +
                     std::to_string(first + rows - 1) + " asked, the text has " + std::to_string(total) +
                     " windows of " + std::to_string(context) + " tokens");
  token_batch b{rows, context, std::vector<std::int32_t>(rows * context), std::vector<std::int32_t>(rows * context)};
  for (std::size_t r = 0; r < rows; ++r) detail::copy_window(text, (first + r) * context, r, b);
  return b;
}

/// The number of whole evaluation windows of `context` tokens in `text` (see `tile_windows`).
inline std::size_t count_windows(std::span<const std::uint8_t> text, std::size_t context) noexcept {
  return context == 0 || text.size() < 2 ? 0 : (text.size() - 1) / context;
}

}  // namespace meshlib::nn

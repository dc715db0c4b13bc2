// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// What the flagships' command lines share (train_fashion_mnist, train_resnet_fashion_mnist,
// train_gpt_chars): the usage error (argparse's exit status 2) and the parsers of numbers and mesh
// shapes, written once so that all of them accept and refuse the same spellings with the same messages.

#include <cmath>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>

namespace flagship {

/// A mistake in the options: main prints the usage line and the message before anything is
/// loaded, and exits with status 2.
struct usage_error : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// `v` as a whole non-negative integer (no sign, no trailing characters, no overflow), else nothing.
inline std::optional<std::size_t> whole_number(const std::string& v) {
  std::size_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size()) return std::nullopt;
  return n;
}

/// The value of `option` as a positive integer.
inline std::size_t positive_integer(const std::string& option, const std::string& v) {
  const auto n = whole_number(v);
  if (!n || *n == 0) throw usage_error(option + " wants a positive integer, not '" + v + "'");
  return *n;
}

/// The value of `option` as a finite positive number (`--lr`).
inline float positive_number(const std::string& option, const std::string& v) {
  float r = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), r);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size() || !std::isfinite(r) || r <= 0)
    throw usage_error(option + " wants a positive number, not '" + v + "'");
  return r;
}

/// The value of `option` as a non-negative 64-bit integer (`--seed`).
inline std::uint64_t seed_number(const std::string& option, const std::string& v) {
  std::uint64_t n = 0;
  const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
  if (v.empty() || ec != std::errc() || end != v.data() + v.size())
    throw usage_error(option + " wants a non-negative integer, not '" + v + "'");
  return n;
}

/// "DxM": two positive integers around one 'x' ("4x", "2x2x2" and "x4" are refused); `example`
/// is the shape the message suggests (the program's default).
inline std::pair<std::size_t, std::size_t> mesh_shape(const std::string& v, const char* example) {
  const auto x = v.find('x');
  const auto d = x == std::string::npos ? std::nullopt : whole_number(v.substr(0, x));
  const auto m = x == std::string::npos ? std::nullopt : whole_number(v.substr(x + 1));
  if (!d || !m || *d == 0 || *m == 0)
    throw usage_error("--mesh wants DxM, two positive integers (data x model devices) such as " + std::string(example) +
                      ", not '" + v + "'");
  if (*d > std::numeric_limits<std::size_t>::max() / *m) throw usage_error("--mesh " + v + " has too many devices");
  return {*d, *m};
}

}  // namespace flagship

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Products of sizes that cannot wrap: the element count of a shape, the device count of a
/// mesh, a byte count. Each throws a `meshlib::error` subtype naming what overflowed, instead of
/// wrapping to a small number that passes a later size check and writes past a buffer.
/// @code
/// meshlib::experimental::checked_mul(a, b, "the byte count");  // throws sharding_error on overflow
/// @endcode

#include <array>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>

#include "meshlib/core/errors.hpp"

namespace meshlib::core::detail {

/// A size that came from a negative signed value (e.g. `mesh{-1}`, `size_t(-8)`) reads as a number
/// near 2^64; anything above 2^62 is refused as certainly not a real size.
inline constexpr std::size_t max_sane_size = std::size_t{1} << 62;

/// `a * b`, or throws `sharding_error` saying that `what` overflows.
inline std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw sharding_error("meshlib: " + std::string(what) + " overflows: " + std::to_string(a) + " x " + std::to_string(b) +
                         " does not fit in 64 bits");
  return r;
}

/// The product of `sizes`; throws `sharding_error` naming `what`, the dimension and its value when a
/// size looks negative (above `max_sane_size`) or the product overflows. Builds no string unless it
/// throws: it runs on every size query.
inline std::size_t checked_product(std::span<const std::size_t> sizes, std::string_view what) {
  const auto where = [&] {
    std::string s = "meshlib: " + std::string(what) + " (";
    for (std::size_t d = 0; d < sizes.size(); ++d) s += (d ? ", " : "") + std::to_string(sizes[d]);
    return s + (sizes.size() == 1 ? ",)" : ")");
  };
  std::size_t n = 1;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > max_sane_size)
      throw sharding_error(where() + ": dimension " + std::to_string(d) + " has size " + std::to_string(sizes[d]) +
                           " (" + std::to_string(static_cast<long long>(sizes[d])) +
                           " as a signed number), larger than 2^62: a negative or overflowed size?");
    if (__builtin_mul_overflow(n, sizes[d], &n))
      throw sharding_error(where() + ": the element count overflows at dimension " + std::to_string(d) + " (size " +
                           std::to_string(sizes[d]) + "): it does not fit in 64 bits");
  }
  return n;
}

/// `checked_product` of a shape array.
template <std::size_t Rank>
std::size_t checked_product(const std::array<std::size_t, Rank>& shape, std::string_view what) {
  return checked_product(std::span<const std::size_t>(shape.data(), Rank), what);
}

/// The byte count of `count` elements of `T`, checked.
template <class T>
std::size_t checked_bytes(std::size_t count, std::string_view what) {
  return checked_mul(count, sizeof(T), what);
}

}  // namespace meshlib::core::detail

namespace meshlib::experimental {
/// The byte size of `n` elements of `T`, throwing `sharding_error` on overflow.
using core::detail::checked_bytes;

/// The product of a shape's extents, throwing `sharding_error` on overflow.
using core::detail::checked_product;

/// `a * b`, throwing `sharding_error` (naming `what`) when the product overflows `std::size_t`.
using core::detail::checked_mul;
}  // namespace meshlib::experimental

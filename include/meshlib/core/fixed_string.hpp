// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `fixed_string`: a string usable as a C++20 class-type template parameter, so that mesh
/// axis names (`axis<"data">`) are part of a type and checked by the compiler.

#include <algorithm>
#include <cstddef>
#include <ostream>
#include <string_view>

namespace meshlib {

/// @brief A compile-time string literal: `fixed_string{"data"}`.
/// @tparam N the size of the literal including its terminating zero.
template <std::size_t N>
struct fixed_string {
  /// The characters, with the terminating NUL.
  char chars[N] = {};

  constexpr fixed_string() = default;
  /// Copies a string literal; implicit, so `axis<"data">` works.
  constexpr fixed_string(const char (&s)[N]) noexcept { std::copy_n(s, N, chars); }

  /// The characters without the NUL.
  [[nodiscard]] constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
  /// The number of characters, NUL excluded.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return N - 1; }
  /// True for `""`.
  [[nodiscard]] constexpr bool empty() const noexcept { return N == 1; }
  /// Converts to `view()`, so a name compares with and passes as a `std::string_view`.
  constexpr operator std::string_view() const noexcept { return view(); }

  /// Equal when the characters are equal; strings of different lengths compare unequal.
  template <std::size_t M>
  [[nodiscard]] friend constexpr bool operator==(const fixed_string& a, const fixed_string<M>& b) noexcept {
    return a.view() == b.view();
  }

  /// Prints the characters.
  friend std::ostream& operator<<(std::ostream& os, const fixed_string& s) { return os << s.view(); }
};

/// @brief Deduces the size from the literal: `fixed_string{"data"}` is a `fixed_string<5>`.
template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N>;

}  // namespace meshlib

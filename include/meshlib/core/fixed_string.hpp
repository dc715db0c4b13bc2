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
  char chars[N] = {};

  constexpr fixed_string() = default;
  constexpr fixed_string(const char (&s)[N]) noexcept { std::copy_n(s, N, chars); }

  [[nodiscard]] constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
  [[nodiscard]] constexpr std::size_t size() const noexcept { return N - 1; }
  [[nodiscard]] constexpr bool empty() const noexcept { return N == 1; }
  constexpr operator std::string_view() const noexcept { return view(); }

  template <std::size_t M>
  [[nodiscard]] friend constexpr bool operator==(const fixed_string& a, const fixed_string<M>& b) noexcept {
    return a.view() == b.view();
  }

  friend std::ostream& operator<<(std::ostream& os, const fixed_string& s) { return os << s.view(); }
};

/// @brief Deduces the size from the literal: `fixed_string{"data"}` is a `fixed_string<5>`.
template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N>;

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `number_text`: a number in a message as a user would write it (`1e-4`, `0.9`, `0.01`),
/// not as `std::to_string` prints it (`0.000100`, `0.900000`): the shortest text that reads back as
/// the same value (`std::to_chars`), with the exponent's leading zeros and `+` dropped. Locale
/// independent, as every message is.

#include <charconv>
#include <string>

namespace meshlib::nn::detail {

/// `v` as the shortest decimal text that reads back as `v` (fixed or scientific, whichever is
/// shorter): `number_text(1e-4f) == "1e-4"`, `number_text(0.01f) == "0.01"`, `number_text(3.0f) == "3"`,
/// `number_text(2.5e10) == "2.5e10"`. With `significant` > 0, rounded to that many significant digits
/// first (`number_text(0.30000000004, 6) == "0.3"`): for values that carry noise, such as a finite
/// difference, where the digits past the sixth say nothing to a reader.
template <class T>
std::string number_text(T v, int significant = 0) {
  char buf[64];
  const auto r = significant > 0 ? std::to_chars(buf, buf + sizeof buf, v, std::chars_format::general, significant)
                                 : std::to_chars(buf, buf + sizeof buf, v);
  std::string s(buf, r.ptr);
  const auto e = s.find('e');
  if (e == std::string::npos) return s;
  std::string exp = s.substr(e + 1);
  const bool negative = !exp.empty() && exp.front() == '-';
  if (!exp.empty() && (exp.front() == '-' || exp.front() == '+')) exp.erase(0, 1);
  while (exp.size() > 1 && exp.front() == '0') exp.erase(0, 1);
  return s.substr(0, e + 1) + (negative ? "-" : "") + exp;
}

}  // namespace meshlib::nn::detail

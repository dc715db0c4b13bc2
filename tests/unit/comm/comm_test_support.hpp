// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Shared helpers of the comm tests: deterministic inputs, independent reference reductions, and
// bitwise comparison. Catch2 assertions are not thread-safe, so tests collect what each
// participant saw and check it on the main thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/comm.hpp"

namespace comm_test {

using meshlib::bfloat16;
using meshlib::reduce_op;

/// Input element i of rank r: non-integral floats (so that the order of a float sum shows in the
/// bits), small signed integers.
template <class T>
T input(int r, std::size_t i, int salt = 0) {
  if constexpr (std::is_integral_v<T>) {
    return static_cast<T>(static_cast<long long>((r * 31 + static_cast<long long>(i) * 17 + salt * 7) % 11) - 5);
  } else {
    const double v = (r + 1) * 0.37 + static_cast<double>(i % 97) * 0.011 - 0.5 + salt * 0.013;
    if constexpr (std::is_same_v<T, bfloat16>) return bfloat16(static_cast<float>(v));
    else return static_cast<T>(v);
  }
}

template <class T>
std::vector<T> inputs(int r, std::size_t count, int salt = 0) {
  std::vector<T> v(count);
  for (std::size_t i = 0; i < count; ++i) v[i] = input<T>(r, i, salt);
  return v;
}

/// The reference reduction, written from the documented semantics: rank order, float
/// accumulation for bfloat16, wrap-around for integers, mean = sum / n.
template <class T>
T reference(reduce_op op, int n, std::size_t i, int salt = 0, int index_offset = 0) {
  const std::size_t at = i + static_cast<std::size_t>(index_offset);
  if constexpr (std::is_integral_v<T>) {
    using U = std::make_unsigned_t<T>;
    U acc = static_cast<U>(input<T>(0, at, salt));
    for (int r = 1; r < n; ++r) {
      const T x = input<T>(r, at, salt);
      switch (op) {
        case reduce_op::sum:
        case reduce_op::mean: acc = static_cast<U>(acc + static_cast<U>(x)); break;
        case reduce_op::prod: acc = static_cast<U>(acc * static_cast<U>(x)); break;
        case reduce_op::min: acc = x < static_cast<T>(acc) ? static_cast<U>(x) : acc; break;
        case reduce_op::max: acc = x > static_cast<T>(acc) ? static_cast<U>(x) : acc; break;
      }
    }
    if (op == reduce_op::mean) return static_cast<T>(static_cast<T>(acc) / static_cast<T>(n));
    return static_cast<T>(acc);
  } else {
    using A = std::conditional_t<std::is_same_v<T, bfloat16>, float, T>;
    A acc = static_cast<A>(input<T>(0, at, salt));
    for (int r = 1; r < n; ++r) {
      const A x = static_cast<A>(input<T>(r, at, salt));
      switch (op) {
        case reduce_op::sum:
        case reduce_op::mean: acc = acc + x; break;
        case reduce_op::prod: acc = acc * x; break;
        case reduce_op::min: acc = x < acc ? x : acc; break;
        case reduce_op::max: acc = acc < x ? x : acc; break;
      }
    }
    if (op == reduce_op::mean) acc = acc / static_cast<A>(n);
    return static_cast<T>(acc);
  }
}

template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

/// What a participant's exception said, for checks on the main thread.
struct caught {
  std::string type;  // "aborted", "timeout", "mismatch", "argument", "other", or "" for none
  std::string what;
  double seconds = 0;
};

inline caught classify(const std::exception_ptr& e) {
  caught c;
  if (!e) return c;
  try {
    std::rethrow_exception(e);
  } catch (const meshlib::comm_aborted& x) {
    c = {"aborted", x.what()};
  } catch (const meshlib::comm_timeout& x) {
    c = {"timeout", x.what()};
  } catch (const meshlib::collective_mismatch& x) {
    c = {"mismatch", x.what()};
  } catch (const meshlib::comm_argument_error& x) {
    c = {"argument", x.what()};
  } catch (const std::exception& x) {
    c = {"other", x.what()};
  }
  return c;
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

inline meshlib::thread_comm_options options_with_timeout(double seconds) {
  meshlib::thread_comm_options o;
  o.timeout = std::chrono::nanoseconds(static_cast<long long>(seconds * 1e9));
  return o;
}

}  // namespace comm_test

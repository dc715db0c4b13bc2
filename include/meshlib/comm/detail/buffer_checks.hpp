// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The buffer checks every backend runs before any data moves, so that a wrong call reads
/// the same on the thread, MPI and hybrid communicators.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace meshlib::comm::detail {

/// Whether the byte ranges `[a, a + an)` and `[b, b + bn)` share a byte; an empty range overlaps
/// nothing.
inline bool buffers_overlap(const void* a, std::size_t an, const void* b, std::size_t bn) noexcept {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return an != 0 && bn != 0 && pa < pb + bn && pb < pa + an;
}

/// What is wrong with the buffers of an out-of-place call that writes `needed` elements to `recv`,
/// or an empty string when nothing is.
template <class T>
std::string out_of_place_problem(std::span<const T> send, std::span<T> recv, std::size_t needed) {
  if (recv.size() < needed)
    return "receive buffer holds " + std::to_string(recv.size()) + " elements but " + std::to_string(needed) +
           " are needed";
  if (buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
    return "the send and receive buffers overlap; use the in-place form (one buffer) instead";
  return {};
}

}  // namespace meshlib::comm::detail

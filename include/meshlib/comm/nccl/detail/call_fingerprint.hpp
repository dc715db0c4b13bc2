// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A collective call packed into one int64, so that a device communicator can compare every
/// participant's call with one tiny all-gather on its stream (NCCL has no other channel), and say
/// in the `collective_mismatch` message what each participant called (in the words every backend
/// uses, call_text.hpp).
///
/// Layout (low to high bits): operation 5, element type 4 (15: none), reduce op 3 (7: none),
/// root 16 (65535: none), count 36. Counts of 2^36 elements or more are compared modulo 2^36.

#if MESHLIB_ENABLE_NCCL

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::detail {

struct call_fingerprint {
  op_kind op = op_kind::barrier;
  int type = -1;     ///< datatype, or -1
  int reduce = -1;   ///< reduce_op, or -1
  int root = -1;     ///< or -1
  std::uint64_t count = 0;

  [[nodiscard]] std::int64_t pack() const noexcept {
    const std::uint64_t t = type < 0 ? 15u : static_cast<std::uint64_t>(type);
    const std::uint64_t r = reduce < 0 ? 7u : static_cast<std::uint64_t>(reduce);
    const std::uint64_t o = root < 0 ? 65535u : static_cast<std::uint64_t>(root) & 0xffffu;
    const std::uint64_t bits = static_cast<std::uint64_t>(op) | (t << 5) | (r << 9) | (o << 12) |
                               ((count & ((std::uint64_t{1} << 36) - 1)) << 28);
    return static_cast<std::int64_t>(bits);
  }
  [[nodiscard]] static call_fingerprint unpack(std::int64_t packed) noexcept {
    const auto bits = static_cast<std::uint64_t>(packed);
    call_fingerprint f;
    f.op = static_cast<op_kind>(bits & 31u);
    const auto t = static_cast<int>((bits >> 5) & 15u);
    const auto r = static_cast<int>((bits >> 9) & 7u);
    const auto o = static_cast<int>((bits >> 12) & 0xffffu);
    f.type = t == 15 ? -1 : t;
    f.reduce = r == 7 ? -1 : r;
    f.root = o == 65535 ? -1 : o;
    f.count = bits >> 28;
    return f;
  }
  /// What a mismatch message shows of the call (`describe_call`): "all_reduce(float32, count 8,
  /// op sum)", "broadcast(int64, count 3, root 1)", "barrier()". An element type without a
  /// `datatype` (14: CUDA's own 16-bit types) shows as "-"; the fingerprint keeps no ppermute pairs.
  [[nodiscard]] call_summary summary() const noexcept {
    call_summary c;
    c.kind = op;
    if (type >= 0 && type <= static_cast<int>(datatype::bfloat16)) c.dtype = static_cast<datatype>(type);
    c.count = count;
    if (reduce >= 0) c.op = static_cast<reduce_op>(reduce);
    c.root = root;
    return c;
  }
};

/// The `collective_mismatch` message for the gathered fingerprints (one per rank), or empty when
/// they agree.
[[nodiscard]] inline std::string mismatch_message(std::string_view seen_by, std::span<const std::int64_t> all) {
  bool agree = true;
  for (std::int64_t f : all) agree = agree && f == all[0];
  if (agree) return {};
  std::string m = "meshlib: collective mismatch (seen by " + std::string(seen_by) + "):";
  for (std::size_t r = 0; r < all.size(); ++r)
    m += " rank " + std::to_string(r) + " called " + describe_call(call_fingerprint::unpack(all[r]).summary()) +
         (r + 1 < all.size() ? ";" : "");
  return m;
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_NCCL

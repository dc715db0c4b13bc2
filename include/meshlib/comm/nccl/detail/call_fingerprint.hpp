// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief A collective call packed into one int64, so that a device communicator can compare every
/// participant's calls with one small all-gather on its stream (NCCL has no other channel), a batch
/// of calls at a time (`call_batch`), and say in the `collective_mismatch` message which call
/// differed and what each participant called (in the words every backend uses, call_text.hpp).
///
/// Layout (low to high bits): operation 5, element type 4 (15: none), reduce op 3 (7: none),
/// root 16 (65535: none), count 36. Counts of 2^36 elements or more are compared modulo 2^36.

#if MESHLIB_ENABLE_NCCL

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

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
/// they agree. `call` > 0: the number of the collective on its communicator (1 for the first),
/// which the message names, so that a batched check points at the exact call.
[[nodiscard]] inline std::string mismatch_message(std::string_view seen_by, std::span<const std::int64_t> all,
                                                  std::uint64_t call = 0) {
  bool agree = true;
  for (std::int64_t f : all) agree = agree && f == all[0];
  if (agree) return {};
  std::string m = "meshlib: collective mismatch" +
                  (call > 0 ? " in collective " + std::to_string(call) + " on this communicator" : std::string()) +
                  " (seen by " + std::string(seen_by) + "):";
  for (std::size_t r = 0; r < all.size(); ++r)
    m += " rank " + std::to_string(r) + " called " + describe_call(call_fingerprint::unpack(all[r]).summary()) +
         (r + 1 < all.size() ? ";" : "");
  return m;
}

/// The message of the first call of a gathered batch on which the ranks disagree, or empty.
/// `all` holds every rank's `per` fingerprints, rank after rank (what an all-gather of each rank's
/// batch gives); `first_call` is the number of the batch's first collective.
[[nodiscard]] inline std::string batch_mismatch_message(std::string_view seen_by, std::uint64_t first_call,
                                                        std::size_t per, std::span<const std::int64_t> all) {
  if (per == 0) return {};
  const std::size_t ranks = all.size() / per;
  std::vector<std::int64_t> column(ranks);
  for (std::size_t j = 0; j < per; ++j) {
    for (std::size_t r = 0; r < ranks; ++r) column[r] = all[r * per + j];
    if (std::string m = mismatch_message(seen_by, column, first_call + j); !m.empty()) return m;
  }
  return {};
}

/// @brief When a device communicator checks its calls: the fingerprints of the collectives made
/// since the last check, and the schedule. Each of the first `each_first` collectives is checked
/// on its own, before its data moves (a program's first step, where most shape bugs show, and
/// where a disagreement on a count would otherwise hang NCCL); after that the calls are exchanged
/// `every` at a time, the last one's before its data moves, so the check's cost (a small
/// all-gather and two copies on the stream, several microseconds) is paid once per `every` calls.
/// The schedule depends only on the number of calls, so every rank exchanges at the same calls
/// (as NCCL needs: an all-gather on one rank against a data collective on another would hang).
/// A disagreement among the batched calls is named exactly (the call's number and every rank's
/// call); one that hangs NCCL before its batch is exchanged ends in the timeout, whose message
/// lists the calls this rank made since its last check (`describe_pending`).
class call_batch {
 public:
  /// Checks each of the first `each_first` calls, then every `every` calls (at least 1).
  explicit call_batch(std::size_t every = 1, std::size_t each_first = 0)
      : every_(every < 1 ? 1 : every), each_first_(each_first) {
    pending_.reserve(every_);  // no allocation on the per-call path
  }
  /// Records the fingerprint of the next collective; true when the calls since the last exchange
  /// (`pending()`) must be exchanged now, before this call's data moves (then `clear()`).
  bool add(std::int64_t fingerprint) {
    pending_.push_back(fingerprint);
    ++calls_;
    return calls_ <= each_first_ || pending_.size() >= every_;
  }
  /// The fingerprints recorded since the last exchange, oldest first.
  [[nodiscard]] std::span<const std::int64_t> pending() const noexcept { return pending_; }
  /// The number of the oldest pending call (1 for a communicator's first collective).
  [[nodiscard]] std::uint64_t first_pending() const noexcept { return calls_ - pending_.size() + 1; }
  /// Collectives recorded so far.
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }
  /// The largest batch: what a check slot must hold per rank.
  [[nodiscard]] std::size_t every() const noexcept { return every_; }
  /// After an exchange.
  void clear() noexcept { pending_.clear(); }
  /// "; the collectives this rank made since its last mismatch check: 37 all_reduce(float32,
  /// count 8, op sum), 38 barrier()" (empty when none): what a timeout adds, so that each rank's
  /// message shows what it called where the ranks may have disagreed.
  [[nodiscard]] std::string describe_pending() const {
    if (pending_.empty()) return {};
    std::string m = "; the collectives this rank made since its last mismatch check:";
    for (std::size_t i = 0; i < pending_.size(); ++i)
      m += (i ? ", " : " ") + std::to_string(first_pending() + i) + " " +
           describe_call(call_fingerprint::unpack(pending_[i]).summary());
    return m;
  }

 private:
  std::size_t every_;
  std::size_t each_first_;
  std::uint64_t calls_ = 0;
  std::vector<std::int64_t> pending_;
};

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_NCCL

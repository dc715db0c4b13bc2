// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How a `collective_mismatch` message shows one participant's call, for every backend:
/// "all_reduce(float32, count 8, op sum)", "reduce(int64, count 3, op max, root 1)",
/// "ppermute(float32, count 4, pairs [(0, 1), (1, 0)])", "split(color 1, key 0)", "barrier()".
/// Each backend records calls in its own format (the thread group's descriptors, the MPI call
/// record, the NCCL fingerprint, the shared-GPU call); it decodes its record into a `call_summary`
/// and asks `describe_call` for the text (and `describe_counts_disagreement` for an all_to_all_v
/// whose counts disagree). One describer, so that the backends cannot drift apart
/// in how they name the same call (they had: "count 4, op sum" on the host, "4 elements, sum" on
/// the devices), and so that one set of expected words (the conformance kit's) fits them all.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

/// One participant's call, as far as its backend's record of the call knows it. Which fields are
/// shown follows from `kind` (`uses_dtype`, `uses_count`, `uses_op`, `uses_root`), so a backend
/// may leave the others at any value; the optional parts are shown only where a backend has them.
struct call_summary {
  op_kind kind = op_kind::barrier;
  /// The element type; empty for an element type without a `datatype` (the device backends'
  /// CUDA 16-bit types), shown as "-".
  std::optional<datatype> dtype;
  std::uint64_t count = 0;       ///< elements per participant, as the concept counts them
  reduce_op op = reduce_op::sum;
  int root = 0;
  /// split: the color and key, where the backend records them.
  std::optional<int> color;
  int key = 0;
  /// ppermute: the pairs, where the backend keeps every participant's (the others keep a hash).
  std::optional<std::span<const permute_pair>> pairs;
  /// all_to_all_v: the send and receive counts (one per participant), where the backend may read
  /// them when the message is written.
  std::optional<std::span<const std::int64_t>> send_counts;
  std::optional<std::span<const std::int64_t>> recv_counts;
};

/// "[1, 2, 3]".
inline std::string bracketed_counts(std::span<const std::int64_t> a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

/// The text every backend's `collective_mismatch` message shows for one call:
/// "<op>(<type>, count <n>, op <reduce op>, root <r>, pairs [...], send_counts [...],
/// recv_counts [...])", with only the parts the operation takes ("split(color 1, key 0)",
/// "barrier()").
inline std::string describe_call(const call_summary& c) {
  std::string s(op_name(c.kind));
  s += '(';
  if (c.kind == op_kind::split) {
    if (c.color) s += "color " + std::to_string(*c.color) + ", key " + std::to_string(c.key);
  } else if (uses_dtype(c.kind)) {
    s += c.dtype ? std::string(to_string(*c.dtype)) : std::string("-");
    if (uses_count(c.kind)) s += ", count " + std::to_string(c.count);
    if (uses_op(c.kind)) s += ", op " + std::string(to_string(c.op));
    if (uses_root(c.kind)) s += ", root " + std::to_string(c.root);
    if (c.kind == op_kind::ppermute && c.pairs) {
      s += ", pairs [";
      for (std::size_t i = 0; i < c.pairs->size(); ++i)
        s += (i ? ", (" : "(") + std::to_string((*c.pairs)[i].source) + ", " + std::to_string((*c.pairs)[i].dest) + ')';
      s += ']';
    }
    if (c.kind == op_kind::all_to_all_v) {
      if (c.send_counts) s += ", send_counts " + bracketed_counts(*c.send_counts);
      if (c.recv_counts) s += ", recv_counts " + bracketed_counts(*c.recv_counts);
    }
  }
  return s + ')';
}

/// "rank 1 sends 3 elements to rank 0, which expects 2": how every backend's
/// `collective_mismatch` message names an all_to_all_v whose counts disagree (the sender's
/// send_counts entry for the receiver against the receiver's recv_counts entry for the sender),
/// with each backend's labels of the participants.
inline std::string describe_counts_disagreement(std::string_view sender, std::string_view receiver,
                                                std::int64_t sent, std::int64_t expected) {
  return std::string(sender) + " sends " + std::to_string(sent) + " elements to " + std::string(receiver) +
         ", which expects " + std::to_string(expected);
}

/// One (sender, receiver) pair of an all_to_all_v whose counts disagree.
struct counts_disagreement {
  std::size_t sender = 0;
  std::size_t receiver = 0;
  std::int64_t sent = 0;      ///< the sender's send_counts entry for the receiver
  std::int64_t expected = 0;  ///< the receiver's recv_counts entry for the sender
};

/// The first pair of `n` participants whose counts disagree, in the one order every backend that
/// sees all the counts checks (senders ascending, then receivers), so that every participant
/// names the same pair; empty when they all agree. `sent(i, j)`: participant i's send_counts
/// entry for j; `expected(j, i)`: participant j's recv_counts entry for i.
template <class Sent, class Expected>
std::optional<counts_disagreement> first_counts_disagreement(std::size_t n, Sent&& sent, Expected&& expected) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t s = sent(i, j), e = expected(j, i);
      if (s != e) return counts_disagreement{i, j, s, e};
    }
  return std::nullopt;
}

}  // namespace meshlib::comm::detail

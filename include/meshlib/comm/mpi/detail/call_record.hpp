// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The call record of the MPI fingerprint exchange as text (`describe_record`, through the
/// describer every backend shares) and the fingerprint of ppermute pairs (`pairs_hash`). Apart
/// from either communicator because the MPI and the hybrid communicators both use them, so that
/// both fingerprint and name calls the same way. Internal to the MPI communicators.

#if MESHLIB_ENABLE_MPI

#include <cstdint>
#include <span>
#include <string>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/core/hash.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

/// What a mismatch message shows of a call record of the mismatch fingerprint (`describe_call`):
/// {call number, op_kind, datatype + 1 (0: none), count, reduce op, root, extra}. The record
/// keeps only a hash of ppermute pairs and none of the all_to_all_v counts, which are not shown.
inline call_summary summary_of_record(const std::uint64_t* d) {
  call_summary c;
  c.kind = static_cast<op_kind>(d[1]);
  if (d[2] != 0) c.dtype = static_cast<datatype>(d[2] - 1);
  c.count = d[3];
  c.op = static_cast<reduce_op>(d[4]);
  c.root = static_cast<int>(d[5]);
  return c;
}

/// "<who> called all_reduce(float32, count 8, op sum) as call #3", from a call record. Shared by
/// the MPI and hybrid communicators, so both frame calls the same way.
inline std::string describe_record(const std::string& who, const std::uint64_t* d) {
  return who + " called " + describe_call(summary_of_record(d)) + " as call #" + std::to_string(d[0]);
}

/// A fingerprint of ppermute pairs (every participant must pass the same).
inline std::uint64_t pairs_hash(std::span<const permute_pair> pairs) noexcept {
  experimental::fnv1a h;
  for (const auto& p : pairs) h.add(static_cast<std::uint32_t>(p.source)).add(static_cast<std::uint32_t>(p.dest));
  return h.value ^ pairs.size();
}

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_MPI

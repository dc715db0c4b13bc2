// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The call record of the MPI fingerprint exchange as text (`describe_call`) and the
/// fingerprint of ppermute pairs (`pairs_hash`). Apart from either communicator because the MPI
/// and the hybrid communicators both use them, so that both fingerprint and name calls the same
/// way. Internal to the MPI communicators.

#if MESHLIB_ENABLE_MPI

#include <cstdint>
#include <span>
#include <string>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::detail {

/// "<who> called all_reduce(float32, count 8, op sum) as call #3", from a call record of the
/// mismatch fingerprint: {call number, op_kind, datatype + 1 (0: none), count, reduce op, root,
/// extra}. Shared by the MPI and hybrid communicators, so both name calls the same way.
inline std::string describe_call(const std::string& who, const std::uint64_t* d) {
  const auto k = static_cast<op_kind>(d[1]);
  std::string s = who + " called " + std::string(op_name(k)) + "(";
  if (d[2] != 0) {
    s += std::string(to_string(static_cast<datatype>(d[2] - 1)));
    if (k != op_kind::all_to_all_v) s += ", count " + std::to_string(d[3]);
    if (k == op_kind::all_reduce || k == op_kind::reduce || k == op_kind::reduce_scatter)
      s += ", op " + std::string(to_string(static_cast<reduce_op>(d[4])));
    if (k == op_kind::reduce || k == op_kind::broadcast) s += ", root " + std::to_string(d[5]);
  }
  return s + ") as call #" + std::to_string(d[0]);
}

/// A fingerprint of ppermute pairs (every participant must pass the same).
inline std::uint64_t pairs_hash(std::span<const permute_pair> pairs) noexcept {
  std::uint64_t h = 1469598103934665603ull;
  for (const auto& p : pairs)
    h = (((h ^ static_cast<std::uint32_t>(p.source)) * 1099511628211ull) ^ static_cast<std::uint32_t>(p.dest)) *
        1099511628211ull;
  return h ^ pairs.size();
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI

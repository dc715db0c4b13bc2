// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief What one rank of a thread group called in one step: the full descriptor (`call_desc`),
/// its hot part in the rank's flag line (`flag_line`, one cache line), how two ranks' calls are
/// compared (`same_call`) and what a mismatch message shows of a call (`summary_of`, for the
/// describer every backend shares, call_text.hpp). Apart from the group state because this is the
/// step protocol's vocabulary (what a rank publishes and what its peers check), whereas the group
/// state is where it lives.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

/// What one rank called in one step: compared across ranks (mismatch detection), and the source
/// of the peers' buffer addresses for the zero-copy algorithms.
struct call_desc {
  op_kind kind = op_kind::barrier;
  datatype dtype = datatype::float32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  std::uint64_t count = 0;
  int color = 0;
  int key = 0;
  const void* src = nullptr;  ///< staged copy (one-shot) or the user's send buffer (zero-copy)
  void* dst = nullptr;        ///< the user's receive buffer (zero-copy algorithms that push)
  std::span<const permute_pair> pairs{};  ///< ppermute: the caller's pairs (the slot keeps a copy)
  const std::int64_t* v[4] = {nullptr, nullptr, nullptr, nullptr};  ///< all_to_all_v: sc, sd, rc, rd
  int nv = 0;                                                       ///< length of each v array
};

/// What a mismatch message shows of a rank's call (`describe_call`). `pairs` is the slot's copy
/// of a ppermute's pairs; the all_to_all_v counts are shown only when `with_arrays` (they live in
/// the caller's memory, which is safe to read only while the caller is blocked).
inline call_summary summary_of(const call_desc& d, const std::vector<permute_pair>& pairs, bool with_arrays) {
  call_summary c;
  c.kind = d.kind;
  c.dtype = d.dtype;
  c.count = d.count;
  c.op = d.op;
  c.root = d.root;
  if (d.kind == op_kind::split) {
    c.color = d.color;
    c.key = d.key;
  }
  if (d.kind == op_kind::ppermute) c.pairs = std::span<const permute_pair>(pairs);
  if (d.kind == op_kind::all_to_all_v && with_arrays) {
    c.send_counts = std::span<const std::int64_t>(d.v[0], static_cast<std::size_t>(d.nv));
    c.recv_counts = std::span<const std::int64_t>(d.v[2], static_cast<std::size_t>(d.nv));
  }
  return c;
}

/// The hot part of a rank's call in one step, in one cache line with its step number, so that a
/// peer learns that the rank arrived, what it called, and (for up to 24 bytes) its payload, from
/// one cache-line transfer.
struct alignas(64) flag_line {
  std::atomic<std::uint64_t> seq{0};  ///< step + 1 once this line holds the rank's call of that step
  op_kind kind = op_kind::barrier;
  datatype dtype = datatype::float32;
  reduce_op op = reduce_op::sum;
  std::int32_t root = 0;
  std::uint64_t count = 0;
  std::int32_t color = 0;
  std::int32_t key = 0;
  const void* src = nullptr;
  alignas(8) std::byte inline_data[24] = {};
};
static_assert(sizeof(flag_line) == 64);
inline constexpr std::size_t inline_capacity = sizeof(flag_line::inline_data);

/// Whether two ranks' calls agree on everything the step depends on (pairs: the slots' copies).
inline bool same_call(const flag_line& a, const flag_line& b, const std::vector<permute_pair>& pa,
                      const std::vector<permute_pair>& pb) {
  if (a.kind != b.kind) return false;
  if (uses_dtype(a.kind) && a.dtype != b.dtype) return false;
  if (uses_count(a.kind) && a.count != b.count) return false;
  if (uses_op(a.kind) && a.op != b.op) return false;
  if (uses_root(a.kind) && a.root != b.root) return false;
  if (a.kind == op_kind::ppermute && pa != pb) return false;
  return true;
}

}  // namespace meshlib::comm::detail

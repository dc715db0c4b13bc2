// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief What one rank of a thread group called in one step: the full descriptor (`call_desc`),
/// its hot part in the rank's flag line (`flag_line`, one cache line), how two ranks' calls are
/// compared (`same_call`) and how a call is shown in a mismatch message (`describe`). Apart from
/// the group state because this is the step protocol's vocabulary (what a rank publishes and what
/// its peers check), whereas the group state is where it lives.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::detail {

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

inline bool uses_dtype(op_kind k) noexcept { return k != op_kind::barrier && k != op_kind::split; }
inline bool uses_count(op_kind k) noexcept {
  return uses_dtype(k) && k != op_kind::all_to_all_v;
}
inline bool uses_op(op_kind k) noexcept {
  return k == op_kind::all_reduce || k == op_kind::reduce || k == op_kind::reduce_scatter;
}
inline bool uses_root(op_kind k) noexcept { return k == op_kind::reduce || k == op_kind::broadcast; }

inline void print_v(std::ostream& os, const std::int64_t* a, int n) {
  os << '[';
  for (int i = 0; i < n; ++i) os << (i ? ", " : "") << a[i];
  os << ']';
}

/// "all_reduce(float32, count 8, op sum)": how error messages show a call. `pairs` is the slot's
/// copy of a ppermute's pairs; the all_to_all_v counts are printed only when `with_arrays` (they
/// live in the caller's memory, which is safe to read only while the caller is blocked).
inline std::string describe(const call_desc& d, const std::vector<permute_pair>& pairs, bool with_arrays) {
  std::ostringstream os;
  os << op_name(d.kind) << '(';
  if (d.kind == op_kind::split) {
    os << "color " << d.color << ", key " << d.key;
  } else if (uses_dtype(d.kind)) {
    os << d.dtype;
    if (uses_count(d.kind)) os << ", count " << d.count;
    if (uses_op(d.kind)) os << ", op " << d.op;
    if (uses_root(d.kind)) os << ", root " << d.root;
    if (d.kind == op_kind::ppermute) {
      os << ", pairs [";
      for (std::size_t i = 0; i < pairs.size(); ++i)
        os << (i ? ", " : "") << '(' << pairs[i].source << ", " << pairs[i].dest << ')';
      os << ']';
    }
    if (d.kind == op_kind::all_to_all_v && with_arrays) {
      os << ", send_counts ";
      print_v(os, d.v[0], d.nv);
      os << ", recv_counts ";
      print_v(os, d.v[2], d.nv);
    }
  }
  os << ')';
  return os.str();
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

}  // namespace meshlib::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The description of one communicator operation, as the front end hands it to a backend's
/// transport: what was called (`op_kind`), on which buffers, with which count, reduce op, root,
/// peer or tag. Every backend sees the same normalised description, whatever overload the user
/// called (in-place forms set `in_place` and point `send` and `recv` into the one buffer), and
/// the MPI backends derive their mismatch fingerprint from it.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

/// The operations of the `communicator` concept (the values are part of the MPI fingerprint).
enum class op_kind : std::uint8_t {
  barrier,
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_to_all_v,
  ppermute,
  split,
  send,
  recv,
};

/// The public name of an operation, as error messages show it.
constexpr std::string_view op_name(op_kind k) noexcept {
  switch (k) {
    case op_kind::barrier: return "barrier";
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::reduce: return "reduce";
    case op_kind::broadcast: return "broadcast";
    case op_kind::all_gather: return "all_gather";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::all_to_all: return "all_to_all";
    case op_kind::all_to_all_v: return "all_to_all_v";
    case op_kind::ppermute: return "ppermute";
    case op_kind::split: return "split";
    case op_kind::send: return "send";
    case op_kind::recv: return "recv";
  }
  return "unknown";
}

/// Whether the participants of an operation must agree on its element type (all but barrier and
/// split). With `uses_count`, `uses_op` and `uses_root`, this is what every backend compares
/// across participants and what a mismatch message shows (`describe_call`).
constexpr bool uses_dtype(op_kind k) noexcept { return k != op_kind::barrier && k != op_kind::split; }
/// Whether they must agree on the count (all_to_all_v's counts are per peer, checked apart).
constexpr bool uses_count(op_kind k) noexcept { return uses_dtype(k) && k != op_kind::all_to_all_v; }
/// Whether they must agree on the reduce op (the reducing operations).
constexpr bool uses_op(op_kind k) noexcept {
  return k == op_kind::all_reduce || k == op_kind::reduce || k == op_kind::reduce_scatter;
}
/// Whether they must agree on a root (reduce and broadcast).
constexpr bool uses_root(op_kind k) noexcept { return k == op_kind::reduce || k == op_kind::broadcast; }

/// One operation, after the front end's checks. Buffer conventions (n = size(), c = count):
///
/// | kind | send | recv | count |
/// | --- | --- | --- | --- |
/// | all_reduce, reduce | c elements (== recv in place) | c elements (reduce: root only) | c |
/// | reduce_scatter | n*c elements | c elements (in place: block rank() of send) | c |
/// | broadcast | root's c elements (nullptr elsewhere out of place; == recv in place) | c elements | c |
/// | all_gather | c elements (in place: block rank() of recv) | n*c elements | c |
/// | all_to_all | n*c elements (== recv in place) | n*c elements | c (per peer) |
/// | all_to_all_v | the send buffer; counts/displs in `v` | the receive buffer | 0 |
/// | ppermute | c elements (== recv in place) | c elements | c |
/// | send / recv | the message (`peer`, `tag`) | the message | c |
/// | barrier | - | - | 0 |
template <class T>
struct operation {
  op_kind kind = op_kind::barrier;
  const T* send = nullptr;
  T* recv = nullptr;
  std::size_t count = 0;
  reduce_op op = reduce_op::sum;
  int root = 0;  ///< root of reduce and broadcast
  int peer = 0;  ///< destination of send, source of recv
  int tag = 0;
  bool in_place = false;
  std::span<const permute_pair> pairs{};                            ///< ppermute
  const std::int64_t* v[4] = {nullptr, nullptr, nullptr, nullptr};  ///< all_to_all_v: sc, sd, rc, rd (n each)
};

}  // namespace meshlib::comm::detail

namespace meshlib::experimental {
/// The kinds of communicator operation (`op_kind::send`, ...), as the front end and its callers name them.
using comm::detail::op_kind;
}  // namespace meshlib::experimental

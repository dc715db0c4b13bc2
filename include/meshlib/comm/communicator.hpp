// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The `communicator` concept that every backend (thread, MPI, NCCL) satisfies.
///
/// A communicator is one participant's handle on a group of `size()` participants numbered
/// `0 .. size()-1`. Every collective must be called by every participant of the group, in the same
/// order, with agreeing arguments; the backends check that and throw `collective_mismatch`
/// where it is not so (the thread backend always; see docs/design.md for the others).
///
/// Operations (T is any `comm_element`; every one returns `C::request_type`, and takes an optional
/// last argument of type `C::context_type`: a CUDA stream for NCCL, nothing for host backends):
///
/// | operation | out-of-place | in-place |
/// | --- | --- | --- |
/// | all_reduce | `all_reduce(send, recv, op)`: recv[i] = op over ranks of send[i] | `all_reduce(buf, op)` |
/// | reduce | `reduce(send, recv, op, root)`: only root's recv is written | `reduce(buf, op, root)` |
/// | broadcast | `broadcast(send, recv, root)`: send read on root only | `broadcast(buf, root)` |
/// | all_gather | `all_gather(send, recv)`: recv = [send of rank 0, rank 1, ...] | `all_gather(buf)`: own block at buf[rank*c] |
/// | reduce_scatter | `reduce_scatter(send, recv, op)`: recv = block `rank` of the reduced send | `reduce_scatter(buf, op)`: result at buf[rank*c] (NCCL's convention) |
/// | all_to_all | `all_to_all(send, recv)`: block j of send goes to rank j, lands at block `rank` | `all_to_all(buf)` |
/// | all_to_all_v | `all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs)` | |
/// | ppermute | `ppermute(send, recv, pairs)`: recv gets the send of the rank that sends to it, zeros if none | `ppermute(buf, pairs)` |
/// | send / recv | `send(buf, dest, tag)`, `recv(buf, source, tag)` | |
/// | barrier | `barrier()` | |
/// | split | `split(color, key)` -> a communicator of the same type over the ranks of equal color, ordered by (key, rank) | |
///
/// Counts come from the spans: `all_reduce`, `reduce`, `broadcast` and `all_gather` move
/// `send.size()` elements per rank, `reduce_scatter` `recv.size()` per rank, `all_to_all`
/// `send.size() / size()` per peer. A receive buffer longer than needed is allowed (the rest is left
/// untouched); a shorter one, and an overlap of send and receive buffers, are rejected with
/// `comm_argument_error` before any data moves (pass the in-place form instead).

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"

namespace meshlib {

/// @brief A (source, destination) pair of a `ppermute`, as in `jax.lax.ppermute(x, perm=[(0, 1), ...])`.
struct permute_pair {
  /// The rank that sends.
  int source = 0;
  /// The rank that receives what `source` sends.
  int dest = 0;
  /// Pairs are equal when source and dest both match.
  friend constexpr bool operator==(const permute_pair&, const permute_pair&) = default;
};

namespace comm::detail {
// The element type through which the concept checks the templated operations; a backend must
// provide them for every comm_element, the concept can only spell out one.
using concept_probe_t = float;
}  // namespace comm::detail

/// @brief Types that opted in as communicators (nested `is_communicator` tag), with their handle types.
template <class C>
concept communicator_tagged = requires {
  typename C::is_communicator;
  typename C::request_type;
  typename C::context_type;
} && comm_request<typename C::request_type>;

/// @brief A participant handle of a group: `rank()` in `[0, size())`.
template <class C>
concept communicator_group = requires(const C& c) {
  { c.rank() } -> std::same_as<int>;
  { c.size() } -> std::same_as<int>;
};

/// @brief The reducing collectives, out-of-place and in-place.
template <class C>
concept reducing_communicator = requires(C& c, std::span<const comm::detail::concept_probe_t> s,
                                         std::span<comm::detail::concept_probe_t> r, reduce_op op, int root) {
  { c.all_reduce(s, r, op) } -> std::same_as<typename C::request_type>;
  { c.all_reduce(r, op) } -> std::same_as<typename C::request_type>;
  { c.reduce(s, r, op, root) } -> std::same_as<typename C::request_type>;
  { c.reduce(r, op, root) } -> std::same_as<typename C::request_type>;
  { c.reduce_scatter(s, r, op) } -> std::same_as<typename C::request_type>;
  { c.reduce_scatter(r, op) } -> std::same_as<typename C::request_type>;
};

/// @brief The data-movement collectives, out-of-place and in-place.
template <class C>
concept moving_communicator = requires(C& c, std::span<const comm::detail::concept_probe_t> s,
                                       std::span<comm::detail::concept_probe_t> r, std::span<const std::int64_t> counts,
                                       std::span<const permute_pair> pairs, int root) {
  { c.broadcast(s, r, root) } -> std::same_as<typename C::request_type>;
  { c.broadcast(r, root) } -> std::same_as<typename C::request_type>;
  { c.all_gather(s, r) } -> std::same_as<typename C::request_type>;
  { c.all_gather(r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all(s, r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all(r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all_v(s, counts, counts, r, counts, counts) } -> std::same_as<typename C::request_type>;
  { c.ppermute(s, r, pairs) } -> std::same_as<typename C::request_type>;
  { c.ppermute(r, pairs) } -> std::same_as<typename C::request_type>;
};

/// @brief Point-to-point messages, matched by (source, tag) in send order.
template <class C>
concept point_to_point_communicator = requires(C& c, std::span<const comm::detail::concept_probe_t> s,
                                               std::span<comm::detail::concept_probe_t> r, int peer, int tag) {
  { c.send(s, peer, tag) } -> std::same_as<typename C::request_type>;
  { c.recv(r, peer, tag) } -> std::same_as<typename C::request_type>;
};

/// @brief Synchronisation and sub-communicators.
template <class C>
concept structured_communicator = requires(C& c, int color, int key) {
  { c.barrier() } -> std::same_as<typename C::request_type>;
  { c.split(color, key) } -> std::same_as<C>;
};

/// @brief A communicator: one participant's handle on a group, with every collective meshlib uses.
/// Satisfied by `thread_communicator` (and later the MPI and NCCL communicators).
template <class C>
concept communicator = communicator_tagged<C> && communicator_group<C> && reducing_communicator<C> &&
                       moving_communicator<C> && point_to_point_communicator<C> && structured_communicator<C> &&
                       std::movable<C>;

}  // namespace meshlib

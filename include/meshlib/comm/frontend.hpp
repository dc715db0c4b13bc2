// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `communicator_frontend`: the public operations of every communicator, written once.
///
/// A backend derives from `communicator_frontend<Backend, Request, Context>` and implements only
/// its transport; the front end gives it every overload of the `communicator` concept (in-place and
/// out-of-place), checks every argument before any data moves (buffer sizes, overlap, roots,
/// peers, tags, ppermute pairs, all_to_all_v layouts, element-count overflow) and builds every
/// argument error, so that a wrong call reads the same on every backend.
///
/// @code
/// class my_communicator : public meshlib::communicator_frontend<my_communicator> {
///   friend class meshlib::communicator_frontend<my_communicator>;
///  public:
///   int rank() const noexcept;  int size() const noexcept;
///   my_communicator split(int color, int key);    // (call check_split(color) first)
///  private:
///   void ensure_usable(meshlib::comm::detail::op_kind) const;   // throws on an empty or failed handle
///   std::string label() const;                             // "rank 2", "MPI rank 1", ...
///   template <meshlib::comm::detail::op_kind K, class T>                    // the transport of operation K
///   ready_request transport(const meshlib::comm::detail::operation<T>&, host_context);
/// };
/// @endcode
///
/// Optional hook: `void on_argument_error(op_kind, const std::string& what) const`, called before
/// the front end throws `comm_argument_error` (the thread backend fails its world there, so that
/// peers already waiting for this rank are released at once).
///
/// Asynchronous backends: every operation takes an optional last argument of the backend's
/// `Context` (a CUDA stream for NCCL) and returns its `Request`; the front end passes both through
/// untouched, so a stream-ordered backend plugs in without any change above it.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"

namespace meshlib {

/// @brief The shared front end of the communicators (see the file comment): `Backend` derives from
/// it and provides the transport.
template <class Backend, class Request = ready_request, class Context = host_context>
class communicator_frontend {
 public:
  /// Tag that opts the communicator into the `communicator_tagged` concept.
  using is_communicator = void;
  /// What the non-blocking calls return (`wait()` / `test()`).
  using request_type = Request;
  /// The backend state the collectives run on.
  using context_type = Context;

  // ---- reducing collectives --------------------------------------------------------------------

  /// @brief recv[i] = op over every rank of send[i], for i < send.size(), on every rank.
  template <comm_element T>
  request_type all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                          context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_reduce;
    check_out_of_place(k, send, recv, send.size());
    return start<k>(reducing<T>(k, send.data(), recv.data(), send.size(), op, false), ctx);
  }
  /// @brief In-place all_reduce: buf[i] = op over every rank of buf[i].
  template <comm_element T>
  request_type all_reduce(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_reduce;
    usable(k);
    return start<k>(reducing<T>(k, buf.data(), buf.data(), buf.size(), op, true), ctx);
  }

  /// @brief Like all_reduce, but only `root` receives the result; recv is ignored elsewhere.
  template <comm_element T>
  request_type reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root,
                      context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::reduce;
    check_root(k, root);
    if (self().rank() == root) check_out_of_place(k, send, recv, send.size());
    auto o = reducing<T>(k, send.data(), self().rank() == root ? recv.data() : nullptr, send.size(), op, false);
    o.root = root;
    return start<k>(o, ctx);
  }
  /// @brief In-place reduce: root's buf receives the result; the others' buf is only read.
  template <comm_element T>
  request_type reduce(std::span<T> buf, reduce_op op, int root, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::reduce;
    check_root(k, root);
    auto o = reducing<T>(k, buf.data(), buf.data(), buf.size(), op, true);
    o.root = root;
    return start<k>(o, ctx);
  }

  /// @brief recv = block `rank()` of the element-wise reduction of every rank's send, whose
  /// length is `size() * recv.size()`.
  template <comm_element T>
  request_type reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                              context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::reduce_scatter;
    const std::size_t count = recv.size();
    const std::size_t total = checked_mul(k, count);
    if (send.size() < total)
      bad_argument(k, "send buffer holds " + std::to_string(send.size()) + " elements but size() * recv.size() = " +
                          std::to_string(total) + " are needed");
    check_out_of_place(k, send.first(total), recv, count);
    return start<k>(reducing<T>(k, send.data(), recv.data(), count, op, false), ctx);
  }
  /// @brief In-place reduce_scatter (NCCL's convention): buf holds `size()` blocks; block `rank()`
  /// receives the reduction of every rank's block `rank()`; the other blocks are left as they were.
  template <comm_element T>
  request_type reduce_scatter(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::reduce_scatter;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(reducing<T>(k, buf.data(), buf.data() + block(count), count, op, true), ctx);
  }

  // ---- data movement ---------------------------------------------------------------------------

  /// @brief Every rank's recv receives root's send (read on root only); `recv.size()` is the count.
  template <comm_element T>
  request_type broadcast(std::span<const std::type_identity_t<T>> send, std::span<T> recv, int root,
                         context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::broadcast;
    check_root(k, root);
    const bool is_root = self().rank() == root;
    if (is_root) {
      check_out_of_place(k, send, recv, recv.size());
      if (send.size() < recv.size())
        bad_argument(k, "root's send buffer holds " + std::to_string(send.size()) + " elements but recv.size() = " +
                            std::to_string(recv.size()) + " are broadcast");
    }
    auto o = moving<T>(k, is_root ? send.data() : nullptr, recv.data(), recv.size(), false);
    o.root = root;
    return start<k>(o, ctx);
  }
  /// @brief In-place broadcast: every rank's buf receives root's buf.
  template <comm_element T>
  request_type broadcast(std::span<T> buf, int root, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::broadcast;
    check_root(k, root);
    auto o = moving<T>(k, buf.data(), buf.data(), buf.size(), true);
    o.root = root;
    return start<k>(o, ctx);
  }

  /// @brief recv = [send of rank 0, send of rank 1, ...]: `size() * send.size()` elements.
  template <comm_element T>
  request_type all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_gather;
    const std::size_t count = send.size();
    check_out_of_place(k, send, recv, checked_mul(k, count));
    return start<k>(moving<T>(k, send.data(), recv.data(), count, false), ctx);
  }
  /// @brief In-place all_gather: buf holds `size()` blocks, this rank's own already in block `rank()`.
  template <comm_element T>
  request_type all_gather(std::span<T> buf, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_gather;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(moving<T>(k, buf.data() + block(count), buf.data(), count, true), ctx);
  }

  /// @brief send holds `size()` equal blocks; block j goes to rank j, where it lands in block `rank()`.
  template <comm_element T>
  request_type all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_to_all;
    const std::size_t count = blocks_of(k, send.size());
    check_out_of_place(k, send, recv, send.size());
    return start<k>(moving<T>(k, send.data(), recv.data(), count, false), ctx);
  }
  /// @brief In-place all_to_all.
  template <comm_element T>
  request_type all_to_all(std::span<T> buf, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_to_all;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(moving<T>(k, buf.data(), buf.data(), count, true), ctx);
  }

  /// @brief all_to_all with a count per peer (MPI_Alltoallv): `send_counts[j]` elements from
  /// `send[send_displs[j]]` go to rank j, which receives them at `recv[recv_displs[rank()]]`; every
  /// rank's `recv_counts[j]` must equal rank j's `send_counts[rank()]` (else `collective_mismatch`).
  template <comm_element T>
  request_type all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, std::span<T> recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::all_to_all_v;
    usable(k);
    check_layout(k, "send", send.size(), send_counts, send_displs);
    check_layout(k, "recv", recv.size(), recv_counts, recv_displs);
    if (comm::detail::buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
      bad_argument(k, "the send and receive buffers overlap; all_to_all_v has no in-place form");
    auto o = moving<T>(k, send.data(), recv.data(), 0, false);
    o.v[0] = send_counts.data();
    o.v[1] = send_displs.data();
    o.v[2] = recv_counts.data();
    o.v[3] = recv_displs.data();
    return start<k>(o, ctx);
  }

  /// @brief Each rank sends its send to the destination of the pairs whose source it is; recv
  /// receives the send of the pair whose destination this rank is, or zeros (as in JAX). Every
  /// rank passes the same pairs; a duplicate source or destination is rejected.
  template <comm_element T>
  request_type ppermute(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::ppermute;
    check_pairs(pairs);
    check_out_of_place(k, send, recv, send.size());
    auto o = moving<T>(k, send.data(), recv.data(), send.size(), false);
    o.pairs = pairs;
    return start<k>(o, ctx);
  }
  /// @brief In-place ppermute.
  template <comm_element T>
  request_type ppermute(std::span<T> buf, std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::ppermute;
    check_pairs(pairs);
    auto o = moving<T>(k, buf.data(), buf.data(), buf.size(), true);
    o.pairs = pairs;
    return start<k>(o, ctx);
  }

  // ---- point to point --------------------------------------------------------------------------

  /// @brief Sends buf to rank `dest` with `tag` (>= 0). Buffered: returns once buf is copied,
  /// whether or not `dest` has posted its recv (so exchanges written as send-then-recv on every
  /// rank cannot deadlock).
  template <class T>
    requires comm_element<std::remove_cv_t<T>>
  request_type send(std::span<T> buf, int dest, int tag = 0, context_type ctx = {}) {
    using U = std::remove_cv_t<T>;
    constexpr auto k = comm::detail::op_kind::send;
    check_peer(k, dest, "destination");
    check_tag(k, tag);
    auto o = moving<U>(k, buf.data(), nullptr, buf.size(), false);
    o.peer = dest;
    o.tag = tag;
    return start<k>(o, ctx);
  }

  /// @brief Receives into buf the oldest message that rank `source` sent to this rank with `tag`.
  /// Its element type and count must be those of buf (else `collective_mismatch`).
  template <comm_element T>
  request_type recv(std::span<T> buf, int source, int tag = 0, context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::recv;
    check_peer(k, source, "source");
    check_tag(k, tag);
    auto o = moving<T>(k, nullptr, buf.data(), buf.size(), false);
    o.peer = source;
    o.tag = tag;
    return start<k>(o, ctx);
  }

  // ---- synchronisation -------------------------------------------------------------------------

  /// @brief Returns once every rank of the group has called barrier.
  request_type barrier(context_type ctx = {}) {
    constexpr auto k = comm::detail::op_kind::barrier;
    usable(k);
    comm::detail::operation<float> o;
    o.kind = k;
    return start<k>(o, ctx);
  }

 protected:
  communicator_frontend() = default;

  /// The default of the optional hook (see the file comment): nothing to release.
  void on_argument_error(comm::detail::op_kind, const std::string&) const {}

  /// For `split`: refuses a negative color (after the usability check).
  void check_split(int color) const {
    constexpr auto k = comm::detail::op_kind::split;
    usable(k);
    if (color < 0) bad_argument(k, "color " + std::to_string(color) + " is negative; colors are >= 0");
  }

  /// "all_reduce on rank 2 of 4": how messages name the call and the caller.
  std::string where(comm::detail::op_kind k) const {
    return std::string(comm::detail::op_name(k)) + " on " + self().label() + " of " + std::to_string(self().size());
  }

  /// Throws `comm_argument_error` ("meshlib: invalid argument to <where>: <what>") after the
  /// backend's `on_argument_error` hook. For the backends' own limits too (MPI's int counts).
  [[noreturn]] void bad_argument(comm::detail::op_kind k, const std::string& what) const {
    self().on_argument_error(k, what);
    throw comm_argument_error("meshlib: invalid argument to " + where(k) + ": " + what);
  }

 private:
  Backend& self() noexcept { return static_cast<Backend&>(*this); }
  const Backend& self() const noexcept { return static_cast<const Backend&>(*this); }

  template <comm::detail::op_kind K, class T>
  request_type start(comm::detail::operation<T> o, context_type ctx) {
    o.kind = K;
    return self().template transport<K, T>(o, ctx);
  }

  template <class T>
  static comm::detail::operation<T> moving(comm::detail::op_kind k, const T* send, T* recv, std::size_t count, bool in_place) {
    comm::detail::operation<T> o;
    o.kind = k;
    o.send = send;
    o.recv = recv;
    o.count = count;
    o.in_place = in_place;
    return o;
  }
  template <class T>
  static comm::detail::operation<T> reducing(comm::detail::op_kind k, const T* send, T* recv, std::size_t count, reduce_op op,
                                       bool in_place) {
    auto o = moving<T>(k, send, recv, count, in_place);
    o.op = op;
    return o;
  }

  std::size_t block(std::size_t count) const noexcept { return static_cast<std::size_t>(self().rank()) * count; }

  void usable(comm::detail::op_kind k) const { self().ensure_usable(k); }

  void check_root(comm::detail::op_kind k, int root) const {
    usable(k);
    if (root < 0 || root >= self().size())
      bad_argument(k, "root " + std::to_string(root) + " is out of range [0, " + std::to_string(self().size()) + ")");
  }

  void check_peer(comm::detail::op_kind k, int peer, const char* what) const {
    usable(k);
    if (peer < 0 || peer >= self().size())
      bad_argument(k, std::string(what) + " rank " + std::to_string(peer) + " is out of range [0, " +
                          std::to_string(self().size()) + ")");
  }

  void check_tag(comm::detail::op_kind k, int tag) const {
    if (tag < 0) bad_argument(k, "tag " + std::to_string(tag) + " is negative; tags are >= 0");
  }

  /// Out-of-place forms: recv must hold `needed` elements and must not overlap send.
  template <class T>
  void check_out_of_place(comm::detail::op_kind k, std::span<const T> send, std::span<T> recv, std::size_t needed) const {
    usable(k);
    if (auto problem = comm::detail::out_of_place_problem(send, recv, needed); !problem.empty()) bad_argument(k, problem);
  }

  /// count * size(), refused when it overflows.
  std::size_t checked_mul(comm::detail::op_kind k, std::size_t count) const {
    usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    if (count > std::numeric_limits<std::size_t>::max() / n)
      bad_argument(k, "count " + std::to_string(count) + " times " + std::to_string(n) + " ranks overflows");
    return count * n;
  }

  /// The block length of a buffer of `size()` equal blocks.
  std::size_t blocks_of(comm::detail::op_kind k, std::size_t total) const {
    usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    if (total % n != 0)
      bad_argument(k, "buffer of " + std::to_string(total) + " elements does not split into " + std::to_string(n) +
                          " equal blocks");
    return total / n;
  }

  /// One side of an all_to_all_v: n counts and displacements, each block inside the buffer. The
  /// end of a block is compared without adding count and displacement first (int64 overflow).
  void check_layout(comm::detail::op_kind k, const char* which, std::size_t buffer, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs) const {
    const auto n = static_cast<std::size_t>(self().size());
    const std::string w(which);
    if (counts.size() != n || displs.size() != n)
      bad_argument(k, w + "_counts and " + w + "_displs need " + std::to_string(n) + " entries each, got " +
                          std::to_string(counts.size()) + " and " + std::to_string(displs.size()));
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t c = counts[j];
      const std::int64_t d = displs[j];
      if (c < 0 || d < 0)
        bad_argument(k, w + "_counts[" + std::to_string(j) + "] = " + std::to_string(c) + " and " + w + "_displs[" +
                            std::to_string(j) + "] = " + std::to_string(d) + ": counts and displacements must be >= 0");
      if (c > std::numeric_limits<std::int64_t>::max() - d || static_cast<std::uint64_t>(c + d) > buffer)
        bad_argument(k, w + " block " + std::to_string(j) + " (displacement " + std::to_string(d) + ", count " +
                            std::to_string(c) + ") overflows or runs past the end of the " + w + " buffer of " +
                            std::to_string(buffer) + " elements");
    }
  }

  void check_pairs(std::span<const permute_pair> pairs) const {
    constexpr auto k = comm::detail::op_kind::ppermute;
    usable(k);
    const int n = self().size();
    std::vector<char> src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
    for (const auto& p : pairs) {
      if (p.source < 0 || p.source >= n || p.dest < 0 || p.dest >= n)
        bad_argument(k, "pair (" + std::to_string(p.source) + ", " + std::to_string(p.dest) +
                            ") names a rank out of range [0, " + std::to_string(n) + ")");
      if (src[static_cast<std::size_t>(p.source)]++)
        bad_argument(k, "rank " + std::to_string(p.source) + " is the source of two pairs; each rank sends at most once");
      if (dst[static_cast<std::size_t>(p.dest)]++)
        bad_argument(k, "rank " + std::to_string(p.dest) + " is the destination of two pairs; each rank receives at most once");
    }
  }
};

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The thread communicator: N participants that are N threads of one process, talking
/// through shared memory. meshlib's embedded default, and what every test runs on.
///
/// @code
/// meshlib::run_on_threads(4, [](meshlib::thread_communicator& comm) {
///   std::vector<float> x(1024, float(comm.rank()));
///   comm.all_reduce(std::span(x), meshlib::reduce_op::sum);   // in place: every x[i] == 6
/// });
/// @endcode
/// or, by hand: `meshlib::thread_world world(4);` then on thread r `auto comm = world.communicator(r);`.
///
/// Algorithms (docs/design.md has the details and docs/benchmarks.md the measurements):
/// - one-shot, for small payloads (`thread_comm_options::one_shot_max_bytes`): each rank copies
///   its payload into its slot (up to 24 bytes into the very cache line that announces its
///   arrival) and publishes its call; once every peer's call is there, each rank reads what it
///   needs from the peers' slots. One synchronisation per collective.
/// - zero-copy, above that: each rank arrives with the addresses of its buffers; after the release
///   each reads straight from its peers' buffers (all_reduce: rank k reduces slice k of every input
///   and writes it into every output), then all meet once more so no buffer is left while a peer
///   still reads or writes it. No byte is staged or moved twice; big payloads are written with
///   streaming stores.
/// Both reduce each element in rank order, so results are bitwise identical on every rank, in
/// every run, with either algorithm.
///
/// Faults: no wait is unbounded. A failed participant (`thread_world::abort`, or `run_on_threads`
/// seeing it throw), a participant whose handle is destroyed while peers wait for it, a timeout, a
/// mismatched step or an invalid argument fails the whole world (every group split from it), and
/// every participant's pending and later calls throw the root cause's error type
/// (`comm_aborted`, `comm_timeout`, `collective_mismatch`) with the same root-cause message.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/comm/thread/detail/group_state.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"
#include "meshlib/comm/thread/detail/step_protocol.hpp"
#include "meshlib/comm/thread/options.hpp"

namespace meshlib {

class thread_world;

/// @brief One participant's handle on a group of threads. Satisfies `communicator`.
///
/// A handle belongs to one thread at a time (it is movable, not copyable) and every operation
/// blocks that thread until the operation is complete, then returns an already-complete
/// `ready_request`. Destroying a handle tells its peers that this rank has left: a peer that
/// waits for it in a collective gets `comm_aborted` instead of waiting for the timeout.
class thread_communicator : public communicator_frontend<thread_communicator>, private comm::detail::step_protocol {
  friend class communicator_frontend<thread_communicator>;
  friend class hybrid_communicator;  // restates a timeout of its local steps (timeout_facts), sets patience_

 public:

  /// An empty handle (not part of any group); only assignable and destructible.
  thread_communicator() = default;
  thread_communicator(const thread_communicator&) = delete;
  thread_communicator& operator=(const thread_communicator&) = delete;
  /// Movable: the moved-from communicator is no longer valid.
  thread_communicator(thread_communicator&& o) noexcept
      : comm::detail::step_protocol(std::move(o)) {}
  /// Move assignment: the moved-from communicator is no longer valid.
  thread_communicator& operator=(thread_communicator&& o) noexcept {
    if (this != &o) {
      depart();
      state_ = std::move(o.state_);
      rank_ = o.rank_;
      step_ = o.step_;
      central_ = o.central_;
      cpu_ = o.cpu_;
    }
    return *this;
  }
  ~thread_communicator() { depart(); }

  /// Rank of this participant in its group, in `[0, size())`.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of participants of the group (0 for an empty handle).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->n : 0; }
  /// Whether the handle belongs to a group.
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// Rank of this participant in the world the group was split from.
  [[nodiscard]] int world_rank() const noexcept {
    return state_ ? state_->world_ranks[static_cast<std::size_t>(rank_)] : -1;
  }

  /// @brief Fails the whole world with this rank as the root cause; every participant's pending
  /// and later calls throw `comm_aborted` naming this rank and `reason`.
  /// @returns whether this call recorded the root cause (false when the world had already failed).
  bool abort(std::string_view reason) {
    require_valid(comm::detail::op_kind::barrier);
    return state_->world->fail(comm::detail::failure_kind::aborted, world_rank(),
                               "meshlib: communicator aborted: " + state_->rank_label(rank_) + " failed: " +
                                   std::string(reason));
  }

  // The collectives, point to point and barrier: communicator_frontend (argument checks); the
  // transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// @brief Collective: the ranks that pass the same `color` (>= 0) form a new communicator, in
  /// which they are ordered by (`key`, rank in this one), as `MPI_Comm_split`. Sub-groups belong to
  /// the same world: a failure in any of them fails all.
  thread_communicator split(int color, int key) {
    constexpr auto k = comm::detail::op_kind::split;
    check_split(color);
    comm::detail::call_desc d;
    d.kind = k;
    d.color = color;
    d.key = key;
    const std::uint64_t s = arrive(d, false);
    auto& g = *state_;
    std::vector<std::pair<int, int>> keyed;  // (key, rank) of the members
    for (int r = 0; r < g.n; ++r) {
      const auto& lr = line(r, s);
      if (lr.color == color) keyed.emplace_back(lr.key, r);
    }
    std::sort(keyed.begin(), keyed.end());
    std::vector<int> members;
    members.reserve(keyed.size());
    int new_rank = 0;
    for (std::size_t i = 0; i < keyed.size(); ++i) {
      if (keyed[i].second == rank_) new_rank = static_cast<int>(i);
      members.push_back(g.world_ranks[static_cast<std::size_t>(keyed[i].second)]);
    }
    auto sub = comm::detail::claim_split_group(g.world, g.id, s, color, members);
    sub->slots[new_rank].claimed.store(true);
    return thread_communicator(std::move(sub), new_rank);
  }

 private:
  friend class thread_world;
  using op_kind = comm::detail::op_kind;

  thread_communicator(std::shared_ptr<comm::detail::group_state> s, int rank) : comm::detail::step_protocol(std::move(s), rank) {}

  void depart() noexcept {
    if (!state_) return;
    if (std::uncaught_exceptions() > 0)
      state_->slots[rank_].unwound_at.store(comm::detail::comm_clock::now().time_since_epoch().count() | 1,
                                            std::memory_order_relaxed);
    state_->slots[rank_].departed.store(true, std::memory_order_seq_cst);
    state_->wake_all_unconditionally();
    state_.reset();
  }

  std::size_t mailbox(int src, int dst) const noexcept {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(state_->n) + static_cast<std::size_t>(dst);
  }

  // ---- the front end's hooks: its argument checks all run before this rank arrives, so before
  // any data moves -----------------------------------------------------------------------------

  std::string label() const { return state_->rank_label(rank_); }

  void require_valid(op_kind k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(comm::detail::op_name(k)) +
                       " called on an empty thread_communicator handle (default-constructed or moved from)");
  }

  /// Refuses every call once the world has failed.
  void ensure_usable(op_kind k) const {
    require_valid(k);
    if (state_->word.load(std::memory_order_acquire) & comm::detail::failed_bit)
      state_->world->rethrow("refused " + where(k) + ": the communicator has failed");
  }

  /// Fails the world before the front end throws comm_argument_error, so that peers waiting for
  /// this rank are released at once.
  void on_argument_error(op_kind k, const std::string& what) const {
    require_valid(k);
    state_->world->fail(comm::detail::failure_kind::aborted, world_rank(),
                        "meshlib: communicator aborted: " + state_->rank_label(rank_) + " passed an invalid argument to " +
                            std::string(comm::detail::op_name(k)) + ": " + what);
  }

  /// The transport of operation K (the front end has checked its arguments).
  template <op_kind K, class T>
  request_type transport(const comm::detail::operation<T>& o, context_type) {
    if constexpr (K == op_kind::all_reduce) return do_all_reduce<T>(o.send, o.recv, o.count, o.op);
    else if constexpr (K == op_kind::reduce) return do_reduce<T>(o.send, o.recv, o.count, o.op, o.root);
    else if constexpr (K == op_kind::reduce_scatter) return do_reduce_scatter<T>(o.send, o.recv, o.count, o.op);
    else if constexpr (K == op_kind::broadcast) return do_broadcast<T>(o.send, o.recv, o.count, o.root);
    else if constexpr (K == op_kind::all_gather) return do_all_gather<T>(o.send, o.recv, o.count);
    else if constexpr (K == op_kind::all_to_all) return do_all_to_all<T>(o.send, o.recv, o.count);
    else if constexpr (K == op_kind::all_to_all_v)
      return do_all_to_all_v<T>(o.send, o.v[0], o.v[1], o.recv, o.v[2], o.v[3]);
    else if constexpr (K == op_kind::ppermute) return do_ppermute<T>(o.send, o.recv, o.count, o.pairs);
    else if constexpr (K == op_kind::send) return post(o.send, o.count, datatype_of<T>, o.peer, o.tag);
    else if constexpr (K == op_kind::recv) {
      receive(o.recv, o.count, datatype_of<T>, o.peer, o.tag);
      return {};
    } else {
      static_assert(K == op_kind::barrier);
      comm::detail::call_desc d;
      d.kind = K;
      arrive(d, false);
      return {};
    }
  }

  /// Buffered send: the message is copied into the mailbox of (this rank, dest).
  request_type post(const void* data, std::size_t count, datatype dt, int dest, int tag) {
    comm::detail::p2p_message m;
    m.tag = tag;
    m.dtype = dt;
    m.count = count;
    m.data.resize(count * size_of(dt));
    comm::detail::copy_bytes(m.data.data(), data, m.data.size());
    auto& g = *state_;
    {
      std::lock_guard lk(g.p2p_mutex);
      g.mailboxes[mailbox(rank_, dest)].push_back(std::move(m));
    }
    g.p2p_cv.notify_all();
    return {};
  }

  // ---- algorithms ------------------------------------------------------------------------------

  bool one_shot(std::size_t staged_bytes) const noexcept { return staged_bytes <= state_->policy.one_shot_max; }
  /// Whether a zero-copy path moving `payload_bytes` per rank writes with streaming stores: when the
  /// payloads of all ranks together reach `streaming_min` (they no longer fit in the caches).
  bool streaming(std::size_t payload_bytes) const noexcept {
    return payload_bytes >= state_->policy.streaming_min / static_cast<std::size_t>(state_->n);
  }

  /// A zero-copy path's copy: streaming stores for big payloads.
  static void move_bytes(void* dst, const void* src, std::size_t bytes, bool stream) noexcept {
    if (bytes == 0 || dst == src) return;
    if (stream) comm::detail::stream_bytes(dst, src, bytes);
    else std::memcpy(dst, src, bytes);
  }

  template <class T>
  const T* src_of(std::uint64_t s, int r) const noexcept {
    return static_cast<const T*>(line(r, s).src);
  }
  template <class T>
  T* dst_of(std::uint64_t s, int r) const noexcept {
    return static_cast<T*>(state_->slots[r].desc[s & 1].dst);
  }

  /// [lo, hi) of the elements this rank reduces in the zero-copy all_reduce: contiguous slices,
  /// cut at cache-line boundaries so that no two ranks write the same line.
  std::pair<std::size_t, std::size_t> slice(std::size_t count, std::size_t elem, int k) const noexcept {
    const std::size_t per_line = std::max<std::size_t>(1, 64 / elem);
    const std::size_t lines = (count + per_line - 1) / per_line;
    const auto n = static_cast<std::size_t>(state_->n);
    const auto kk = static_cast<std::size_t>(k);
    return {std::min(count, lines * kk / n * per_line), std::min(count, lines * (kk + 1) / n * per_line)};
  }

  template <class T>
  comm::detail::call_desc desc(op_kind k, std::size_t count) const noexcept {
    comm::detail::call_desc d;
    d.kind = k;
    d.dtype = datatype_of<T>;
    d.count = count;
    return d;
  }

  template <class T>
  request_type do_all_reduce(const T* send, T* recv, std::size_t count, reduce_op op) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_reduce, count);
    d.op = op;
    ins_.resize(static_cast<std::size_t>(n));
    outs_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    if (one_shot(count * sizeof(T) * static_cast<std::size_t>(n))) {  // each rank reads n payloads
      d.src = stage(send, count * sizeof(T));
      const std::uint64_t s = arrive(d, false);
      for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r);
      comm::detail::reduce_into<T>(op, in, n, &recv, 1, count);
      return {};
    }
    d.src = send;
    d.dst = recv;
    const std::uint64_t s = arrive(d, true);
    const auto [lo, hi] = slice(count, sizeof(T), rank_);
    T** out = reinterpret_cast<T**>(outs_.data());
    for (int r = 0; r < n; ++r) {
      in[r] = src_of<T>(s, r) + lo;
      out[r] = dst_of<T>(s, r) + lo;
    }
    comm::detail::reduce_into<T>(op, in, n, out, n, hi - lo, streaming(count * sizeof(T)));
    complete();
    return {};
  }

  template <class T>
  request_type do_reduce(const T* send, T* recv, std::size_t count, reduce_op op, int root) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::reduce, count);
    d.op = op;
    d.root = root;
    ins_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    if (one_shot(count * sizeof(T) * static_cast<std::size_t>(n))) {  // each rank reads n payloads
      d.src = stage(send, count * sizeof(T));
      const std::uint64_t s = arrive(d, false);
      if (rank_ == root) {
        for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r);
        comm::detail::reduce_into<T>(op, in, n, &recv, 1, count);
      }
      return {};
    }
    d.src = send;
    d.dst = rank_ == root ? recv : nullptr;
    const std::uint64_t s = arrive(d, true);
    const auto [lo, hi] = slice(count, sizeof(T), rank_);
    for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r) + lo;
    T* out = dst_of<T>(s, root) + lo;
    comm::detail::reduce_into<T>(op, in, n, &out, 1, hi - lo, streaming(count * sizeof(T)));
    complete();
    return {};
  }

  template <class T>
  request_type do_reduce_scatter(const T* send, T* recv, std::size_t count, reduce_op op) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::reduce_scatter, count);
    d.op = op;
    ins_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    const std::size_t mine = static_cast<std::size_t>(rank_) * count;
    const std::size_t total_bytes = count * sizeof(T) * static_cast<std::size_t>(n);
    const bool staged = one_shot(total_bytes);
    d.src = staged ? stage(send, total_bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r) + mine;
    comm::detail::reduce_into<T>(op, in, n, &recv, 1, count, !staged && streaming(total_bytes));
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_broadcast(const T* send, T* recv, std::size_t count, int root) {
    auto d = desc<T>(op_kind::broadcast, count);
    d.root = root;
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    if (rank_ == root) d.src = staged ? stage(send, bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    const bool stream = !staged && streaming(bytes);
    if (rank_ == root) move_bytes(recv, send, bytes, stream);
    else move_bytes(recv, src_of<T>(s, root), bytes, stream);
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_gather(const T* send, T* recv, std::size_t count) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_gather, count);
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    d.src = staged ? stage(send, bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    const bool stream = !staged && streaming(bytes * static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      // Own block from the caller's buffer; in place it is already there and move_bytes skips it.
      const T* from = r == rank_ ? send : src_of<T>(s, r);
      move_bytes(recv + static_cast<std::size_t>(r) * count, from, bytes, stream);
    }
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_to_all(const T* send, T* recv, std::size_t count) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_to_all, count);
    const std::size_t bytes = count * sizeof(T);
    const std::size_t total = bytes * static_cast<std::size_t>(n);
    const bool staged = one_shot(total);
    if (staged) {
      d.src = stage(send, total);
    } else if (send == recv) {
      // In place and zero-copy: peers read this rank's blocks while it overwrites them; give them a copy.
      std::byte* copy = scratch_.reserve(total);
      comm::detail::copy_bytes(copy, send, total);
      d.src = copy;
    } else {
      d.src = send;
    }
    const std::uint64_t s = arrive(d, !staged);
    const std::size_t mine = static_cast<std::size_t>(rank_) * count;
    const bool stream = !staged && streaming(total);
    for (int r = 0; r < n; ++r) move_bytes(recv + static_cast<std::size_t>(r) * count, src_of<T>(s, r) + mine, bytes, stream);
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_to_all_v(const T* send, const std::int64_t* sc, const std::int64_t* sd, T* recv,
                               const std::int64_t* rc, const std::int64_t* rd) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_to_all_v, 0);
    d.src = send;
    d.v[0] = sc;
    d.v[1] = sd;
    d.v[2] = rc;
    d.v[3] = rd;
    d.nv = n;
    const std::uint64_t s = arrive(d, true);
    for (int r = 0; r < n; ++r) {
      const auto& dr = state_->slots[r].desc[s & 1];
      const T* from = static_cast<const T*>(dr.src) + dr.v[1][rank_];
      comm::detail::copy_bytes(recv + rd[r], from, static_cast<std::size_t>(rc[r]) * sizeof(T));
    }
    complete();
    return {};
  }

  template <class T>
  request_type do_ppermute(const T* send, T* recv, std::size_t count, std::span<const permute_pair> pairs) {
    auto d = desc<T>(op_kind::ppermute, count);
    d.pairs = pairs;
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    if (staged) {
      d.src = stage(send, bytes);
    } else if (send == recv) {
      std::byte* copy = scratch_.reserve(bytes);
      comm::detail::copy_bytes(copy, send, bytes);
      d.src = copy;
    } else {
      d.src = send;
    }
    const std::uint64_t s = arrive(d, !staged);
    int from = -1;
    for (const auto& p : pairs)
      if (p.dest == rank_) from = p.source;
    if (from >= 0) comm::detail::copy_bytes(recv, src_of<T>(s, from), bytes);
    else std::fill_n(recv, count, T{});
    if (!staged) complete();
    return {};
  }

  void receive(void* buf, std::size_t count, datatype dt, int source, int tag) {
    constexpr auto k = op_kind::recv;
    auto& g = *state_;
    auto& box = g.mailboxes[mailbox(source, rank_)];
    const auto deadline = comm::detail::comm_clock::now() + g.policy.timeout;
    std::unique_lock lk(g.p2p_mutex);
    for (;;) {
      auto it = std::find_if(box.begin(), box.end(), [tag](const comm::detail::p2p_message& m) { return m.tag == tag; });
      if (it != box.end()) {
        if (it->dtype != dt || it->count != count) {
          std::ostringstream os;
          os << "meshlib: point-to-point mismatch: " << g.rank_label(source) << " sent " << it->count << " elements of "
             << it->dtype << " with tag " << tag << " but " << g.rank_label(rank_) << " receives " << count
             << " elements of " << dt;
          lk.unlock();
          g.world->fail(comm::detail::failure_kind::mismatch, -1, os.str());
          g.world->rethrow("seen by " + where(k));
        }
        comm::detail::copy_bytes(buf, it->data.data(), it->data.size());
        box.erase(it);
        return;
      }
      if (g.word.load(std::memory_order_acquire) & comm::detail::failed_bit) {
        lk.unlock();
        g.world->rethrow("seen by " + where(k) + " from " + g.rank_label(source));
      }
      const auto now = comm::detail::comm_clock::now();
      if (departure_is_final(source) || now >= deadline) {
        lk.unlock();
        if (now >= deadline)
          g.world->fail(comm::detail::failure_kind::timeout, world_rank(),
                        "meshlib: recv from " + g.rank_label(source) + " with tag " + std::to_string(tag) +
                            " timed out on " + g.rank_label(rank_) + " after " +
                            std::to_string(std::chrono::duration<double>(g.policy.timeout).count()) + " s: " +
                            g.rank_label(source) + " never sent it");
        else
          g.world->fail(comm::detail::failure_kind::aborted, g.world_ranks[static_cast<std::size_t>(source)],
                        "meshlib: communicator aborted: " + g.rank_label(source) +
                            " left the communicator (its handle was destroyed or its thread ended) while " +
                            g.rank_label(rank_) + " waited to receive from it");
        g.world->rethrow("seen by " + where(k));
      }
      g.p2p_cv.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
  }

  std::vector<const void*> ins_;  ///< scratch arrays of peer pointers, kept to avoid allocations
  std::vector<void*> outs_;
  comm::detail::staging_buffer scratch_;  ///< copy of an in-place buffer that peers read (zero-copy paths)
};

static_assert(communicator<thread_communicator>);

}  // namespace meshlib

// The world that hands out the handles (after the class: it uses it).
#include "meshlib/comm/thread/thread_world.hpp"

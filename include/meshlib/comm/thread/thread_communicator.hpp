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
#include "meshlib/comm/thread/options.hpp"

namespace meshlib {

class thread_world;

/// @brief One participant's handle on a group of threads. Satisfies `communicator`.
///
/// A handle belongs to one thread at a time (it is movable, not copyable) and every operation
/// blocks that thread until the operation is complete, then returns an already-complete
/// `ready_request`. Destroying a handle tells its peers that this rank has left: a peer that
/// waits for it in a collective gets `comm_aborted` instead of waiting for the timeout.
class thread_communicator : public communicator_frontend<thread_communicator> {
  friend class communicator_frontend<thread_communicator>;
  friend class hybrid_communicator;  // restates a timeout of its local steps (timeout_facts), sets patience_

 public:

  /// An empty handle (not part of any group); only assignable and destructible.
  thread_communicator() = default;
  thread_communicator(const thread_communicator&) = delete;
  thread_communicator& operator=(const thread_communicator&) = delete;
  /// Movable: the moved-from communicator is no longer valid.
  thread_communicator(thread_communicator&& o) noexcept
      : state_(std::move(o.state_)), rank_(o.rank_), step_(o.step_), central_(o.central_) {}
  /// Move assignment: the moved-from communicator is no longer valid.
  thread_communicator& operator=(thread_communicator&& o) noexcept {
    if (this != &o) {
      depart();
      state_ = std::move(o.state_);
      rank_ = o.rank_;
      step_ = o.step_;
      central_ = o.central_;
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
    require_valid(detail::op_kind::barrier);
    return state_->world->fail(detail::failure_kind::aborted, world_rank(),
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
    constexpr auto k = detail::op_kind::split;
    check_split(color);
    detail::call_desc d;
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
    auto sub = detail::claim_split_group(g.world, g.id, s, color, members);
    sub->slots[new_rank].claimed.store(true);
    return thread_communicator(std::move(sub), new_rank);
  }

 private:
  friend class thread_world;
  using op_kind = detail::op_kind;

  thread_communicator(std::shared_ptr<detail::group_state> s, int rank) : state_(std::move(s)), rank_(rank) {}

  void depart() noexcept {
    if (!state_) return;
    if (std::uncaught_exceptions() > 0)
      state_->slots[rank_].unwound_at.store(detail::comm_clock::now().time_since_epoch().count() | 1,
                                            std::memory_order_relaxed);
    state_->slots[rank_].departed.store(true, std::memory_order_seq_cst);
    state_->wake_all_unconditionally();
    state_.reset();
  }

  /// Whether rank `r` of this group has left for good: its handle is gone, and if an exception
  /// took it, the grace for that exception's report has passed (see `unwind_grace`).
  bool departure_is_final(int r) const noexcept {
    const auto& slot = state_->slots[static_cast<std::size_t>(r)];
    if (!slot.departed.load()) return false;
    const std::int64_t at = slot.unwound_at.load(std::memory_order_relaxed);
    return at == 0 ||
           detail::comm_clock::now().time_since_epoch().count() - at >=
               std::chrono::duration_cast<detail::comm_clock::duration>(detail::unwind_grace).count();
  }

  std::size_t mailbox(int src, int dst) const noexcept {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(state_->n) + static_cast<std::size_t>(dst);
  }

  // ---- the front end's hooks: its argument checks all run before this rank arrives, so before
  // any data moves -----------------------------------------------------------------------------

  std::string label() const { return state_->rank_label(rank_); }

  void require_valid(op_kind k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(detail::op_name(k)) +
                       " called on an empty thread_communicator handle (default-constructed or moved from)");
  }

  /// Refuses every call once the world has failed.
  void ensure_usable(op_kind k) const {
    require_valid(k);
    if (state_->word.load(std::memory_order_acquire) & detail::failed_bit)
      state_->world->rethrow("refused " + where(k) + ": the communicator has failed");
  }

  /// Fails the world before the front end throws comm_argument_error, so that peers waiting for
  /// this rank are released at once.
  void on_argument_error(op_kind k, const std::string& what) const {
    require_valid(k);
    state_->world->fail(detail::failure_kind::aborted, world_rank(),
                        "meshlib: communicator aborted: " + state_->rank_label(rank_) + " passed an invalid argument to " +
                            std::string(detail::op_name(k)) + ": " + what);
  }

  /// The transport of operation K (the front end has checked its arguments).
  template <op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type) {
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
      detail::call_desc d;
      d.kind = K;
      arrive(d, false);
      return {};
    }
  }

  /// Buffered send: the message is copied into the mailbox of (this rank, dest).
  request_type post(const void* data, std::size_t count, datatype dt, int dest, int tag) {
    detail::p2p_message m;
    m.tag = tag;
    m.dtype = dt;
    m.count = count;
    m.data.resize(count * size_of(dt));
    detail::copy_bytes(m.data.data(), data, m.data.size());
    auto& g = *state_;
    {
      std::lock_guard lk(g.p2p_mutex);
      g.mailboxes[mailbox(rank_, dest)].push_back(std::move(m));
    }
    g.p2p_cv.notify_all();
    return {};
  }

  // ---- synchronisation -------------------------------------------------------------------------
  //
  // Every collective is one step. A rank publishes its call in its flag line for the step (one
  // cache line: step number, call, up to 24 bytes of payload) and:
  // - one-shot steps (payload staged in the slot, nothing of the caller's is read by peers): waits
  //   until every peer's flag line shows the step, checks that the calls agree, and goes on. One
  //   synchronisation; on two cores, one cache-line transfer each way.
  // - zero-copy steps (peers read the caller's own buffers): also arrives at the group's counter;
  //   the rank that arrives last checks the calls and releases the step with a compare-and-swap
  //   that fails once the world has failed, so that a step a rank gave up on (timeout, abort) is
  //   never released and no one reads the buffers of a rank that has left. After the copies all
  //   meet once more (complete()).

  /// The flag line of rank r for step s.
  detail::flag_line& line(int r, std::uint64_t s) const noexcept { return state_->slots[r].line[s & 1]; }

  /// Copies `bytes` of payload where peers will read it in the next step: into the flag line
  /// when it fits, else into this rank's staging buffer.
  const void* stage(const void* data, std::size_t bytes) {
    auto& slot = state_->slots[rank_];
    std::byte* buf = bytes <= detail::inline_capacity ? slot.line[step_ & 1].inline_data
                                                      : slot.staging[step_ & 1].reserve(bytes);
    detail::copy_bytes(buf, data, bytes);
    return buf;
  }

  /// Takes the next step with this rank's call `d` and returns the step number once the step may
  /// proceed (every rank arrived with an agreeing call).
  std::uint64_t arrive(const detail::call_desc& d, bool zero_copy) {
    auto& g = *state_;
    const std::uint64_t s = step_++;
    auto& slot = g.slots[rank_];
    slot.desc[s & 1] = d;
    if (d.kind == op_kind::ppermute) slot.pairs[s & 1].assign(d.pairs.begin(), d.pairs.end());
    auto& ln = slot.line[s & 1];
    ln.kind = d.kind;
    ln.dtype = d.dtype;
    ln.op = d.op;
    ln.root = d.root;
    ln.count = d.count;
    ln.color = d.color;
    ln.key = d.key;
    ln.src = d.src;
    // A release store, not seq_cst: a full fence here would wait for the peers' copies of this
    // line to be invalidated, one cache-line transfer on the critical path. The price is that the
    // sleeper check below may miss a waiter that is just going to sleep; sleepers re-check every
    // millisecond (wait_until), so a missed wake-up costs at most that, and only after the waiter
    // had already waited for milliseconds.
    ln.seq.store(s + 1, std::memory_order_release);
    g.wake();
    if (g.n == 1) return s;
    if (!zero_copy) {
      wait_flags(s, d.kind);
      check_flags(s);
      return s;
    }
    arrive_central(d.kind, s);
    return s;
  }

  /// Waits until every peer's flag line shows step s.
  void wait_flags(std::uint64_t s, op_kind k) {
    const int n = state_->n;
    int next = 0;  // ranks below `next` have arrived
    auto ready = [&] {
      while (next < n && line(next, s).seq.load(std::memory_order_acquire) > s) ++next;
      return next == n;
    };
    auto arrived = [&](int r) { return line(r, s).seq.load(std::memory_order_acquire) > s; };
    wait_until(ready, arrived, k, s, /*cancellable=*/true);
  }

  /// Mismatch detection of a one-shot step; every rank runs it on the same lines, so every rank
  /// reaches the same verdict.
  void check_flags(std::uint64_t s) const {
    auto& g = *state_;
    const auto& mine = line(rank_, s);
    const auto& my_pairs = g.slots[rank_].pairs[s & 1];
    bool ok = true;
    for (int r = 0; r < g.n && ok; ++r)
      if (r != rank_) ok = detail::same_call(mine, line(r, s), my_pairs, g.slots[r].pairs[s & 1]);
    if (!ok) report_mismatch(s, "", /*with_arrays=*/false);
  }

  [[noreturn]] void report_mismatch(std::uint64_t s, const std::string& extra, bool with_arrays) const {
    auto& g = *state_;
    std::ostringstream os;
    os << "meshlib: collective mismatch in step " << s << " of a communicator of " << g.n
       << " ranks: the ranks called different collectives";
    for (int r = 0; r < g.n; ++r)
      os << (r ? "; " : ": ") << g.rank_label(r) << " called "
         << detail::describe(g.slots[r].desc[s & 1], g.slots[r].pairs[s & 1], with_arrays);
    os << extra;
    g.world->fail(detail::failure_kind::mismatch, -1, os.str());
    g.world->rethrow("seen by " + where(g.slots[rank_].desc[s & 1].kind));
  }

  /// The central arrival of a zero-copy step. The release decides, once for all, whether the step
  /// happens; only then does every rank check the calls (from the flag lines and the slots' copies,
  /// which stay valid while any rank may still read them), so the releaser does not read its peers'
  /// lines one after the other on the critical path. all_to_all_v, whose check reads arrays in the
  /// callers' memory, is checked by the releaser while every other rank is still blocked.
  void arrive_central(op_kind k, std::uint64_t s) {
    auto& g = *state_;
    const std::uint64_t target = ++central_;
    g.slots[rank_].arrived.store(target, std::memory_order_release);
    const std::uint64_t c = g.arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (c == target * static_cast<std::uint64_t>(g.n)) {
      if (k == op_kind::all_to_all_v) check_step(s);
      std::uint64_t w = g.word.load(std::memory_order_relaxed);
      do {
        if (w & detail::failed_bit) failed_while_waiting(k, s);
      } while (!g.word.compare_exchange_weak(w, w + 1, std::memory_order_seq_cst, std::memory_order_relaxed));
      g.wake();
    } else {
      auto ready = [&] { return (g.word.load(std::memory_order_acquire) & ~detail::failed_bit) >= target; };
      auto arrived = [&](int r) { return g.slots[r].arrived.load(std::memory_order_acquire) >= target; };
      wait_until(ready, arrived, k, s, /*cancellable=*/true);
    }
    if (k != op_kind::all_to_all_v) check_flags(s);
  }

  /// The second meeting of the zero-copy algorithms: every rank has finished reading and writing
  /// its peers' buffers (each rank raises its `done` flag; one cache-line transfer each way).
  /// Cannot fail: every rank is past the release of the step, so every rank gets here after a
  /// bounded amount of copying; giving up here on a failure would let a rank return (and its
  /// caller free its buffers) while a peer still copies them.
  void complete() {
    detail::stream_fence();  // streaming stores are weakly ordered: drain them before telling peers
    auto& g = *state_;
    if (g.n == 1) return;
    const std::uint64_t s = step_ - 1;
    g.slots[rank_].done.store(s + 1, std::memory_order_release);
    g.wake();
    int next = 0;
    auto ready = [&] {
      while (next < g.n && g.slots[next].done.load(std::memory_order_acquire) > s) ++next;
      return next == g.n;
    };
    wait_until(ready, [](int) { return true; }, op_kind::barrier, s, /*cancellable=*/false);
  }

  /// Mismatch detection of a zero-copy step, run by the last rank to arrive while the others are
  /// blocked (so their descriptors, and the arrays they point to, are safe to read).
  void check_step(std::uint64_t s) const {
    auto& g = *state_;
    const auto& l0 = line(0, s);
    const auto& p0 = g.slots[0].pairs[s & 1];
    bool ok = true;
    for (int r = 1; r < g.n && ok; ++r) ok = detail::same_call(l0, line(r, s), p0, g.slots[r].pairs[s & 1]);
    std::string extra;
    if (ok && l0.kind == op_kind::all_to_all_v) {
      for (int i = 0; i < g.n && ok; ++i)
        for (int j = 0; j < g.n && ok; ++j) {
          const std::int64_t sent = g.slots[i].desc[s & 1].v[0][j];
          const std::int64_t expected = g.slots[j].desc[s & 1].v[2][i];
          if (sent != expected) {
            ok = false;
            extra = "; rank " + std::to_string(i) + " sends " + std::to_string(sent) + " elements to rank " +
                    std::to_string(j) + ", which expects " + std::to_string(expected);
          }
        }
    }
    if (!ok) report_mismatch(s, extra, /*with_arrays=*/true);
  }

  /// Waits until `ready()`: spins, then yields, then blocks with a deadline. When `cancellable`,
  /// throws once the world fails first, when the timeout passes (naming the ranks for which
  /// `arrived(r)` is false) or when such a rank has left.
  template <class Ready, class Arrived>
  void wait_until(Ready&& ready, Arrived&& arrived, op_kind k, std::uint64_t s, bool cancellable) {
    auto& g = *state_;
    auto failed = [&] { return cancellable && (g.word.load(std::memory_order_acquire) & detail::failed_bit); };
    // A first burst of spinning without reading the clock: most waits of a participant with a
    // core of its own end within it.
    for (int i = 0; i < g.policy.burst; ++i) {
      if (ready()) return;
      detail::cpu_relax();
    }
    const auto start = detail::comm_clock::now();
    for (unsigned i = 1;; ++i) {
      if (ready()) return;
      if (failed()) {
        if (ready()) return;
        failed_while_waiting(k, s);
      }
      detail::cpu_relax();
      if ((i & 31u) == 0 && detail::comm_clock::now() - start > g.policy.spin) break;
    }
    for (;;) {
      if (ready()) return;
      if (failed()) {
        if (ready()) return;
        failed_while_waiting(k, s);
      }
      if (detail::comm_clock::now() - start >= g.policy.spin + g.policy.yield) break;
      std::this_thread::yield();
    }
    const auto deadline = start + g.policy.timeout + patience_;
    int departed = -1;
    bool timed_out = false;
    bool done = false;
    {
      std::unique_lock lk(g.mutex);
      g.sleepers.fetch_add(1, std::memory_order_seq_cst);
      for (;;) {
        if (ready()) {
          done = true;
          break;
        }
        if (!cancellable) {
          g.cv.wait_for(lk, std::chrono::milliseconds(1));
          continue;
        }
        if (failed()) break;
        for (int r = 0; r < g.n && departed < 0; ++r)
          if (departure_is_final(r) && !arrived(r)) departed = r;
        if (departed >= 0) break;
        const auto now = detail::comm_clock::now();
        if (now >= deadline) {
          timed_out = true;
          break;
        }
        g.cv.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(1)));
      }
      g.sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
    if (done) return;
    if (departed >= 0) {
      g.world->fail(detail::failure_kind::aborted, g.world_ranks[static_cast<std::size_t>(departed)],
                    "meshlib: communicator aborted: " + g.rank_label(departed) +
                        " left the communicator (its handle was destroyed or its thread ended) while " +
                        g.rank_label(rank_) + " waited for it in " + std::string(detail::op_name(k)) + " (step " +
                        std::to_string(s) + ")");
    } else if (timed_out) {
      detail::missing_report facts;
      facts.waiter = world_rank();
      std::vector<int> missing;
      for (int r = 0; r < g.n; ++r)
        if (!arrived(r)) {
          missing.push_back(r);
          facts.missing.push_back(g.world_ranks[static_cast<std::size_t>(r)]);
        }
      const std::string msg = detail::timeout_message(
          std::string(detail::op_name(k)) + " (step " + std::to_string(s) + ")", g.rank_label(rank_), g.n,
          g.policy.timeout,
          detail::list_participants("rank", missing,
                                    [&](int r) { return g.is_world() ? std::to_string(r) : g.rank_label(r); }),
          "thread_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
      // The root cause is the first rank that never arrived, not this waiter (device_error::device()
      // of spmd names it). The facts let an owner (the hybrid communicator) name them its own way.
      const int culprit = missing.empty() ? world_rank() : facts.missing.front();
      g.world->fail(detail::failure_kind::timeout, culprit, msg, std::move(facts));
    }
    // The failure bit is set now; a step that became ready meanwhile still counts.
    if (ready()) return;
    failed_while_waiting(k, s);
  }

  [[noreturn]] void failed_while_waiting(op_kind k, std::uint64_t s) const {
    state_->world->rethrow("seen by " + where(k) + ", step " + std::to_string(s));
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
    if (stream) detail::stream_bytes(dst, src, bytes);
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
  detail::call_desc desc(op_kind k, std::size_t count) const noexcept {
    detail::call_desc d;
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
      detail::reduce_into<T>(op, in, n, &recv, 1, count);
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
    detail::reduce_into<T>(op, in, n, out, n, hi - lo, streaming(count * sizeof(T)));
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
        detail::reduce_into<T>(op, in, n, &recv, 1, count);
      }
      return {};
    }
    d.src = send;
    d.dst = rank_ == root ? recv : nullptr;
    const std::uint64_t s = arrive(d, true);
    const auto [lo, hi] = slice(count, sizeof(T), rank_);
    for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r) + lo;
    T* out = dst_of<T>(s, root) + lo;
    detail::reduce_into<T>(op, in, n, &out, 1, hi - lo, streaming(count * sizeof(T)));
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
    detail::reduce_into<T>(op, in, n, &recv, 1, count, !staged && streaming(total_bytes));
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
      detail::copy_bytes(copy, send, total);
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
      detail::copy_bytes(recv + rd[r], from, static_cast<std::size_t>(rc[r]) * sizeof(T));
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
      detail::copy_bytes(copy, send, bytes);
      d.src = copy;
    } else {
      d.src = send;
    }
    const std::uint64_t s = arrive(d, !staged);
    int from = -1;
    for (const auto& p : pairs)
      if (p.dest == rank_) from = p.source;
    if (from >= 0) detail::copy_bytes(recv, src_of<T>(s, from), bytes);
    else std::fill_n(recv, count, T{});
    if (!staged) complete();
    return {};
  }

  void receive(void* buf, std::size_t count, datatype dt, int source, int tag) {
    constexpr auto k = op_kind::recv;
    auto& g = *state_;
    auto& box = g.mailboxes[mailbox(source, rank_)];
    const auto deadline = detail::comm_clock::now() + g.policy.timeout;
    std::unique_lock lk(g.p2p_mutex);
    for (;;) {
      auto it = std::find_if(box.begin(), box.end(), [tag](const detail::p2p_message& m) { return m.tag == tag; });
      if (it != box.end()) {
        if (it->dtype != dt || it->count != count) {
          std::ostringstream os;
          os << "meshlib: point-to-point mismatch: " << g.rank_label(source) << " sent " << it->count << " elements of "
             << it->dtype << " with tag " << tag << " but " << g.rank_label(rank_) << " receives " << count
             << " elements of " << dt;
          lk.unlock();
          g.world->fail(detail::failure_kind::mismatch, -1, os.str());
          g.world->rethrow("seen by " + where(k));
        }
        detail::copy_bytes(buf, it->data.data(), it->data.size());
        box.erase(it);
        return;
      }
      if (g.word.load(std::memory_order_acquire) & detail::failed_bit) {
        lk.unlock();
        g.world->rethrow("seen by " + where(k) + " from " + g.rank_label(source));
      }
      const auto now = detail::comm_clock::now();
      if (departure_is_final(source) || now >= deadline) {
        lk.unlock();
        if (now >= deadline)
          g.world->fail(detail::failure_kind::timeout, world_rank(),
                        "meshlib: recv from " + g.rank_label(source) + " with tag " + std::to_string(tag) +
                            " timed out on " + g.rank_label(rank_) + " after " +
                            std::to_string(std::chrono::duration<double>(g.policy.timeout).count()) + " s: " +
                            g.rank_label(source) + " never sent it");
        else
          g.world->fail(detail::failure_kind::aborted, g.world_ranks[static_cast<std::size_t>(source)],
                        "meshlib: communicator aborted: " + g.rank_label(source) +
                            " left the communicator (its handle was destroyed or its thread ended) while " +
                            g.rank_label(rank_) + " waited to receive from it");
        g.world->rethrow("seen by " + where(k));
      }
      g.p2p_cv.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
  }

  std::shared_ptr<detail::group_state> state_;
  int rank_ = 0;
  std::uint64_t step_ = 0;     ///< collectives this handle has taken part in
  std::uint64_t central_ = 0;  ///< central arrivals (two per zero-copy collective)
  std::vector<const void*> ins_;  ///< scratch arrays of peer pointers, kept to avoid allocations
  std::vector<void*> outs_;
  detail::staging_buffer scratch_;  ///< copy of an in-place buffer that peers read (zero-copy paths)
  /// Time this handle waits in a collective beyond the group's timeout before it gives up. Zero
  /// but while a hybrid member waits for its leader's exchange between processes: the process
  /// whose device never arrived must time out first, so that its report (naming that device)
  /// reaches every process before a waiter elsewhere blames the innocent leader.
  std::chrono::nanoseconds patience_{0};
};

static_assert(communicator<thread_communicator>);

/// @brief The shared state of a group of `size` threads, and the source of their handles.
///
/// The world outlives nothing it hands out: handles share ownership of the state, so a handle
/// may outlive its world. Destroying the world while a handle it gave out is still held aborts
/// the world ("the thread_world was destroyed"), which releases every blocked participant.
class thread_world {
 public:
  /// @throws comm_argument_error unless 1 <= size.
  explicit thread_world(int size, thread_comm_options options = {}) {
    if (size < 1)
      throw comm_argument_error("meshlib: a thread_world needs at least 1 participant, got " + std::to_string(size));
    world_ = std::make_shared<detail::world_state>(options, size);
    std::vector<int> ranks(static_cast<std::size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    group_ = detail::make_group(world_, std::move(ranks));
  }
  thread_world(const thread_world&) = delete;
  thread_world& operator=(const thread_world&) = delete;
  /// Movable: the world's shared state moves with it.
  thread_world(thread_world&&) noexcept = default;
  /// Move assignment: the world's shared state moves with it.
  thread_world& operator=(thread_world&&) noexcept = default;
  ~thread_world() {
    if (!group_) return;
    for (int r = 0; r < group_->n; ++r) {
      const auto& slot = group_->slots[r];
      if (slot.claimed.load() && !slot.departed.load()) {
        world_->fail(detail::failure_kind::aborted, -1,
                     "meshlib: communicator aborted: the thread_world was destroyed while rank " + std::to_string(r) +
                         " still held its handle");
        break;
      }
    }
  }

  /// Number of participants.
  [[nodiscard]] int size() const noexcept { return group_->n; }

  /// @brief The handle of participant `rank`, for the thread that plays it. Each rank's handle is
  /// handed out once.
  /// @throws comm_argument_error when rank is out of range or its handle was already taken.
  [[nodiscard]] thread_communicator communicator(int rank) {
    if (rank < 0 || rank >= group_->n)
      throw comm_argument_error("meshlib: thread_world::communicator: rank " + std::to_string(rank) +
                                " is out of range [0, " + std::to_string(group_->n) + ")");
    if (group_->slots[rank].claimed.exchange(true))
      throw comm_argument_error("meshlib: thread_world::communicator: the handle of rank " + std::to_string(rank) +
                                " was already handed out; each rank has one handle");
    return thread_communicator(group_, rank);
  }

  /// @brief Fails the world with `rank` as the root cause (`comm_aborted` everywhere, naming it).
  /// @returns whether this call recorded the root cause.
  bool abort(int rank, std::string_view reason) {
    return abort(rank, reason, "rank " + std::to_string(rank));
  }
  /// @brief As `abort(rank, reason)`, with the failed participant named `who` in the message
  /// ("meshlib: communicator aborted: <who> failed: <reason>"): a hybrid world names the global
  /// device; rank -1 is a participant outside this world (a device of another process).
  bool abort(int rank, std::string_view reason, std::string_view who) {
    return world_->fail(detail::failure_kind::aborted, rank,
                        "meshlib: communicator aborted: " + std::string(who) + " failed: " + std::string(reason));
  }

  /// @brief Fails the world as a collective mismatch that was detected elsewhere (by another
  /// process of a hybrid world): every participant gets `collective_mismatch` with `message`, no
  /// participant being the root cause. @returns whether this call recorded the root cause.
  bool fail_as_mismatch(std::string_view message) { return fail_as(detail::failure_kind::mismatch, message); }

  /// @brief Fails the world with an error detected elsewhere (by another process of a hybrid
  /// world, or by its leader's exchange between processes): every participant gets the error of
  /// `kind` (`comm_aborted`, `comm_timeout`, `collective_mismatch`) with `message`, no participant
  /// of this world being the root cause. @returns whether this call recorded the root cause.
  bool fail_as(detail::failure_kind kind, std::string_view message) {
    return world_->fail(kind, -1, std::string(message));
  }

  /// Whether the world has failed.
  [[nodiscard]] bool failed() const noexcept { return world_->failed.load(); }
  /// World rank of the root cause of the failure, -1 when none or when no one rank caused it (a mismatch).
  [[nodiscard]] int root_cause_rank() const { return world_->root_cause_rank(); }

 private:
  std::shared_ptr<detail::world_state> world_;
  std::shared_ptr<detail::group_state> group_;
};

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief One rank's side of the thread communicator's step protocol: publishing its call for a
/// step, waiting for its peers (spin, yield, block, with the timeout and departures), releasing
/// zero-copy steps, the second meeting after the copies, and mismatch detection. Apart from
/// `thread_communicator` because the protocol is the synchronisation, the communicator the
/// algorithms and the API on top of it; the communicator derives from `step_protocol`, which
/// holds the handle's place in its group (group, rank, step counters).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/blocking_waits.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/spin_then_block.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/thread/detail/call_desc.hpp"
#include "meshlib/comm/thread/detail/group_state.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"
#include "meshlib/comm/thread/detail/wait_policy.hpp"

namespace meshlib::comm::detail {

/// Waits of every thread communicator of the process that went on to block, so far (tests: a
/// waiter whose peer is late ends up blocked, not spinning or yielding for ever).
inline std::atomic<std::uint64_t>& blocked_waits() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

/// @brief A handle's place in its thread group and the protocol of its steps. The base of
/// `thread_communicator`; moving a handle moves its place (not its `patience_`).
/// A template over a tag only so that `MESHLIB_SEPARATE_COMPILATION` can declare its one
/// instantiation `extern template` and compile it once (meshlib/separate_compilation.hpp); use
/// `step_protocol`.
template <class Tag = void>
class basic_step_protocol {
 protected:
  basic_step_protocol() = default;
  basic_step_protocol(std::shared_ptr<group_state> s, int rank) : state_(std::move(s)), rank_(rank) {}
  basic_step_protocol(basic_step_protocol&& o) noexcept
      : state_(std::move(o.state_)), rank_(o.rank_), step_(o.step_), central_(o.central_), cpu_(o.cpu_) {}
  basic_step_protocol& operator=(const basic_step_protocol&) = delete;

  /// "all_reduce on rank 2 of 4", as the front end's `where` names the call and the caller.
  std::string step_where(op_kind k) const {
    return std::string(op_name(k)) + " on " + state_->rank_label(rank_) + " of " + std::to_string(state_->n);
  }
  /// Rank of this participant in the world its group was split from.
  int own_world_rank() const noexcept { return state_->world_ranks[static_cast<std::size_t>(rank_)]; }

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
    // line to be invalidated, one cache-line transfer on the critical path. A waiter that is just
    // going to sleep pays for the fence instead (group_state::wake, sleeper_fence).
    ln.seq.store(s + 1, std::memory_order_release);
    g.wake();
    // Where this rank runs, for peers that wait for it later (wait_until); stored only when it
    // changed, so that the line stays in the peers' caches.
    if (const int cpu = detail::current_cpu(); cpu != cpu_) slot.cpu.store(cpu_ = cpu, std::memory_order_relaxed);
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
         << detail::describe_call(detail::summary_of(g.slots[r].desc[s & 1], g.slots[r].pairs[s & 1], with_arrays));
    os << extra;
    g.world->fail(detail::failure_kind::mismatch, -1, os.str());
    g.world->rethrow("seen by " + step_where(g.slots[rank_].desc[s & 1].kind));
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
      const auto bad = detail::first_counts_disagreement(
          static_cast<std::size_t>(g.n), [&](std::size_t i, std::size_t j) { return g.slots[i].desc[s & 1].v[0][j]; },
          [&](std::size_t j, std::size_t i) { return g.slots[j].desc[s & 1].v[2][i]; });
      if (bad) {
        ok = false;
        extra = "; " + detail::describe_counts_disagreement(g.rank_label(static_cast<int>(bad->sender)),
                                                            g.rank_label(static_cast<int>(bad->receiver)), bad->sent,
                                                            bad->expected);
      }
    }
    if (!ok) report_mismatch(s, extra, /*with_arrays=*/true);
  }

  /// Waits until `ready()`: spins (for this thread's adaptive budget, at most the policy's window),
  /// yields (oversubscribed groups only), then blocks with a deadline: the spin-then-block path of
  /// comm/detail/spin_then_block.hpp, which the device threads share. When `cancellable`, throws
  /// once the world fails first, when the timeout passes (naming the ranks for which `arrived(r)`
  /// is false) or when such a rank has left.
  template <class Ready, class Arrived>
  void wait_until(Ready&& ready, Arrived&& arrived, op_kind k, std::uint64_t s, bool cancellable) {
    auto& g = *state_;
    auto failed = [&] { return cancellable && (g.word.load(std::memory_order_acquire) & detail::failed_bit); };
    // A first burst of spinning without reading the clock: most waits of a participant with a
    // core of its own end within it.
    if (ready()) return;  // nothing to learn about spinning from a wait that did not wait
    for (int i = 1; i < g.policy.burst; ++i) {
      detail::cpu_relax();
      if (ready()) return detail::adaptive_spin::caught(g.policy.spin);
    }
    const auto start = detail::comm_clock::now();
    // A thread that prefers blocking (a communication worker: comm/detail/blocking_waits.hpp)
    // neither spins nor yields: its core is better spent on the computation it overlaps.
    if (!detail::prefer_blocking_waits()) {
      // A late peer that last ran on this very CPU cannot arrive while this thread spins: give it
      // the core at once (a yield is a context switch; blocking would add a wake-up). Two unpinned
      // threads that the scheduler put on one core of a busy machine: 8 B all_reduce 10.3 us, 16.8
      // spinning first (docs/benchmarks.md, "Waiting and the large all_reduce"), 14-28 blocking.
      const int here = detail::current_cpu();
      bool beside = false;
      for (int r = 0; r < g.n && !beside && here >= 0; ++r)
        beside = r != rank_ && !arrived(r) && g.slots[r].cpu.load(std::memory_order_relaxed) == here;
      // Otherwise spin, for the thread's budget (wait_policy.hpp, adaptive_spin: cut short while
      // its spinning has been in vain), at most the policy's window.
      if (!beside) {
        if (detail::poll_for([&] { return ready() || failed(); }, detail::adaptive_spin::budget(g.policy.spin))) {
          if (ready()) return detail::adaptive_spin::caught(g.policy.spin);
          failed_while_waiting(k, s);
        }
        detail::adaptive_spin::missed(g.policy.spin);
      }
      // Yield (a bounded time) only where a peer needs this core to arrive at all: it shares this
      // CPU, or there are more participants than cores. A peer on another core that is late will
      // not come sooner for this thread's system calls, and they would take a core from others.
      if (beside || g.policy.oversubscribed) {
        const auto until = detail::comm_clock::now() + g.policy.yield;
        for (;;) {
          if (ready()) return;
          if (failed()) {
            if (ready()) return;
            failed_while_waiting(k, s);
          }
          if (detail::comm_clock::now() >= until) break;
          std::this_thread::yield();
        }
      }
    }
    const auto deadline = start + g.policy.timeout + patience_;
    int departed = -1;
    bool timed_out = false;
    bool done = false;
    {
      detail::blocked_waits().fetch_add(1, std::memory_order_relaxed);
      g.sleepers.fetch_add(1, std::memory_order_seq_cst);
      // With the process-wide barrier no waker can miss this sleeper, and the re-check below is
      // only for departures and the deadline; without it a missed wake-up costs at most the time
      // waited so far (the re-check period grows from the spin window to 1 ms).
      const bool fenced = detail::sleeper_fence();
      auto recheck = [&](detail::comm_clock::time_point now) {
        if (fenced) return std::chrono::duration_cast<detail::comm_clock::duration>(std::chrono::milliseconds(1));
        return std::clamp<detail::comm_clock::duration>(now - start, detail::spin_window, std::chrono::milliseconds(1));
      };
      std::unique_lock lk(g.mutex);
      for (;;) {
        if (ready()) {
          done = true;
          break;
        }
        if (!cancellable) {
          g.cv.wait_for(lk, recheck(detail::comm_clock::now()));
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
        g.cv.wait_until(lk, std::min(deadline, now + recheck(now)));
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
      facts.waiter = own_world_rank();
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
      const int culprit = missing.empty() ? own_world_rank() : facts.missing.front();
      g.world->fail(detail::failure_kind::timeout, culprit, msg, std::move(facts));
    }
    // The failure bit is set now; a step that became ready meanwhile still counts.
    if (ready()) return;
    failed_while_waiting(k, s);
  }

  [[noreturn]] void failed_while_waiting(op_kind k, std::uint64_t s) const {
    state_->world->rethrow("seen by " + step_where(k) + ", step " + std::to_string(s));
  }

  std::shared_ptr<detail::group_state> state_;
  int rank_ = 0;
  std::uint64_t step_ = 0;     ///< collectives this handle has taken part in
  std::uint64_t central_ = 0;  ///< central arrivals (two per zero-copy collective)
  int cpu_ = -1;               ///< the CPU last published in this rank's slot
  /// Time this handle waits in a collective beyond the group's timeout before it gives up. Zero
  /// but while a hybrid member waits for its leader's exchange between processes: the process
  /// whose device never arrived must time out first, so that its report (naming that device)
  /// reaches every process before a waiter elsewhere blames the innocent leader.
  std::chrono::nanoseconds patience_{0};
};

/// @brief The thread communicator's step protocol (`basic_step_protocol`'s one instantiation).
using step_protocol = basic_step_protocol<>;

}  // namespace meshlib::comm::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The persistent device threads that run every local device at once: `spmd` and
/// `shard_map` calls on a `thread_runner` (exec/thread_runner.hpp), and global-view operations
/// (elementwise, reductions, matmul, transpose on `sharded_tensor`s), which reach them through the
/// tensor layer's dispatcher hook (tensor/for_each_device.hpp) that this header installs.
///
/// Why persistent: starting and joining a thread per device costs tens of microseconds per device
/// and call (measured: an empty 8-device `spmd` took 3.5 ms that way), more than a small kernel or
/// a training step's collectives; these threads start on first use and wait, blocked on a futex so
/// that an oversubscribed machine loses no core to them, for the next job. Only while every index
/// of the job has a core of its own do the waiting threads (worker and caller) first poll for
/// at most 50 us: on an idle virtual machine a futex wake-up of a sleeping core took 27-50 us per
/// empty 2-device `spmd` (1.5-2.8 us with the bounded poll); oversubscribed, they block at once
/// (an unbounded spin made a 2-device call 5x slower on a busy machine: the spinner held the core
/// the caller needed). Index `i` of a job is
/// always run by the same thread (the caller runs index 0, worker `i` the others), so device `i`
/// keeps its thread, its thread-local state and its execution-space instance from call to call.
/// Workers are pinned to one core each, none to the core the caller runs on when it submits the
/// job, while a job has no more indices than the process has cores, which keeps two device threads
/// off one core (measured: unpinned, one in a few launches
/// took 150x longer); for a larger job they are unpinned again, free to move to an idle core.
///
/// The pool lives in the exec layer with the runners that own it (ARCHITECTURE.md: exec owns the
/// device threads); the tensor layer below only declares the hook its global-view operations
/// dispatch through. There is one process-wide pool (`get()`), and a `thread_runner` owns one of
/// its own for as long as the user keeps it.
///
/// No job waits for the pool: a job submitted from inside a job (from a device thread of any pool)
/// or while another thread's job runs is refused by `try_run`, and `run` then runs its indices one
/// after another on the calling thread (global-view operations: their devices do not talk to each
/// other), while `spmd` starts threads of its own (its devices do).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif

#include "meshlib/comm/detail/spin_then_block.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/tensor/for_each_device.hpp"

namespace meshlib::exec::detail {

/// Whether the calling thread is running an index of a `device_workers` job (any pool's).
inline bool& in_device_worker() noexcept {
  thread_local bool inside = false;
  return inside;
}

/// A pool of persistent device threads (see the file comment).
class device_workers {
 public:
  /// The process-wide pool: started on first use, its threads joined at exit.
  static device_workers& get() {
    static device_workers w;
    return w;
  }
  /// An empty pool; threads start on the first job that needs them. `may_pin`: whether workers
  /// pin themselves to a core while a job fits the cores (false for the threads of a process
  /// that shares its node's cores with other processes of one run: each would pin its worker `i`
  /// to the same core `i`; MPI launchers bind the processes themselves).
  explicit device_workers(bool may_pin = true) : may_pin_(may_pin) {}
  device_workers(const device_workers&) = delete;
  device_workers& operator=(const device_workers&) = delete;
  /// Stops and joins every worker (none may be running a job: jobs are synchronous).
  ~device_workers() {
#if defined(__linux__)
    if (forked()) {  // the workers live in the parent only: nothing to stop or join here
      for (auto& w : workers_) (void)w.release();
      return;
    }
#endif
    stop_.store(true, std::memory_order_release);
    for (auto& w : workers_) {
      w->go.fetch_add(1, std::memory_order_release);
      w->go.notify_one();
    }
    for (auto& w : workers_) w->thread.join();
  }

  /// Calls `f(i)` for every `i` in `[0, count)` at once, `i = 0` on the calling thread and `i` on
  /// worker `i`, and returns when all have returned; rethrows the exception of the lowest `i` that
  /// threw. When the pool cannot take the job (see the file comment), runs the indices one after
  /// another on the calling thread instead.
  template <class F>
  void run(std::size_t count, F& f) {
    std::vector<std::exception_ptr> errors(count);
    auto guarded = [&](std::size_t i) {
      try {
        f(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    if (!try_run(count, guarded)) {
      inside_guard g;
      for (std::size_t i = 0; i < count; ++i) guarded(i);
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  /// As `run`, but refuses (returns false, having run nothing) when called from a device thread or
  /// while another thread's job runs, so that a caller whose indices must run at the same time
  /// (they communicate) can start threads of its own instead.
  /// `width`: the cores each index computes on (its device's team of Kokkos threads, which the
  /// index's thread starts and which inherit its pinning); workers are pinned to `width` cores each
  /// while `count * width` cores are there.
  /// @pre `f` does not throw (a worker has nowhere to send an exception: catch inside `f`).
  template <class F>
  [[nodiscard]] bool try_run(std::size_t count, F& f, std::size_t width = 1) {
    if (count == 0) return true;
    if (in_device_worker()) return false;
#if defined(__linux__)
    if (forked()) return false;  // a child of fork() has none of the workers
#endif
    std::unique_lock submit(submit_, std::try_to_lock);
    if (!submit.owns_lock()) return false;
    if (count == 1) {
      inside_guard g;
      f(std::size_t{0});
      return true;
    }
    grow(count - 1);
    const bool pin = may_pin_ && pin_fits(count * width);
    job_ = job{[](void* p, std::size_t i) { (*static_cast<F*>(p))(i); }, &f, count, pin, pin ? caller_cpu() : -1, width};
    remaining_.store(static_cast<std::uint32_t>(count - 1), std::memory_order_relaxed);
    for (std::size_t i = 1; i < count; ++i) {
      auto& w = *workers_[i - 1];
      w.go.fetch_add(1, std::memory_order_release);  // publishes job_ to worker i
      w.go.notify_one();
    }
    {
      inside_guard g;
      f(std::size_t{0});
    }
    const bool spin = job_.pin;
    for (std::uint32_t left = remaining_.load(std::memory_order_acquire); left != 0;
         left = remaining_.load(std::memory_order_acquire))
      if (!spin || !spin_while_equal(remaining_, left)) remaining_.wait(left, std::memory_order_acquire);
    return true;
  }

  /// Worker threads started so far (index `i` of a job runs on the `i`-th, for `i >= 1`).
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size(); }

 private:
  /// Polls `a` for up to `spin_window` while it still holds `old`; true when it changed: the
  /// thread communicator's spin-then-block path (comm/detail/spin_then_block.hpp, where the window
  /// is measured), used only while every index of the job has a core of its own (never when
  /// oversubscribed). Waking a blocked thread on an idle core of a virtual machine costs tens of
  /// microseconds (measured on the idle 2-core machine: 27-50 us per empty 2-device call blocked,
  /// against 6 us when the cores were busy), more than the short calls of a training step take; a
  /// bounded spin keeps that cost off the common back-to-back calls and gives the core back soon after.
  static bool spin_while_equal(const std::atomic<std::uint32_t>& a, std::uint32_t old) noexcept {
    return experimental::poll_for([&] { return a.load(std::memory_order_acquire) != old; }, experimental::spin_window);
  }

  struct inside_guard {
    bool previous = in_device_worker();
    inside_guard() { in_device_worker() = true; }
    ~inside_guard() { in_device_worker() = previous; }
  };

  struct job {
    void (*call)(void*, std::size_t) = nullptr;
    void* ctx = nullptr;
    std::size_t count = 0;
    bool pin = false;
    int caller_cpu = -1;  // where the caller (index 0) ran when it submitted the job; -1: unknown
    std::size_t width = 1;  // cores per index
  };

  struct worker {
    std::atomic<std::uint32_t> go{0};  // bumped once per job for this worker, and at stop
    std::thread thread;
  };

#if defined(__linux__)
  /// The CPUs this process may run on when the pool started its first worker.
  static const cpu_set_t& allowed_cpus() {
    static const cpu_set_t set = [] {
      cpu_set_t s;
      CPU_ZERO(&s);
      if (pthread_getaffinity_np(pthread_self(), sizeof(s), &s) != 0) CPU_ZERO(&s);
      return s;
    }();
    return set;
  }
#endif
  /// The CPU the calling thread runs on, or -1.
  static int caller_cpu() noexcept { return experimental::current_cpu(); }

#if defined(__linux__)
  /// Pins worker `index` to `width` CPUs of its own beside the caller's: with the allowed CPUs in
  /// order but the caller's first, block `index` of `width` of them (block 0, with the caller's
  /// CPU, is left to the caller and its team). Why not simply the `index`-th CPU: the caller
  /// (device 0) is the user's thread and is never pinned, so on a busy machine the scheduler had
  /// left it on the CPU of worker 1 for whole runs (issue 27), and two device threads on one core
  /// wait for each other through context switches (9 us per 8 B psum, ~107 us with the full spin,
  /// against 0.5 us apart). A worker's team threads (Kokkos OpenMP) inherit its block.
  static void pin_beside(std::size_t index, int caller, std::size_t width) {
    const cpu_set_t& allowed = allowed_cpus();
    std::vector<int> order;
    if (caller >= 0 && caller < CPU_SETSIZE && CPU_ISSET(caller, &allowed)) order.push_back(caller);
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &allowed) && cpu != caller) order.push_back(cpu);
    if (order.empty()) return;
    cpu_set_t block;
    CPU_ZERO(&block);
    for (std::size_t k = index * width; k < (index + 1) * width; ++k) CPU_SET(order[k % order.size()], &block);
    pthread_setaffinity_np(pthread_self(), sizeof(block), &block);
  }
#endif

  /// Whether every index of a `count`-index job (the caller's included) gets a core of its own.
  static bool pin_fits([[maybe_unused]] std::size_t count) {
#if defined(__linux__)
    return count <= static_cast<std::size_t>(CPU_COUNT(&allowed_cpus()));
#else
    return false;
#endif
  }

#if defined(__linux__)
  /// Whether this is a child process of the one that started the workers.
  [[nodiscard]] bool forked() const noexcept { return ::getpid() != owner_; }
  const pid_t owner_ = ::getpid();
#endif

  /// Starts workers until there are `n`.
  void grow(std::size_t n) {
    while (workers_.size() < n) {
      auto w = std::make_unique<worker>();
      const std::size_t index = workers_.size() + 1;
      w->thread = std::thread([this, index, &go = w->go] { serve(index, go); });
      workers_.push_back(std::move(w));
    }
  }

  /// Worker `index`'s loop: block until its `go` moves, run its index of the job, count down.
  void serve(std::size_t index, std::atomic<std::uint32_t>& go) {
    in_device_worker() = true;
    bool pinned = false;
    int pinned_beside = -1;  // the caller's CPU this worker's pin avoids
    std::size_t pinned_width = 1;  // the cores of its block
    std::uint32_t seen = 0;
    for (;;) {
      if (!pinned || !spin_while_equal(go, seen)) go.wait(seen, std::memory_order_acquire);
      seen = go.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      const job j = job_;
#if defined(__linux__)
      // Pinned while the job fits the cores, off the caller's CPU (`pin_beside`); given all CPUs
      // back for a larger job. A syscall only when the policy or the caller's CPU changes.
      if (j.pin != pinned || (j.pin && (j.caller_cpu != pinned_beside || j.width != pinned_width))) {
        if (j.pin) pin_beside(index, j.caller_cpu, j.width);
        else pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &allowed_cpus());
        pinned = j.pin;
        pinned_beside = j.caller_cpu;
        pinned_width = j.width;
      }
#endif
      j.call(j.ctx, index);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  const bool may_pin_ = true;
  std::mutex submit_;  // one job at a time; held only by try_lock (no job waits for another)
  job job_{};
  std::atomic<std::uint32_t> remaining_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::unique_ptr<worker>> workers_;  // workers_[i] serves index i + 1
};

/// Runs `call(ctx, i)` for every `i` in `[0, count)` on the process-wide device threads: what
/// the tensor layer's global-view operations dispatch to (tensor/for_each_device.hpp).
inline void run_on_device_workers(std::size_t count, void* ctx, void (*call)(void*, std::size_t)) {
  auto f = [ctx, call](std::size_t i) { call(ctx, i); };
  device_workers::get().run(count, f);
}

/// Installs the device threads as the tensor layer's dispatcher when a program includes exec:
/// tensor cannot include this layer, so it exposes the hook and this layer fills it (before
/// `main`; a global-view operation run before that runs its devices one after another).
inline const bool device_workers_installed = [] {
  experimental::device_dispatcher.store(&run_on_device_workers, std::memory_order_release);
  return true;
}();

}  // namespace meshlib::exec::detail

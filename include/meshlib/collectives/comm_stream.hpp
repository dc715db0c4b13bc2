// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `detail::comm_stream`: one device's communication worker, what makes the typed
/// collectives' `*_start` forms (collectives/collective_request.hpp) asynchronous on host backends.
///
/// Why a worker thread and one queue per device: a host backend (thread, MPI) moves the bytes on
/// the thread that calls it, so a collective can only run beside the device's computation on
/// another thread. One queue per device, run in issue order, is an NCCL stream: every device of a
/// group issues the same collectives in the same order (SPMD does), so the workers of a group meet
/// in the same order too, and nothing can deadlock that would not deadlock synchronously.
///
/// Why reuse is safe: a communicator handle belongs to one thread at a time. The device thread
/// hands a group's handle to the worker while anything is queued on it, and takes it back only
/// after `drain(group)`: every synchronous collective (`device_context::comm`) drains its group
/// first, so each communicator sees the device's collectives in one order, whichever thread runs
/// them, and the mutex orders the memory between the two threads. A synchronous collective on
/// another group runs beside the worker (a tensor-parallel `psum` during backward while a gradient
/// bucket is summed over the data axis): on a host backend groups are independent, and each
/// group's order is the program's on every device, so no device waits for one that waits for it.
/// A stream backend (NCCL) drains everything: its kernels of different groups must be launched in
/// one order on every device.
///
/// Errors: a queued operation that throws (a peer failed, a timeout, a mismatch: the backend's own
/// abort and timeout machinery, so no wait is unbounded) keeps its exception in its `stream_op`,
/// rethrown by the request's `wait()`; later operations run (and fail as the backend decides:
/// a failed world refuses every later call with the root cause's error).

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace meshlib::detail {

/// One queued operation's completion, shared by the worker and the request that waits for it.
struct stream_op {
  /// Set (release) after `error`, under the stream's mutex. Atomic so that a request can see it
  /// without the stream: every operation is done once its stream has stopped, so a request that
  /// outlives its device's call (dropped in an unwinding, say) never touches the stream again.
  std::atomic<bool> done{false};
  std::exception_ptr error;  ///< what the operation threw, if it did
};

/// A completion that is already complete (an operation a `*_start` form ran at once).
inline std::shared_ptr<stream_op> completed_op() {
  auto op = std::make_shared<stream_op>();
  op->done.store(true, std::memory_order_release);
  return op;
}

/// A device's communication worker (see the file comment). The worker thread starts on the first
/// `enqueue`; the destructor drains the queue and joins it.
class comm_stream {
 public:
  comm_stream() = default;
  comm_stream(const comm_stream&) = delete;
  comm_stream& operator=(const comm_stream&) = delete;
  ~comm_stream() { stop(); }

  /// Queues `job`, an operation on the communicator named `group` (an axis mask), behind every
  /// operation queued before it; returns its completion.
  std::shared_ptr<stream_op> enqueue(std::function<void()> job, std::uint64_t group) {
    auto op = std::make_shared<stream_op>();
    {
      std::lock_guard lock(m_);
      if (!worker_.joinable()) worker_ = std::thread([this] { run(); });
      queue_.push_back({std::move(job), op, group});
      ++count_of(group);
      ++pending_;
      outstanding_.store(pending_, std::memory_order_release);
    }
    work_.notify_one();
    return op;
  }

  /// Blocks until `op` is complete; rethrows what it threw.
  void wait(const stream_op& op) {
    if (!op.done.load(std::memory_order_acquire)) {
      std::unique_lock lock(m_);
      done_.wait(lock, [&] { return op.done.load(std::memory_order_acquire); });
    }
    if (op.error) std::rethrow_exception(op.error);
  }

  /// Whether `op` is complete (does not throw: `wait` reports its error).
  [[nodiscard]] static bool test(const stream_op& op) noexcept { return op.done.load(std::memory_order_acquire); }

  /// Blocks until every queued operation is complete (their errors stay with their requests).
  void drain() {
    std::unique_lock lock(m_);
    done_.wait(lock, [&] { return pending_ == 0; });
  }
  /// Blocks until every queued operation on `group` is complete (and so every one queued before
  /// them: the queue runs in order).
  void drain(std::uint64_t group) {
    std::unique_lock lock(m_);
    done_.wait(lock, [&] { return count_of(group) == 0; });
  }

  /// Whether nothing is queued or running: the synchronous collectives' fast path, one load (the
  /// device thread is the only one that queues, so `false` cannot turn stale into `true` unseen).
  [[nodiscard]] bool idle() const noexcept { return outstanding_.load(std::memory_order_acquire) == 0; }

  /// Drains and joins the worker (the device context calls it before its communicators go).
  void stop() noexcept {
    {
      std::unique_lock lock(m_);
      if (!worker_.joinable()) return;
      done_.wait(lock, [&] { return pending_ == 0; });
      stopping_ = true;
    }
    work_.notify_one();
    worker_.join();
    stopping_ = false;
  }

 private:
  void run() {
#if defined(__linux__)
    // No wake-up preemption of the device thread: on a machine without a spare core, a started
    // collective's worker, woken by the device thread, would otherwise take that core at once and
    // the computation it should overlap would wait for it (docs/benchmarks.md, "Overlapped
    // gradient synchronisation", has the measurements, which this did not change much).
    sched_param param{};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, nothing left
      auto [job, op, group] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      job = nullptr;  // what the job holds goes before the device thread is told it may go on
      lock.lock();
      op->error = std::move(error);
      op->done.store(true, std::memory_order_release);
      --count_of(group);
      --pending_;
      outstanding_.store(pending_, std::memory_order_release);
      done_.notify_all();
    }
  }

  struct entry {
    std::function<void()> job;
    std::shared_ptr<stream_op> op;
    std::uint64_t group;
  };
  /// Queued or running operations on `group` (a device uses a handful of groups: a short list).
  std::size_t& count_of(std::uint64_t group) {
    for (auto& [g, n] : per_group_)
      if (g == group) return n;
    return per_group_.emplace_back(group, 0).second;
  }

  std::mutex m_;
  std::condition_variable work_;  ///< the worker waits for a job
  std::condition_variable done_;  ///< the device thread waits for completions
  std::deque<entry> queue_;
  std::vector<std::pair<std::uint64_t, std::size_t>> per_group_;
  std::size_t pending_ = 0;  ///< queued or running
  std::atomic<std::size_t> outstanding_{0};  ///< `pending_`, readable without the lock
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace meshlib::detail

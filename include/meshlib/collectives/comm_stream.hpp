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

#include "meshlib/comm/detail/blocking_waits.hpp"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace meshlib::collectives::detail {

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

/// A communication worker thread, parked between the calls that use it (see `comm_stream`): a
/// device thread's `spmd` / `shard_map` calls take one from that thread's pool (`take`) and give it
/// back when their stream stops (`give_back`), so a training loop of one call per step starts its
/// workers once, not once per step per device.
class comm_worker {
 public:
  comm_worker() = default;
  comm_worker(const comm_worker&) = delete;
  comm_worker& operator=(const comm_worker&) = delete;
  ~comm_worker() {
    {
      std::lock_guard lock(m_);
      quit_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  /// Runs `loop` on the worker thread (started on the first call); the caller makes sure that the
  /// previous loop has returned.
  void post(std::function<void()> loop) {
    {
      std::lock_guard lock(m_);
      loop_ = std::move(loop);
      if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
    }
    cv_.notify_one();
  }

  /// A parked worker of this thread's pool, or a new one.
  static std::unique_ptr<comm_worker> take() {
    auto& pool = parked();
    if (pool.empty()) return std::make_unique<comm_worker>();
    auto w = std::move(pool.back());
    pool.pop_back();
    return w;
  }
  /// Parks `w` (whose loop has returned) in this thread's pool, joined when this thread ends.
  static void give_back(std::unique_ptr<comm_worker> w) noexcept {
    try {
      parked().push_back(std::move(w));
    } catch (...) {  // no room to park it: `w` is joined here instead
    }
  }

 private:
  static std::vector<std::unique_ptr<comm_worker>>& parked() {
    thread_local std::vector<std::unique_ptr<comm_worker>> pool;
    return pool;
  }
  void main() {
#if defined(__linux__)
    // No wake-up preemption of the device thread: on a machine without a spare core, a started
    // collective's worker, woken by the device thread, would otherwise take that core at once and
    // the computation it should overlap would wait for it (docs/benchmarks.md, "Overlapped
    // gradient synchronisation", has the measurements, which this did not change much).
    sched_param param{};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
    experimental::prefer_blocking_waits() = true;  // nothing waits on this thread but the busy device thread
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return quit_ || loop_ != nullptr; });
      if (loop_ == nullptr) return;  // quitting, nothing posted
      auto loop = std::move(loop_);
      loop_ = nullptr;
      lock.unlock();
      loop();
      loop = nullptr;
      lock.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::function<void()> loop_;
  bool quit_ = false;
  std::thread thread_;
};

/// A device's communication worker (see the file comment). The worker starts on the first
/// `enqueue` (a parked `comm_worker` of the device thread when it has one); the destructor drains
/// the queue and parks it again.
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
      if (!worker_) {
        worker_ = comm_worker::take();
        running_ = true;
        worker_->post([this] { run(); });
      }
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

  /// Drains the queue and parks the worker (the device context calls it before its communicators
  /// go): once it returns, the worker no longer touches this stream.
  void stop() noexcept {
    std::unique_ptr<comm_worker> w;
    {
      std::unique_lock lock(m_);
      if (!worker_) return;
      done_.wait(lock, [&] { return pending_ == 0; });
      stopping_ = true;
      work_.notify_one();
      done_.wait(lock, [&] { return !running_; });
      stopping_ = false;
      w = std::move(worker_);
    }
    comm_worker::give_back(std::move(w));
  }

 private:
  /// The worker's loop for this stream: returns once `stop` asks and the queue is empty.
  void run() {
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {  // stopping, nothing left: the last touch of this stream
        running_ = false;
        done_.notify_all();
        return;
      }
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
  bool running_ = false;  ///< the worker is in `run` (from the first `enqueue` until `stop`)
  std::unique_ptr<comm_worker> worker_;
};

}  // namespace meshlib::collectives::detail

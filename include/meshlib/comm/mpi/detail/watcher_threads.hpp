// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `watcher_threads`: the threads that run the hybrid worlds' abort-channel watchers,
/// started once and parked between calls. Internal to the MPI backends.
///
/// Why: every call on a hybrid mesh builds a world whose watcher polls the abort channel while the
/// call runs. Starting and joining a thread for it cost 37 us of the call's ~190 us (docs/design.md,
/// measured on 2 processes); a parked thread takes the next watcher in about a futex wake-up.
///
/// The threads are detached and never joined: a parked thread holds nothing, and one still running
/// a watcher at exit (a world not closed) must not make exit wait for it.

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace meshlib::comm::detail {

/// @brief Runs jobs on parked threads, one job per thread at a time; a job that finds every thread
/// busy (two hybrid calls at once from different threads) gets a new thread, which stays.
class watcher_threads {
 public:
  /// What `run` returns: `join()` waits until the job has returned (as `std::thread::join`).
  class job {
   public:
    job() = default;
    /// True until `join()`: the job was given to a thread and not joined yet.
    [[nodiscard]] bool joinable() const noexcept { return state_ != nullptr; }
    /// Waits until the job has returned.
    void join() {
      if (!state_) return;
      std::unique_lock lk(state_->mutex);
      state_->cv.wait(lk, [&] { return state_->done; });
      lk.unlock();
      state_.reset();
    }

   private:
    friend class watcher_threads;
    struct state {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    std::shared_ptr<state> state_;
  };

  /// The process's threads (never destroyed: see the file comment).
  static watcher_threads& get() {
    static auto* threads = new watcher_threads;
    return *threads;
  }

  /// Runs `fn` (which must not throw) on a parked thread, or a new one when none is parked.
  job run(std::function<void()> fn) {
    job j;
    j.state_ = std::make_shared<job::state>();
    std::shared_ptr<slot> s;
    {
      std::lock_guard lk(mutex_);
      for (auto& candidate : slots_)
        if (!candidate->busy) {
          s = candidate;
          break;
        }
      if (!s) {
        s = slots_.emplace_back(std::make_shared<slot>());
        std::thread([s] { serve(*s); }).detach();
      }
      s->busy = true;  // under mutex_: no other run() picks this slot
    }
    {
      std::lock_guard lk(s->mutex);
      s->fn = std::move(fn);
      s->owner = j.state_;
    }
    s->cv.notify_one();
    return j;
  }

 private:
  struct slot {
    std::mutex mutex;
    std::condition_variable cv;
    std::function<void()> fn;               // guarded by mutex
    std::shared_ptr<job::state> owner;      // guarded by mutex
    bool busy = false;                      // guarded by watcher_threads::mutex_
  };

  static void serve(slot& s) {
    for (;;) {
      std::function<void()> fn;
      std::shared_ptr<job::state> owner;
      {
        std::unique_lock lk(s.mutex);
        s.cv.wait(lk, [&] { return static_cast<bool>(s.fn); });
        fn = std::move(s.fn);
        s.fn = nullptr;
        owner = std::move(s.owner);
      }
      fn();
      fn = nullptr;  // what the job captured is released before it counts as done
      {
        std::lock_guard lk(get().mutex_);
        s.busy = false;
      }
      {
        std::lock_guard lk(owner->mutex);
        owner->done = true;
      }
      owner->cv.notify_all();
    }
  }

  std::mutex mutex_;
  std::vector<std::shared_ptr<slot>> slots_;  // guarded by mutex_
};

}  // namespace meshlib::comm::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The persistent device worker threads that run global-view operations (elementwise,
/// reductions, matmul, transpose on `sharded_tensor`s) on every local device at once.
///
/// Why persistent: starting and joining a thread per device costs tens of microseconds per call,
/// more than a small kernel; these threads start on first use and wait (blocked, so an
/// oversubscribed machine loses no core to them) for the next operation. Device `d` of a call is
/// always run by the same worker (its index in the call's device list), on device `d`'s own
/// execution-space instance (`device_instance`), so its kernels never queue behind another
/// device's. Workers are pinned to one core each when the machine has at least as many cores as
/// the call has devices, which keeps two device threads off one core (measured: unpinned, one in
/// a few launches took 150x longer).
///
/// The calling thread runs the first device itself. A global-view operation called from inside
/// another one (or from a worker) runs its devices one after another instead of waiting for
/// workers that are busy with its caller.

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::detail {

inline bool& in_device_worker() noexcept {
  thread_local bool inside = false;
  return inside;
}

/// The process-wide pool (see the file comment).
class device_workers {
 public:
  static device_workers& get() {
    static device_workers w;
    return w;
  }
  device_workers(const device_workers&) = delete;
  device_workers& operator=(const device_workers&) = delete;
  ~device_workers() {
    {
      std::lock_guard l(m_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  /// Calls `f(i)` for every `i` in `[0, count)`, `i = 0` on the calling thread and `i` on worker
  /// `i`, and returns when all have returned. Rethrows the exception of the lowest `i` that threw.
  template <class F>
  void run(std::size_t count, F& f) {
    if (count == 0) return;
    std::vector<std::exception_ptr> errors(count);
    struct context {
      F* f;
      std::exception_ptr* errors;
    } ctx{&f, errors.data()};
    auto call = [](void* p, std::size_t i) {
      auto* c = static_cast<context*>(p);
      try {
        (*c->f)(i);
      } catch (...) {
        c->errors[i] = std::current_exception();
      }
    };
    if (count == 1 || in_device_worker()) {
      inside_guard g;
      for (std::size_t i = 0; i < count; ++i) call(&ctx, i);
    } else {
      std::lock_guard submit(submit_);
      grow(count - 1);
      {
        std::lock_guard l(m_);
        job_ = job{call, &ctx, count};
        remaining_ = count - 1;
        ++generation_;
      }
      work_cv_.notify_all();
      {
        inside_guard g;
        call(&ctx, 0);
      }
      std::unique_lock l(m_);
      done_cv_.wait(l, [&] { return remaining_ == 0; });
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

 private:
  device_workers() = default;

  struct inside_guard {
    bool previous = in_device_worker();
    inside_guard() { in_device_worker() = true; }
    ~inside_guard() { in_device_worker() = previous; }
  };

  struct job {
    void (*call)(void*, std::size_t) = nullptr;
    void* ctx = nullptr;
    std::size_t count = 0;
  };

  /// Starts workers until there are `n`, pinning the new ones (the comm layer's `pin_to`, as
  /// `run_on_threads` pins) when the machine has a core for every device of this call (`n + 1`
  /// with the caller); oversubscribed, they stay free to move to an idle core.
  void grow(std::size_t n) {
    if (threads_.size() >= n) return;
#if defined(__linux__)
    cpu_set_t allowed;
    CPU_ZERO(&allowed);
    const bool pin = pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0 &&
                     n + 1 <= static_cast<std::size_t>(CPU_COUNT(&allowed));
#endif
    while (threads_.size() < n) {
      const std::size_t index = threads_.size() + 1;
#if defined(__linux__)
      threads_.emplace_back([this, index, pin, allowed] {
        if (pin) pin_to(allowed, static_cast<int>(index));
        serve(index);
      });
#else
      threads_.emplace_back([this, index] { serve(index); });
#endif
    }
  }

  void serve(std::size_t index) {
    in_device_worker() = true;
    std::uint64_t seen = 0;
    std::unique_lock l(m_);
    for (;;) {
      work_cv_.wait(l, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= job_.count) continue;
      const job j = job_;
      l.unlock();
      j.call(j.ctx, index);
      l.lock();
      if (--remaining_ == 0) done_cv_.notify_one();
    }
  }

  std::mutex submit_;  // one operation at a time
  std::mutex m_;
  std::condition_variable work_cv_, done_cv_;
  std::uint64_t generation_ = 0;
  job job_{};
  std::size_t remaining_ = 0;
  bool stop_ = false;
  std::vector<std::thread> threads_;  // threads_[i] serves index i + 1
};

/// Below this many element operations in all, waking workers costs more than it saves (a wake is
/// a few microseconds; a host kernel does about a thousand element operations per microsecond).
inline constexpr std::size_t parallel_work_threshold = std::size_t{1} << 15;

/// Runs `f(d)` for every device `d` in `devices` at once (see the file comment), each on its
/// execution-space instance for memory space `Space` among `num_devices` devices. `work`: the
/// element operations of all devices together; below `parallel_work_threshold` the calling thread
/// runs the devices one after another (still each on its instance).
template <class Space, class F>
void for_each_device(std::span<const std::size_t> devices, std::size_t num_devices, std::size_t work, F&& f) {
  if (devices.empty()) return;
  (void)device_instance<Space>(0, num_devices);  // made here, not in the workers
  auto task = [&](std::size_t i) {
    const std::size_t d = devices[i];
    scoped_exec_space<Space> on(device_instance<Space>(d, num_devices));
    f(d);
  };
  if (work < parallel_work_threshold) {
    for (std::size_t i = 0; i < devices.size(); ++i) task(i);
    return;
  }
  device_workers::get().run(devices.size(), task);
}

}  // namespace meshlib::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `thread_runner`: the runner (exec/runner.hpp) with one device per thread of this
/// process, each call on a fresh `thread_world`, run by persistent device threads
/// (`detail::device_workers`). A runner the user makes owns its device threads for as long as it
/// (or any copy of it) lives; `spmd` and `shard_map` without a runner run on the process-wide
/// device threads, which are just as persistent. An own runner keeps a library's or a test's
/// devices off the threads that global-view operations and other callers use, and ends its
/// threads when it goes.
/// A device is one core by default; `threads_per_device` makes each a team of cores (Kokkos 4
/// OpenMP), so that a mesh smaller than the machine still uses all of it.
/// @code
/// meshlib::mesh<meshlib::axis<"x">> m{4};
/// meshlib::thread_runner runner({.timeout = std::chrono::seconds(10)});
/// runner.threads_per_device = 4;                         // 16 cores: 4 devices of 4 cores
/// for (int step = 0; step < 1000; ++step)
///   meshlib::spmd(m, [] { /* one step */ }, runner);     // the same 3 worker threads every step
/// @endcode

#include <cstddef>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"
#include "meshlib/exec/detail/device_workers.hpp"
#include "meshlib/exec/runner.hpp"

namespace meshlib {

namespace exec::detail {
/// Tag of the `thread_runner` that runs on the process-wide device threads (what `spmd` and
/// `shard_map` use without a runner, through `default_runner`).
struct process_wide_threads_t {
  explicit process_wide_threads_t() = default;
};
/// The tag's value.
inline constexpr process_wide_threads_t process_wide_threads{};
}  // namespace exec::detail

/// @brief One thread per device, all in this process (see the file comment). Device 0 runs on the
/// calling thread and device `d` always on the pool's worker `d`, so repeated calls reuse the same
/// threads, which start on the first call that needs them (as many as the largest mesh run on it,
/// less the calling thread) and are joined when the last copy of the runner is destroyed.
///
/// Calls on one runner run one at a time. A call the threads cannot take (a `spmd` inside a device
/// of another call, or while another thread's call runs on them) runs on threads started for it
/// (`run_on_threads`), with the same results and errors: nested calls never wait for the threads
/// of their caller.
struct thread_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;

  /// Options of each call's `thread_world` (timeout, spin policy). `pin_threads` applies only to
  /// calls that start their own threads: the persistent ones pin themselves whenever every device
  /// has a core (exec/detail/device_workers.hpp).
  thread_comm_options options{};
  /// The device threads, shared by every copy of this runner; null: the process-wide ones.
  std::shared_ptr<exec::detail::device_workers> workers{};
  /// The cores each device computes on: its execution-space instance is a team of this many
  /// Kokkos threads (Kokkos 4 with the OpenMP backend; with any other backend only 1 is
  /// accepted), and its device thread is pinned to as many cores of its own while the machine has
  /// them all. 1, the default, is one core per device; a (2, 1) mesh on a 16-core machine uses all
  /// cores with 8.
  std::size_t threads_per_device = 1;

  /// A runner with device threads of its own, whose calls' communicators get `options`.
  explicit thread_runner(thread_comm_options options = {})
      : options(std::move(options)), workers(std::make_shared<exec::detail::device_workers>()) {}
  /// A runner on the process-wide device threads (`default_runner`'s in one process).
  explicit thread_runner(exec::detail::process_wide_threads_t, thread_comm_options options = {})
      : options(std::move(options)) {}

  /// @brief Runs `body(device, communicator)` on `n` threads, one per device; returns when all finish.
  /// @throws participant_error naming the root-cause device (exec/runner.hpp).
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    auto device = [&](thread_communicator& c) {
      const auto d = static_cast<std::size_t>(c.rank());
      body(d, std::move(c));
    };
    const int size = static_cast<int>(n);
    exec::detail::device_workers& pool = workers ? *workers : exec::detail::device_workers::get();
    // A fresh world for every call: a failed world stays failed, and a fresh one costs less than
    // a microsecond per device next to the wake-up of the threads.
    thread_world world(size, options);
    experimental::participant_failures failures(size);
    auto task = [&](std::size_t d) { failures.run(world, static_cast<int>(d), device); };
    if (!pool.try_run(n, task, threads_per_device)) {
      run_on_threads(size, device, options);
      return;
    }
    failures.rethrow(world);
  }

  /// The devices this process runs: all `n` of them, `0 .. n-1` (one process owns every thread).
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    std::vector<std::size_t> d(n);
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
};

/// @brief Deprecated name of a `thread_runner` on the process-wide device threads (what it was
/// before runners had one name each); removed in the next release.
struct [[deprecated("use meshlib::thread_runner")]] thread_backend : thread_runner {
  /// Options of each call's `thread_world`.
  thread_backend(thread_comm_options options = {})  // NOLINT(google-explicit-constructor): as before
      : thread_runner(exec::detail::process_wide_threads, std::move(options)) {}
};

static_assert(runner<thread_runner>);

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `run_on_threads(n, fn)`: runs `fn(comm)` once per participant of a fresh `thread_world`
/// of n threads, joins them, and rethrows the root cause of a failure with its rank: the thread
/// backend's own launcher, as `run_hybrid` is the MPI backend's. `spmd` and `shard_map` run on the
/// persistent device threads of exec's `thread_runner` instead (exec/detail/device_workers.hpp)
/// and come here only for a call those cannot take (a nested call); both report failures through
/// `detail::participant_failures`, and pin with `detail::pin_to`, both here because this launcher,
/// below exec, needs them too.

#include <exception>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/root_cause.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

namespace comm::detail {
/// Pins the calling thread to the `index`-th CPU of `allowed` (modulo their number).
#if defined(__linux__)
inline void pin_to(const cpu_set_t& allowed, int index) {
  const int count = CPU_COUNT(&allowed);
  if (count <= 0) return;
  int want = index % count;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (want-- == 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
      return;
    }
  }
}
#endif

/// @brief The participants' failures in one run on a `thread_world`, and who is blamed for them:
/// shared by `run_on_threads` and the persistent device threads (`thread_runner`), so that both
/// report the same root cause with the same message.
class participant_failures {
 public:
  /// For a world of `n` participants.
  explicit participant_failures(int n) : errors_(static_cast<std::size_t>(n)) {}

  /// Runs `fn(comm)` as participant `r` of `world`; an exception is recorded and aborts the world
  /// with it as the root cause (while `r` still holds its handle, so the abort, not its departure,
  /// is what its peers see).
  template <class F>
  void run(thread_world& world, int r, F& fn) {
    thread_communicator comm = world.communicator(r);
    try {
      fn(comm);
    } catch (...) {
      errors_[static_cast<std::size_t>(r)] = std::current_exception();
      world.abort(r, what_of(errors_[static_cast<std::size_t>(r)]));
    }
  }

  /// Once every participant has ended: throws `participant_error` for the root cause, if any
  /// failed, by the rule every runner shares (`detail::find_root_cause`): the world's root cause
  /// (the first to throw, or the first that never arrived at a collective that timed out), even
  /// when it threw nothing itself (it was only late); the exception reported is its own, else that
  /// of the lowest participant that threw.
  void rethrow(const thread_world& world) const {
    rethrow_root_cause({.errors = errors_,
                        .size = static_cast<int>(errors_.size()),
                        .local_root = world.failed() ? world.root_cause_rank() : -1});
  }

 private:
  std::vector<std::exception_ptr> errors_;
};
}  // namespace comm::detail

namespace experimental {
/// The failures of the participants of a run, collected for `rethrow_root_cause`.
using comm::detail::participant_failures;
}  // namespace experimental

/// @brief Runs `fn(thread_communicator&)` on `n` threads, one per participant of a new
/// `thread_world(n, options)` (participant 0 on the calling thread), and returns when all have
/// returned.
///
/// When a participant throws, the world is aborted with it as the root cause, so every peer that
/// waits in (or later enters) a collective gets `comm_aborted` instead of hanging; once every
/// thread has ended, `run_on_threads` throws `participant_error` for the root cause: the first
/// participant to throw, or, when the communicator itself failed (a collective mismatch, a
/// timeout), the lowest rank that threw.
/// @code
/// std::vector<std::vector<float>> out(4, std::vector<float>(4));   // one result per participant
/// meshlib::run_on_threads(4, [&](meshlib::thread_communicator& c) {
///   const float x = float(c.rank());
///   c.all_gather(std::span<const float>(&x, 1), std::span<float>(out[c.rank()]));  // {0, 1, 2, 3}
/// });
/// @endcode
/// @throws participant_error as above; comm_argument_error when n < 1; std::system_error when a
/// thread cannot be started (after the started ones are aborted and joined).
template <class F>
  requires std::is_invocable_v<F&, thread_communicator&>
void run_on_threads(int n, F&& fn, thread_comm_options options = {}) {
  const bool pin = options.pin_threads;
  thread_world world(n, std::move(options));
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  // Pin only when every participant gets its own CPU; oversubscribed participants must be free to
  // move to whichever core is idle (OpenMPI does not bind oversubscribed ranks either).
  const bool can_pin = pin && pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0 &&
                       n <= CPU_COUNT(&allowed);
  struct restore_affinity {
    bool active;
    cpu_set_t mask;
    ~restore_affinity() {
      if (active) pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask);
    }
  } restore{can_pin, allowed};
#else
  (void)pin;
#endif
  comm::detail::participant_failures failures(n);
  auto body = [&](int r) {
#if defined(__linux__)
    if (can_pin) comm::detail::pin_to(allowed, r);
#endif
    failures.run(world, r, fn);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n > 0 ? n - 1 : 0));
  try {
    for (int r = 1; r < n; ++r) threads.emplace_back(body, r);
  } catch (...) {
    world.abort(0, "run_on_threads could not start a thread");
    for (auto& t : threads) t.join();
    throw;
  }
  body(0);
  for (auto& t : threads) t.join();
  failures.rethrow(world);
}

}  // namespace meshlib

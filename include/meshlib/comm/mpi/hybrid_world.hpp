// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `hybrid_world`, one process's part of a hybrid group (its thread world, the leaders'
/// MPI communicator, the duplicate for point-to-point, and the abort channel with its watcher
/// thread), and `run_hybrid`, which runs the devices of this process on it. Apart from
/// `hybrid_communicator` because the world's wiring (what each process owns, how a failure
/// travels between processes) is a subject of its own; the communicator is the device's handle.
/// `<meshlib/comm/mpi/hybrid_communicator.hpp>` includes this header, so either gives both.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/root_cause.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/mpi/detail/abort_channel.hpp"
#include "meshlib/comm/mpi/hybrid_communicator.hpp"
#include "meshlib/comm/mpi/mpi_comm_options.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

/// @brief One process's part of a hybrid group of `procs.size()` processes x `threads` threads.
/// Construction is collective over `procs` (it duplicates it for point-to-point traffic).
class hybrid_world {
 public:
  /// @throws comm_error when T > 1 and MPI does not provide `MPI_THREAD_MULTIPLE`;
  /// comm_argument_error when threads < 1.
  hybrid_world(const mpi_communicator& procs, int threads, thread_comm_options options = {})
      : threads_(threads), local_(threads > 0 ? threads : 1, options) {
    if (threads < 1)
      throw comm_argument_error("meshlib: a hybrid_world needs at least 1 thread per process, got " +
                                std::to_string(threads));
    int level = 0;
    MPI_Query_thread(&level);
    if (threads > 1 && level < MPI_THREAD_MULTIPLE)
      throw comm_error("meshlib: a hybrid mesh with " + std::to_string(threads) +
                       " threads per process needs MPI_THREAD_MULTIPLE, but MPI was initialised with a lower thread "
                       "level; initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or meshlib::mpi::initialize");
    group_ = std::make_shared<comm::detail::hybrid_group>();
    group_->threads_per_process = threads;
    group_->timeout = procs.options().timeout;
    // The leaders' exchange waits longer than a local step, and the members waiting for it longer
    // still (hybrid_group::patience): a device that never arrives is named by its own process.
    const auto local_timeout = options.timeout;
    const auto grace = local_timeout.count() > 0
                           ? std::min<std::chrono::nanoseconds>(local_timeout / 2, std::chrono::seconds(2))
                           : std::chrono::nanoseconds(0);
    group_->patience = 2 * grace;
    mpi_comm_options leaders = procs.options();
    if (leaders.timeout.count() > 0) leaders.timeout = std::max(leaders.timeout, local_timeout) + grace;
    for (int d = 0; d < procs.size() * threads; ++d) group_->member_device.push_back(d);
    group_->layout(procs.rank());
    // meshlib's own duplicate (collective), so that the interrupt hook is never the application's.
    group_->mpi = mpi_communicator(procs.native(), leaders, false);  // open_channel installs the world's
    if (MPI_Comm_dup(procs.native(), &group_->p2p) != MPI_SUCCESS)
      throw comm_error("meshlib: hybrid_world: MPI_Comm_dup failed");
    MPI_Comm_set_errhandler(group_->p2p, MPI_ERRORS_RETURN);
    hybrid_communicator::set_tag_ub(*group_);
    process_ = procs.rank();
    group_->channel = channel_;
    open_channel(procs, level);
  }
  hybrid_world(const hybrid_world&) = delete;
  hybrid_world& operator=(const hybrid_world&) = delete;
  ~hybrid_world() { channel_->close(std::chrono::milliseconds(1000)); }

  /// Devices in the world: processes x threads.
  [[nodiscard]] int size() const noexcept { return group_->n; }
  /// How many threads (devices) each process runs.
  [[nodiscard]] int threads_per_process() const noexcept { return threads_; }

  /// The handle of local thread `t` (device `process * T + t`); each once.
  [[nodiscard]] hybrid_communicator communicator(int t) {
    hybrid_communicator c;
    c.local_ = local_.communicator(t);
    c.group_ = group_;
    c.rank_ = process_ * threads_ + t;
    return c;
  }

  /// @brief Fails the hybrid world with local thread `t` (global device `process * T + t`) as the
  /// root cause: this process's devices get `comm_aborted` at once, and so (through the abort
  /// channel) do the devices of every other process, all naming "hybrid device D of N".
  bool abort(int t, std::string_view reason) {
    const int device = process_ * threads_ + t;
    const std::string who = "hybrid device " + std::to_string(device) + " of " + std::to_string(size());
    const bool first = local_.abort(t, reason, who);
    channel_->interrupt("meshlib: communicator aborted: " + who + " failed: " + std::string(reason), device);
    // A failure that came from another process is not sent back; any other (a throw, or a local
    // timeout or mismatch that the devices rethrow) is told to every process.
    if (channel_->remote_device.load() < 0) {
      const int root = local_.root_cause_rank();
      const int blamed = first || root < 0 ? device : process_ * threads_ + root;
      channel_->notify(blamed, std::string(reason));
    }
    return first;
  }
  /// @brief Local thread `t` left with `collective_mismatch` (`message`): fails the hybrid world as
  /// that mismatch, so that every device of every process that still waits (for the verdict of
  /// that collective, or in any other) gets `collective_mismatch` with the same message, never
  /// `comm_aborted`. Every member of the mismatched collective detects it on its own; this only
  /// keeps the error's type when another device's failure would otherwise overtake it.
  bool fail_mismatch(int t, std::string_view message) {
    const bool first = local_.fail_as_mismatch(message);
    channel_->interrupt(std::string(message), -1, comm::detail::failure_kind::mismatch);
    // The report names the device whose call differed (every member of the mismatched collective
    // computed it), so that processes that were not members blame it too; else this device.
    const int culprit = channel_->mismatch_culprit.load();
    if (channel_->remote_device.load() < 0)
      channel_->notify(culprit >= 0 ? culprit : process_ * threads_ + t, std::string(message),
                       comm::detail::failure_kind::mismatch);
    return first;
  }
  /// Global device whose call differed in a collective mismatch of this world (the same on every
  /// process), -1 when there was none or it is not known.
  [[nodiscard]] int mismatch_culprit() const noexcept { return channel_->mismatch_culprit.load(); }
  /// True once a participant of this process failed; the others then stop waiting.
  [[nodiscard]] bool failed() const noexcept { return local_.failed(); }
  /// Local thread of the root cause of a failure, -1 when none (or when it was another process's).
  [[nodiscard]] int root_cause_thread() const { return local_.root_cause_rank(); }
  /// Global device of a failure that another process reported through the abort channel, -1 if none.
  [[nodiscard]] int remote_root_cause_device() const noexcept { return channel_->remote_device.load(); }

 private:
  void open_channel(const mpi_communicator& procs, int level) {
    auto& ch = *channel_;
    auto* channel = channel_.get();
    group_->mpi.state_->check_interrupt = [channel] { channel->check(); };
    // Also tells the leaders' communicator, when it is freed, that the world failed (its abandoned
    // collectives must keep it allocated); splits of it inherit both.
    group_->mpi.state_->channel = channel_;
    // The watcher calls MPI beside the devices: only with MPI_THREAD_MULTIPLE.
    ch.open(procs.native(), level >= MPI_THREAD_MULTIPLE);
    if (!ch.enabled) return;
    const int devices = size();
    // On a parked thread: starting one per call cost a fifth of an empty call (watcher_threads.hpp).
    ch.watcher = comm::detail::watcher_threads::get().run([this, channel, devices] {
      while (!channel->stop.load()) {
        int device = -1;
        std::string what;
        comm::detail::failure_kind kind{};
        if (channel->poll(device, what, kind)) {
          // The channel first, then the thread world: a device that the thread world releases
          // and that leaves run_hybrid reports its error to the channel, which must already hold
          // the root cause (a leader released by the channel records the same in the thread world).
          if (kind != comm::detail::failure_kind::aborted) {
            // A timeout or mismatch another process saw: the same error and message here, not an
            // abort (the message already names global devices and the user's operation).
            channel->interrupt(what, device, kind);
            if (kind == comm::detail::failure_kind::mismatch) channel->blame_mismatch(device);  // fail_mismatch names it
            local_.fail_as(kind, what);
            return;
          }
          const std::string who = "hybrid device " + std::to_string(device) + " of " + std::to_string(devices);
          channel->interrupt("meshlib: communicator aborted: " + who + " failed: " + what, device);
          local_.abort(-1, what, who);
          return;
        }
        channel->nap(std::chrono::milliseconds(1));
      }
    });
  }

  int threads_;
  int process_ = 0;
  thread_world local_;
  std::shared_ptr<comm::detail::hybrid_group> group_;
  std::shared_ptr<comm::detail::abort_channel> channel_ = std::make_shared<comm::detail::abort_channel>();
};

namespace comm::detail {
/// How `run_hybrid` runs its threads by default: `threads - 1` started for the call (thread 0 is
/// the caller's), joined before it returns. A launcher `launch(threads, body)` must call
/// `body(t)` for every `t` in `[0, threads)` at once and return when all have returned; `body`
/// does not throw. The persistent runners pass their device threads instead (exec/mpi_runner.hpp).
struct start_hybrid_threads {
  template <class Body>
  void operator()(int threads, Body& body) const {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
    body(0);
    for (auto& th : pool) th.join();
  }
};
}  // namespace comm::detail

namespace experimental {
/// Starts the device threads of a hybrid (MPI + threads) run.
using comm::detail::start_hybrid_threads;
}  // namespace experimental

/// @brief Runs `fn(hybrid_communicator&)` on `threads` threads of this process, as device
/// `process * threads + t` of a hybrid world over `procs`; joins them and rethrows the first
/// failure as `participant_error` (with the device; for a collective mismatch, the device whose
/// call differed, the same on every process). Collective over `procs`. `launch` runs the
/// threads (default: started for this call; see `detail::start_hybrid_threads`).
template <class F, class Launch = comm::detail::start_hybrid_threads>
  requires std::is_invocable_v<F&, hybrid_communicator&>
void run_hybrid(const mpi_communicator& procs, int threads, F&& fn, thread_comm_options options = {},
                Launch launch = {}) {
  hybrid_world world(procs, threads, std::move(options));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  auto body = [&](int t) {
    try {
      hybrid_communicator comm = world.communicator(t);
      fn(comm);
    } catch (const collective_mismatch& e) {
      errors[static_cast<std::size_t>(t)] = std::current_exception();
      world.fail_mismatch(t, e.what());
    } catch (...) {
      errors[static_cast<std::size_t>(t)] = std::current_exception();
      world.abort(t, comm::detail::what_of(errors[static_cast<std::size_t>(t)]));
    }
  };
  launch(threads, body);
  // The rule every runner shares (detail::find_root_cause); a mismatch is blamed on the device
  // whose call differed, which every process computed from every member's call (or learnt from the
  // report), and a failure another process reported on its device.
  comm::detail::rethrow_root_cause({.errors = errors,
                              .first = procs.rank() * threads,
                              .size = world.size(),
                              .local_root = world.root_cause_thread(),
                              .remote_root = world.remote_root_cause_device(),
                              .mismatch_culprit = world.mismatch_culprit(),
                              .noun = "hybrid device"});
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI

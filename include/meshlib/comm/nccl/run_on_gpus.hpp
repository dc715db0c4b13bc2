// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief One process driving several GPUs: `nccl_communicators(devices)` makes one communicator
/// per GPU in one call, and `run_on_gpus(devices, fn)` runs `fn(comm)` on one runner thread per
/// GPU, as `run_on_threads` does for the thread communicator.
///
/// @code
/// const int gpus[] = {0, 1, 2, 3};
/// meshlib::run_on_gpus(gpus, [&](meshlib::nccl_communicator& c) {   // thread r drives GPU gpus[r]
///   c.all_reduce(std::span(grad[c.rank()], n), meshlib::reduce_op::mean).wait();
/// });
/// @endcode
///
/// Creation follows `ncclCommInitAll` (one unique id, `ncclCommInitRank` for every GPU inside one
/// `ncclGroupStart`/`ncclGroupEnd`), but with the non-blocking configuration every meshlib
/// communicator has (`ncclCommInitAll` takes no configuration), so that a fault ends in an error
/// instead of a hang. NCCL refuses two ranks on one GPU: `devices` must be distinct.

#if MESHLIB_ENABLE_NCCL

#include <atomic>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/root_cause.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/comm/nccl/nccl_version.hpp"

namespace meshlib {

/// @brief One NCCL communicator per GPU of `devices` (rank r on `devices[r]`), each bound to a new
/// stream of its own unless `options.stream` is given (then it must be usable on every device).
/// @throws comm_argument_error for an empty list, a repeated device or one that does not exist;
/// comm_error, comm_timeout when NCCL fails.
[[nodiscard]] inline std::vector<nccl_communicator> nccl_communicators(std::span<const int> devices,
                                                                      nccl_comm_options options = {}) {
  constexpr std::string_view what = "nccl_communicators";
  if (devices.empty()) throw comm_argument_error("meshlib: nccl_communicators needs at least one GPU");
  for (std::size_t i = 0; i < devices.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw comm_argument_error("meshlib: nccl_communicators: GPU " + std::to_string(devices[i]) +
                                  " is listed twice; NCCL refuses two ranks on one GPU (use one communicator per "
                                  "GPU, and the thread communicator between devices that share one)");
  comm::detail::require_nccl_version(what);
  const int n = static_cast<int>(devices.size());
  const ncclUniqueId id = nccl_communicator::new_unique_id();
  std::vector<std::shared_ptr<comm::detail::nccl_comm_state>> states;
  for (int r = 0; r < n; ++r) {
    nccl_comm_options o = options;
    o.device = devices[static_cast<std::size_t>(r)];
    states.push_back(nccl_communicator::make_state(o, r, n, what));
  }
  {
    ncclConfig_t config = nccl_communicator::nonblocking_config();
    comm::detail::check_nccl(ncclGroupStart(), what, "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    for (int r = 0; r < n; ++r) {
      auto& s = *states[static_cast<std::size_t>(r)];
      comm::detail::cuda_device_scope g(s.device, what);
      ncclUniqueId copy = id;
      const ncclResult_t rc = ncclCommInitRankConfig(&s.comm, n, copy, r, &config);
      if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
    }
    const ncclResult_t end = ncclGroupEnd();
    comm::detail::check_nccl(first, what, "ncclCommInitRankConfig");
    comm::detail::check_nccl(end, what, "ncclGroupEnd");
  }
  std::vector<nccl_communicator> out;
  for (auto& s : states) {
    nccl_communicator::init_checked(*s, ncclInProgress, "ncclCommInitRankConfig");
    out.emplace_back(std::move(s));
  }
  return out;
}

/// @brief Destroys communicators of several GPUs of this process concurrently, one thread each:
/// finalizing one waits for its peers to finalize, so destroying them one after another from one
/// thread would wait for the timeout. Leaves `comms` empty.
inline void destroy_communicators(std::vector<nccl_communicator>& comms) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&c] { c = nccl_communicator{}; });
  for (auto& t : threads) t.join();
  comms.clear();
}

/// @brief Runs `fn(nccl_communicator&)` on one thread per communicator of `comms` (thread r has
/// `comms[r]`'s GPU current), and returns when all have returned: `run_on_gpus` on communicators
/// made before, which a caller keeps across calls (NCCL's initialisation costs far more than a
/// training step: `gpu_runner` keeps them). When one throws, every communicator is aborted (peers
/// waiting in a collective get `comm_aborted`; the communicators are unusable afterwards), and once
/// all threads have ended `participant_error` is thrown for the first failure, its exception nested.
template <class F>
  requires std::is_invocable_v<F&, nccl_communicator&>
void run_on_communicators(std::span<nccl_communicator> comms, F&& fn) {
  const int n = static_cast<int>(comms.size());
  std::vector<std::exception_ptr> errors(comms.size());
  std::atomic<int> first{-1};
  auto body = [&](int r) {
    auto& c = comms[static_cast<std::size_t>(r)];
    try {
      comm::detail::check_cuda(cudaSetDevice(c.device()), "run_on_gpus", "cudaSetDevice");
      fn(c);
    } catch (...) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      int none = -1;
      first.compare_exchange_strong(none, r);
      const std::string why = "participant " + std::to_string(r) + " failed: " +
                              comm::detail::what_of(errors[static_cast<std::size_t>(r)]);
      for (auto& other : comms) other.abort(why);
    }
  };
  if (n == 1) {
    body(0);  // one GPU: on the caller's thread (no thread to start per call)
  } else {
    std::vector<std::thread> threads;
    threads.reserve(comms.size());
    try {
      for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
    } catch (...) {
      for (auto& c : comms) c.abort("run_on_gpus could not start a thread");
      for (auto& t : threads) t.join();
      throw;  // aborted communicators are released without finalizing
    }
    for (auto& t : threads) t.join();
  }
  comm::detail::rethrow_root_cause({.errors = errors, .size = n, .local_root = first.load()}, [&](int r) {
    return "participant " + std::to_string(r) + " of " + std::to_string(n) + " (GPU " +
           std::to_string(comms[static_cast<std::size_t>(r)].device()) + ")";
  });
}

/// @brief Runs `fn(nccl_communicator&)` on one thread per GPU of `devices` (thread r has
/// `devices[r]` current and rank r), and returns when all have returned: new communicators
/// (`nccl_communicators`), `run_on_communicators`, and the communicators destroyed again. When one
/// throws, every communicator is aborted (peers waiting in a collective get `comm_aborted`), and
/// once all threads have ended `participant_error` is thrown for the first failure, its exception nested.
template <class F>
  requires std::is_invocable_v<F&, nccl_communicator&>
void run_on_gpus(std::span<const int> devices, F&& fn, nccl_comm_options options = {}) {
  std::vector<nccl_communicator> comms = nccl_communicators(devices, std::move(options));
  struct destroy_at_end {
    std::vector<nccl_communicator>& c;
    ~destroy_at_end() { destroy_communicators(c); }
  } at_end{comms};
  run_on_communicators(std::span<nccl_communicator>(comms), fn);
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

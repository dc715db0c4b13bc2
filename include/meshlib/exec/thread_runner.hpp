// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `thread_runner`: a thread runner that owns its device threads for as long as the user
/// keeps it (or any copy of it). Without one, `spmd` and `shard_map` run on the process-wide
/// device threads, which are just as persistent; an own runner keeps a library's or a test's
/// devices off the threads that global-view operations and other callers use, and ends its
/// threads when it goes.
/// @code
/// meshlib::mesh<meshlib::axis<"x">> m{4};
/// meshlib::thread_runner runner({.timeout = std::chrono::seconds(10)});
/// for (int step = 0; step < 1000; ++step)
///   meshlib::spmd(m, [] { /* one step */ }, runner);     // the same 3 worker threads every step
/// @endcode

#include <memory>
#include <utility>

#include "meshlib/collectives/backend.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/tensor/device_workers.hpp"

namespace meshlib {

/// @brief A `thread_backend` with device threads of its own: they start on the first call that
/// needs them (as many as the largest mesh run on it, less the calling thread, which runs device
/// 0) and are joined when the last copy of the runner is destroyed. Calls on one runner run one
/// at a time; a call made while another thread's call runs on it, or from inside one of its
/// devices, starts threads of its own (see `thread_backend`).
struct thread_runner : thread_backend {
  /// A runner whose calls' communicators get `options` (timeout, spin policy).
  explicit thread_runner(thread_comm_options options = {})
      : thread_backend{std::move(options), std::make_shared<detail::device_workers>()} {}
};

static_assert(runner<thread_backend>);
static_assert(runner<thread_runner>);

}  // namespace meshlib

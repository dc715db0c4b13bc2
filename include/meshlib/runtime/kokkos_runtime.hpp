// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The Kokkos part of `distributed::initialize`, kept out of distributed.hpp so that launcher
/// detection and the process queries build without Kokkos. Including this header makes
/// `initialize` initialise Kokkos when the program has not (`options::initialize_kokkos`), and
/// `shutdown` finalise it only when `initialize` was the one that initialised it.
///
/// Kokkos 3.x (3.4.1 here) cannot be initialised again in a process after `Kokkos::finalize`: a
/// program that shuts meshlib down and initialises it again must own Kokkos itself
/// (`Kokkos::ScopeGuard` in `main`); `initialize` says so with a `distributed_error` instead of
/// letting Kokkos fail.
///
/// It also holds the Kokkos lifecycle rule every meshlib entry point checks
/// (`detail::require_kokkos`): Kokkos must be initialised before the first tensor is made and
/// before any device thread starts, and stay initialised until the last tensor is gone. Without
/// the check, a forgotten `Kokkos::ScopeGuard` aborts inside a device thread with Kokkos' own
/// "deallocated after Kokkos::finalize" or "terminate called recursively", which names neither
/// the cause nor the fix.

#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <Kokkos_Core.hpp>

#include "meshlib/core/errors.hpp"
#include "meshlib/runtime/distributed.hpp"

namespace meshlib {

/// @brief A meshlib entry point was called while Kokkos is not initialised (never was, or was
/// already finalised). `what()` names the entry point and the fix.
/// @code
/// int main(int argc, char** argv) {
///   Kokkos::ScopeGuard kokkos(argc, argv);  // or meshlib::distributed::guard / meshlib::mpi::guard
///   meshlib::mesh<meshlib::axis<"x">> m{2};
///   meshlib::spmd(m, [] {});                // without the guard: throws kokkos_lifecycle_error
/// }
/// @endcode
class kokkos_lifecycle_error : public error {
 public:
  using error::error;
};

namespace runtime::detail {

/// Throws `kokkos_lifecycle_error` unless Kokkos is initialised; `what` names the entry point.
inline void require_kokkos(std::string_view what) {
  if (Kokkos::is_initialized()) [[likely]]
    return;
#if KOKKOS_VERSION >= 40000
  const bool finalized = Kokkos::is_finalized();
#else
  const bool finalized = false;  // Kokkos 3.x cannot tell "finalised" from "never initialised"
#endif
  throw kokkos_lifecycle_error(
      "meshlib: " + std::string(what) + ": Kokkos " + (finalized ? "was already finalised" : "is not initialised") +
      "; hold a Kokkos::ScopeGuard in main() (or meshlib::distributed::guard, or meshlib::mpi::guard with MPI, "
      "which initialise MPI and Kokkos in the right order) before the first meshlib call and before any device "
      "thread starts, and keep it alive until every tensor is destroyed");
}

/// `Kokkos::push_finalize_hook`, serialised: Kokkos keeps its hooks in a plain stack, so two threads
/// that push at once (two user threads making their first meshlib call together) corrupt it. Every
/// hook meshlib pushes goes through here, from the thread that calls into meshlib, never from a
/// device thread.
inline void push_finalize_hook(std::function<void()> hook) {
  static std::mutex m;
  std::lock_guard lock(m);
  Kokkos::push_finalize_hook(std::move(hook));
}

}  // namespace runtime::detail

namespace experimental {
/// Registers a function to run before Kokkos finalises (frees views a layer caches).
using runtime::detail::push_finalize_hook;

/// Throws when Kokkos is not initialised, naming what needed it.
using runtime::detail::require_kokkos;
}  // namespace experimental
}  // namespace meshlib

namespace meshlib::distributed::detail {

inline bool start_kokkos() {
  if (Kokkos::is_initialized()) return false;
  Kokkos::initialize();
  return true;
}

inline void stop_kokkos() {
  if (Kokkos::is_initialized()) Kokkos::finalize();
}

/// Registers the hooks before `main` (an inline variable is initialised once per program).
inline const bool kokkos_hooks_registered = [] {
  hooks().start_kokkos = &start_kokkos;
  hooks().stop_kokkos = &stop_kokkos;
  return true;
}();

}  // namespace meshlib::distributed::detail

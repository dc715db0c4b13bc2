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

#include <Kokkos_Core.hpp>

#include "meshlib/runtime/distributed.hpp"

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

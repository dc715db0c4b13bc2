// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `available_cores()`: the cores this process may run its devices on.

#include <cstddef>
#include <thread>

#if defined(__linux__)
#include <sched.h>
#endif

namespace meshlib {

/// @brief The cores this process may run on: its CPU affinity mask, as `nproc` counts them
/// (`taskset -c 0-3` gives 4), else `std::thread::hardware_concurrency()`, else 0 (unknown).
///
/// Not `hardware_concurrency` alone: it counts the machine's CPUs, so a run pinned to 4 of 16 cores
/// would choose its mesh and threads per device for 16 and oversubscribe the 4 it has.
inline std::size_t available_cores() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return static_cast<std::size_t>(CPU_COUNT(&set));
#endif
  return std::thread::hardware_concurrency();
}

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The timeout every communicator starts from unless told otherwise: `MESHLIB_COMM_TIMEOUT`
/// or 60 s. Here, in the comm layer and apart from any backend, because every backend's options
/// (thread, MPI, NCCL) and the debug layer's slow-collective warning use the same default; before,
/// they reached into the thread backend's options for it.

#include <chrono>
#include <cstdlib>
#include <string>

#include "meshlib/comm/errors.hpp"

namespace meshlib {

/// @brief Timeout of a communicator whose creator gave none and whose environment has no
/// `MESHLIB_COMM_TIMEOUT`: 60 seconds. Long enough for any step of a real program on a loaded
/// machine, short enough that a hung CI job fails with a message instead of being killed.
inline constexpr std::chrono::seconds default_comm_timeout_fallback{60};

/// @brief The timeout communicators use unless told otherwise: `MESHLIB_COMM_TIMEOUT` (seconds, a
/// positive decimal number such as `2` or `0.5`), else `default_comm_timeout_fallback` (60 s).
/// @throws comm_argument_error when the variable is set to something that is not a positive number.
inline std::chrono::nanoseconds default_comm_timeout() {
  const char* env = std::getenv("MESHLIB_COMM_TIMEOUT");  // NOLINT(concurrency-mt-unsafe): read only
  if (env == nullptr || *env == '\0') return default_comm_timeout_fallback;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(seconds > 0) || seconds > 1e9) {
    throw comm_argument_error(std::string("meshlib: MESHLIB_COMM_TIMEOUT='") + env +
                              "' is not a positive number of seconds; set it to e.g. 30 or 0.5, or unset it for " +
                              std::to_string(default_comm_timeout_fallback.count()) + " s");
  }
  return std::chrono::nanoseconds(static_cast<long long>(seconds * 1e9));
}

}  // namespace meshlib

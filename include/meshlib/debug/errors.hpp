// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The errors of debug mode's checks: `debug_check_error` and its two kinds.

#include <string>

#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief A debug-mode check failed (see docs/debugging.md).
class debug_check_error : public error {
 public:
  using error::error;
};

/// @brief A value whose type says it is replicated over some axes differs between the devices of
/// one of those groups (`check_replicated`; debug mode checks `shard_map` outputs).
/// `what()` names the first differing device, the element index and both values.
class replica_mismatch : public debug_check_error {
 public:
  using debug_check_error::debug_check_error;
};

/// @brief A collective's input or output holds a NaN or an infinity (debug mode). `what()` names
/// the device, the operation and the element.
class nonfinite_error : public debug_check_error {
 public:
  using debug_check_error::debug_check_error;
};

}  // namespace meshlib

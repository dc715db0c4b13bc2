// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exception types of the runtime layer: what a launch can get wrong before any data
/// moves. Both are thrown at start-up so that a bad launch fails loudly instead of hanging later.

#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief A launch meshlib cannot make sense of: contradictory launcher environments (OpenMPI says
/// rank 1 of 4, torchrun says rank 2 of 4), a rank outside its world, a variable that is not a
/// number, explicit arguments that contradict the launcher, or `initialize` called again with other
/// arguments. `what()` names every variable and value involved.
class distributed_error : public error {
 public:
  using error::error;
};

/// @brief Processes that disagree about something every process must share (the process count,
/// the local device count, a mesh's shape or axis names). Thrown on every process, with each
/// disagreeing process's value, by the start-up checks that exchange a description of the value.
class process_mismatch : public distributed_error {
 public:
  using distributed_error::distributed_error;
};

}  // namespace meshlib

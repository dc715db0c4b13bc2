// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exception types of meshlib's core: what a run-time fact (a size, a shape, a device
/// count) can get wrong. Each `what()` names what was expected, what was found, and where.

#include <stdexcept>
#include <string>

namespace meshlib {

/// @brief Base of every exception meshlib throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A mesh that cannot exist: a zero-sized axis, sizes that disagree with the static sizes of
/// the mesh type, or sizes whose product is not the number of devices.
class mesh_error : public error {
 public:
  using error::error;
};

/// @brief A sharding that does not fit a shape: wrong rank, a dimension not divisible where the
/// chosen rule requires it, local shapes that do not assemble into a global one.
class sharding_error : public error {
 public:
  using error::error;
};

}  // namespace meshlib

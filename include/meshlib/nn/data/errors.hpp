// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exception type of meshlib's data pipeline: a data set file that is missing or
/// malformed, or loader options that cannot cut the data set into batches.

#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief A data set that cannot be read or batched as asked: a missing file, a file that is not
/// IDX (bad magic), wrong dimensions, a truncated or over-long file, label and image counts that
/// disagree, a label outside the classes, or a global batch that does not split over the
/// processes. `what()` names the file (or the option) and says what was expected and what was
/// found.
class data_error : public error {
 public:
  using error::error;
};

}  // namespace meshlib

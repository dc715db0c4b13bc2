// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The exceptions of SPMD execution: `device_error` (how a failure on one device of
/// `shard_map` / `spmd` / `reshard` reaches the caller) and `spmd_context_error` (a collective or
/// axis query used where no device runs).

#include <cstddef>
#include <exception>
#include <string>

#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief A collective or axis query used where it cannot run: outside `shard_map` / `spmd`, or
/// naming an axis the running mesh does not have.
class spmd_context_error : public error {
 public:
  using error::error;
};

/// @brief A device of `shard_map` / `spmd` threw. `device()` is the device that failed first (the
/// root cause: devices that only saw their peers' failure, as `comm_aborted`, are not reported),
/// `cause()` the exception it threw, and `what()` reads
/// `meshlib: device 3 of mesh{'x': 4} failed: <the cause's what()>`.
/// @code
/// try { meshlib::spmd(m, fn); }
/// catch (const meshlib::device_error& e) {
///   e.device();            // 3
///   e.rethrow_cause();     // throws the original exception, with its own type
/// }
/// @endcode
class device_error : public error {
 public:
  device_error(std::size_t device, std::exception_ptr cause, const std::string& what)
      : error(what), device_(device), cause_(std::move(cause)) {}

  [[nodiscard]] std::size_t device() const noexcept { return device_; }
  [[nodiscard]] std::exception_ptr cause() const noexcept { return cause_; }
  [[noreturn]] void rethrow_cause() const { std::rethrow_exception(cause_); }

 private:
  std::size_t device_;
  std::exception_ptr cause_;
};

}  // namespace meshlib

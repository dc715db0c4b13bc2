// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How meshlib's element types, reduce ops and errors map to NCCL's and CUDA's: the pure
/// part of the NCCL backend, which needs the headers and libraries but no GPU (so CI tests it).
///
/// | meshlib | NCCL |
/// | --- | --- |
/// | `float`, `double`, `int32`, `int64` | `ncclFloat32`, `ncclFloat64`, `ncclInt32`, `ncclInt64` |
/// | `bfloat16` (meshlib's, or CUDA's `__nv_bfloat16`) | `ncclBfloat16` |
/// | `__half` (CUDA's, NCCL backend only) | `ncclFloat16` |
/// | `sum`, `prod`, `min`, `max`, `mean` | `ncclSum`, `ncclProd`, `ncclMin`, `ncclMax`, `ncclAvg` |
///
/// Errors: every CUDA and NCCL return code goes through `check_nccl` / `check_cuda`, which throw
///
/// | code | meshlib exception |
/// | --- | --- |
/// | `ncclInvalidArgument`, `ncclInvalidUsage`; `cudaErrorInvalidValue`, `cudaErrorInvalidDevice`, `cudaErrorInvalidDevicePointer` | `comm_argument_error` |
/// | `ncclRemoteError` (a peer failed or left) | `comm_aborted` |
/// | every other failure (`ncclSystemError`, `ncclInternalError`, `ncclUnhandledCudaError`, CUDA errors) | `comm_error` |
///
/// with the message "meshlib: <operation> <where>: <call> failed: <NCCL's or CUDA's error
/// string>[ (<ncclGetLastError>)]".

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <string_view>
#include <type_traits>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/reduce_op.hpp"

// CUDA's 16-bit float types, when the program already includes their headers (nvcc always does for
// __half through cuda_runtime.h); forward declarations would clash with them, so they are only
// recognised when present.
#if defined(__CUDA_FP16_TYPES_EXIST__) || defined(__CUDA_FP16_HPP__) || defined(__CUDA_FP16_H__)
#define MESHLIB_NCCL_HAS_CUDA_HALF 1
#endif
#if defined(__CUDA_BF16_TYPES_EXIST__) || defined(__CUDA_BF16_HPP__) || defined(__CUDA_BF16_H__)
#define MESHLIB_NCCL_HAS_CUDA_BF16 1
#endif

namespace meshlib {

namespace comm::detail {
template <class T>
consteval int nccl_type_index() {
  using U = std::remove_cv_t<T>;
#if defined(MESHLIB_NCCL_HAS_CUDA_HALF)
  if constexpr (std::is_same_v<U, __half>) return ncclFloat16;
  else
#endif
#if defined(MESHLIB_NCCL_HAS_CUDA_BF16)
  if constexpr (std::is_same_v<U, __nv_bfloat16>) return ncclBfloat16;
  else
#endif
  if constexpr (comm_element<U>) {
    switch (datatype_of<U>) {
      case datatype::float32: return ncclFloat32;
      case datatype::float64: return ncclFloat64;
      case datatype::int32: return ncclInt32;
      case datatype::int64: return ncclInt64;
      case datatype::bfloat16: return ncclBfloat16;
    }
    return -1;
  } else {
    return -1;
  }
}
}  // namespace comm::detail

/// @brief An element type the NCCL communicator moves and reduces: every `comm_element`, plus CUDA's
/// `__half` and `__nv_bfloat16` when their headers are included (`<cuda_fp16.h>`, `<cuda_bf16.h>`).
template <class T>
concept nccl_element = (comm::detail::nccl_type_index<T>() >= 0);

/// @brief NCCL's data type of element type `T` (`ncclBfloat16` for meshlib's `bfloat16`,
/// `ncclFloat16` for `__half`).
template <nccl_element T>
inline constexpr ncclDataType_t nccl_datatype_of = static_cast<ncclDataType_t>(comm::detail::nccl_type_index<T>());

/// @brief NCCL's data type of a run-time `datatype` tag.
[[nodiscard]] constexpr ncclDataType_t to_nccl(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return ncclFloat32;
    case datatype::float64: return ncclFloat64;
    case datatype::int32: return ncclInt32;
    case datatype::int64: return ncclInt64;
    case datatype::bfloat16: return ncclBfloat16;
  }
  return ncclNumTypes;
}

/// @brief NCCL's reduction of a `reduce_op`; `mean` is NCCL's own `ncclAvg` (one pass, no division
/// kernel afterwards). Integer `mean` in NCCL rounds as its sum divided by the count, as meshlib's.
[[nodiscard]] constexpr ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::prod: return ncclProd;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::mean: return ncclAvg;
  }
  return ncclNumOps;
}

namespace comm::detail {

/// Which meshlib exception an NCCL result becomes (see the file comment).
enum class comm_failure_kind { argument, aborted, timeout, error };

[[nodiscard]] constexpr comm_failure_kind failure_kind_of(ncclResult_t rc) noexcept {
  switch (rc) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return comm_failure_kind::argument;
    case ncclRemoteError: return comm_failure_kind::aborted;
    default: return comm_failure_kind::error;
  }
}

[[nodiscard]] constexpr comm_failure_kind failure_kind_of(cudaError_t rc) noexcept {
  switch (rc) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return comm_failure_kind::argument;
    default: return comm_failure_kind::error;
  }
}

/// Throws the exception of `kind` with `message`.
[[noreturn]] inline void throw_comm_failure(comm_failure_kind kind, const std::string& message) {
  switch (kind) {
    case comm_failure_kind::argument: throw comm_argument_error(message);
    case comm_failure_kind::aborted: throw comm_aborted(message);
    case comm_failure_kind::timeout: throw comm_timeout(message);
    case comm_failure_kind::error: break;
  }
  throw comm_error(message);
}

/// "ncclInvalidArgument: invalid argument" style text for an NCCL result: the enumerator's name
/// (what users search for) and NCCL's description.
[[nodiscard]] inline std::string nccl_result_text(ncclResult_t rc) {
  const char* name = "ncclResult";
  switch (rc) {
    case ncclSuccess: name = "ncclSuccess"; break;
    case ncclUnhandledCudaError: name = "ncclUnhandledCudaError"; break;
    case ncclSystemError: name = "ncclSystemError"; break;
    case ncclInternalError: name = "ncclInternalError"; break;
    case ncclInvalidArgument: name = "ncclInvalidArgument"; break;
    case ncclInvalidUsage: name = "ncclInvalidUsage"; break;
    case ncclRemoteError: name = "ncclRemoteError"; break;
    case ncclInProgress: name = "ncclInProgress"; break;
    default: return "NCCL error " + std::to_string(static_cast<int>(rc));
  }
  return std::string(name) + " (" + ncclGetErrorString(rc) + ")";
}

/// "cudaErrorNoDevice (no CUDA-capable device is detected)" for a CUDA error.
[[nodiscard]] inline std::string cuda_error_text(cudaError_t rc) {
  return std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
}

/// The message of a failed call: "meshlib: <what>: <call> failed: <text>[: <detail>]".
[[nodiscard]] inline std::string failed_call_message(std::string_view what, std::string_view call,
                                                     const std::string& text, std::string_view detail = {}) {
  std::string m = "meshlib: " + std::string(what) + ": " + std::string(call) + " failed: " + text;
  if (!detail.empty()) m += std::string(": ") + std::string(detail);
  return m;
}

/// Throws the meshlib exception of a failed NCCL call (`rc` other than ncclSuccess and
/// ncclInProgress); `last_error` is `ncclGetLastError(comm)` where a communicator exists.
inline void check_nccl(ncclResult_t rc, std::string_view what, std::string_view call, const char* last_error = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  throw_comm_failure(failure_kind_of(rc),
                     failed_call_message(what, call, nccl_result_text(rc),
                                         last_error != nullptr ? std::string_view(last_error) : std::string_view{}));
}

/// Throws the meshlib exception of a failed CUDA runtime call, and clears CUDA's sticky last error
/// for non-sticky failures so that the next call does not report it again.
inline void check_cuda(cudaError_t rc, std::string_view what, std::string_view call) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  throw_comm_failure(failure_kind_of(rc), failed_call_message(what, call, cuda_error_text(rc)));
}

}  // namespace comm::detail

namespace experimental {
/// Throws `comm_error` naming the call when a CUDA runtime call failed.
using comm::detail::check_cuda;
}  // namespace experimental
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

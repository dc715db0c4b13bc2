// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief How meshlib's element types and reduce ops map to MPI's, and the error check of every
/// MPI call. Internal to the MPI communicator.
///
/// | meshlib | MPI datatype (min, max, moves) | MPI datatype (sum, prod, mean) | MPI op |
/// | --- | --- | --- | --- |
/// | float / double | `MPI_FLOAT` / `MPI_DOUBLE` | same | `MPI_SUM`, `MPI_PROD` (over more than 2 ranks: moved and reduced in rank order instead, `ordered_reduce.hpp`); min/max: meshlib's user ops (NaN propagates, -0 < +0); mean = `MPI_SUM` then / n |
/// | int32 / int64 | `MPI_INT32_T` / `MPI_INT64_T` | `MPI_UINT32_T` / `MPI_UINT64_T` | the same ops; unsigned so that sums wrap as the thread backend's do (signed overflow is undefined in MPI's C loops) |
/// | bfloat16 | `MPI_UINT16_T` (its bits) | widened to `MPI_FLOAT` (default) or 16-bit on the wire with a user-defined op that combines in float | see `mpi_comm_options::bfloat16_on_wire` |

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

namespace meshlib::comm::detail {

/// The text MPI gives for error code `rc`.
inline std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<std::size_t>(len));
}

/// MPI's datatype for T. `wrapping`: the unsigned twin of integers (sum, prod, mean).
template <comm_element T>
MPI_Datatype mpi_datatype(bool wrapping = false) noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<U, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<U, bfloat16>) return MPI_UINT16_T;
  else if constexpr (sizeof(U) == 4) return wrapping ? MPI_UINT32_T : MPI_INT32_T;
  else return wrapping ? MPI_UINT64_T : MPI_INT64_T;
}

/// Whether op combines by addition or multiplication (wraps for integers).
constexpr bool wraps(reduce_op op) noexcept {
  return op == reduce_op::sum || op == reduce_op::prod || op == reduce_op::mean;
}

/// meshlib's min or max of float or double (`float_min`, `float_max`: NaN propagates, -0 < +0) as
/// an MPI user op; MPI's own MPI_MIN and MPI_MAX lose a NaN that is not in the first operand.
/// `in` holds the lower ranks' result (the op is created non-commutative, so MPI keeps rank order).
template <class F, reduce_op Op>
void float_minmax_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const F*>(in);
  auto* b = static_cast<F*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Op == reduce_op::min ? float_min(a[i], b[i]) : float_max(a[i], b[i]);
}

/// The user ops of `float_minmax_combine`: [float min, float max, double min, double max], created
/// on first use (after `MPI_Init`) and kept until `MPI_Finalize`.
inline MPI_Op float_minmax_op(bool is_double, reduce_op op) {
  static MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  static const bool made = [] {
    MPI_Op_create(&float_minmax_combine<float, reduce_op::min>, 0, &ops[0]);
    MPI_Op_create(&float_minmax_combine<float, reduce_op::max>, 0, &ops[1]);
    MPI_Op_create(&float_minmax_combine<double, reduce_op::min>, 0, &ops[2]);
    MPI_Op_create(&float_minmax_combine<double, reduce_op::max>, 0, &ops[3]);
    return true;
  }();
  (void)made;
  return ops[(is_double ? 2 : 0) + (op == reduce_op::max ? 1 : 0)];
}

/// MPI's op for a meshlib op on T (mean is a sum followed by a division by the participant count;
/// min and max of floating-point values are meshlib's user ops).
template <class T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_floating_point_v<T>)
    if (op == reduce_op::min || op == reduce_op::max) return float_minmax_op(std::is_same_v<T, double>, op);
  switch (op) {
    case reduce_op::sum:
    case reduce_op::mean: return MPI_SUM;
    case reduce_op::prod: return MPI_PROD;
    case reduce_op::min: return MPI_MIN;
    case reduce_op::max: return MPI_MAX;
  }
  return MPI_SUM;
}

/// bfloat16 user-defined ops: each combination is done in float and rounded to bfloat16.
template <reduce_op Op>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const bfloat16*>(in);
  auto* b = static_cast<bfloat16*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i];
    const float y = b[i];
    float r;
    if constexpr (Op == reduce_op::sum || Op == reduce_op::mean) r = x + y;
    else if constexpr (Op == reduce_op::prod) r = x * y;
    else if constexpr (Op == reduce_op::min) r = float_min(x, y);
    else r = float_max(x, y);
    b[i] = bfloat16(r);
  }
}

/// The user-defined `MPI_Op` for bfloat16 and `op`, created on first use (after `MPI_Init`) and
/// kept until `MPI_Finalize` frees it with the rest of MPI's state.
inline MPI_Op bf16_mpi_op(reduce_op op) {
  static MPI_Op ops[5] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  static const bool made = [] {
    MPI_Op_create(&bf16_combine<reduce_op::sum>, 1, &ops[static_cast<int>(reduce_op::sum)]);
    MPI_Op_create(&bf16_combine<reduce_op::prod>, 1, &ops[static_cast<int>(reduce_op::prod)]);
    MPI_Op_create(&bf16_combine<reduce_op::min>, 1, &ops[static_cast<int>(reduce_op::min)]);
    MPI_Op_create(&bf16_combine<reduce_op::max>, 1, &ops[static_cast<int>(reduce_op::max)]);
    ops[static_cast<int>(reduce_op::mean)] = ops[static_cast<int>(reduce_op::sum)];
    return true;
  }();
  (void)made;
  return ops[static_cast<int>(op)];
}

/// After a sum: divide by the participant count as the thread backend's mean does (integers:
/// the wrapped sum, as signed, divided toward zero).
template <comm_element T>
void finish_avg(T* data, std::size_t count, int n) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>) data[i] = static_cast<T>(data[i] / static_cast<T>(n));
    else if constexpr (std::is_same_v<T, bfloat16>) data[i] = bfloat16(static_cast<float>(data[i]) / static_cast<float>(n));
    else data[i] = static_cast<T>(data[i] / static_cast<T>(n));
  }
}

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_MPI

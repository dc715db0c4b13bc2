// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reduce_op`: the reductions every communicator supports (NCCL's `ncclRedOp_t`, MPI's
/// `MPI_Op`), `mean` included because JAX's `pmean` is one collective, not a sum and a division.
/// One name for it across meshlib (`pmean`, `mean<D>`, `reduce_op::mean`); NCCL calls it `ncclAvg`.

#include <cstdint>
#include <ostream>
#include <string_view>

namespace meshlib {

/// @brief A reduction over the participants of a collective.
///
/// Reductions are applied in rank order (`((x0 op x1) op x2) ...`) by every backend that meshlib
/// implements itself, so results are bitwise reproducible. Integer `sum` and `prod` wrap modulo
/// 2^bits; integer `mean` is the wrapped sum divided by the participant count, rounded toward zero.
/// `bfloat16` values are combined in `float` and rounded once at the end.
enum class reduce_op : std::uint8_t {
  sum,   ///< x0 + x1 + ... (JAX `psum`)
  prod,  ///< x0 * x1 * ...
  min,   ///< smallest value (JAX `pmin`)
  max,   ///< largest value (JAX `pmax`)
  mean,  ///< sum divided by the number of participants (JAX `pmean`; NCCL's `ncclAvg`)
};

/// @brief The name of a reduce op, as used in error messages: "sum", "prod", "min", "max", "mean".
[[nodiscard]] constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::prod: return "prod";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::mean: return "mean";
  }
  return "unknown";
}

/// @brief Prints the reduce op's name (`to_string`).
inline std::ostream& operator<<(std::ostream& os, reduce_op op) { return os << to_string(op); }

/// @brief Every reduce op, for loops in tests and benchmarks.
inline constexpr reduce_op all_reduce_ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max,
                                               reduce_op::mean};

}  // namespace meshlib

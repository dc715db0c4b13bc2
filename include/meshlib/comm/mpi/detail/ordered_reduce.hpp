// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Floating-point reductions in rank order on MPI: the same bits as the thread backend.
///
/// IEEE addition and multiplication are commutative but not associative, and `MPI_Allreduce`
/// combines the ranks' values in an order of its own (ring, tree, recursive halving: it depends on
/// the size, the message length and the MPI build). The thread backend combines every element as
/// `((x0 op x1) op x2) ...` in rank order. So for float and double sum, prod and mean over more
/// than two ranks, the MPI communicator moves the inputs instead and reduces them with the thread
/// backend's own kernel (`reduce_into`): an all-to-all of blocks, each rank reducing its block in
/// rank order (a reduce-scatter), then an all-gather for all_reduce, or a gather to the root for
/// reduce. With two ranks every order is `x0 op x1` (commutativity), so MPI's native path already
/// gives those bits and stays. Integers (exact, wrapping) and min / max (meshlib's NaN-aware ops
/// do not depend on the order) stay native too.

#include <cstddef>
#include <type_traits>
#include <vector>

#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"

namespace meshlib::comm::detail {

/// Whether a reduction of T with `op` over `ranks` ranks must run in rank order to give the thread
/// backend's bits (see the file comment).
template <class T>
constexpr bool needs_rank_order(reduce_op op, int ranks) noexcept {
  return std::is_floating_point_v<T> && ranks > 2 &&
         (op == reduce_op::sum || op == reduce_op::prod || op == reduce_op::mean);
}

/// out[i] = blocks[0][i] op blocks[1][i] op ... in rank order (mean: divided by n), i < len, where
/// block r starts at `blocks + r * stride`. The thread backend's kernel, so its bits.
template <class T>
void reduce_blocks_in_order(reduce_op op, const T* blocks, int n, std::size_t stride, T* out, std::size_t len) {
  if (len == 0) return;
  std::vector<const T*> in(static_cast<std::size_t>(n));
  for (std::size_t r = 0; r < in.size(); ++r) in[r] = blocks + r * stride;
  T* outs[1] = {out};
  reduce_into<T>(op, in.data(), n, outs, 1, len);
}

}  // namespace meshlib::comm::detail

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Completion handles. Every communicator operation returns its backend's `request_type`,
/// so that code written against the `communicator` concept works unchanged with backends that
/// complete later (NCCL enqueues on a CUDA stream, MPI has non-blocking calls), as kokkos-comm's
/// `Req` and c10d's `Work`.

#include <concepts>

namespace meshlib {

/// @brief A completion handle: `wait()` blocks until the operation is complete (its receive
/// buffers hold the result and its send buffers may be reused); `test()` says whether it is,
/// without blocking. Both may throw the communicator's errors.
template <class R>
concept comm_request = requires(R& r) {
  r.wait();
  { r.test() } -> std::convertible_to<bool>;
};

/// @brief The request of a backend that completes every operation before returning (the thread
/// communicator): already complete, `wait()` does nothing.
class ready_request {
 public:
  constexpr void wait() const noexcept {}
  [[nodiscard]] constexpr bool test() const noexcept { return true; }
};

static_assert(comm_request<ready_request>);

/// @brief The execution context of a backend that runs on the calling host thread (thread and MPI
/// communicators): nothing to pass. A stream backend has its own context type (NCCL: a CUDA
/// stream), and every operation takes one as an optional last argument.
struct host_context {};

}  // namespace meshlib

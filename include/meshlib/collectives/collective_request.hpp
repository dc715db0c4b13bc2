// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `collective_request<Result>`: what a typed collective's asynchronous form (`psum_start`)
/// returns, as c10d's `Work` or an MPI request with the typed result attached: `wait()` gives the
/// very value the synchronous form would have returned (its type computed and checked at compile
/// time as the synchronous form's), `test()` says whether it is ready.
/// @code
/// // inside shard_map / spmd, g a gradient bucket that is a pending sum over "data":
/// auto r = meshlib::psum_start<"data">(std::move(g));  // returns at once; the sum runs beside
/// compute_more();                                        // ... the device's own work
/// auto sum = r.wait();                                   // psum<"data">(g)'s value, same bits
/// @endcode
/// A request must be waited for on the device that started it, inside the same `shard_map` /
/// `spmd` call. One that is destroyed unwaited still completes first (its buffers may be in use);
/// its error, if any, is then dropped: the device's later collectives report the failure.

#include <any>
#include <memory>
#include <utility>

#include "meshlib/collectives/comm_stream.hpp"
#include "meshlib/core/errors.hpp"

namespace meshlib {

/// @brief The pending result of an asynchronous typed collective (see the file comment).
/// @tparam Result the type the synchronous collective returns.
template <class Result>
class [[nodiscard]] collective_request {
 public:
  /// An empty request (nothing to wait for; `wait()` throws).
  collective_request() = default;
  /// Used by the `*_start` collectives: `op` completes on `stream`; `keep` holds the inputs the
  /// operation reads (released after completion, on the waiting thread).
  collective_request(collectives::detail::comm_stream& stream, std::shared_ptr<collectives::detail::stream_op> op, Result result,
                     std::any keep = {})
      : stream_(&stream), op_(std::move(op)), result_(std::move(result)), keep_(std::move(keep)) {}
  /// Takes over `o`'s operation (a moved-from request has none: its `wait()` is not called).
  collective_request(collective_request&& o) noexcept
      : stream_(o.stream_), op_(std::move(o.op_)), result_(std::move(o.result_)), keep_(std::move(o.keep_)) {}
  /// Completes this request's own operation first (a dropped request still completes), then takes
  /// over `o`'s.
  collective_request& operator=(collective_request&& o) noexcept {
    if (this != &o) {
      complete_quietly();
      stream_ = o.stream_;
      op_ = std::move(o.op_);
      result_ = std::move(o.result_);
      keep_ = std::move(o.keep_);
    }
    return *this;
  }
  collective_request(const collective_request&) = delete;
  collective_request& operator=(const collective_request&) = delete;
  ~collective_request() { complete_quietly(); }

  /// Whether the request has an operation not yet waited for.
  [[nodiscard]] bool valid() const noexcept { return op_ != nullptr; }

  /// @brief Blocks until the collective is complete and returns its result (once).
  /// @throws the backend's error (`comm_aborted`, `comm_timeout`, `collective_mismatch`, ...) when
  /// the collective failed; `meshlib::error` on an empty or already-waited request.
  Result wait() {
    if (!op_) throw error("meshlib: collective_request::wait() on an empty request (default-constructed, moved from or "
                          "already waited for); wait for each started collective once");
    auto op = std::move(op_);
    stream_->wait(*op);  // rethrows the collective's error
    keep_.reset();
    return std::move(result_);
  }

  /// Whether the collective is complete (`wait()` will not block). Does not throw its error.
  [[nodiscard]] bool test() const noexcept { return !op_ || collectives::detail::comm_stream::test(*op_); }

 private:
  void complete_quietly() noexcept {
    if (!op_) return;
    try {
      stream_->wait(*op_);
    } catch (...) {  // dropped on purpose (file comment): the device's next collective reports it
    }
    op_.reset();
  }

  collectives::detail::comm_stream* stream_ = nullptr;
  std::shared_ptr<collectives::detail::stream_op> op_;
  Result result_{};
  std::any keep_;
};

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `basic_stream_request<Channel>`: the request of a stream-ordered backend. An operation
/// is enqueued on a CUDA stream and an event recorded after it; the request completes when that
/// event does. Waiting polls the event and the channel's asynchronous error against the
/// communicator's timeout, so no wait is unbounded: an error of the channel (NCCL's
/// `ncclCommGetAsyncError`) or a passed deadline aborts the channel (`ncclCommAbort`) and throws
/// `comm_aborted` or `comm_timeout` naming the operation.
///
/// The state machine is independent of CUDA (CI tests it with a fake stream):
///
/// | state | `test()` | `wait()` |
/// | --- | --- | --- |
/// | empty (default-constructed) | true | returns |
/// | pending | polls once: complete -> true; failed -> aborts, throws; deadline passed -> aborts, throws `comm_timeout`; else false | polls until one of those |
/// | complete | true | returns |
/// | failed | throws the same error again | throws the same error again |
///
/// A channel that checks the participants' calls (the NCCL communicator's `verify_collectives`)
/// reports a disagreement as a failed poll marked `mismatch`: the request throws
/// `collective_mismatch` with the channel's message and aborts the channel (the mismatched
/// collective itself may never finish).
///
/// A `Channel` provides `event_type`, `poll(event_type) -> stream_poll` (never blocks),
/// `abort(reason, timed_out)` (stops the channel's outstanding work; later operations on the channel are
/// refused), `release(event_type)` (takes back an event for reuse) and `describe(op)` (the
/// operation and the participant, for messages).

#include <chrono>
#include <concepts>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "meshlib/comm/errors.hpp"

namespace meshlib {

/// @brief What one poll of a stream event found.
struct stream_poll {
  /// Where the operation stands.
  enum class state { pending, complete, failed };
  /// What this poll found.
  state status = state::pending;
  /// For `failed`: why (NCCL's or CUDA's error text), and whether a peer failed (`comm_aborted`) or
  /// this participant's own call did (`comm_error`).
  std::string error;
  /// For `failed`: true when a peer failed (`comm_aborted`), false when this call did (`comm_error`).
  bool peer_failed = true;
  /// For `failed`: the participants called different collectives (`collective_mismatch`); `error`
  /// is then the whole message, listing each participant's call.
  bool mismatch = false;

  /// Not done yet: poll again.
  [[nodiscard]] static stream_poll pending() { return {}; }
  /// Done without error.
  [[nodiscard]] static stream_poll complete() { return {state::complete, {}, false}; }
  /// Failed because of `why`; `peer` says whether a peer (true) or this call (false) failed.
  [[nodiscard]] static stream_poll failed(std::string why, bool peer = true) {
    return {state::failed, std::move(why), peer};
  }
  /// Failed because participants called different collectives; `message` lists each call.
  [[nodiscard]] static stream_poll mismatched(std::string message) {
    return {state::failed, std::move(message), false, true};
  }
};

/// @brief A request that completes when its stream event does. Movable, not copyable; destroying a
/// pending request does not wait (the work stays ordered on its stream) and returns its event.
template <class Channel>
class basic_stream_request {
 public:
  /// The event type the channel records on the stream.
  using event_type = typename Channel::event_type;

  /// An empty request: already complete.
  basic_stream_request() = default;

  /// @brief A pending request for `op`, whose completion `event` marks; waits end with
  /// `comm_timeout` after `timeout` (zero or negative: never).
  basic_stream_request(std::shared_ptr<Channel> channel, event_type event, std::string op,
                       std::chrono::nanoseconds timeout)
      : channel_(std::move(channel)), event_(event), op_(std::move(op)), state_(state::pending) {
    if (timeout.count() > 0) deadline_ = std::chrono::steady_clock::now() + timeout;
  }

  /// Movable: the moved-from request no longer waits on anything.
  basic_stream_request(basic_stream_request&& o) noexcept { *this = std::move(o); }
  /// Move assignment: the moved-from request no longer waits on anything.
  basic_stream_request& operator=(basic_stream_request&& o) noexcept {
    if (this != &o) {
      give_back();
      channel_ = std::move(o.channel_);
      event_ = o.event_;
      has_event_ = std::exchange(o.has_event_, false);
      op_ = std::move(o.op_);
      state_ = std::exchange(o.state_, state::empty);
      deadline_ = o.deadline_;
      failure_ = std::move(o.failure_);
      failure_is_timeout_ = o.failure_is_timeout_;
      failure_is_abort_ = o.failure_is_abort_;
      failure_is_mismatch_ = o.failure_is_mismatch_;
    }
    return *this;
  }
  basic_stream_request(const basic_stream_request&) = delete;
  basic_stream_request& operator=(const basic_stream_request&) = delete;
  ~basic_stream_request() { give_back(); }

  /// @brief Whether the operation is complete, without blocking.
  /// @throws comm_aborted, comm_timeout or comm_error as `wait()`.
  [[nodiscard]] bool test() {
    switch (state_) {
      case state::empty:
      case state::complete: return true;
      case state::failed: rethrow();
      case state::pending: break;
    }
    return step();
  }

  /// @brief Blocks until the operation is complete (its receive buffers hold the result).
  /// @throws comm_aborted when the channel reports an error (a peer failed, the communicator was
  /// aborted), comm_timeout when the deadline passes first (the channel is aborted then too).
  void wait() {
    while (!test()) std::this_thread::yield();
  }

  /// Whether the request is still pending (neither complete nor failed).
  [[nodiscard]] bool pending() const noexcept { return state_ == state::pending; }
  /// The operation's name, as in error messages.
  [[nodiscard]] const std::string& operation() const noexcept { return op_; }

 private:
  enum class state { empty, pending, complete, failed };

  bool step() {
    stream_poll p = channel_->poll(event_);
    if (p.status == stream_poll::state::complete) {
      state_ = state::complete;
      give_back();
      return true;
    }
    if (p.status == stream_poll::state::failed && p.mismatch) {
      failure_is_mismatch_ = true;
      fail(p.error.starts_with("meshlib: ") ? p.error.substr(9) : p.error, false, false);
    } else if (p.status == stream_poll::state::failed) {
      fail(channel_->describe(op_) + " failed: " + p.error, false, p.peer_failed);
    } else if (deadline_ && std::chrono::steady_clock::now() > *deadline_) {
      fail(channel_->describe(op_) + " did not complete within the communicator's timeout (" +
               std::to_string(timeout_ms()) + " ms); a peer never joined, or the collectives were called in "
               "different orders (NCCL cannot tell); the communicator was aborted" + unchecked_calls(),
           true, false);
    }
    return false;
  }
  /// The channel's calls not yet checked against the peers' (`unchecked_calls()`, where it has
  /// one: the NCCL communicator's batched mismatch check), for the timeout's message.
  [[nodiscard]] std::string unchecked_calls() const {
    if constexpr (requires(const Channel& c) { { c.unchecked_calls() } -> std::convertible_to<std::string>; })
      return channel_->unchecked_calls();
    else
      return {};
  }
  [[nodiscard]] long long timeout_ms() const noexcept {
    // Recomputed for the message only: the deadline minus the creation time is not kept.
    return channel_ ? channel_->timeout_ms() : 0;
  }
  [[noreturn]] void fail(std::string message, bool timeout, bool aborted) {
    failure_ = "meshlib: " + std::move(message);
    failure_is_timeout_ = timeout;
    failure_is_abort_ = aborted;
    state_ = state::failed;
    channel_->abort(failure_, timeout);
    give_back();
    rethrow();
  }
  [[noreturn]] void rethrow() const {
    if (failure_is_mismatch_) throw collective_mismatch(failure_);
    if (failure_is_timeout_) throw comm_timeout(failure_);
    if (failure_is_abort_) throw comm_aborted(failure_);
    throw comm_error(failure_);
  }
  void give_back() noexcept {
    if (channel_ && has_event_) channel_->release(event_);
    has_event_ = false;
  }

  std::shared_ptr<Channel> channel_;
  event_type event_{};
  bool has_event_ = true;
  std::string op_;
  state state_ = state::empty;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  std::string failure_;
  bool failure_is_timeout_ = false;
  bool failure_is_abort_ = false;
  bool failure_is_mismatch_ = false;
};

}  // namespace meshlib

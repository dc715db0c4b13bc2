// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `thread_world`: the shared state of a group of threads and the source of their
/// `thread_communicator` handles (each rank's once), and the way to fail the group from outside
/// a handle (a runner that saw a participant throw, a hybrid world's watcher). Apart from the
/// communicator because it is the group's owner, not a participant's handle;
/// `<meshlib/comm/thread/thread_communicator.hpp>` includes this header, so either gives both.

#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/thread/detail/group_state.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

/// @brief The shared state of a group of `size` threads, and the source of their handles.
///
/// The world outlives nothing it hands out: handles share ownership of the state, so a handle
/// may outlive its world. Destroying the world while a handle it gave out is still held aborts
/// the world ("the thread_world was destroyed"), which releases every blocked participant.
class thread_world {
 public:
  /// @throws comm_argument_error unless 1 <= size.
  explicit thread_world(int size, thread_comm_options options = {}) {
    if (size < 1)
      throw comm_argument_error("meshlib: a thread_world needs at least 1 participant, got " + std::to_string(size));
    world_ = std::make_shared<comm::detail::world_state>(options, size);
    std::vector<int> ranks(static_cast<std::size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    group_ = comm::detail::make_group(world_, std::move(ranks));
  }
  thread_world(const thread_world&) = delete;
  thread_world& operator=(const thread_world&) = delete;
  /// Movable: the world's shared state moves with it.
  thread_world(thread_world&&) noexcept = default;
  /// Move assignment: the world's shared state moves with it.
  thread_world& operator=(thread_world&&) noexcept = default;
  ~thread_world() {
    if (!group_) return;
    for (int r = 0; r < group_->n; ++r) {
      const auto& slot = group_->slots[r];
      if (slot.claimed.load() && !slot.departed.load()) {
        world_->fail(comm::detail::failure_kind::aborted, -1,
                     "meshlib: communicator aborted: the thread_world was destroyed while rank " + std::to_string(r) +
                         " still held its handle");
        break;
      }
    }
  }

  /// Number of participants.
  [[nodiscard]] int size() const noexcept { return group_->n; }

  /// @brief The handle of participant `rank`, for the thread that plays it. Each rank's handle is
  /// handed out once.
  /// @throws comm_argument_error when rank is out of range or its handle was already taken.
  [[nodiscard]] thread_communicator communicator(int rank) {
    if (rank < 0 || rank >= group_->n)
      throw comm_argument_error("meshlib: thread_world::communicator: rank " + std::to_string(rank) +
                                " is out of range [0, " + std::to_string(group_->n) + ")");
    if (group_->slots[rank].claimed.exchange(true))
      throw comm_argument_error("meshlib: thread_world::communicator: the handle of rank " + std::to_string(rank) +
                                " was already handed out; each rank has one handle");
    return thread_communicator(group_, rank);
  }

  /// @brief Fails the world with `rank` as the root cause (`comm_aborted` everywhere, naming it).
  /// @returns whether this call recorded the root cause.
  bool abort(int rank, std::string_view reason) {
    return abort(rank, reason, "rank " + std::to_string(rank));
  }
  /// @brief As `abort(rank, reason)`, with the failed participant named `who` in the message
  /// ("meshlib: communicator aborted: <who> failed: <reason>"): a hybrid world names the global
  /// device; rank -1 is a participant outside this world (a device of another process).
  bool abort(int rank, std::string_view reason, std::string_view who) {
    return world_->fail(comm::detail::failure_kind::aborted, rank,
                        "meshlib: communicator aborted: " + std::string(who) + " failed: " + std::string(reason));
  }

  /// @brief Fails the world as a collective mismatch that was detected elsewhere (by another
  /// process of a hybrid world): every participant gets `collective_mismatch` with `message`, no
  /// participant being the root cause. @returns whether this call recorded the root cause.
  bool fail_as_mismatch(std::string_view message) { return fail_as(comm::detail::failure_kind::mismatch, message); }

  /// @brief Fails the world with an error detected elsewhere (by another process of a hybrid
  /// world, or by its leader's exchange between processes): every participant gets the error of
  /// `kind` (`comm_aborted`, `comm_timeout`, `collective_mismatch`) with `message`, no participant
  /// of this world being the root cause. @returns whether this call recorded the root cause.
  bool fail_as(comm::detail::failure_kind kind, std::string_view message) {
    return world_->fail(kind, -1, std::string(message));
  }

  /// Whether the world has failed.
  [[nodiscard]] bool failed() const noexcept { return world_->failed.load(); }
  /// World rank of the root cause of the failure, -1 when none or when no one rank caused it (a mismatch).
  [[nodiscard]] int root_cause_rank() const { return world_->root_cause_rank(); }

 private:
  std::shared_ptr<comm::detail::world_state> world_;
  std::shared_ptr<comm::detail::group_state> group_;
};

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `basic_shared_event`: an event one participant records and its peers wait on, handed to
/// them through a host rendezvous (the shared-GPU communicator's "ready" and "done" events), and
/// `peer_event_refs`, what a participant holds of its peers' events after the rendezvous.
///
/// Why jointly owned. A peer waits on the event (`cudaStreamWaitEvent`) after the rendezvous
/// that handed it over, and the rendezvous is the last meeting of the operation: the owner may
/// already have returned from it, ended its thread and destroyed its communicator. Destroying
/// the event there made the peer's wait use a destroyed event (the SIGSEGV of
/// shared-GPU conformance runs with 4 devices, issue 36). So the event is reference counted:
/// its owner holds one reference, adds one per peer *before* it publishes the handle
/// (`share`), and each peer gives its reference back once it has enqueued its wait (or has
/// failed before); the last reference destroys the event. No peer can see the handle without
/// holding a reference, however early its owner leaves.
///
/// If the rendezvous itself fails for the owner (an abort, a timeout), it cannot know which
/// peers received the handle: the references of those that did not are never given back and the
/// event is leaked (one event per failed rendezvous), never destroyed while a peer may use it.
///
/// Independent of CUDA (`Traits` supplies the event type and its destruction), so the protocol is
/// tested on the host with a fake event (tests/unit/nccl/test_nccl_host.cpp).

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace meshlib::comm::detail {

/// @brief An event with a reference count. `Traits` provides `event_type` and
/// `static void destroy(event_type, int device) noexcept`.
template <class Traits>
class basic_shared_event {
 public:
  using event_type = typename Traits::event_type;

  /// Takes ownership of `e` (of GPU `device`) with one reference, its owner's.
  [[nodiscard]] static basic_shared_event* adopt(event_type e, int device) { return new basic_shared_event(e, device); }

  basic_shared_event(const basic_shared_event&) = delete;
  basic_shared_event& operator=(const basic_shared_event&) = delete;

  /// The event.
  [[nodiscard]] event_type get() const noexcept { return event_; }
  /// What a rendezvous carries: the address of this object.
  [[nodiscard]] std::int64_t handle() const noexcept { return reinterpret_cast<std::int64_t>(this); }
  /// The object a handle names (a handle received from a peer, which holds a reference for us).
  [[nodiscard]] static basic_shared_event* from_handle(std::int64_t h) noexcept {
    return reinterpret_cast<basic_shared_event*>(h);
  }

  /// @brief One reference for each of `peers` participants; call before publishing `handle()`.
  void share(int peers) noexcept { refs_.fetch_add(peers, std::memory_order_relaxed); }
  /// @brief Gives back one reference; the last one destroys the event and this object.
  void release() noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      Traits::destroy(event_, device_);
      delete this;
    }
  }

 private:
  basic_shared_event(event_type e, int device) noexcept : event_(e), device_(device) {}
  ~basic_shared_event() = default;

  event_type event_;
  int device_;
  std::atomic<int> refs_{1};
};

/// @brief The references to its peers' events that a participant received in one rendezvous
/// (every rank's but its own), each given back exactly once: by `release_all` or on destruction,
/// whichever way the operation ends (a mismatch, a failed CUDA call).
template <class Traits>
class peer_event_refs {
 public:
  using event_type = typename Traits::event_type;

  /// Takes the reference of every rank q != `self` of `n`, whose handle is `handle_of(q)`. Call it
  /// right after the rendezvous, before anything can throw.
  template <class HandleOf>
  peer_event_refs(int n, int self, HandleOf&& handle_of) {
    events_.reserve(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q)
      events_.push_back(q == self ? nullptr : basic_shared_event<Traits>::from_handle(handle_of(q)));
  }
  peer_event_refs(const peer_event_refs&) = delete;
  peer_event_refs& operator=(const peer_event_refs&) = delete;
  ~peer_event_refs() { release_all(); }

  /// The event of rank q (q != self).
  [[nodiscard]] event_type operator[](int q) const noexcept { return events_[static_cast<std::size_t>(q)]->get(); }
  /// Gives every reference back (their waits are enqueued).
  void release_all() noexcept {
    for (auto*& e : events_)
      if (e != nullptr) std::exchange(e, nullptr)->release();
  }

 private:
  std::vector<basic_shared_event<Traits>*> events_;
};

}  // namespace meshlib::comm::detail

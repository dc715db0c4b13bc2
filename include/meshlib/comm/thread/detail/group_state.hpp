// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The shared state of the thread communicator: one `world_state` per `thread_world` (the
/// failure record every group of that world shares, and the registry of sub-groups being split),
/// one `group_state` per communicator group (the arrival counter, the release word, a slot per
/// rank with its call descriptor and staging buffers, and the point-to-point mailboxes).
///
/// Synchronisation (details in docs/design.md, "The thread communicator"): every collective is
/// one step. Each rank publishes its call in its flag line for the step (one cache line). One-shot
/// steps wait for every peer's flag line and compare the calls; zero-copy steps also count arrivals
/// on `arrivals`, and the rank that completes the count releases the step by incrementing `word`
/// with a compare-and-swap that fails once the world has failed. Waits spin, then block on a
/// condition variable with a deadline (oversubscribed groups yield in between). A failure sets the high bit of `word` in every group of
/// the world, which ends every wait at once.
///
/// What a rank publishes in a step is in call_desc.hpp; how long it spins, yields and blocks, and
/// which algorithm a step takes, in wait_policy.hpp.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/detail/spin_then_block.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/detail/call_desc.hpp"
#include "meshlib/comm/thread/detail/wait_policy.hpp"
#include "meshlib/comm/thread/options.hpp"

namespace meshlib::comm::detail {

using comm_clock = std::chrono::steady_clock;

/// How long a waiter waits, after a peer's handle was destroyed by an exception unwinding its
/// stack, for that peer's runner to report the exception (well inside the 1 s promise).
inline constexpr std::chrono::milliseconds unwind_grace{200};


/// A buffer aligned to a cache line, grown by its owner only.
class staging_buffer {
 public:
  staging_buffer() = default;
  staging_buffer(const staging_buffer&) = delete;
  staging_buffer& operator=(const staging_buffer&) = delete;
  ~staging_buffer() { release(); }
  std::byte* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      release();
      const std::size_t cap = std::max<std::size_t>(bytes, 256);
      data_ = static_cast<std::byte*>(::operator new(cap, std::align_val_t{64}));
      capacity_ = cap;
    }
    return data_;
  }

 private:
  void release() noexcept {
    if (data_) ::operator delete(data_, std::align_val_t{64});
    data_ = nullptr;
    capacity_ = 0;
  }
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
};

/// One rank's slot. Flag lines, descriptors and staging buffers are double-buffered by the parity of the step:
/// a rank can start step s+1 (and overwrite its parity-(s+1) copies) while slow peers still read
/// its step-s copies, but it cannot start step s+2 before every peer arrived at s+1, that is,
/// before every peer finished reading step s.
struct alignas(64) rank_slot {
  flag_line line[2];
  call_desc desc[2];
  std::vector<permute_pair> pairs[2];     ///< copy of a ppermute's pairs (peers may read it after the caller returned)
  alignas(64) std::atomic<std::uint64_t> arrived{0};  ///< central arrivals of this rank (zero-copy steps)
  alignas(64) std::atomic<std::uint64_t> done{0};     ///< step + 1 of the last zero-copy step it finished copying
  /// The CPU its thread ran on when it last arrived (-1: unknown), written only when it changes: a
  /// waiter whose late peer shares its CPU yields instead of spinning (step_protocol::wait_until).
  std::atomic<int> cpu{-1};
  std::atomic<bool> departed{false};      ///< its handle was destroyed
  /// When the handle was destroyed by stack unwinding (steady-clock ticks; 0: it was not). Its
  /// thread is about to report the exception itself, and that exception is the better root cause
  /// than "it left": waiters give it `unwind_grace` to arrive before they blame the departure.
  std::atomic<std::int64_t> unwound_at{0};
  std::atomic<bool> claimed{false};       ///< its handle was handed out
  staging_buffer staging[2];
};

struct group_state;

/// The failure record and sub-group registry shared by every group of one thread_world.
struct world_state {
  world_state(const thread_comm_options& o, int participants) : options(o), size(participants) {}

  thread_comm_options options;
  const int size;  ///< threads of the world: whether they outnumber the cores decides how groups wait
  std::mutex mutex;
  std::atomic<bool> failed{false};
  failure_kind kind = failure_kind::aborted;  // guarded by mutex
  int failed_rank = -1;                       // world rank of the root cause, -1 if none
  std::string message;                        // guarded by mutex
  missing_report timed_out;                   // a timeout's waiter and missing ranks (world ranks; guarded by mutex)
  std::vector<std::weak_ptr<group_state>> groups;
  struct pending_group {
    std::shared_ptr<group_state> state;
    int claims = 0;
  };
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, pending_group> pending;
  std::uint64_t next_group_id = 0;

  /// Records the root cause (the first failure wins) and releases every waiter of every group.
  /// @returns whether this call recorded the root cause.
  bool fail(failure_kind k, int world_rank, std::string msg, missing_report report = {});

  /// Throws the error of the recorded root cause, `context` appended.
  [[noreturn]] void rethrow(std::string_view context) {
    failure_kind k;
    std::string m;
    {
      std::lock_guard lk(mutex);
      k = kind;
      m = message;
    }
    if (!context.empty()) {
      m += " [";
      m += context;
      m += ']';
    }
    throw_failure(k, std::move(m));
  }

  /// The facts of the root cause when it is a timeout this world detected (world ranks), so that
  /// an owner can restate it in its own terms; false when it is not.
  bool timeout_facts(missing_report& out) {
    std::lock_guard lk(mutex);
    if (!failed.load(std::memory_order_relaxed) || kind != failure_kind::timeout || timed_out.waiter < 0) return false;
    out = timed_out;
    return true;
  }

  int root_cause_rank() {
    std::lock_guard lk(mutex);
    return failed_rank;
  }
};

/// A point-to-point message in flight: send copies it here, so send never waits for recv.
struct p2p_message {
  int tag = 0;
  datatype dtype = datatype::float32;
  std::size_t count = 0;
  std::vector<std::byte> data;
};

inline constexpr std::uint64_t failed_bit = std::uint64_t{1} << 63;

struct group_state {
  group_state(std::shared_ptr<world_state> w, std::vector<int> members, std::uint64_t gid)
      : world(std::move(w)),
        n(static_cast<int>(members.size())),
        id(gid),
        world_ranks(std::move(members)),
        policy(make_wait_policy(world->options, world->size)),
        slots(new rank_slot[static_cast<std::size_t>(n)]),
        mailboxes(static_cast<std::size_t>(n) * static_cast<std::size_t>(n)) {}

  std::shared_ptr<world_state> world;
  const int n;
  const std::uint64_t id;
  const std::vector<int> world_ranks;  ///< world rank of each group rank
  const wait_policy policy;

  // The arrival counter and the release word share a line: the rank that completes a step
  // already owns the line when it releases the step.
  alignas(64) std::atomic<std::uint64_t> arrivals{0};
  std::atomic<std::uint64_t> word{0};  ///< released steps | failed_bit

  alignas(64) std::atomic<int> sleepers{0};
  std::mutex mutex;
  std::condition_variable cv;

  std::unique_ptr<rank_slot[]> slots;

  std::mutex p2p_mutex;
  std::condition_variable p2p_cv;
  /// [source * n + dest], guarded by p2p_mutex; in send order. Vectors, not deques: a default
  /// deque allocates, and a world (one per spmd call) has n * n mailboxes, nearly always empty.
  std::vector<std::vector<p2p_message>> mailboxes;

  bool is_world() const noexcept { return id == 0; }

  /// "rank 2", or "rank 2 (world rank 5)" in a sub-group.
  std::string rank_label(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (!is_world()) s += " (world rank " + std::to_string(world_ranks[static_cast<std::size_t>(r)]) + ")";
    return s;
  }

  /// Wakes every blocked waiter of this group (after a rank arrived or departed). The check of
  /// `sleepers` is unfenced on purpose: a waiter about to sleep issues the process-wide barrier
  /// instead (`sleeper_fence`, comm/detail/spin_then_block.hpp), so that no wake-up is missed
  /// while every collective's arrival stays one plain store.
  void wake() {
    waker_fence();
    if (sleepers.load(std::memory_order_relaxed) != 0) {
      { std::lock_guard lk(mutex); }
      cv.notify_all();
    }
  }
  void wake_all_unconditionally() {
    { std::lock_guard lk(mutex); }
    cv.notify_all();
    { std::lock_guard lk(p2p_mutex); }
    p2p_cv.notify_all();
  }
};

inline bool world_state::fail(failure_kind k, int world_rank, std::string msg, missing_report report) {
  std::vector<std::shared_ptr<group_state>> live;
  {
    std::lock_guard lk(mutex);
    if (failed.load(std::memory_order_relaxed)) return false;
    kind = k;
    failed_rank = world_rank;
    message = std::move(msg);
    timed_out = std::move(report);
    failed.store(true, std::memory_order_seq_cst);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live) {
    g->word.fetch_or(failed_bit, std::memory_order_seq_cst);
    g->wake_all_unconditionally();
  }
  return true;
}

/// Creates a group of `world` and registers it for failure propagation; the caller holds world->mutex.
inline std::shared_ptr<group_state> make_group_locked(const std::shared_ptr<world_state>& world,
                                                      std::vector<int> members) {
  auto g = std::make_shared<group_state>(world, std::move(members), world->next_group_id++);
  std::erase_if(world->groups, [](const std::weak_ptr<group_state>& w) { return w.expired(); });
  world->groups.push_back(g);
  if (world->failed.load(std::memory_order_relaxed)) g->word.fetch_or(failed_bit);
  return g;
}

inline std::shared_ptr<group_state> make_group(const std::shared_ptr<world_state>& world, std::vector<int> members) {
  std::lock_guard lk(world->mutex);
  return make_group_locked(world, std::move(members));
}

/// The sub-group of color `color` made by the split in step `step` of group `parent`: the first
/// member to come creates it, the others find it; the entry goes when every member took it.
inline std::shared_ptr<group_state> claim_split_group(const std::shared_ptr<world_state>& world, std::uint64_t parent,
                                                      std::uint64_t step, int color, const std::vector<int>& members) {
  std::lock_guard lk(world->mutex);
  const auto key = std::make_tuple(parent, step, color);
  auto it = world->pending.find(key);
  if (it == world->pending.end())
    it = world->pending.emplace(key, world_state::pending_group{make_group_locked(world, members), 0}).first;
  std::shared_ptr<group_state> g = it->second.state;
  if (++it->second.claims == static_cast<int>(members.size())) world->pending.erase(it);
  return g;
}

}  // namespace meshlib::comm::detail

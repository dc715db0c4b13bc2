// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `collective_workspace`: the buffers one device's typed collectives write their results
/// and staging into, reused from call to call, so that a collective called again with the same
/// shapes allocates nothing (issue 9: a typed `psum` used to allocate and copy its result on every
/// call, which doubled its latency at 8 B and cost 40% of the bandwidth at 16 MiB).
///
/// Why reuse is safe: a buffer is handed out again only while the workspace holds its only
/// reference (`Kokkos::View::use_count() == 1`). A result the caller still holds keeps the count
/// above one, so a later call never overwrites it: it takes another buffer, or a fresh one.
///
/// Lifetime: one workspace per thread (`thread_workspace`), so it outlives the `shard_map` /
/// `spmd` call: a training loop that runs one call per step reuses the previous step's buffers
/// instead of allocating them again and taking a page fault on every page of each (issue 9: on
/// this VM, first-touch faults cost a typed psum 60% of its bandwidth at 16 MiB). A device always
/// runs on the same persistent thread (exec/thread_runner.hpp), so its workspace follows it.
/// Three rules keep that within the Kokkos 3.4.1 rule of tensor/view.hpp (a device thread copies
/// and drops handles only of its own blocks): when a call ends, its device's thread drops the
/// buffers someone else still holds (results that leave the call), keeping only those nobody
/// holds; a thread's workspace is emptied on that thread when it exits; and a Kokkos finalize hook
/// empties the workspaces of idle threads (a buffer must not outlive Kokkos). It keeps at most
/// `max_shapes` shapes, dropping the least recently used unheld ones past that.

#include <array>
#include <cstddef>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <memory>
#include <tuple>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "meshlib/tensor/kernel.hpp"
#include "meshlib/tensor/view.hpp"

namespace meshlib::collectives::detail {

/// The reusable buffers of one device (see the file comment), by view type and extents. Used as
/// `collective_workspace`: a template only so that its map and vectors are compiled where
/// collectives run, not in every translation unit that includes meshlib (core/deferred.hpp).
template <class Tag = void>
class basic_collective_workspace {
 public:
  /// How many buffers of one type and shape are kept; past that, a call whose every kept buffer is
  /// still held gets a fresh one that the workspace does not keep.
  static constexpr std::size_t buffers_per_shape = 4;
  /// How many types and shapes are kept across calls (a program's collectives use a few; one that
  /// keeps changing its shapes must not keep a buffer of each for ever).
  static constexpr std::size_t max_shapes = 32;

  basic_collective_workspace() = default;
  basic_collective_workspace(const basic_collective_workspace&) = delete;
  basic_collective_workspace& operator=(const basic_collective_workspace&) = delete;

  /// A block of `shape` (uninitialised) that nobody but the workspace holds.
  template <class T, std::size_t Rank, class Space>
  block_view<T, Rank, Space> acquire(const std::array<std::size_t, Rank>& shape) {
    using view_t = block_view<T, Rank, Space>;
    auto& entry = slots_[key_of<view_t>(shape)];
    entry.last_use = ++uses_;
    auto& kept = entry.buffers;
    for (auto& s : kept) {
      auto& v = static_cast<slot<view_t>&>(*s).view;
      if (v.use_count() == 1) return v;
    }
    ++allocations_;
    view_t fresh = allocate<T, Rank, Space>(shape, "meshlib::collective", false);
    if (kept.size() < buffers_per_shape) {
      kept.push_back(std::make_unique<slot<view_t>>(fresh));
      trim();
    }
    return fresh;
  }

  /// Drops the buffers that someone else still holds (see the file comment: called on the
  /// device's thread when its call ends), keeping those nobody holds for the next call.
  void release_held() {
    for (auto it = slots_.begin(); it != slots_.end();) {
      auto& kept = it->second.buffers;
      kept.erase(std::remove_if(kept.begin(), kept.end(), [](const auto& s) { return s->use_count() > 1; }), kept.end());
      it = kept.empty() ? slots_.erase(it) : std::next(it);
    }
  }

  /// Drops every buffer (a Kokkos finalize hook, or the thread's exit).
  void clear() noexcept { slots_.clear(); }

  /// Types and shapes kept.
  [[nodiscard]] std::size_t shapes() const noexcept { return slots_.size(); }

  /// A one-dimensional staging buffer of `n` elements, for use within one collective call.
  template <class T, class Space>
  block_view<T, 1, Space> scratch(std::size_t n) {
    return acquire<T, 1, Space>(std::array<std::size_t, 1>{n});
  }

  /// Whether `v` is one of the workspace's buffers (then the workspace holds one of its references).
  template <class View>
  [[nodiscard]] bool holds(const View& v) const {
    const auto it = slots_.find(key_of<View>(experimental::extents_of(v)));
    if (it == slots_.end()) return false;
    for (const auto& s : it->second.buffers)
      if (static_cast<const slot<View>&>(*s).view.data() == v.data()) return true;
    return false;
  }

  /// Buffers allocated so far (a fresh workspace: 0; after warm-up a repeated call adds none).
  [[nodiscard]] std::size_t allocations() const noexcept { return allocations_; }

 private:
  struct slot_base {
    virtual ~slot_base() = default;
    [[nodiscard]] virtual long use_count() const noexcept = 0;
  };
  template <class View>
  struct slot final : slot_base {
    explicit slot(View v) : view(std::move(v)) {}
    long use_count() const noexcept override { return static_cast<long>(view.use_count()); }
    View view;
  };
  struct entry {
    std::vector<std::unique_ptr<slot_base>> buffers;
    std::uint64_t last_use = 0;
  };
  /// The view type and its extents (unused ones 0): a buffer is reused only for the same shape,
  /// because a Kokkos view cannot be re-shaped while sharing ownership.
  using key = std::tuple<std::type_index, std::array<std::size_t, 8>>;

  template <class View, std::size_t Rank>
  static key key_of(const std::array<std::size_t, Rank>& shape) {
    std::array<std::size_t, 8> e{};
    for (std::size_t d = 0; d < Rank; ++d) e[d] = shape[d];
    return key{std::type_index(typeid(View)), e};
  }

  /// Past `max_shapes`, drops the least recently used shapes whose buffers nobody holds.
  void trim() {
    while (slots_.size() > max_shapes) {
      auto victim = slots_.end();
      for (auto it = slots_.begin(); it != slots_.end(); ++it) {
        const auto& kept = it->second.buffers;
        const bool unheld = std::all_of(kept.begin(), kept.end(), [](const auto& s) { return s->use_count() == 1; });
        if (unheld && it->second.last_use != uses_ && (victim == slots_.end() || it->second.last_use < victim->second.last_use))
          victim = it;
      }
      if (victim == slots_.end()) return;  // every other shape is in use: keep them until the call ends
      slots_.erase(victim);
    }
  }

  std::map<key, entry> slots_;
  std::size_t allocations_ = 0;
  std::uint64_t uses_ = 0;
};

/// The buffers of one device (see `basic_collective_workspace`).
using collective_workspace = basic_collective_workspace<>;

/// The workspaces of every thread that has one, so that a Kokkos finalize hook can empty them
/// (their buffers must not outlive Kokkos, and a pool thread lives until the process exits). Used
/// as `workspace_registry` (a template for the reason `basic_collective_workspace` is).
template <class Tag = void>
class basic_workspace_registry {
  using workspace = basic_collective_workspace<Tag>;

 public:
  /// Never destroyed: threads deregister at their exit, which may come after static destruction.
  static basic_workspace_registry& get() {
    static auto* r = new basic_workspace_registry;
    return *r;
  }
  void add(workspace* w) {
    std::lock_guard lock(m_);
    all_.push_back(w);
  }
  void remove(workspace* w) {
    std::lock_guard lock(m_);
    all_.erase(std::remove(all_.begin(), all_.end(), w), all_.end());
  }
  /// Pushes the finalize hook once per Kokkos initialisation (a finalize runs and pops it). Called
  /// by `run_devices` on the calling thread before any device thread can keep a buffer.
  void hook() {
    if (hooked_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(m_);
    if (hooked_.load(std::memory_order_relaxed)) return;
    hooked_.store(true, std::memory_order_release);
    experimental::push_finalize_hook([this] {
      // Every device thread is idle (Kokkos is finalised outside shard_map / spmd), and the pool's
      // job hand-off orders their last use before this.
      std::lock_guard l(m_);
      for (auto* w : all_) w->clear();
      hooked_.store(false, std::memory_order_release);
    });
  }

 private:
  std::mutex m_;
  std::vector<workspace*> all_;
  std::atomic<bool> hooked_{false};
};

/// The registry of every thread's workspace (see `basic_workspace_registry`).
using workspace_registry = basic_workspace_registry<>;

/// The calling thread's workspace (see the file comment), emptied on that thread when it exits.
template <class Tag = void>
basic_collective_workspace<Tag>& thread_workspace() {
  struct owner {
    basic_collective_workspace<Tag> ws;
    owner() { basic_workspace_registry<Tag>::get().add(&ws); }
    ~owner() {
      basic_workspace_registry<Tag>::get().remove(&ws);
      ws.clear();
    }
    owner(const owner&) = delete;
    owner& operator=(const owner&) = delete;
  };
  thread_local owner o;
  return o.ws;
}

}  // namespace meshlib::collectives::detail

namespace meshlib::experimental {
/// The per-process store of device workspaces a runner keeps alive across calls.
using collectives::detail::workspace_registry;
}  // namespace meshlib::experimental

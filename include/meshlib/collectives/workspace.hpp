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
/// Lifetime: the workspace belongs to one `device_context`, which lives for one `shard_map` /
/// `spmd` call on that device's thread; it holds only its own views (no communicator, no pointer
/// into the call), and drops them on that thread when the call ends (the Kokkos 3.4.1 rule of
/// tensor/view.hpp: a device thread copies and drops handles only of its own blocks). A result
/// that outlives the call keeps its buffer; the workspace merely lets go of it.

#include <array>
#include <cstddef>
#include <map>
#include <memory>
#include <tuple>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include "meshlib/tensor/view.hpp"

namespace meshlib::detail {

/// The reusable buffers of one device (see the file comment), by view type and extents.
class collective_workspace {
 public:
  /// How many buffers of one type and shape are kept; past that, a call whose every kept buffer is
  /// still held gets a fresh one that the workspace does not keep.
  static constexpr std::size_t buffers_per_shape = 4;

  collective_workspace() = default;
  collective_workspace(const collective_workspace&) = delete;
  collective_workspace& operator=(const collective_workspace&) = delete;

  /// A block of `shape` (uninitialised) that nobody but the workspace holds.
  template <class T, std::size_t Rank, class Space>
  block_view_t<T, Rank, Space> acquire(const std::array<std::size_t, Rank>& shape) {
    using view_t = block_view_t<T, Rank, Space>;
    auto& kept = slots_[key_of<view_t>(shape)];
    for (auto& s : kept) {
      auto& v = static_cast<slot<view_t>&>(*s).view;
      if (v.use_count() == 1) return v;
    }
    ++allocations_;
    view_t fresh = allocate<T, Rank, Space>(shape, "meshlib::collective", false);
    if (kept.size() < buffers_per_shape) kept.push_back(std::make_unique<slot<view_t>>(fresh));
    return fresh;
  }

  /// A one-dimensional staging buffer of `n` elements, for use within one collective call.
  template <class T, class Space>
  block_view_t<T, 1, Space> scratch(std::size_t n) {
    return acquire<T, 1, Space>(std::array<std::size_t, 1>{n});
  }

  /// Whether `v` is one of the workspace's buffers (then the workspace holds one of its references).
  template <class View>
  [[nodiscard]] bool holds(const View& v) const {
    const auto it = slots_.find(key_of<View>(extents_of(v)));
    if (it == slots_.end()) return false;
    for (const auto& s : it->second)
      if (static_cast<const slot<View>&>(*s).view.data() == v.data()) return true;
    return false;
  }

  /// Buffers allocated so far (a fresh workspace: 0; after warm-up a repeated call adds none).
  [[nodiscard]] std::size_t allocations() const noexcept { return allocations_; }

 private:
  struct slot_base {
    virtual ~slot_base() = default;
  };
  template <class View>
  struct slot final : slot_base {
    explicit slot(View v) : view(std::move(v)) {}
    View view;
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

  std::map<key, std::vector<std::unique_ptr<slot_base>>> slots_;
  std::size_t allocations_ = 0;
};

}  // namespace meshlib::detail

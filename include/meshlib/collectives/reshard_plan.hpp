// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `reshard_plan`: the collectives that move an array from one sharding of a mesh to another,
/// chosen before anything moves, so that a user can print the plan and see the bytes each device
/// will send.
///
/// The planner works on the run-time form of a spec (per dimension, the mesh positions of the axes
/// that split it, major to minor) and walks from the source spec to the target spec:
/// - a dimension whose axes are not a prefix of its target's loses its minor axis `a`; when `a`
///   is exactly the next axis the target adds to another dimension, one `all_to_all` over `a`
///   moves it there; otherwise an `all_gather` over `a` drops it;
/// - once every dimension's axes are a prefix of its target's, one local slice adds the rest (no
///   communication: the target block lies inside the block the device already holds).
/// Each step is exact only when every sharded dimension divides evenly by its shard counts, which
/// the planner checks; otherwise (the `uneven` rule with sizes that do not divide), it falls back to
/// the general `exchange`, where every device receives, from one holder each, the intersection of
/// its target block with the source blocks.

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/shard_layout.hpp"

namespace meshlib {

/// @brief What one step of a reshard plan does.
enum class reshard_kind {
  local_slice,  ///< keep a sub-block of the local block; no communication
  all_gather,   ///< tiled all_gather over one axis along one dimension (shard -> replicate)
  all_to_all,   ///< all_to_all over one axis: split one dimension, concatenate another (move)
  exchange,     ///< general point-to-point exchange of block intersections (any -> any)
};

/// @brief The name of a resharding step kind, as printed in plans.
[[nodiscard]] constexpr std::string_view to_string(reshard_kind k) noexcept {
  switch (k) {
    case reshard_kind::local_slice: return "local_slice";
    case reshard_kind::all_gather: return "all_gather";
    case reshard_kind::all_to_all: return "all_to_all";
    case reshard_kind::exchange: return "exchange";
  }
  return "unknown";
}

namespace collectives::detail {

/// Run-time partition spec: per dimension, the mesh positions of its axes, major to minor.
using dyn_spec = std::vector<std::vector<std::size_t>>;

/// The run-time form of the spec of sharding `S`, padded to `Rank` dimensions.
template <sharding_type S>
dyn_spec to_dyn_spec(std::size_t rank) {
  dyn_spec out(rank);
  for (std::size_t d = 0; d < rank; ++d) {
    const auto ax = S::dim_axes(d);
    for (std::size_t k = 0; k < S::dim_axis_count(d); ++k) out[d].push_back(ax[k]);
  }
  return out;
}

/// Number of shards of one dimension split over `axes`.
template <class Mesh>
std::size_t dyn_shards(const Mesh& m, const std::vector<std::size_t>& axes) {
  std::size_t n = 1;
  for (auto a : axes) n *= m.axis_size(a);
  return n;
}

/// The block of `device` for global shape `shape` under the run-time spec `spec`.
template <class Mesh, std::size_t Rank>
block<Rank> dyn_block_of(const Mesh& m, const dyn_spec& spec, const std::array<std::size_t, Rank>& shape,
                         std::size_t device, shard_rule rule) {
  const auto c = m.coords(device);
  block<Rank> b;
  for (std::size_t d = 0; d < Rank; ++d) {
    std::size_t idx = 0;
    for (auto a : spec[d]) idx = idx * m.axis_size(a) + c[a];
    const auto [off, ext] = experimental::split_dim(shape[d], dyn_shards(m, spec[d]), idx, rule);
    b.offset[d] = off;
    b.extent[d] = ext;
  }
  return b;
}

/// Intersection of two blocks (extent 0 somewhere when they do not meet).
template <std::size_t Rank>
block<Rank> intersect(const block<Rank>& a, const block<Rank>& b) {
  block<Rank> r;
  for (std::size_t d = 0; d < Rank; ++d) {
    const std::size_t lo = std::max(a.offset[d], b.offset[d]);
    const std::size_t hi = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    r.offset[d] = lo;
    r.extent[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

inline bool is_prefix(const std::vector<std::size_t>& p, const std::vector<std::size_t>& v) {
  return p.size() <= v.size() && std::equal(p.begin(), p.end(), v.begin());
}

template <class Mesh>
std::string describe_dyn_spec(const dyn_spec& s) {
  // Built with a stream: GCC 12 warns falsely (-Wrestrict) on `"\"" + std::string(...)` at -O2.
  std::ostringstream os;
  os << "P<";
  for (std::size_t d = 0; d < s.size(); ++d) {
    if (d) os << ", ";
    if (s[d].empty()) {
      os << "none";
    } else if (s[d].size() == 1) {
      os << '"' << Mesh::axis_names[s[d][0]] << '"';
    } else {
      os << "axes(";
      for (std::size_t k = 0; k < s[d].size(); ++k) os << (k ? ", " : "") << '"' << Mesh::axis_names[s[d][k]] << '"';
      os << ')';
    }
  }
  os << '>';
  return os.str();
}

}  // namespace collectives::detail

namespace experimental {
/// The run-time spec of a compile-time `partition_spec` (reshard plans and checkpoints take it).
using collectives::detail::to_dyn_spec;
}  // namespace experimental

/// @brief One step of a reshard plan.
struct reshard_step {
  /// Which kind of step: a local slice or the collective it runs.
  reshard_kind kind = reshard_kind::local_slice;
  /// Mesh position of the axis the collective runs over (all_gather, all_to_all).
  std::size_t axis = 0;
  /// all_gather: the dimension gathered; all_to_all: the dimension split (it becomes sharded).
  std::size_t split_dim = 0;
  /// all_to_all: the dimension concatenated (it stops being sharded on `axis`).
  std::size_t concat_dim = 0;
  /// The spec after this step.
  collectives::detail::dyn_spec after;
  /// Bytes each device sends to other devices in this step, indexed by device.
  std::vector<std::size_t> bytes_sent;
  /// A line such as `all_gather over 'model' along dim 1 -> P<"data", none>`.
  std::string description;
};

/// @brief The plan that `reshard<To>(x)` runs: inspect it with `plan_reshard<To>(x)` first.
/// @code
/// auto plan = meshlib::plan_reshard<meshlib::P<meshlib::none, "data">>(x);
/// std::cout << plan;                 // one line per collective
/// plan.max_bytes_sent();             // the busiest device's traffic
/// @endcode
class reshard_plan {
 public:
  reshard_plan() = default;
  /// @brief A plan from sharding `from` to `to` (both as printed) over `devices` devices, running `steps` in order.
  reshard_plan(std::string from, std::string to, std::size_t devices, std::vector<reshard_step> steps)
      : from_(std::move(from)), to_(std::move(to)), devices_(devices), steps_(std::move(steps)) {}

  /// The steps in the order they run; empty when nothing moves.
  [[nodiscard]] const std::vector<reshard_step>& steps() const noexcept { return steps_; }
  /// True when source and target are the same sharding: nothing runs.
  [[nodiscard]] bool empty() const noexcept { return steps_.empty(); }
  /// True when no step sends data.
  [[nodiscard]] bool communication_free() const noexcept {
    for (const auto& s : steps_)
      for (auto b : s.bytes_sent)
        if (b) return false;
    return true;
  }
  /// Bytes device `device` sends over the whole plan.
  [[nodiscard]] std::size_t bytes_sent(std::size_t device) const noexcept {
    std::size_t n = 0;
    for (const auto& s : steps_) n += device < s.bytes_sent.size() ? s.bytes_sent[device] : 0;
    return n;
  }
  /// The largest `bytes_sent(d)` over devices.
  [[nodiscard]] std::size_t max_bytes_sent() const noexcept {
    std::size_t m = 0;
    for (std::size_t d = 0; d < devices_; ++d) m = std::max(m, bytes_sent(d));
    return m;
  }
  /// Sum of `bytes_sent(d)` over devices.
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept {
    std::size_t m = 0;
    for (std::size_t d = 0; d < devices_; ++d) m += bytes_sent(d);
    return m;
  }
  /// The kinds of the steps, in order (handy in tests).
  [[nodiscard]] std::vector<reshard_kind> kinds() const {
    std::vector<reshard_kind> k;
    for (const auto& s : steps_) k.push_back(s.kind);
    return k;
  }

  /// Prints `reshard P<"data", none> -> P<none, "data">: all_to_all over 'data' ... (N bytes/device max)`.
  friend std::ostream& operator<<(std::ostream& os, const reshard_plan& p) {
    os << "reshard " << p.from_ << " -> " << p.to_ << ":";
    if (p.steps_.empty()) os << " nothing to do";
    for (const auto& s : p.steps_) {
      std::size_t mx = 0;
      for (auto b : s.bytes_sent) mx = std::max(mx, b);
      os << "\n  " << s.description << " (max " << mx << " bytes sent per device)";
    }
    return os;
  }
  /// The plan as printed by `operator<<`: one line per step.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  std::string from_, to_;
  std::size_t devices_ = 0;
  std::vector<reshard_step> steps_;
};

namespace collectives::detail {

/// Whether the step-by-step plan is exact: every dimension divides evenly by the shard counts of
/// both specs (then every intermediate spec, whose counts divide one of them, divides evenly too).
template <class Mesh, std::size_t Rank>
bool stepwise_exact(const Mesh& m, const dyn_spec& from, const dyn_spec& to, const std::array<std::size_t, Rank>& shape) {
  for (std::size_t d = 0; d < Rank; ++d) {
    if (shape[d] % dyn_shards(m, from[d]) != 0 || shape[d] % dyn_shards(m, to[d]) != 0) return false;
    // A dimension that passes through an intermediate spec: the common prefix keeps it divisible.
  }
  return true;
}

/// For the general exchange: which device sends device `dst` its piece of the source block that
/// `src_rep` (any holder of that block) holds: `dst` itself when it holds that block, otherwise one
/// holder chosen by `dst`'s index so that the load spreads over the replicas.
template <class Mesh>
std::size_t exchange_source(const Mesh& m, const dyn_spec& from, std::size_t src_rep, std::size_t dst) {
  axis_mask used = 0;
  for (const auto& axes : from)
    for (auto a : axes) used |= axis_mask{1} << a;
  const axis_mask rep = Mesh::all_axes & ~used;
  const auto holders = m.group(src_rep, rep);
  for (auto h : holders)
    if (h == dst) return dst;
  return holders[dst % holders.size()];
}

/// The devices whose source block is distinct: one representative per block (the group leaders
/// along the replicated axes).
template <class Mesh>
std::vector<std::size_t> block_representatives(const Mesh& m, const dyn_spec& from) {
  axis_mask used = 0;
  for (const auto& axes : from)
    for (auto a : axes) used |= axis_mask{1} << a;
  const axis_mask rep = Mesh::all_axes & ~used;
  std::vector<std::size_t> out;
  for (std::size_t d = 0; d < m.size(); ++d)
    if (m.group_rank(d, rep) == 0) out.push_back(d);
  return out;
}

/// The plan from `from` to `to` for global shape `shape`, elements of `elem_size` bytes.
template <class Mesh, std::size_t Rank>
reshard_plan make_reshard_plan(const Mesh& m, const dyn_spec& from, shard_rule from_rule, const dyn_spec& to,
                               shard_rule to_rule, const std::array<std::size_t, Rank>& shape, std::size_t elem_size) {
  const std::size_t n = m.size();
  std::vector<reshard_step> steps;
  // Under the step-wise plan every dimension divides evenly, where both rules give the same blocks.
  const shard_rule rule = shard_rule::even;
  auto local_bytes = [&](const dyn_spec& s, std::size_t dev) {
    return dyn_block_of(m, s, shape, dev, rule).size() * elem_size;
  };
  const bool same_blocks = stepwise_exact(m, from, to, shape) || from_rule == to_rule;
  if (from == to && same_blocks) return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, {});

  if (!stepwise_exact(m, from, to, shape)) {
    reshard_step st;
    st.kind = reshard_kind::exchange;
    st.after = to;
    st.bytes_sent.assign(n, 0);
    const auto reps = block_representatives(m, from);
    for (std::size_t dst = 0; dst < n; ++dst) {
      const auto want = dyn_block_of(m, to, shape, dst, to_rule);
      for (auto r : reps) {
        const auto piece = intersect(want, dyn_block_of(m, from, shape, r, from_rule));
        if (piece.size() == 0) continue;
        const std::size_t src = exchange_source(m, from, r, dst);
        if (src != dst) st.bytes_sent[src] += piece.size() * elem_size;
      }
    }
    st.description = "exchange of block intersections (general plan) -> " + describe_dyn_spec<Mesh>(to);
    steps.push_back(std::move(st));
    return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, std::move(steps));
  }

  dyn_spec cur = from;
  while (true) {
    std::size_t bad = Rank;
    for (std::size_t d = 0; d < Rank; ++d)
      if (!is_prefix(cur[d], to[d])) {
        bad = d;
        break;
      }
    if (bad == Rank) break;
    const std::size_t a = cur[bad].back();
    // Does the target add `a` to another dimension right after what that dimension holds now?
    std::size_t dest = Rank;
    for (std::size_t d = 0; d < Rank; ++d)
      if (d != bad && is_prefix(cur[d], to[d]) && to[d].size() > cur[d].size() && to[d][cur[d].size()] == a) dest = d;
    reshard_step st;
    st.axis = a;
    st.bytes_sent.assign(n, 0);
    const std::size_t g = m.axis_size(a);
    if (dest != Rank) {
      st.kind = reshard_kind::all_to_all;
      st.split_dim = dest;
      st.concat_dim = bad;
      for (std::size_t dev = 0; dev < n; ++dev) st.bytes_sent[dev] = local_bytes(cur, dev) / g * (g - 1);
      cur[bad].pop_back();
      cur[dest].push_back(a);
      st.description = "all_to_all over '" + std::string(Mesh::axis_names[a]) + "' (split dim " +
                       std::to_string(dest) + ", concat dim " + std::to_string(bad) + ") -> " +
                       describe_dyn_spec<Mesh>(cur);
    } else {
      st.kind = reshard_kind::all_gather;
      st.split_dim = bad;
      for (std::size_t dev = 0; dev < n; ++dev) st.bytes_sent[dev] = local_bytes(cur, dev) * (g - 1);
      cur[bad].pop_back();
      st.description = "all_gather over '" + std::string(Mesh::axis_names[a]) + "' along dim " + std::to_string(bad) +
                       " -> " + describe_dyn_spec<Mesh>(cur);
    }
    st.after = cur;
    steps.push_back(std::move(st));
  }
  if (cur != to) {
    reshard_step st;
    st.kind = reshard_kind::local_slice;
    st.after = to;
    st.bytes_sent.assign(n, 0);
    st.description = "local slice (no communication) -> " + describe_dyn_spec<Mesh>(to);
    steps.push_back(std::move(st));
  }
  return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, std::move(steps));
}

}  // namespace collectives::detail

/// @brief The plan that moves an array of shape `shape` with elements of `elem_size` bytes from
/// sharding `from` to spec `ToSpec` of the same mesh.
template <partition_spec_type ToSpec, sharding_type From, std::size_t Rank>
reshard_plan make_reshard_plan(const From& from, const std::array<std::size_t, Rank>& shape, std::size_t elem_size) {
  using to_sharding = named_sharding<typename From::mesh_type, ToSpec>;
  static_assert(From::template check_rank<Rank>() && to_sharding::template check_rank<Rank>());
  return collectives::detail::make_reshard_plan(from.mesh(), collectives::detail::to_dyn_spec<From>(Rank), from.rule(),
                                   collectives::detail::to_dyn_spec<to_sharding>(Rank), from.rule(), shape, elem_size);
}

}  // namespace meshlib

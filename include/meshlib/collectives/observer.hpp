// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The observer interface of a run's collectives, and `observed_comm`, the forwarding
/// decorator that reports every operation of a device's communicator (`device_comm`) to it.
///
/// Why here, beside `device_comm`, and not in the debug layer: the device context
/// (device_context.hpp) must hand out decorated communicators, and the layer that declares a
/// decorator point must not include the layer that fills it. So collectives declare the interface
/// (`comm_observer`) and forward to it; debug implements it (`run_observer`, debug/observe.hpp:
/// trace, Kokkos regions, NaN/Inf checks, the slow-peer watchdog); exec, which runs the devices,
/// creates one per run and installs it in every device's context. Without an observer, or with an
/// inactive one, nothing is wrapped: one predictable branch per collective.
/// @code
/// struct counting final : meshlib::experimental::comm_observer {   // e.g. a test's observer
///   std::atomic<int> calls{0};
///   bool active() const noexcept override { return true; }
///   void open(meshlib::experimental::comm_site&) override {}
///   void enter(const meshlib::experimental::comm_site&, meshlib::experimental::comm_call&) override { ++calls; }
///   void leave(const meshlib::experimental::comm_site&, const meshlib::experimental::comm_call&) noexcept override {}
///   void done(const meshlib::experimental::comm_site&, const meshlib::experimental::comm_call&) override {}
/// };
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/core/mesh.hpp"

namespace meshlib::collectives::detail {

/// Inside this scope the calling thread's collectives are not observed: the debug layer's own
/// collectives (ordered printing, replica checks) stay out of the trace and the checks.
inline int& unobserved_depth() noexcept {
  thread_local int depth = 0;
  return depth;
}
/// Leaves the calling thread's collectives unobserved while it lives (nests).
struct unobserved_scope {
  unobserved_scope() noexcept { ++unobserved_depth(); }
  ~unobserved_scope() { --unobserved_depth(); }
  unobserved_scope(const unobserved_scope&) = delete;
  unobserved_scope& operator=(const unobserved_scope&) = delete;
};

/// "device 3 (data=1, model=1)".
template <mesh_type Mesh>
std::string device_label(const Mesh& m, std::size_t device) {
  std::string s = "device " + std::to_string(device) + " (";
  const auto c = m.coords(device);
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    s += (a ? ", " : "") + std::string(Mesh::axis_names[a]) + "=" + std::to_string(c[a]);
  return s + ")";
}

/// "0,2,4".
inline std::string join_ids(const std::vector<std::size_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace meshlib::collectives::detail

namespace meshlib::experimental {
/// Writes a list of ids joined by commas, as messages and traces print them.
using collectives::detail::join_ids;

/// A device as messages and traces name it.
using collectives::detail::device_label;

/// Turns the device's observer off for a scope (an observer's own collectives are not observed).
using collectives::detail::unobserved_scope;
}  // namespace meshlib::experimental

/// Interfaces that cross layers and may still change: the debug layer implements `comm_observer`,
/// and a user may too (see the file comment).
namespace meshlib::experimental {

/// Where a device's communicator sits: the device, its group along `mask` and the axes' names.
struct comm_site {
  std::size_t device = 0;  ///< the device id
  std::string device_label;  ///< the device as messages name it
  axis_mask mask = 0;  ///< the mesh axes the group spans
  std::string axes;  ///< their names, comma-separated ("model", "data,model")
  std::size_t color = 0;  ///< which group of the split along `mask` this is
  std::vector<std::size_t> group;  ///< the group's device ids in group-rank order
  std::size_t group_rank = 0;  ///< this device's rank in `group`
  /// The observer's own state for this site, set by `comm_observer::open` (debug: its trace track).
  void* data = nullptr;
};

/// One collective as the decorator reports it: its user-level name, element type, the elements
/// this device sends, its input and output (for checks), and its sequence number on the group.
struct comm_call {
  const char* name = "";  ///< the collective's user-level name ("all_reduce")
  datatype dt = datatype::float32;  ///< the element type
  std::size_t send_count = 0;  ///< elements this device sends
  const void* in = nullptr;  ///< the input buffer (for checks)
  std::size_t in_count = 0;  ///< elements in `in`
  const void* out = nullptr;  ///< the output buffer (for checks)
  std::size_t out_count = 0;  ///< elements in `out`
  std::uint64_t seq = 0;  ///< the call's sequence number on the group (from 0)
  /// When the observer saw it start (its clock; set by `enter`, read by `done`).
  std::int64_t start_ns = 0;
};

/// @brief What a run's observer is told about every collective of every device it observes; the
/// debug layer implements it (debug/observe.hpp). Called on the device threads, concurrently.
class comm_observer {
 public:
  /// Whether to wrap at all: an inactive observer costs one branch per collective.
  [[nodiscard]] virtual bool active() const noexcept = 0;
  /// Once per device and group, when its decorated communicator is made: may set `site.data`.
  virtual void open(comm_site& site) = 0;
  /// Before the operation; may throw to refuse it (then neither `leave` nor `done` follows).
  virtual void enter(const comm_site& site, comm_call& call) = 0;
  /// After the operation, whether it returned or threw.
  virtual void leave(const comm_site& site, const comm_call& call) noexcept = 0;
  /// After `leave`, when the operation returned; may throw (a check of the output).
  virtual void done(const comm_site& site, const comm_call& call) = 0;

 protected:
  comm_observer() = default;
  ~comm_observer() = default;
  /// Copyable by the implementing class only (no slicing through the base).
  comm_observer(const comm_observer&) = default;
  /// Assignable by the implementing class only.
  comm_observer& operator=(const comm_observer&) = default;
};

}  // namespace meshlib::experimental

namespace meshlib::collectives::detail {

/// The site of device `device`'s communicator over the axes in `mask` of `m`.
template <mesh_type Mesh>
experimental::comm_site make_comm_site(const Mesh& m, std::size_t device, axis_mask mask) {
  experimental::comm_site s;
  s.device = device;
  s.device_label = device_label(m, device);
  s.mask = mask & Mesh::all_axes;
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    if (s.mask & (axis_mask{1} << a)) s.axes += (s.axes.empty() ? "" : ",") + std::string(Mesh::axis_names[a]);
  s.color = m.group_color(device, s.mask);
  s.group = m.group(device, s.mask);
  s.group_rank = m.group_rank(device, s.mask);
  return s;
}

/// The user-level name of a reduction: psum, pmean, pmax, pmin (the typed collectives' names).
constexpr const char* reduction_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "psum";
    case reduce_op::mean: return "pmean";
    case reduce_op::max: return "pmax";
    case reduce_op::min: return "pmin";
    default: return "all_reduce";
  }
}

/// `Iface` (the typed collectives' per-device communicator interface, `device_comm`) decorated:
/// every operation goes to `inner`, reported to `obs` around it (see the file comment).
template <class Iface>
class observed_comm final : public Iface {
 public:
  observed_comm(Iface& inner, experimental::comm_observer& obs, experimental::comm_site site) : inner_(inner), obs_(obs), site_(std::move(site)) {
    obs_.open(site_);
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

  void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, buf, count, buf, count, [&] { inner_.all_reduce(buf, count, dt, op); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, send, count, recv, count,
            [&] { inner_.all_reduce(send, recv, count, dt, op); });
  }
  void all_gather(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_gather", dt, count, send, count, recv, count * n(), [&] { inner_.all_gather(send, recv, count, dt); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    const char* name = op == reduce_op::sum ? "psum_scatter" : "reduce_scatter";
    observe(name, dt, count * n(), send, count * n(), recv, count,
            [&] { inner_.reduce_scatter(send, recv, count, dt, op); });
  }
  void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_to_all", dt, count * n(), send, count * n(), recv, count * n(),
            [&] { inner_.all_to_all(send, recv, count, dt); });
  }
  void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                    void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                    std::size_t send_total, std::size_t recv_total, datatype dt) override {
    observe("all_to_all_v", dt, send_total, send, send_total, recv, recv_total, [&] {
      inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, send_total, recv_total, dt);
    });
  }
  void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                std::span<const permute_pair> pairs) override {
    observe("ppermute", dt, count, send, count, recv, count, [&] { inner_.ppermute(send, recv, count, dt, pairs); });
  }
  void synchronize() override { inner_.synchronize(); }
  void broadcast(void* buf, std::size_t count, datatype dt, int root) override {
    // Only the root's buffer is an input: the others' may hold anything before the call.
    const bool is_root = static_cast<int>(site_.group_rank) == root;
    observe("broadcast", dt, is_root ? count : 0, buf, is_root ? count : 0, buf, count,
            [&] { inner_.broadcast(buf, count, dt, root); });
  }

 private:
  std::size_t n() const { return static_cast<std::size_t>(inner_.size()); }

  template <class F>
  void observe(const char* name, datatype dt, std::size_t send_count, const void* in, std::size_t in_count,
               const void* out, std::size_t out_count, F&& call) {
    if (unobserved_depth() > 0) {
      call();
      return;
    }
    experimental::comm_call c{name, dt, send_count, in, in_count, out, out_count, seq_++, 0};
    obs_.enter(site_, c);
    struct leave {
      observed_comm& self;
      const experimental::comm_call& c;
      ~leave() { self.obs_.leave(self.site_, c); }
    };
    {
      leave guard{*this, c};
      call();
    }
    obs_.done(site_, c);
  }

  Iface& inner_;
  experimental::comm_observer& obs_;
  experimental::comm_site site_;
  std::uint64_t seq_ = 0;
};

}  // namespace meshlib::collectives::detail

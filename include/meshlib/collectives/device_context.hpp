// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The device a piece of SPMD code runs as: its id, its mesh coordinates, and the
/// communicator of each of its axis groups. `shard_map` and `spmd` install one per device thread
/// (`detail::scoped_device`); typed collectives and `axis_index` / `axis_size` read it.
///
/// Why type-erased: a collective sees only a `local_tensor`, whose type names the mesh but not the
/// backend, and the same program must run on the thread, MPI and NCCL backends unchanged. So the
/// context holds its communicators behind `device_comm`, a small virtual interface over raw
/// buffers and a run-time `datatype` tag, implemented once per backend by `device_comm_for<C>` on
/// top of the `communicator` concept. The virtual call costs nothing next to the collective.
///
/// Sub-communicators come from the comm layer's `axis_communicators`: split on first use from the
/// device's world communicator, cached per axis set. That is safe because every device of an SPMD
/// program reaches the same collectives in the same order (what every backend already requires).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "meshlib/collectives/comm_stream.hpp"
#include "meshlib/collectives/errors.hpp"
#include "meshlib/collectives/observer.hpp"
#include "meshlib/collectives/workspace.hpp"
#include "meshlib/comm/axis_communicators.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/core/named_sharding.hpp"

/// Set to 0 to compile the debug layer's hook out of the device context (only bench/trace_bench
/// does, to measure what the hook costs when tracing and debug mode are off).
#ifndef MESHLIB_DEBUG_HOOKS
#define MESHLIB_DEBUG_HOOKS 1
#endif

namespace meshlib {

namespace collectives::detail {

/// Calls `f.template operator()<T>()` with the element type `T` that `dt` names.
template <class F>
decltype(auto) with_element_type(datatype dt, F&& f) {
  switch (dt) {
    case datatype::float32: return f.template operator()<float>();
    case datatype::float64: return f.template operator()<double>();
    case datatype::int32: return f.template operator()<std::int32_t>();
    case datatype::int64: return f.template operator()<std::int64_t>();
    case datatype::bfloat16: return f.template operator()<bfloat16>();
  }
  return f.template operator()<float>();
}

/// One device's handle on one group (see the file comment): raw buffers, `count` elements of `dt`.
class device_comm {
 public:
  virtual ~device_comm() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// In place: `buf[i]` = op over ranks.
  virtual void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) = 0;
  /// Out of place: `recv[i]` = op over ranks of `send[i]` (the typed collectives' form: the
  /// backend reads the input where it lies, so no copy into the result comes first).
  virtual void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) = 0;
  /// `recv` = [send of rank 0, rank 1, ...], `count` elements each.
  virtual void all_gather(const void* send, void* recv, std::size_t count, datatype dt) = 0;
  /// `recv` = block `rank` (of `count` elements) of the reduction of `send` (`count * size()` elements).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) = 0;
  /// Block j (of `count` elements) of `send` goes to rank j and lands at block `rank` of `recv`.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) = 0;
  /// Variable-sized all-to-all, counts and displacements in elements.
  virtual void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, void* recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            std::size_t send_total, std::size_t recv_total, datatype dt) = 0;
  /// `recv` = the `send` of the rank that sends to this one; zeros when none does.
  virtual void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                        std::span<const permute_pair> pairs) = 0;
  /// In place: every rank's `buf` = root's.
  virtual void broadcast(void* buf, std::size_t count, datatype dt, int root) = 0;
  /// Waits for the operations this handle has enqueued on its stream (a stream backend: NCCL,
  /// shared-GPU) and throws their error; nothing to do on a host backend, whose calls complete.
  virtual void synchronize() {}
};

/// Whether backend communicator `C` orders its operations on a stream (NCCL, shared-GPU: its
/// `context_type` is a CUDA stream) rather than completing them on the host: its buffers are device
/// memory, and the typed collectives enqueue on it without waiting (collectives/reductions.hpp).
template <class C>
inline constexpr bool stream_ordered_v = !std::is_same_v<typename C::context_type, host_context>;

/// `device_comm` over a backend communicator `C` (a reference: the communicator lives in
/// `axis_communicators`).
template <communicator C>
class device_comm_for final : public device_comm {
 public:
  explicit device_comm_for(C& comm) : comm_(comm) {}
  C& get() noexcept { return comm_; }

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }

  void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() { settle(comm_.all_reduce(std::span<T>(static_cast<T*>(buf), count), op)); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_reduce(std::span<const T>(static_cast<const T*>(send), count), std::span<T>(static_cast<T*>(recv), count), op));
    });
  }
  void all_gather(const void* send, void* recv, std::size_t count, datatype dt) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_gather(std::span<const T>(static_cast<const T*>(send), count),
                       std::span<T>(static_cast<T*>(recv), count * static_cast<std::size_t>(comm_.size()))));
    });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.reduce_scatter(std::span<const T>(static_cast<const T*>(send), count * static_cast<std::size_t>(comm_.size())),
                           std::span<T>(static_cast<T*>(recv), count), op));
    });
  }
  void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) override {
    const std::size_t total = count * static_cast<std::size_t>(comm_.size());
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_to_all(std::span<const T>(static_cast<const T*>(send), total), std::span<T>(static_cast<T*>(recv), total)));
    });
  }
  void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                    void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                    std::size_t send_total, std::size_t recv_total, datatype dt) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_to_all_v(std::span<const T>(static_cast<const T*>(send), send_total), send_counts, send_displs,
                         std::span<T>(static_cast<T*>(recv), recv_total), recv_counts, recv_displs));
    });
  }
  void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                std::span<const permute_pair> pairs) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.ppermute(std::span<const T>(static_cast<const T*>(send), count), std::span<T>(static_cast<T*>(recv), count),
                     pairs));
    });
  }
  void broadcast(void* buf, std::size_t count, datatype dt, int root) override {
    with_element_type(dt, [&]<class T>() { settle(comm_.broadcast(std::span<T>(static_cast<T*>(buf), count), root)); });
  }
  void synchronize() override {
    if constexpr (stream_ordered_v<C>) {
      if (last_) {
        auto r = std::move(*last_);
        last_.reset();
        r.wait();
      }
    }
  }

 private:
  C& comm_;
  /// A stream backend's last enqueued operation (its stream completes them in order).
  std::optional<typename C::request_type> last_;

  /// A host backend's operation completes here; a stream backend's stays enqueued on the
  /// communicator's stream (the device's execution-space instance's: exec/gpu_runner.hpp), so the
  /// host does not wait: kernels after it on that stream see its result. The previous operation's
  /// error, if it has one by now, is thrown (a poll, never a wait).
  template <class Request>
  void settle(Request&& r) {
    if constexpr (stream_ordered_v<C>) {
      if (last_) (void)last_->test();
      last_.emplace(std::forward<Request>(r));
    } else {
      r.wait();
    }
  }
};

/// The device this thread runs as (see the file comment).
class device_context {
 public:
  virtual ~device_context() = default;
  /// The device id: its row-major index in the mesh.
  [[nodiscard]] virtual std::size_t device() const noexcept = 0;
  /// Position of the axis called `name` in the running mesh, or the mesh's rank when it has none.
  [[nodiscard]] virtual std::size_t find_axis(std::string_view name) const noexcept = 0;
  [[nodiscard]] virtual std::size_t axis_count() const noexcept = 0;
  [[nodiscard]] virtual std::string_view axis_name(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::size_t axis_size(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::size_t coord(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::string describe_mesh() const = 0;
  /// The communicator of this device's group along the axes in `mask`, in group-rank order, for a
  /// synchronous collective on this thread: the device's queued asynchronous collectives complete
  /// first (collectives/comm_stream.hpp), so its collectives keep one order.
  [[nodiscard]] device_comm& comm(axis_mask mask) {
    if (!stream_.idle()) {
      if (independent_groups()) stream_.drain(mask);  // (collectives/comm_stream.hpp: why)
      else stream_.drain();
    }
    return handle(mask);
  }
  /// Starts `job` on the communicator of `mask` on the device's communication worker, behind its
  /// earlier asynchronous collectives; the typed `*_start` collectives' one way in. With an active
  /// observer (tracing, debug mode) the job runs here and now, where the observer expects it (its
  /// checks may issue collectives of their own); its error is still reported at `wait()`.
  [[nodiscard]] std::shared_ptr<stream_op> start(axis_mask mask, std::function<void(device_comm&)> job) {
    device_comm& c = handle(mask);
    if (synchronous_starts()) {
      std::exception_ptr error;
      try {
        job(c);
      } catch (...) {
        error = std::current_exception();
      }
      auto op = completed_op();
      op->error = std::move(error);
      return op;
    }
    return stream_.enqueue([&c, job = std::move(job)] { job(c); }, mask);
  }
  /// The device's communication worker (requests wait on it).
  [[nodiscard]] comm_stream& stream() noexcept { return stream_; }
  /// Whether this device's communicators take device memory: a stream backend (NCCL, shared-GPU),
  /// whose collectives the typed layer enqueues on the device's stream (`stream_ordered_v`).
  [[nodiscard]] virtual bool takes_device_memory() const noexcept { return false; }
  /// Waits for the collectives this device enqueued on its stream (a stream backend) and throws
  /// their error, bounded by the communicator's timeout; the end of every device call
  /// (exec/detail/run_devices.hpp). Nothing to do on a host backend.
  void synchronize() {
    stream_.drain();
    synchronize_handles();
  }
  /// The buffers this device's typed collectives reuse (collectives/workspace.hpp): its thread's,
  /// which outlive the call; the buffers the call's results still hold are dropped when it ends.
  /// (Templates, as the workspace is: compiled where collectives run; call them as plain functions.)
  template <class Tag = void>
  [[nodiscard]] basic_collective_workspace<Tag>& workspace() noexcept {
    return thread_workspace<Tag>();
  }

 protected:
  device_context() = default;
  /// The communicator of `mask`. Its first use splits it from the world communicator, a collective
  /// on the device thread, after the worker has drained.
  [[nodiscard]] virtual device_comm& handle(axis_mask mask) = 0;
  /// Whether starts run at once on the device thread (an active observer).
  [[nodiscard]] virtual bool synchronous_starts() const noexcept = 0;
  /// Whether collectives of different groups may run at once on two threads (a host backend).
  [[nodiscard]] virtual bool independent_groups() const noexcept = 0;
  /// `device_comm::synchronize` on every communicator handed out.
  virtual void synchronize_handles() {}
  /// The worker: stopped by the derived context's destructor, before its communicators go.
  comm_stream stream_;
  /// The end of the device's call, on its own thread: results that leave the call keep their
  /// buffers, and the workspace lets go of them (collectives/workspace.hpp).
  template <class Tag = void>
  void end_call() noexcept {
    try {
      thread_workspace<Tag>().release_held();
    } catch (...) {  // nothing in it allocates; a failure only keeps a buffer for longer
    }
  }
};

/// The `device_context` of a device of mesh `Mesh` on backend communicator `C`: owns the world
/// communicator and the device's `axis_communicators`. With an active `observer` (collectives/
/// observer.hpp; the runner installs the debug layer's while tracing, debug mode or a Kokkos tool
/// is on), its communicators are handed out decorated.
template <communicator C, mesh_type Mesh>
class device_context_for final : public device_context {
 public:
  device_context_for(const Mesh& mesh, std::size_t device, C world, experimental::comm_observer* observer = nullptr)
      : mesh_(mesh),
        device_(device),
        coords_(mesh.coords(device)),
        world_(std::move(world)),
        axes_(world_, mesh),
        observer_(observer != nullptr && observer->active() ? observer : nullptr) {}
  device_context_for(const device_context_for&) = delete;
  device_context_for& operator=(const device_context_for&) = delete;
  ~device_context_for() override {
    stream_.stop();  // the worker may be using the communicators below
    end_call();
  }

  std::size_t device() const noexcept override { return device_; }
  std::size_t find_axis(std::string_view name) const noexcept override { return Mesh::find_axis(name); }
  std::size_t axis_count() const noexcept override { return Mesh::ndim; }
  std::string_view axis_name(std::size_t axis) const noexcept override { return Mesh::axis_names[axis]; }
  std::size_t axis_size(std::size_t axis) const noexcept override { return mesh_.axis_size(axis); }
  std::size_t coord(std::size_t axis) const noexcept override { return coords_[axis]; }
  std::string describe_mesh() const override { return mesh_.to_string(); }
  const Mesh& mesh() const noexcept { return mesh_; }
  bool independent_groups() const noexcept override { return std::is_same_v<typename C::context_type, host_context>; }
  bool takes_device_memory() const noexcept override { return stream_ordered_v<C>; }
  void synchronize_handles() override {
    if constexpr (stream_ordered_v<C>)
      for (auto& [mask, h] : handles_) h->synchronize();
  }
  bool synchronous_starts() const noexcept override {
#if MESHLIB_DEBUG_HOOKS
    return observer_ != nullptr;
#else
    return false;
#endif
  }

  device_comm& handle(axis_mask mask) override {
    auto it = handles_.find(mask);
    if (it == handles_.end()) {
      // The split is a collective on the world communicator, on this thread: the worker must not
      // be using any of the device's communicators meanwhile (the world may be one of them).
      stream_.drain();
      it = handles_.emplace(mask, std::make_unique<device_comm_for<C>>(axes_.over(mask))).first;
    }
#if MESHLIB_DEBUG_HOOKS
    if (observer_ == nullptr) [[likely]] return *it->second;
    return observed(mask, *it->second);
#else
    return *it->second;
#endif
  }

 private:
  Mesh mesh_;
  std::size_t device_;
  typename Mesh::coord_type coords_;
  C world_;
  axis_communicators<C, Mesh> axes_;
  std::map<axis_mask, std::unique_ptr<device_comm_for<C>>> handles_;
  // The decorator point (collectives/observer.hpp): only with an active observer.
  experimental::comm_observer* observer_;
  std::map<axis_mask, std::unique_ptr<observed_comm<device_comm>>> observed_;

  device_comm& observed(axis_mask mask, device_comm& raw) {
    auto it = observed_.find(mask);
    if (it == observed_.end())
      it = observed_.emplace(mask, std::make_unique<observed_comm<device_comm>>(raw, *observer_,
                                                                                make_comm_site(mesh_, device_, mask)))
               .first;
    return *it->second;
  }
};

inline device_context*& current_device_slot() noexcept {
  thread_local device_context* current = nullptr;
  return current;
}

/// Installs `ctx` as this thread's device for its lifetime (nests: restores the previous one).
class scoped_device {
 public:
  explicit scoped_device(device_context& ctx) noexcept : previous_(current_device_slot()) { current_device_slot() = &ctx; }
  ~scoped_device() { current_device_slot() = previous_; }
  scoped_device(const scoped_device&) = delete;
  scoped_device& operator=(const scoped_device&) = delete;

 private:
  device_context* previous_;
};

/// The running device; throws `spmd_context_error` outside `shard_map` / `spmd`.
inline device_context& current_device(std::string_view what) {
  device_context* c = current_device_slot();
  if (!c)
    throw spmd_context_error("meshlib: " + std::string(what) +
                             " called outside shard_map / spmd: collectives and axis queries need a running device");
  return *c;
}

inline std::size_t current_axis(std::string_view what, std::string_view name) {
  device_context& c = current_device(what);
  const std::size_t a = c.find_axis(name);
  if (a >= c.axis_count())
    throw spmd_context_error("meshlib: " + std::string(what) + "<\"" + std::string(name) + "\">: the running mesh " +
                             c.describe_mesh() + " has no axis '" + std::string(name) + "'");
  return a;
}

}  // namespace collectives::detail

namespace experimental {
/// The device context of a mesh type, as a runner builds it.
using collectives::detail::device_context_for;

/// Whether a communicator orders its operations on the device's stream (NCCL) rather than completing them on the host.
using collectives::detail::stream_ordered_v;

/// Makes a device context the calling thread's for a scope (runners use it).
using collectives::detail::scoped_device;

/// The calling thread's device context; throws outside a running device.
using collectives::detail::current_device;

/// The calling thread's device context, or null outside a running device.
using collectives::detail::current_device_slot;

/// What a running device knows: its mesh coordinates, communicators per axis group, workspace, observer.
using collectives::detail::device_context;
}  // namespace experimental

/// @brief This device's index along mesh axis `Name` (JAX's `lax.axis_index`), inside `shard_map` / `spmd`.
/// @throws spmd_context_error outside them, or when the running mesh has no axis `Name`.
template <fixed_string Name>
[[nodiscard]] std::size_t axis_index() {
  const std::size_t a = collectives::detail::current_axis("axis_index", Name.view());
  return collectives::detail::current_device("axis_index").coord(a);
}

/// @brief The size of mesh axis `Name` (JAX's `lax.axis_size` / `psum(1, name)`), inside `shard_map` / `spmd`.
/// @throws spmd_context_error outside them, or when the running mesh has no axis `Name`.
template <fixed_string Name>
[[nodiscard]] std::size_t axis_size() {
  const std::size_t a = collectives::detail::current_axis("axis_size", Name.view());
  return collectives::detail::current_device("axis_size").axis_size(a);
}

/// @brief Makes this device's communicator of its group along the axes `Names...` now, inside
/// `shard_map` / `spmd`. A group's first collective in a call makes it (a split of the call's
/// communicator of the whole mesh: a rendezvous of *every* device, not only the group's); calling
/// this where the devices are together anyway (at the start of the call) keeps that rendezvous out
/// of a later place where devices are apart, such as the first bucket started during a backward.
/// Every device must call it for the same axes in the same order, as it does collectives.
/// @code
/// meshlib::spmd(mesh, [&] {
///   meshlib::prepare_group<"data">();   // the split here, while the devices start together
///   auto g = backward();                 // ... psum_start<"data">(bucket) inside: no split there
/// });
/// @endcode
/// @throws spmd_context_error outside them, or when the running mesh lacks one of the axes.
template <fixed_string... Names>
void prepare_group() {
  static_assert(sizeof...(Names) > 0, "meshlib: prepare_group<>() names no axis; name the group's axes, e.g. "
                                      "prepare_group<\"data\">()");
  axis_mask mask = 0;
  ((mask |= axis_mask{1} << collectives::detail::current_axis("prepare_group", Names.view())), ...);
  (void)collectives::detail::current_device("prepare_group").comm(mask);
}

/// @brief The id of the device running this code (its row-major index in the mesh), inside `shard_map` / `spmd`.
[[nodiscard]] inline std::size_t device_index() { return collectives::detail::current_device("device_index").device(); }

}  // namespace meshlib

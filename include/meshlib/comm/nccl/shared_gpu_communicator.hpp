// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Several mesh devices on one GPU: `shared_gpu_communicator`, one participant per device,
/// each with its own CUDA stream on the same GPU, as JAX users test sharded programs with several
/// CPU devices on one machine. NCCL refuses two ranks on one GPU, so the collectives run here:
/// device-to-device copies (`cudaMemcpyAsync`) and one reduction kernel (detail/reduce_kernel.hpp,
/// compiled at run time by NVRTC so that the library stays header-only for every host compiler).
/// Satisfies `communicator`; same options (`nccl_comm_options`), requests and errors as the NCCL
/// communicator.
///
/// @code
/// meshlib::run_on_shared_gpu(4, [&](meshlib::shared_gpu_communicator& c) {   // 4 devices on GPU 0
///   c.all_reduce(std::span(grad[c.rank()], n), meshlib::reduce_op::sum).wait();
/// });
/// @endcode
///
/// How an operation runs. The participants meet on the host (a `thread_communicator`, which also
/// gives them its fault handling: a participant that throws aborts the others' waits). Each
/// records a "ready" event on its stream and publishes it with its buffer pointers and a
/// descriptor of the call; the descriptors must agree (operation, type, count, root, pairs), else
/// every participant throws `collective_mismatch` listing each rank's call. Each stream then waits
/// for every peer's "ready" event and enqueues its share of the work: for the reductions,
/// participant r reduces block r of every input and writes it to every output (one kernel, so the
/// whole payload is read once and written once, and in-place works because blocks are disjoint);
/// for data movement, each participant pushes or pulls its blocks with copies. Finally each stream
/// records "done", the participants exchange those events, and each stream waits for all of them,
/// so no participant reuses a buffer a peer still reads. Nothing blocks the host on the GPU: the
/// request completes when the participant's stream passes that point. A peer's "ready" and "done"
/// events are waited on after the rendezvous that hands them over, when their owner may already
/// have returned and been destroyed: each event holds a reference for every peer until that
/// peer's wait is enqueued (detail/shared_event.hpp).

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/core/hash.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/call_text.hpp"
#include "meshlib/comm/detail/operation.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/nccl/detail/reduce_kernel.hpp"
#include "meshlib/comm/nccl/detail/shared_event.hpp"
#include "meshlib/comm/nccl/detail/stream_state.hpp"
#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

namespace comm::detail {

/// CUDA events for `basic_shared_event`.
struct cuda_event_traits {
  using event_type = cudaEvent_t;
  static void destroy(cudaEvent_t e, int device) noexcept {
    cuda_device_scope_noexcept g(device);
    (void)cudaEventDestroy(e);
  }
};
/// An event peers wait on after the rendezvous that handed it to them (detail/shared_event.hpp).
using shared_cuda_event = basic_shared_event<cuda_event_traits>;

/// A new event of GPU `device` (current), with its owner's reference.
inline shared_cuda_event* make_shared_cuda_event(int device, std::string_view what) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what, "cudaEventCreateWithFlags");
  try {
    return shared_cuda_event::adopt(e, device);
  } catch (...) {
    (void)cudaEventDestroy(e);
    throw;
  }
}

/// One participant's stream, events and host handle: the `Channel` of its requests.
struct shared_gpu_state : stream_state {
  thread_communicator host;
  /// Recorded when this participant's inputs are ready, and when its share of the work is
  /// enqueued; peers wait on them after the rendezvous that hands them over, possibly after this
  /// participant is gone, so they are jointly owned (detail/shared_event.hpp).
  shared_cuda_event* ready = nullptr;
  shared_cuda_event* done = nullptr;

  shared_gpu_state() = default;
  ~shared_gpu_state() {
    if (ready != nullptr) ready->release();
    if (done != nullptr) done->release();
  }

  [[nodiscard]] std::string describe(std::string_view op) const {
    return std::string(op) + " on shared-GPU device " + std::to_string(host.rank()) + " of " +
           std::to_string(host.size()) + " (GPU " + std::to_string(device) + ")";
  }
  stream_poll poll(cudaEvent_t event) {
    if (failed.load()) return stream_poll::failed("the communicator has failed: " + failure);
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return stream_poll::complete();
    if (q == cudaErrorNotReady) return stream_poll::pending();
    (void)cudaGetLastError();
    return stream_poll::failed("cudaEventQuery failed: " + cuda_error_text(q), false);
  }
  void abort(const std::string& reason, bool by_timeout = false) {
    {
      std::lock_guard lock(mutex);
      if (!record_failure(reason, by_timeout)) return;
    }
    if (host.valid()) (void)host.abort(failure);  // peers waiting on the host rendezvous stop too
  }
};

/// @brief The scratch copy that an in-place all_to_all or ppermute sends from (its peers overwrite
/// the buffer meanwhile): for a buffer of `bytes` > 0, `allocate(bytes)` then `copy(p)`, and the
/// copy is returned for the caller to free once its stream is past the peers' "done" events; for
/// an empty buffer (count 0: nothing moves) null, so nothing is freed. It never returns the
/// caller's own buffer: it once did for an empty one, and the communicator then freed the
/// user's cudaMalloc'ed buffer with cudaFreeAsync, whose owner's cudaFree freed it a second time
/// (the conformance kit's in-place rows with count 0). Independent of CUDA, so the host tests
/// check it (tests/unit/nccl/test_nccl_host.cpp).
template <class Allocate, class Copy>
[[nodiscard]] void* in_place_scratch(std::size_t bytes, Allocate&& allocate, Copy&& copy) {
  if (bytes == 0) return nullptr;
  void* p = allocate(bytes);
  copy(p);
  return p;
}

/// The descriptor every participant publishes for a collective (int64 words, so that the host
/// communicator's all_gather moves it).
struct shared_gpu_call {
  std::int64_t op = 0;      ///< detail::op_kind
  std::int64_t type = -1;   ///< datatype, or -1
  std::int64_t count = 0;   ///< elements (per rank, as the concept counts them)
  std::int64_t root = -1;   ///< root, or -1
  std::int64_t extra = 0;   ///< reduce op, or a hash of the ppermute pairs
  std::int64_t send = 0;    ///< device pointers
  std::int64_t recv = 0;
  std::int64_t ready = 0;   ///< cudaEvent_t
};
static_assert(sizeof(shared_gpu_call) == 8 * sizeof(std::int64_t));

/// What a mismatch message shows of a device's call (`describe_call`). The call keeps only a hash
/// of ppermute pairs (in `extra`), which is not shown.
inline call_summary summary_of(const shared_gpu_call& call) {
  call_summary c;
  c.kind = static_cast<op_kind>(call.op);
  if (call.type >= 0) c.dtype = static_cast<datatype>(call.type);
  c.count = static_cast<std::uint64_t>(call.count);
  if (uses_op(c.kind)) c.op = static_cast<reduce_op>(call.extra);
  c.root = static_cast<int>(call.root);
  return c;
}

}  // namespace comm::detail

/// @brief The request of `shared_gpu_communicator`: completes when its stream passes the operation.
using shared_gpu_request = basic_stream_request<comm::detail::shared_gpu_state>;

/// @brief One mesh device's handle on a group of devices that share one GPU. Move-only (its host
/// handle belongs to one thread).
class shared_gpu_communicator
    : public communicator_frontend<shared_gpu_communicator, shared_gpu_request, cuda_stream_ref> {
  friend class communicator_frontend<shared_gpu_communicator, shared_gpu_request, cuda_stream_ref>;

 public:

  shared_gpu_communicator() = default;

  /// @brief Device `host.rank()` of `host.size()` on GPU `options.device` (default: current),
  /// bound to `options.stream` (default: a new non-blocking stream). Not collective.
  explicit shared_gpu_communicator(thread_communicator host, nccl_comm_options options = {}) {
    if (!host.valid()) throw comm_argument_error("meshlib: shared_gpu_communicator needs a valid thread_communicator");
    if (host.size() > comm::detail::max_local_devices)
      throw comm_argument_error("meshlib: shared_gpu_communicator: " + std::to_string(host.size()) +
                                " devices on one GPU; at most " + std::to_string(comm::detail::max_local_devices) + " are supported");
    // The stream and device come from the same code as the NCCL communicator's.
    auto base = nccl_communicator::make_state(options, host.rank(), host.size(), "shared_gpu_communicator");
    auto s = std::make_shared<comm::detail::shared_gpu_state>();
    s->host = std::move(host);
    s->device = base->device;
    s->stream = base->stream;
    s->stream_owner = base->stream_owner;
    s->options = options;
    {
      comm::detail::cuda_device_scope g(s->device, "shared_gpu_communicator");
      s->ready = comm::detail::make_shared_cuda_event(s->device, "shared_gpu_communicator");
      s->done = comm::detail::make_shared_cuda_event(s->device, "shared_gpu_communicator");
    }
    state_ = std::move(s);
  }

  /// @brief Adopts a participant's state (for creation functions and tests).
  explicit shared_gpu_communicator(std::shared_ptr<comm::detail::shared_gpu_state> s) noexcept : state_(std::move(s)) {}

  /// This participant's rank (0 when moved from).
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->host.rank() : 0; }
  /// The number of participants (0 when moved from).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->host.size() : 0; }
  /// The CUDA device this participant uses (-1 when moved from).
  [[nodiscard]] int device() const noexcept { return state_ ? state_->device : -1; }
  /// The CUDA stream the collectives run on (null when moved from).
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_ ? state_->stream : nullptr; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// True once a participant failed; the others then stop waiting.
  [[nodiscard]] bool failed() const noexcept { return state_ && state_->failed.load(); }
  /// Aborts the group: every participant's pending and later calls fail naming `reason`.
  void abort(std::string_view reason) {
    require_valid("abort");
    state_->abort("meshlib: " + state_->describe("abort") + ": " + std::string(reason));
  }

  // The operations and their argument checks come from communicator_frontend; `transport` (below)
  // is the shared-GPU part.

  /// @brief Devices with the same `color` form a new group (`thread_communicator::split`), on the
  /// same GPU and stream.
  shared_gpu_communicator split(int color, int key) {
    check_split(color);
    nccl_comm_options o = state_->options;
    o.device = state_->device;
    o.stream = state_->stream;
    shared_gpu_communicator out(rendezvous("split", [&] { return state_->host.split(color, key); }), o);
    out.state_->stream_owner = state_->stream_owner;  // keeps the parent's stream alive
    return out;
  }

 private:
  [[nodiscard]] std::string describe(std::string_view k) const { return state_->describe(k); }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty shared_gpu_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    state_->refuse_if_failed(describe(k));
  }
  // ---- the front end's hooks
  [[nodiscard]] std::string label() const { return "shared-GPU device " + std::to_string(rank()); }
  void ensure_usable(comm::detail::op_kind k) const { check_usable(comm::detail::op_name(k)); }
  /// A buffer of `elems` elements of T must be device memory of this GPU (stream_state's check).
  template <comm::detail::op_kind K, class T>
  void device_buffer(const char* name, const T* p, std::size_t elems) const {
    if (auto problem = state_->buffer_problem(name, p, elems * sizeof(T)); !problem.empty()) this->bad_argument(K, problem);
  }

  /// The shared-GPU transport of operation K, after the front end's checks.
  template <comm::detail::op_kind K, class T>
  request_type transport(const comm::detail::operation<T>& o, context_type ctx) {
    using comm::detail::op_kind;
    constexpr std::string_view k = comm::detail::op_name(K);
    constexpr int code = static_cast<int>(K);
    const std::size_t n = static_cast<std::size_t>(size());
    const std::size_t c = o.count;
    const std::size_t me = static_cast<std::size_t>(rank());
    if constexpr (K == op_kind::all_reduce || K == op_kind::reduce) {
      device_buffer<K>("send", o.send, c);
      if (o.recv != nullptr) device_buffer<K>("receive", o.recv, c);
      return reduction<T>(k, K == op_kind::all_reduce ? 0 : 1, code, o.send, o.recv, c, o.op,
                          K == op_kind::reduce ? o.root : -1, ctx);
    } else if constexpr (K == op_kind::reduce_scatter) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c);
      // In place, the front end passes send = the buffer and recv = its block rank(): every
      // device reads block r of each send, so the sends' bases are what the peers need.
      return reduction<T>(k, 4, code, o.send, o.recv, c, o.op, -1, ctx);
    } else if constexpr (K == op_kind::broadcast) {
      if (o.send != nullptr) device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return movement<T>(k, code, o.send, o.recv, c, o.root, 0, ctx, [&](const auto& all, cudaStream_t s) {
        copy(k, o.recv, reinterpret_cast<const T*>(all[static_cast<std::size_t>(o.root)].send), c, s);
      });
    } else if constexpr (K == op_kind::all_gather) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c * n);
      return movement<T>(k, code, o.send, o.recv, c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
        for (const auto& peer : all)  // push my block into every recv (in place: my own is there already)
          copy(k, reinterpret_cast<T*>(peer.recv) + me * c, o.send, c, s);
      });
    } else if constexpr (K == op_kind::all_to_all || K == op_kind::ppermute) {
      const std::size_t len = K == op_kind::all_to_all ? c * n : c;
      device_buffer<K>("send", o.send, len);
      device_buffer<K>("receive", o.recv, len);
      const cudaStream_t s0 = ctx.or_else(state_->stream);
      // In place, peers overwrite this buffer while this device sends from it: send from a copy,
      // which only a non-empty buffer has (detail::in_place_scratch): with nothing to move there
      // is no copy, and nothing to free.
      T* copy_of = o.in_place ? scratch_copy(k, std::span<T>(o.recv, len), s0) : nullptr;
      const T* from = copy_of != nullptr ? copy_of : o.send;
      const std::int64_t extra = K == op_kind::ppermute ? hash_pairs(o.pairs) : 0;
      auto r = movement<T>(k, code, from, o.recv, c, -1, extra, ctx, [&](const auto& all, cudaStream_t s) {
        if constexpr (K == op_kind::all_to_all) push_blocks(k, from, all, c, s);
        else pull_permuted(k, o.recv, c, all, o.pairs, s);
      });
      if (copy_of != nullptr) free_after(k, copy_of, s0);
      return r;
    } else if constexpr (K == op_kind::all_to_all_v) {
      // Every participant's receive counts and displacements (so that each sender pushes to the
      // right place) and send counts. With every participant's counts, every device checks every
      // (sender, receiver) pair in the same order before anything moves and names the same first
      // disagreement: the devices whose own counts agree fail too (as on the host backends).
      std::vector<std::int64_t> mine(3 * n);
      std::copy(o.v[2], o.v[2] + n, mine.begin());
      std::copy(o.v[3], o.v[3] + n, mine.begin() + static_cast<std::ptrdiff_t>(n));
      std::copy(o.v[0], o.v[0] + n, mine.begin() + static_cast<std::ptrdiff_t>(2 * n));
      std::vector<std::int64_t> theirs(3 * n * n);
      return movement<T>(k, code, o.send, o.recv, 0, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
        rendezvous(k, [&] { (void)state_->host.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(theirs)); });
        if (const auto bad = comm::detail::first_counts_disagreement(
                n, [&](std::size_t i, std::size_t j) { return theirs[i * 3 * n + 2 * n + j]; },
                [&](std::size_t j, std::size_t i) { return theirs[j * 3 * n + i]; }))
          throw collective_mismatch("meshlib: collective mismatch in all_to_all_v on the devices of GPU " +
                                    std::to_string(state_->device) + " (seen by device " + std::to_string(me) +
                                    "): the counts disagree: " +
                                    comm::detail::describe_counts_disagreement("device " + std::to_string(bad->sender),
                                                                         "device " + std::to_string(bad->receiver),
                                                                         bad->sent, bad->expected));
        for (std::size_t j = 0; j < n; ++j) {
          const std::int64_t want = theirs[j * 3 * n + me];
          const std::int64_t at = theirs[j * 3 * n + n + me];
          copy(k, reinterpret_cast<T*>(all[j].recv) + at, o.send + o.v[1][j], static_cast<std::size_t>(want), s);
        }
      });
    } else if constexpr (K == op_kind::send) {
      device_buffer<K>("send", o.send, c);
      comm::detail::cuda_device_scope g(state_->device, describe(k));
      const cudaStream_t s = ctx.or_else(state_->stream);
      cudaEvent_t ready = nullptr;
      cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      cuda(k, "cudaEventRecord", cudaEventRecord(ready, s));
      const std::int64_t msg[4] = {reinterpret_cast<std::int64_t>(o.send), static_cast<std::int64_t>(c),
                                   static_cast<std::int64_t>(datatype_of<T>), reinterpret_cast<std::int64_t>(ready)};
      rendezvous(k, [&] { (void)state_->host.send(std::span<const std::int64_t>(msg), o.peer, o.tag); });
      std::int64_t done = 0;
      rendezvous(k, [&] { (void)state_->host.recv(std::span<std::int64_t>(&done, 1), o.peer, o.tag); });
      auto* done_event = reinterpret_cast<cudaEvent_t>(done);
      cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, done_event, 0));
      (void)cudaEventDestroy(done_event);  // the receiver has waited on `ready` and made `done` for us
      (void)cudaEventDestroy(ready);
      return complete_on(k, s);
    } else if constexpr (K == op_kind::recv) {
      device_buffer<K>("receive", o.recv, c);
      comm::detail::cuda_device_scope g(state_->device, describe(k));
      const cudaStream_t s = ctx.or_else(state_->stream);
      std::int64_t msg[4] = {};
      rendezvous(k, [&] { (void)state_->host.recv(std::span<std::int64_t>(msg), o.peer, o.tag); });
      auto* ready = reinterpret_cast<cudaEvent_t>(msg[3]);
      cudaEvent_t done = nullptr;
      cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      const bool same = msg[1] == static_cast<std::int64_t>(c) && msg[2] == static_cast<std::int64_t>(datatype_of<T>);
      if (same) {
        cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, ready, 0));
        copy(k, o.recv, reinterpret_cast<const T*>(msg[0]), c, s);
      }
      cuda(k, "cudaEventRecord", cudaEventRecord(done, s));
      const std::int64_t reply = reinterpret_cast<std::int64_t>(done);
      rendezvous(k, [&] {  // the sender destroys both events
        (void)state_->host.send(std::span<const std::int64_t>(&reply, 1), o.peer, o.tag);
      });
      if (!same)
        throw collective_mismatch("meshlib: " + describe(k) + " expected " + std::to_string(c) + " elements of " +
                                  std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(o.peer) +
                                  " (tag " + std::to_string(o.tag) + ") but the message holds " + std::to_string(msg[1]) +
                                  " elements of " + std::string(to_string(static_cast<datatype>(msg[2]))));
      return complete_on(k, s);
    } else {
      static_assert(K == op_kind::barrier);
      return movement<float>(k, code, nullptr, nullptr, 0, -1, 0, ctx, [](const auto&, cudaStream_t) {});
    }
  }
  /// @brief Runs `f`, a rendezvous of the devices on their host communicator for operation `k`. A
  /// failure there (a peer threw, left, or never came; issue 40) is this communicator's failure
  /// too: recorded, so that `failed()` says so, pending requests fail and every later call is
  /// refused with it; and rethrown with the same type, naming the operation the user called and
  /// the device that saw it (the host's own words name its all_gather and its ranks, which are
  /// the devices' ranks here).
  template <class F>
  std::invoke_result_t<F&> rendezvous(std::string_view k, F&& f) {
    try {
      return f();
    } catch (const comm_timeout& e) {
      throw comm_timeout(host_failure(k, e.what(), true));
    } catch (const comm_aborted& e) {
      throw comm_aborted(host_failure(k, e.what(), false));
    }
  }
  std::string host_failure(std::string_view k, std::string_view host_what, bool by_timeout) {
    constexpr std::string_view prefix = "meshlib: ";
    if (host_what.starts_with(prefix)) host_what.remove_prefix(prefix.size());
    state_->abort(std::string(host_what), by_timeout);  // the host has failed already: records it here
    return "meshlib: " + describe(k) + ": " + std::string(host_what) + " (the devices' host communicator: its rank r is device r)";
  }
  void cuda(std::string_view k, std::string_view call, cudaError_t rc) const {
    if (rc != cudaSuccess) comm::detail::check_cuda(rc, describe(k), call);
  }
  template <class T>
  void copy(std::string_view k, T* to, const T* from, std::size_t n, cudaStream_t s) const {
    if (n == 0 || to == from) return;
    cuda(k, "cudaMemcpyAsync", cudaMemcpyAsync(to, from, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
  }
  /// A stream-ordered copy of a non-empty `buf` (`cudaMallocAsync`; `free_after` frees it), or
  /// null for an empty one: never the caller's own memory (detail::in_place_scratch).
  template <class T>
  T* scratch_copy(std::string_view k, std::span<T> buf, cudaStream_t s) const {
    comm::detail::cuda_device_scope g(state_->device, describe(k));
    return static_cast<T*>(comm::detail::in_place_scratch(
        buf.size_bytes(),
        [&](std::size_t bytes) {
          void* p = nullptr;
          cuda(k, "cudaMallocAsync", cudaMallocAsync(&p, bytes, s));
          return p;
        },
        [&](void* p) { copy(k, static_cast<T*>(p), buf.data(), buf.size(), s); }));
  }
  template <class T>
  void free_after(std::string_view k, T* p, cudaStream_t s) const {
    // Freed on the stream after the peers' "done" events it waited on: no peer reads it any more.
    if (p != nullptr) cuda(k, "cudaFreeAsync", cudaFreeAsync(p, s));
  }
  static std::int64_t hash_pairs(std::span<const permute_pair> pairs) {
    meshlib::experimental::fnv1a h;  // over the pairs, in order
    for (const auto& p : pairs) h.add(static_cast<std::uint32_t>(p.source)).add(static_cast<std::uint32_t>(p.dest));
    return static_cast<std::int64_t>(h.value);
  }
  template <class T, class All>
  void push_blocks(std::string_view k, const T* from, const All& all, std::size_t c, cudaStream_t s) const {
    for (int j = 0; j < size(); ++j)
      copy(k, reinterpret_cast<T*>(all[static_cast<std::size_t>(j)].recv) + static_cast<std::size_t>(rank()) * c,
           from + static_cast<std::size_t>(j) * c, c, s);
  }
  template <class T, class All>
  void pull_permuted(std::string_view k, T* to, std::size_t n, const All& all, std::span<const permute_pair> pairs,
                     cudaStream_t s) const {
    for (const auto& p : pairs)
      if (p.dest == rank()) {
        copy(k, to, reinterpret_cast<const T*>(all[static_cast<std::size_t>(p.source)].send), n, s);
        return;
      }
    if (n != 0) cuda(k, "cudaMemsetAsync", cudaMemsetAsync(to, 0, n * sizeof(T), s));  // no source: zeros
  }

  /// Publishes this participant's call, checks that every participant made the same one, and
  /// orders this stream after every peer's "ready" event.
  ///
  /// Lifetimes: a peer's events are used after the rendezvous that handed them over, when that
  /// peer may have left (after `depart`'s rendezvous, the operation's last, it returns, and may
  /// destroy its communicator at once). Each event carries a reference for every peer, given back
  /// once its wait is enqueued (detail/shared_event.hpp); nothing else of a peer's is touched
  /// after a rendezvous but the buffers it passed, whose reuse the "done" events order.
  std::vector<comm::detail::shared_gpu_call> arrive(std::string_view k, comm::detail::shared_gpu_call mine, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->ready->get(), s));
    mine.ready = state_->ready->handle();
    const auto n = static_cast<std::size_t>(size());
    std::vector<comm::detail::shared_gpu_call> all(n);
    state_->ready->share(size() - 1);  // before the handle is published
    rendezvous(k, [&] {
      (void)state_->host.all_gather(std::span<const std::int64_t>(reinterpret_cast<const std::int64_t*>(&mine), 8),
                                    std::span<std::int64_t>(reinterpret_cast<std::int64_t*>(all.data()), 8 * n));
    });
    comm::detail::peer_event_refs<comm::detail::cuda_event_traits> ready(size(), rank(), [&](int q) {
      return all[static_cast<std::size_t>(q)].ready;
    });
    bool agree = true;
    for (const auto& c : all)
      agree = agree && c.op == all[0].op && c.type == all[0].type && c.count == all[0].count && c.root == all[0].root &&
              c.extra == all[0].extra;
    if (!agree) {
      std::string m = "meshlib: collective mismatch on the devices of GPU " + std::to_string(state_->device) +
                      " (seen by device " + std::to_string(rank()) + "):";
      for (std::size_t q = 0; q < n; ++q)
        m += " device " + std::to_string(q) + " called " + comm::detail::describe_call(comm::detail::summary_of(all[q])) +
             (q + 1 < n ? ";" : "");
      throw collective_mismatch(m);
    }
    for (int q = 0; q < size(); ++q)
      if (q != rank()) cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, ready[q], 0));
    return all;  // (its `ready` handles are not used again: the references go with `ready`)
  }
  /// Records "done", waits for every peer's, and returns the request of this participant.
  request_type depart(std::string_view k, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->done->get(), s));
    const auto n = static_cast<std::size_t>(size());
    const std::int64_t mine = state_->done->handle();
    std::vector<std::int64_t> all(n);
    state_->done->share(size() - 1);  // before the handle is published
    rendezvous(k, [&] { (void)state_->host.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all)); });
    // The last rendezvous of the operation: a peer may return, and destroy its communicator,
    // before this participant has enqueued its waits; its reference keeps the event alive.
    comm::detail::peer_event_refs<comm::detail::cuda_event_traits> done(size(), rank(),
                                                            [&](int q) { return all[static_cast<std::size_t>(q)]; });
    for (int q = 0; q < size(); ++q)
      if (q != rank()) cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, done[q], 0));
    done.release_all();
    return complete_on(k, s);
  }
  request_type complete_on(std::string_view k, cudaStream_t s) {
    cudaEvent_t ev = state_->acquire_event(describe(k));
    cuda(k, "cudaEventRecord", cudaEventRecord(ev, s));
    return request_type(state_, ev, std::string(k), state_->options.timeout);
  }

  template <class T, class Body>
  request_type movement(std::string_view k, int op, const T* send, T* recv, std::size_t count, int root,
                        std::int64_t extra, context_type ctx, Body&& body) {
    comm::detail::cuda_device_scope g(state_->device, describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    comm::detail::shared_gpu_call mine;
    mine.op = op;
    mine.type = op == static_cast<int>(comm::detail::op_kind::barrier) ? -1 : static_cast<std::int64_t>(datatype_of<T>);
    mine.count = static_cast<std::int64_t>(count);
    mine.root = root;
    mine.extra = extra;
    mine.send = reinterpret_cast<std::int64_t>(send);
    mine.recv = reinterpret_cast<std::int64_t>(recv);
    const auto all = arrive(k, mine, s);
    body(all, s);
    return depart(k, s);
  }

  /// all_reduce (shape 0), reduce (1) and reduce_scatter (4): participant r reduces block r.
  template <class T>
  request_type reduction(std::string_view k, int shape, int code, const T* send, T* recv, std::size_t count, reduce_op op,
                         int root, context_type ctx) {
    return movement<T>(k, code, send, recv, count, root, static_cast<std::int64_t>(op), ctx,
                       [&](const auto& all, cudaStream_t s) {
      const auto n = static_cast<std::size_t>(size());
      const auto r = static_cast<std::size_t>(rank());
      std::vector<const void*> in;
      std::vector<void*> out;
      std::size_t begin = 0;
      std::size_t len = 0;
      if (shape == 4) {  // reduce_scatter: my whole result block, from block r of every send
        len = count;
        for (const auto& c : all) in.push_back(reinterpret_cast<const T*>(c.send) + r * count);
        out.push_back(recv);
      } else {  // my slice of the payload, from every send, to every (all_reduce) or root's (reduce) recv
        begin = count * r / n;
        len = count * (r + 1) / n - begin;
        for (const auto& c : all) in.push_back(reinterpret_cast<const T*>(c.send) + begin);
        if (shape == 0)
          for (const auto& c : all) out.push_back(reinterpret_cast<T*>(c.recv) + begin);
        else
          out.push_back(reinterpret_cast<T*>(all[static_cast<std::size_t>(root)].recv) + begin);
      }
      comm::detail::launch_reduce(datatype_of<T>, op, in, out, len, s, describe(k));
    });
  }

  std::shared_ptr<comm::detail::shared_gpu_state> state_;
};

static_assert(communicator<shared_gpu_communicator>);

/// @brief Runs `fn(shared_gpu_communicator&)` for `n` mesh devices sharing one GPU
/// (`options.device`, default the current one), one thread and one new stream each, as
/// `run_on_threads` (whose fault handling it has: `participant_error` names the first failure).
template <class F>
  requires std::is_invocable_v<F&, shared_gpu_communicator&>
void run_on_shared_gpu(int n, F&& fn, nccl_comm_options options = {}, thread_comm_options host_options = {}) {
  if (n > comm::detail::max_local_devices)
    throw comm_argument_error("meshlib: run_on_shared_gpu: " + std::to_string(n) + " devices on one GPU; at most " +
                              std::to_string(comm::detail::max_local_devices) + " are supported");
  if (options.device < 0) comm::detail::check_cuda(cudaGetDevice(&options.device), "run_on_shared_gpu", "cudaGetDevice");
  run_on_threads(
      n,
      [&](thread_communicator& host) {
        shared_gpu_communicator c(std::move(host), options);
        fn(c);
      },
      std::move(host_options));
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

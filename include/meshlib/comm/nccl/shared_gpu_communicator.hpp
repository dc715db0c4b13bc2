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
/// request completes when the participant's stream passes that point.

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
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/device_checks.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/nccl/detail/reduce_kernel.hpp"
#include "meshlib/comm/nccl/detail/stream_state.hpp"
#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"

namespace meshlib {

namespace detail {

/// One participant's stream, events and host handle: the `Channel` of its requests.
struct shared_gpu_state : stream_state {
  thread_communicator host;
  cudaEvent_t ready = nullptr;  ///< recorded when this participant's inputs are ready
  cudaEvent_t done = nullptr;   ///< recorded when its share of the work is enqueued

  shared_gpu_state() = default;
  ~shared_gpu_state() {
    cuda_device_scope_noexcept g(device);
    if (ready != nullptr) (void)cudaEventDestroy(ready);
    if (done != nullptr) (void)cudaEventDestroy(done);
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

/// The descriptor every participant publishes for a collective (int64 words, so that the host
/// communicator's all_gather moves it).
struct shared_gpu_call {
  std::int64_t op = 0;      ///< index into shared_gpu_op_names
  std::int64_t type = -1;   ///< datatype, or -1
  std::int64_t count = 0;   ///< elements (per rank, as the concept counts them)
  std::int64_t root = -1;   ///< root, or -1
  std::int64_t extra = 0;   ///< reduce op, or a hash of the ppermute pairs
  std::int64_t send = 0;    ///< device pointers
  std::int64_t recv = 0;
  std::int64_t ready = 0;   ///< cudaEvent_t
};
static_assert(sizeof(shared_gpu_call) == 8 * sizeof(std::int64_t));
inline constexpr const char* shared_gpu_op_names[] = {"all_reduce", "reduce",     "broadcast", "all_gather",
                                                      "reduce_scatter", "all_to_all", "all_to_all_v",
                                                      "ppermute",   "barrier"};

}  // namespace detail

/// @brief The request of `shared_gpu_communicator`: completes when its stream passes the operation.
using shared_gpu_request = basic_stream_request<detail::shared_gpu_state>;

/// @brief One mesh device's handle on a group of devices that share one GPU. Move-only (its host
/// handle belongs to one thread).
class shared_gpu_communicator : private detail::device_checks<shared_gpu_communicator> {
  friend class detail::device_checks<shared_gpu_communicator>;

 public:
  using is_communicator = void;
  using request_type = shared_gpu_request;
  using context_type = cuda_stream_ref;

  shared_gpu_communicator() = default;

  /// @brief Device `host.rank()` of `host.size()` on GPU `options.device` (default: current),
  /// bound to `options.stream` (default: a new non-blocking stream). Not collective.
  explicit shared_gpu_communicator(thread_communicator host, nccl_comm_options options = {}) {
    if (!host.valid()) throw comm_argument_error("meshlib: shared_gpu_communicator needs a valid thread_communicator");
    if (host.size() > detail::max_local_devices)
      throw comm_argument_error("meshlib: shared_gpu_communicator: " + std::to_string(host.size()) +
                                " devices on one GPU; at most " + std::to_string(detail::max_local_devices) + " are supported");
    // The stream and device come from the same code as the NCCL communicator's.
    auto base = nccl_communicator::make_state(options, host.rank(), host.size(), "shared_gpu_communicator");
    auto s = std::make_shared<detail::shared_gpu_state>();
    s->host = std::move(host);
    s->device = base->device;
    s->stream = base->stream;
    s->stream_owner = base->stream_owner;
    s->options = options;
    {
      detail::cuda_device_scope g(s->device, "shared_gpu_communicator");
      s->ready = s->acquire_event("shared_gpu_communicator");
      s->done = s->acquire_event("shared_gpu_communicator");
    }
    state_ = std::move(s);
  }

  /// @brief Adopts a participant's state (for creation functions and tests).
  explicit shared_gpu_communicator(std::shared_ptr<detail::shared_gpu_state> s) noexcept : state_(std::move(s)) {}

  [[nodiscard]] int rank() const noexcept { return state_ ? state_->host.rank() : 0; }
  [[nodiscard]] int size() const noexcept { return state_ ? state_->host.size() : 0; }
  [[nodiscard]] int device() const noexcept { return state_ ? state_->device : -1; }
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_ ? state_->stream : nullptr; }
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  [[nodiscard]] bool failed() const noexcept { return state_ && state_->failed.load(); }
  /// Aborts the group: every participant's pending and later calls fail naming `reason`.
  void abort(std::string_view reason) {
    require_valid("abort");
    state_->abort("meshlib: " + state_->describe("abort") + ": " + std::string(reason));
  }

  // ---- reducing collectives --------------------------------------------------------------------

  template <comm_element T>
  request_type all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                          context_type ctx = {}) {
    constexpr std::string_view k = "all_reduce";
    check_out_of_place(k, send, recv, send.size());
    return reduction<T>(k, 0, send.data(), recv.data(), send.size(), op, -1, ctx);
  }
  template <comm_element T>
  request_type all_reduce(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr std::string_view k = "all_reduce";
    check_buffer(k, buf);
    return reduction<T>(k, 0, buf.data(), buf.data(), buf.size(), op, -1, ctx);
  }
  template <comm_element T>
  request_type reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root,
                      context_type ctx = {}) {
    constexpr std::string_view k = "reduce";
    check_reduce(k, send, recv, root);
    return reduction<T>(k, 1, send.data(), recv.data(), send.size(), op, root, ctx);
  }
  template <comm_element T>
  request_type reduce(std::span<T> buf, reduce_op op, int root, context_type ctx = {}) {
    constexpr std::string_view k = "reduce";
    check_root(k, root);
    check_buffer(k, buf);
    return reduction<T>(k, 1, buf.data(), buf.data(), buf.size(), op, root, ctx);
  }
  template <comm_element T>
  request_type reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                              context_type ctx = {}) {
    constexpr std::string_view k = "reduce_scatter";
    const std::size_t c = check_reduce_scatter(k, send, recv);
    return reduction<T>(k, 4, send.data(), recv.data(), c, op, -1, ctx);
  }
  template <comm_element T>
  request_type reduce_scatter(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr std::string_view k = "reduce_scatter";
    const std::size_t c = blocks_of(k, buf.size());
    check_buffer(k, buf);
    return reduction<T>(k, 4, buf.data(), buf.data() + static_cast<std::size_t>(rank()) * c, c, op, -1, ctx);
  }

  // ---- data movement ---------------------------------------------------------------------------

  template <comm_element T>
  request_type broadcast(std::span<const std::type_identity_t<T>> send, std::span<T> recv, int root,
                         context_type ctx = {}) {
    constexpr std::string_view k = "broadcast";
    check_broadcast(k, send, recv, root);
    return movement<T>(k, 2, send.data(), recv.data(), recv.size(), root, 0, ctx, [&](const auto& all, cudaStream_t s) {
      const auto& r = all[static_cast<std::size_t>(root)];
      copy(k, recv.data(), reinterpret_cast<const T*>(r.send), recv.size(), s);
    });
  }
  template <comm_element T>
  request_type broadcast(std::span<T> buf, int root, context_type ctx = {}) {
    constexpr std::string_view k = "broadcast";
    check_root(k, root);
    check_buffer(k, buf);
    return movement<T>(k, 2, buf.data(), buf.data(), buf.size(), root, 0, ctx, [&](const auto& all, cudaStream_t s) {
      if (rank() != root) copy(k, buf.data(), reinterpret_cast<const T*>(all[static_cast<std::size_t>(root)].send), buf.size(), s);
    });
  }
  template <comm_element T>
  request_type all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr std::string_view k = "all_gather";
    const std::size_t c = send.size();
    check_out_of_place(k, send, recv, checked_mul(k, c));
    return movement<T>(k, 3, send.data(), recv.data(), c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
      for (int q = 0; q < size(); ++q)  // push my block into every recv
        copy(k, reinterpret_cast<T*>(all[static_cast<std::size_t>(q)].recv) + static_cast<std::size_t>(rank()) * c,
             send.data(), c, s);
    });
  }
  template <comm_element T>
  request_type all_gather(std::span<T> buf, context_type ctx = {}) {
    constexpr std::string_view k = "all_gather";
    const std::size_t c = blocks_of(k, buf.size());
    check_buffer(k, buf);
    const T* mine = buf.data() + static_cast<std::size_t>(rank()) * c;
    return movement<T>(k, 3, buf.data(), buf.data(), c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
      for (int q = 0; q < size(); ++q)
        if (q != rank())
          copy(k, reinterpret_cast<T*>(all[static_cast<std::size_t>(q)].recv) + static_cast<std::size_t>(rank()) * c, mine,
               c, s);
    });
  }
  template <comm_element T>
  request_type all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr std::string_view k = "all_to_all";
    const std::size_t c = blocks_of(k, send.size());
    check_out_of_place(k, send, recv, send.size());
    return movement<T>(k, 5, send.data(), recv.data(), c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
      push_blocks(k, send.data(), all, c, s);
    });
  }
  template <comm_element T>
  request_type all_to_all(std::span<T> buf, context_type ctx = {}) {
    constexpr std::string_view k = "all_to_all";
    const std::size_t c = blocks_of(k, buf.size());
    check_buffer(k, buf);
    // Peers overwrite this buffer while this participant sends from it: send from a copy.
    const cudaStream_t s0 = ctx.or_else(state_->stream);
    T* copy_of = scratch_copy(k, buf, s0);
    auto r = movement<T>(k, 5, copy_of, buf.data(), c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
      push_blocks(k, static_cast<const T*>(copy_of), all, c, s);
    });
    free_after(k, copy_of, s0);
    return r;
  }
  template <comm_element T>
  request_type all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, std::span<T> recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            context_type ctx = {}) {
    constexpr std::string_view k = "all_to_all_v";
    check_all_to_all_v(k, send, send_counts, send_displs, recv, recv_counts, recv_displs);
    // Every receiver's counts and displacements, so that each sender pushes to the right place.
    const auto n = static_cast<std::size_t>(size());
    std::vector<std::int64_t> mine(2 * n);
    std::copy(recv_counts.begin(), recv_counts.end(), mine.begin());
    std::copy(recv_displs.begin(), recv_displs.end(), mine.begin() + static_cast<std::ptrdiff_t>(n));
    std::vector<std::int64_t> theirs(2 * n * n);
    return movement<T>(k, 6, send.data(), recv.data(), 0, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
      (void)state_->host.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(theirs));
      for (std::size_t j = 0; j < n; ++j) {
        const std::int64_t want = theirs[j * 2 * n + static_cast<std::size_t>(rank())];
        if (want != send_counts[j])
          throw collective_mismatch("meshlib: all_to_all_v: " + state_->describe(k) + " sends " +
                                    std::to_string(send_counts[j]) + " elements to rank " + std::to_string(j) +
                                    " but that rank's recv_counts[" + std::to_string(rank()) + "] = " + std::to_string(want));
        const std::int64_t at = theirs[j * 2 * n + n + static_cast<std::size_t>(rank())];
        copy(k, reinterpret_cast<T*>(all[j].recv) + at, send.data() + send_displs[j], static_cast<std::size_t>(want), s);
      }
    });
  }
  template <comm_element T>
  request_type ppermute(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr std::string_view k = "ppermute";
    check_pairs(k, pairs);
    check_out_of_place(k, send, recv, send.size());
    return movement<T>(k, 7, send.data(), recv.data(), send.size(), -1, hash_pairs(pairs), ctx,
                       [&](const auto& all, cudaStream_t s) { pull_permuted(k, recv.data(), send.size(), all, pairs, s); });
  }
  template <comm_element T>
  request_type ppermute(std::span<T> buf, std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr std::string_view k = "ppermute";
    check_pairs(k, pairs);
    check_buffer(k, buf);
    const cudaStream_t s0 = ctx.or_else(state_->stream);
    T* copy_of = scratch_copy(k, buf, s0);
    auto r = movement<T>(k, 7, copy_of, buf.data(), buf.size(), -1, hash_pairs(pairs), ctx,
                         [&](const auto& all, cudaStream_t s) { pull_permuted(k, buf.data(), buf.size(), all, pairs, s); });
    free_after(k, copy_of, s0);
    return r;
  }

  // ---- point to point --------------------------------------------------------------------------

  /// @brief Sends buf to `dest`; returns once `dest` has enqueued the copy (its recv), with a
  /// request that completes when the copy has. Messages match by (source, tag) in order.
  template <class T>
    requires comm_element<T>
  request_type send(std::span<T> buf, int dest, int tag = 0, context_type ctx = {}) {
    constexpr std::string_view k = "send";
    check_usable(k);
    check_peer(k, dest, "destination");
    check_device(k, "send", buf.data(), buf.size_bytes());
    detail::cuda_device_scope g(state_->device, describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    cudaEvent_t ready = nullptr;
    cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
    cuda(k, "cudaEventRecord", cudaEventRecord(ready, s));
    const std::int64_t msg[4] = {reinterpret_cast<std::int64_t>(buf.data()), static_cast<std::int64_t>(buf.size()),
                                 static_cast<std::int64_t>(datatype_of<std::remove_cv_t<T>>),
                                 reinterpret_cast<std::int64_t>(ready)};
    (void)state_->host.send(std::span<const std::int64_t>(msg), dest, tag);
    std::int64_t done = 0;
    (void)state_->host.recv(std::span<std::int64_t>(&done, 1), dest, tag);
    auto* done_event = reinterpret_cast<cudaEvent_t>(done);
    cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, done_event, 0));
    (void)cudaEventDestroy(done_event);  // the receiver has waited on `ready` and made `done` for us
    (void)cudaEventDestroy(ready);
    return complete_on(k, s);
  }
  /// @brief Receives the next message from `source` with `tag`; its length and type must be buf's.
  template <comm_element T>
  request_type recv(std::span<T> buf, int source, int tag = 0, context_type ctx = {}) {
    constexpr std::string_view k = "recv";
    check_usable(k);
    check_peer(k, source, "source");
    check_device(k, "receive", buf.data(), buf.size_bytes());
    detail::cuda_device_scope g(state_->device, describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    std::int64_t msg[4] = {};
    (void)state_->host.recv(std::span<std::int64_t>(msg), source, tag);
    auto* ready = reinterpret_cast<cudaEvent_t>(msg[3]);
    cudaEvent_t done = nullptr;
    cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    const bool same = msg[1] == static_cast<std::int64_t>(buf.size()) && msg[2] == static_cast<std::int64_t>(datatype_of<T>);
    if (same) {
      cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, ready, 0));
      copy(k, buf.data(), reinterpret_cast<const T*>(msg[0]), buf.size(), s);
    }
    cuda(k, "cudaEventRecord", cudaEventRecord(done, s));
    const std::int64_t reply = reinterpret_cast<std::int64_t>(done);
    (void)state_->host.send(std::span<const std::int64_t>(&reply, 1), source, tag);  // the sender destroys both events
    if (!same)
      throw collective_mismatch("meshlib: " + describe(k) + " expected " + std::to_string(buf.size()) + " elements of " +
                                std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(source) +
                                " (tag " + std::to_string(tag) + ") but the message holds " + std::to_string(msg[1]) +
                                " elements of " + std::string(to_string(static_cast<datatype>(msg[2]))));
    return complete_on(k, s);
  }

  // ---- synchronisation and groups --------------------------------------------------------------

  /// @brief Every stream waits until every participant's stream has reached the barrier.
  request_type barrier(context_type ctx = {}) {
    constexpr std::string_view k = "barrier";
    check_usable(k);
    return movement<float>(k, 8, nullptr, nullptr, 0, -1, 0, ctx, [](const auto&, cudaStream_t) {});
  }
  /// @brief Devices with the same `color` form a new group (`thread_communicator::split`), on the
  /// same GPU and stream.
  shared_gpu_communicator split(int color, int key) {
    constexpr std::string_view k = "split";
    check_color(k, color);
    nccl_comm_options o = state_->options;
    o.device = state_->device;
    o.stream = state_->stream;
    shared_gpu_communicator out(state_->host.split(color, key), o);
    out.state_->stream_owner = state_->stream_owner;  // keeps the parent's stream alive
    return out;
  }

 private:
  [[nodiscard]] std::string describe(std::string_view k) const { return state_->describe(k); }
  [[nodiscard]] bool check_pointers() const noexcept { return state_->options.check_pointers; }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty shared_gpu_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    state_->refuse_if_failed(describe(k));
  }
  void cuda(std::string_view k, std::string_view call, cudaError_t rc) const {
    if (rc != cudaSuccess) detail::check_cuda(rc, describe(k), call);
  }
  template <class T>
  void copy(std::string_view k, T* to, const T* from, std::size_t n, cudaStream_t s) const {
    if (n == 0 || to == from) return;
    cuda(k, "cudaMemcpyAsync", cudaMemcpyAsync(to, from, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
  }
  template <class T>
  T* scratch_copy(std::string_view k, std::span<T> buf, cudaStream_t s) const {
    if (buf.empty()) return buf.data();
    detail::cuda_device_scope g(state_->device, describe(k));
    void* p = nullptr;
    cuda(k, "cudaMallocAsync", cudaMallocAsync(&p, buf.size_bytes(), s));
    copy(k, static_cast<T*>(p), buf.data(), buf.size(), s);
    return static_cast<T*>(p);
  }
  template <class T>
  void free_after(std::string_view k, T* p, cudaStream_t s) const {
    // Freed on the stream after the peers' "done" events it waited on: no peer reads it any more.
    if (p != nullptr) cuda(k, "cudaFreeAsync", cudaFreeAsync(p, s));
  }
  static std::int64_t hash_pairs(std::span<const permute_pair> pairs) {
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a over the pairs, in order
    for (const auto& p : pairs)
      for (int v : {p.source, p.dest}) h = (h ^ static_cast<std::uint64_t>(static_cast<std::uint32_t>(v))) * 1099511628211ull;
    return static_cast<std::int64_t>(h);
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
  std::vector<detail::shared_gpu_call> arrive(std::string_view k, detail::shared_gpu_call mine, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->ready, s));
    mine.ready = reinterpret_cast<std::int64_t>(state_->ready);
    const auto n = static_cast<std::size_t>(size());
    std::vector<detail::shared_gpu_call> all(n);
    (void)state_->host.all_gather(std::span<const std::int64_t>(reinterpret_cast<const std::int64_t*>(&mine), 8),
                                  std::span<std::int64_t>(reinterpret_cast<std::int64_t*>(all.data()), 8 * n));
    bool agree = true;
    for (const auto& c : all)
      agree = agree && c.op == all[0].op && c.type == all[0].type && c.count == all[0].count && c.root == all[0].root &&
              c.extra == all[0].extra;
    if (!agree) {
      std::string m = "meshlib: collective mismatch on the devices of GPU " + std::to_string(state_->device) +
                      " (seen by device " + std::to_string(rank()) + "):";
      for (std::size_t q = 0; q < n; ++q) {
        const auto& c = all[q];
        m += " device " + std::to_string(q) + " called " + detail::shared_gpu_op_names[c.op] + "(";
        m += c.type >= 0 ? std::string(to_string(static_cast<datatype>(c.type))) : std::string("-");
        m += ", " + std::to_string(c.count) + " elements";
        if (c.root >= 0) m += ", root " + std::to_string(c.root);
        if (c.op == 0 || c.op == 1 || c.op == 4) m += ", " + std::string(to_string(static_cast<reduce_op>(c.extra)));
        m += ")";
        m += q + 1 < n ? ";" : "";
      }
      throw collective_mismatch(m);
    }
    for (std::size_t q = 0; q < n; ++q)
      if (static_cast<int>(q) != rank())
        cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(all[q].ready), 0));
    return all;
  }
  /// Records "done", waits for every peer's, and returns the request of this participant.
  request_type depart(std::string_view k, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->done, s));
    const auto n = static_cast<std::size_t>(size());
    const auto mine = reinterpret_cast<std::int64_t>(state_->done);
    std::vector<std::int64_t> all(n);
    (void)state_->host.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all));
    for (std::size_t q = 0; q < n; ++q)
      if (static_cast<int>(q) != rank())
        cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, reinterpret_cast<cudaEvent_t>(all[q]), 0));
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
    detail::cuda_device_scope g(state_->device, describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    detail::shared_gpu_call mine;
    mine.op = op;
    mine.type = send == nullptr && recv == nullptr && count == 0 && op == 8 ? -1 : static_cast<std::int64_t>(datatype_of<T>);
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
  request_type reduction(std::string_view k, int shape, const T* send, T* recv, std::size_t count, reduce_op op,
                         int root, context_type ctx) {
    return movement<T>(k, shape, send, recv, count, root, static_cast<std::int64_t>(op), ctx,
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
      detail::launch_reduce(datatype_of<T>, op, in, out, len, s, describe(k));
    });
  }

  std::shared_ptr<detail::shared_gpu_state> state_;
};

static_assert(communicator<shared_gpu_communicator>);

/// @brief Runs `fn(shared_gpu_communicator&)` for `n` mesh devices sharing one GPU
/// (`options.device`, default the current one), one thread and one new stream each, as
/// `run_on_threads` (whose fault handling it has: `participant_error` names the first failure).
template <class F>
  requires std::is_invocable_v<F&, shared_gpu_communicator&>
void run_on_shared_gpu(int n, F&& fn, nccl_comm_options options = {}, thread_comm_options host_options = {}) {
  if (n > detail::max_local_devices)
    throw comm_argument_error("meshlib: run_on_shared_gpu: " + std::to_string(n) + " devices on one GPU; at most " +
                              std::to_string(detail::max_local_devices) + " are supported");
  if (options.device < 0) detail::check_cuda(cudaGetDevice(&options.device), "run_on_shared_gpu", "cudaGetDevice");
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

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The NCCL communicator: one participant per GPU, collectives on device buffers, ordered on
/// a CUDA stream. Satisfies `communicator`.
///
/// @code
/// // one process per GPU (ids exchanged by MPI: <meshlib/comm/nccl/mpi_bootstrap.hpp>, or by the
/// // launcher's environment: meshlib::nccl::connect_from_environment in <meshlib/nccl.hpp>)
/// meshlib::nccl_communicator comm(id, nranks, rank, {.device = local_rank});
/// float* x = nullptr;
/// cudaMalloc(&x, n * sizeof(float));
/// auto r = comm.all_reduce(std::span(x, n), meshlib::reduce_op::sum);   // enqueued on comm.stream()
/// r.wait();                                                             // or keep computing on the stream
/// @endcode
///
/// Streams. Every communicator is bound to one CUDA stream (`nccl_comm_options::stream`: the
/// stream of the Kokkos execution-space instance the device computes on, e.g.
/// `{.stream = Kokkos::Cuda(...)}`, or any `cudaStream_t`; by default a new non-blocking stream
/// the communicator owns). Every operation enqueues its NCCL calls on that stream, or on the
/// stream given as its last argument, and returns at once with a request that completes when an
/// event recorded after the calls does. Kernels before the call on the same stream are ordered
/// before it, kernels after it see its result: no host synchronisation in between. Buffers are
/// device memory (checked with `cudaPointerGetAttributes` unless `check_pointers` is off).
///
/// Faults. The communicator is created non-blocking (`ncclCommInitRankConfig` with
/// `blocking = 0`), so no NCCL call blocks the host. `wait()` polls the event and
/// `ncclCommGetAsyncError` against the timeout (`MESHLIB_COMM_TIMEOUT`, default 60 s); an
/// asynchronous error or a passed deadline calls `ncclCommAbort` and throws `comm_aborted` or
/// `comm_timeout` naming the operation and NCCL's error text. After that every operation is
/// refused with the same root cause. Every CUDA and NCCL return code is checked
/// (`detail/nccl_types.hpp` maps them to meshlib's exceptions). Argument errors are thrown before
/// anything is enqueued. NCCL cannot detect mismatched collectives (a rank that calls another
/// collective, or another count), so meshlib checks them by default (`verify_collectives`,
/// batched: `detail::call_batch` says when, and what is left to the timeout; docs/gpu.md the cost):
/// ranks that disagree get `collective_mismatch` naming the call and each rank's call.
///
/// Threads. A handle and its copies share one NCCL communicator and must be used by one thread at
/// a time, as NCCL's; `abort()` may be called from any thread. The last handle's destruction
/// finalizes the communicator (`ncclCommFinalize`, which waits for the peers to finalize too, then
/// `ncclCommDestroy`; `ncclCommAbort` if that does not finish within the timeout): communicators of
/// several GPUs in one process are destroyed concurrently (`run_on_gpus` does, and
/// `destroy_communicators` for the result of `nccl_communicators`).

#if MESHLIB_ENABLE_NCCL

#include <algorithm>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/detail/buffer_checks.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/call_fingerprint.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/nccl/detail/stream_state.hpp"
#include "meshlib/comm/nccl/nccl_version.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/comm/timeout.hpp"

namespace meshlib {

namespace comm::detail {

/// The NCCL communicator, stream and event pool shared by the handles and requests of one
/// participant: the `Channel` of `basic_stream_request`.
struct nccl_comm_state : stream_state {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int* scratch = nullptr;  ///< one device int: the payload of barrier()

  // verify_collectives: the calls not yet exchanged and when to exchange them (call_batch); a
  // ring of check slots, each (1 + size) * every int64 (own batch, then every rank's), on the
  // device and in pinned host memory; checks whose copies have not been compared.
  static constexpr int check_slots = 64;
  call_batch batch;
  std::int64_t* check_dev = nullptr;
  std::int64_t* check_host = nullptr;
  struct pending_check {
    cudaEvent_t event;
    int slot;
    std::uint64_t first_call;  ///< the number of the batch's first collective
    std::size_t per;           ///< the calls in the batch
  };
  std::deque<pending_check> checks;
  int next_slot = 0;

  nccl_comm_state() = default;

  ~nccl_comm_state() {
    cuda_device_scope_noexcept g(device);
    if (comm != nullptr && !failed.load()) {
      // Finish outstanding work, then free NCCL's resources; a finalize that does not finish
      // within the timeout (a peer is gone) is an abort.
      const ncclResult_t fin = ncclCommFinalize(comm);  // non-blocking: usually ncclInProgress
      bool clean = fin == ncclSuccess || fin == ncclInProgress;
      if (clean) clean = settle_for_destroy();
      if (clean) (void)ncclCommDestroy(comm);
      else (void)ncclCommAbort(comm);
    }
    if (scratch != nullptr) (void)cudaFree(scratch);
    for (const auto& c : checks) (void)cudaEventDestroy(c.event);
    if (check_dev != nullptr) (void)cudaFree(check_dev);
    if (check_host != nullptr) (void)cudaFreeHost(check_host);
  }

  /// Compares the fingerprints of every check whose copies have arrived: the message of the first
  /// disagreement, else empty. Never blocks.
  std::string compare_checks(std::string* cuda_failure) {
    for (auto it = checks.begin(); it != checks.end();) {
      const cudaError_t q = cudaEventQuery(it->event);
      if (q == cudaErrorNotReady) {
        ++it;
        continue;
      }
      if (q != cudaSuccess) {
        (void)cudaGetLastError();
        *cuda_failure = "cudaEventQuery failed: " + cuda_error_text(q);
        return {};
      }
      const auto slot = static_cast<std::size_t>(it->slot);
      const std::size_t slot_size = static_cast<std::size_t>(size + 1) * batch.every();
      const std::int64_t* all = check_host + slot * slot_size + batch.every();
      std::string m = batch_mismatch_message(
          "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + ", GPU " + std::to_string(device),
          it->first_call, it->per, std::span<const std::int64_t>(all, static_cast<std::size_t>(size) * it->per));
      release(it->event);
      it = checks.erase(it);
      if (!m.empty()) return m;
    }
    return {};
  }

  /// What a timeout adds to its message: the collectives this rank made since its last check
  /// (`call_batch::describe_pending`), where the ranks may have disagreed.
  [[nodiscard]] std::string unchecked_calls() const { return batch.describe_pending(); }

  /// "all_reduce on NCCL rank 1 of 4 (GPU 1)".
  [[nodiscard]] std::string describe(std::string_view op) const {
    return std::string(op) + " on NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + " (GPU " +
           std::to_string(device) + ")";
  }
  /// One look at `event` and at the communicator's asynchronous error; never blocks.
  stream_poll poll(cudaEvent_t event) {
    std::lock_guard lock(mutex);
    if (failed.load()) return stream_poll::failed("the communicator has failed: " + failure);
    // The event first: when it has completed, so has this operation's check (enqueued before it on
    // the same stream), which compare_checks then sees.
    const cudaError_t q = cudaEventQuery(event);
    std::string cuda_failure;
    if (std::string m = compare_checks(&cuda_failure); !m.empty()) return stream_poll::mismatched(std::move(m));
    if (!cuda_failure.empty()) return stream_poll::failed(cuda_failure, false);
    if (q == cudaSuccess) return stream_poll::complete();
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return stream_poll::failed("cudaEventQuery failed: " + cuda_error_text(q), false);
    }
    ncclResult_t async = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &async);
    if (rc != ncclSuccess) return stream_poll::failed("ncclCommGetAsyncError failed: " + nccl_result_text(rc), false);
    if (async != ncclSuccess && async != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      return stream_poll::failed(nccl_result_text(async) + (last != nullptr && *last ? std::string(": ") + last : ""));
    }
    return stream_poll::pending();
  }

  /// Aborts the NCCL communicator (its kernels stop, peers see ncclRemoteError) and records why;
  /// later operations are refused with `reason`. Idempotent, callable from any thread.
  void abort(const std::string& reason, bool by_timeout = false) {
    std::lock_guard lock(mutex);
    if (!record_failure(reason, by_timeout)) return;
    if (comm != nullptr) {
      cuda_device_scope_noexcept g(device);
      (void)ncclCommAbort(comm);
    }
  }

 private:
  bool settle_for_destroy() noexcept {
    const auto deadline = std::chrono::steady_clock::now() + (options.timeout.count() > 0 ? options.timeout : std::chrono::hours(1));
    for (;;) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) return false;
      if (async == ncclSuccess) return true;
      if (async != ncclInProgress || std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::yield();
    }
  }
};

}  // namespace comm::detail

/// @brief The request of the NCCL communicator: completes when the event recorded after the
/// operation's NCCL calls does (see `basic_stream_request`).
using nccl_request = basic_stream_request<comm::detail::nccl_comm_state>;

/// @brief One GPU's handle on an NCCL communicator. Copies share it.
class nccl_communicator : public communicator_frontend<nccl_communicator, nccl_request, cuda_stream_ref> {
  friend class communicator_frontend<nccl_communicator, nccl_request, cuda_stream_ref>;

 public:

  /// An empty handle; only assignable and destructible.
  nccl_communicator() = default;

  /// @brief Joins the group of `nranks` participants that share `id` as participant `rank`
  /// (collective over the group: every participant makes this call, each with its own GPU).
  /// @throws comm_argument_error for a rank outside [0, nranks) or a device that does not exist;
  /// comm_timeout when the group is not complete within the timeout; comm_error when NCCL fails.
  nccl_communicator(const ncclUniqueId& id, int nranks, int rank, nccl_comm_options options = {}) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw comm_argument_error("meshlib: nccl_communicator: rank " + std::to_string(rank) +
                                " is outside a group of " + std::to_string(nranks) +
                                " participants; ranks are 0 <= rank < nranks and nranks >= 1");
    comm::detail::require_nccl_version("nccl_communicator");
    auto s = make_state(options, rank, nranks, "nccl_communicator");
    {
      comm::detail::cuda_device_scope g(s->device, "nccl_communicator");
      ncclConfig_t config = nonblocking_config();
      ncclUniqueId copy = id;
      init_checked(*s, ncclCommInitRankConfig(&s->comm, nranks, copy, rank, &config), "ncclCommInitRankConfig");
    }
    state_ = std::move(s);
  }

  /// @brief Adopts state made by a creation function (`run_on_gpus`, `split`).
  explicit nccl_communicator(std::shared_ptr<comm::detail::nccl_comm_state> s) noexcept : state_(std::move(s)) {}

  /// @brief A new unique id (`ncclGetUniqueId`), made by one participant and given to all.
  [[nodiscard]] static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    comm::detail::check_nccl(ncclGetUniqueId(&id), "nccl_communicator", "ncclGetUniqueId");
    return id;
  }

  /// This GPU's rank in the NCCL communicator (0 when moved from).
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  /// The number of ranks (0 when moved from).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// The GPU of this participant.
  [[nodiscard]] int device() const noexcept { return state_ ? state_->device : -1; }
  /// The stream the communicator is bound to.
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_ ? state_->stream : nullptr; }
  /// NCCL's communicator, for calls meshlib does not wrap.
  [[nodiscard]] ncclComm_t native() const noexcept { return state_ ? state_->comm : nullptr; }
  /// The options the communicator was made with.
  [[nodiscard]] const nccl_comm_options& options() const {
    require_valid("options");
    return state_->options;
  }
  /// Whether the communicator has failed (aborted, or an operation timed out).
  [[nodiscard]] bool failed() const noexcept { return state_ && state_->failed.load(); }

  /// @brief Aborts the communicator (`ncclCommAbort`): outstanding operations of every participant
  /// end in `comm_aborted` naming `reason`. Any thread may call it.
  void abort(std::string_view reason) {
    require_valid("abort");
    state_->abort("meshlib: " + state_->describe("abort") + ": " + std::string(reason));
  }

  // The operations (all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all,
  // all_to_all_v, ppermute, send, recv, barrier, in every overload) and their argument checks come
  // from communicator_frontend; `transport` below is the NCCL part.

  /// @brief `ncclCommSplit`: ranks with the same `color` (>= 0) form a new communicator, ordered by
  /// (key, rank), on the same GPU and stream, with the same options. Collective over this one.
  ///
  /// The parent is non-blocking, and NCCL (since 2.23, NVIDIA/nccl#1472) fills the new
  /// communicator's handle only when the split is done, which it reports on the *parent*: so the
  /// parent is polled until it leaves `ncclInProgress`, and only then the new communicator, until
  /// it is ready. Polling the new handle at once polls NULL (`ncclInvalidArgument`).
  nccl_communicator split(int color, int key) {
    constexpr std::string_view k = "split";
    check_split(color);
    auto s = std::make_shared<comm::detail::nccl_comm_state>();
    s->options = state_->options;
    s->batch = batch_of(s->options);
    s->device = state_->device;
    s->stream = state_->stream;
    s->stream_owner = state_->stream_owner;
    {
      comm::detail::cuda_device_scope g(s->device, state_->describe(k));
      ncclConfig_t config = nonblocking_config();
      // NCCL writes the handle from its own thread when the split completes: into a cell that
      // outlives that write (leaked, 8 bytes, if the split is abandoned before it completes).
      auto cell = std::make_unique<ncclComm_t>(nullptr);
      const ncclResult_t rc = ncclCommSplit(state_->comm, color, key, cell.get(), &config);
      if (rc != ncclSuccess && rc != ncclInProgress) fail_with(k, "ncclCommSplit", rc);
      s->comm = settle_split(k, color, cell);
      settle_new(*s, state_->describe(k), "ncclCommSplit");
      call(k, "ncclCommUserRank", ncclCommUserRank(s->comm, &s->rank));
      call(k, "ncclCommCount", ncclCommCount(s->comm, &s->size));
      comm::detail::check_cuda(cudaMalloc(reinterpret_cast<void**>(&s->scratch), sizeof(int)), state_->describe(k), "cudaMalloc");
    }
    return nccl_communicator(std::move(s));
  }

  // ---- for creation functions ------------------------------------------------------------------

  /// The non-blocking configuration every meshlib NCCL communicator is made with.
  [[nodiscard]] static ncclConfig_t nonblocking_config() noexcept {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
  }
  /// A state for participant `rank` of `nranks` on options' device and stream, without its NCCL
  /// communicator yet.
  [[nodiscard]] static std::shared_ptr<comm::detail::nccl_comm_state> make_state(const nccl_comm_options& options, int rank,
                                                                           int nranks, std::string_view what) {
    auto s = std::make_shared<comm::detail::nccl_comm_state>();
    s->options = options;
    s->batch = batch_of(options);
    s->rank = rank;
    s->size = nranks;
    int count = 0;
    comm::detail::check_cuda(cudaGetDeviceCount(&count), what, "cudaGetDeviceCount");
    int device = options.device;
    if (device < 0) comm::detail::check_cuda(cudaGetDevice(&device), what, "cudaGetDevice");
    if (device >= count)
      throw comm_argument_error("meshlib: " + std::string(what) + ": GPU " + std::to_string(device) +
                                " does not exist; this machine has " + std::to_string(count) + " CUDA device(s)");
    s->device = device;
    comm::detail::cuda_device_scope g(device, what);
    if (options.stream.given()) {
      s->stream = options.stream.or_else(nullptr);
    } else {
      cudaStream_t st = nullptr;
      comm::detail::check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), what, "cudaStreamCreateWithFlags");
      s->stream = st;
      s->stream_owner = std::shared_ptr<void>(st, [device](void* p) {
        int prev = 0;
        const bool ok = cudaGetDevice(&prev) == cudaSuccess;
        (void)cudaSetDevice(device);
        (void)cudaStreamDestroy(static_cast<cudaStream_t>(p));
        if (ok) (void)cudaSetDevice(prev);
      });
    }
    comm::detail::check_cuda(cudaMalloc(reinterpret_cast<void**>(&s->scratch), sizeof(int)), what, "cudaMalloc");
    return s;
  }
  /// Checks the result of a communicator-creating call and polls the new communicator until it is
  /// ready (non-blocking creation returns ncclInProgress), against the timeout.
  static void init_checked(comm::detail::nccl_comm_state& s, ncclResult_t rc, std::string_view call_name) {
    const std::string what = s.describe("nccl_communicator creation");
    if (rc != ncclSuccess && rc != ncclInProgress)
      comm::detail::check_nccl(rc, what, call_name, s.comm != nullptr ? ncclGetLastError(s.comm) : nullptr);
    settle_new(s, what, call_name);
  }

 private:
  // ---- enqueueing ------------------------------------------------------------------------------

  template <class F>
  request_type enqueue(std::string_view k, context_type ctx, std::optional<comm::detail::call_fingerprint> fingerprint,
                       F&& calls) {
    comm::detail::cuda_device_scope g(state_->device, state_->describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    if (fingerprint && state_->options.verify_collectives) verify(k, fingerprint->pack(), s);
    calls(s);
    cudaEvent_t ev = state_->acquire_event(state_->describe(k));
    cuda_call(k, "cudaEventRecord", cudaEventRecord(ev, s));
    return request_type(state_, ev, std::string(k), state_->options.timeout);
  }
  template <class T>
  static comm::detail::call_fingerprint fp(comm::detail::op_kind op, std::size_t count, std::optional<reduce_op> r = std::nullopt,
                                     int root = -1) {
    comm::detail::call_fingerprint f;
    f.op = op;
    if constexpr (comm_element<T>) f.type = static_cast<int>(datatype_of<T>);
    else f.type = 14;  // CUDA's own 16-bit types: compared, printed as "-"
    f.reduce = r ? static_cast<int>(*r) : -1;
    f.root = root;
    f.count = count;
    return f;
  }
  /// Records a collective's fingerprint (verify_collectives) and, when the schedule says so
  /// (`detail::call_batch`), enqueues the check of the calls since the last one: this rank's batch
  /// to the device, all-gathered, every rank's back to pinned host memory, an event after; polls
  /// compare. The calls that are not exchanged cost a host-side append only.
  void verify(std::string_view k, std::int64_t fp, cudaStream_t s) {
    auto& st = *state_;
    if (!st.batch.add(fp)) return;
    const std::size_t per = st.batch.pending().size();
    const std::size_t every = st.batch.every();
    const auto n1 = static_cast<std::size_t>(st.size + 1) * every;
    const auto slots = static_cast<std::size_t>(comm::detail::nccl_comm_state::check_slots);
    if (st.check_dev == nullptr) {
      cuda_call(k, "cudaMalloc", cudaMalloc(reinterpret_cast<void**>(&st.check_dev), slots * n1 * sizeof(std::int64_t)));
      cuda_call(k, "cudaHostAlloc",
                cudaHostAlloc(reinterpret_cast<void**>(&st.check_host), slots * n1 * sizeof(std::int64_t), cudaHostAllocDefault));
    }
    const int slot = st.next_slot;
    st.next_slot = (st.next_slot + 1) % comm::detail::nccl_comm_state::check_slots;
    // The slot's previous check must have been compared before its memory is reused.
    const auto deadline = deadline_from_now();
    for (;;) {
      bool busy = false;
      for (const auto& c : st.checks) busy = busy || c.slot == slot;
      if (!busy) break;
      std::string cuda_failure;
      std::string m;
      {
        std::lock_guard lock(st.mutex);
        m = st.compare_checks(&cuda_failure);
      }
      if (!m.empty()) {
        st.abort(m);
        throw collective_mismatch(m);
      }
      if (!cuda_failure.empty()) comm::detail::throw_comm_failure(comm::detail::comm_failure_kind::error, "meshlib: " + st.describe(k) + ": " + cuda_failure);
      if (deadline.passed()) {
        const std::string t = "meshlib: " + st.describe(k) + ": the check of an earlier collective did not complete within the timeout; the communicator was aborted";
        st.abort(t, true);
        throw comm_timeout(t);
      }
      std::this_thread::yield();
    }
    std::int64_t* host = st.check_host + static_cast<std::size_t>(slot) * n1;
    std::int64_t* dev = st.check_dev + static_cast<std::size_t>(slot) * n1;
    const std::uint64_t first = st.batch.first_pending();
    std::copy(st.batch.pending().begin(), st.batch.pending().end(), host);
    st.batch.clear();
    const std::size_t bytes = per * sizeof(std::int64_t);
    cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s));
    call(k, "ncclAllGather (call check)", ncclAllGather(dev, dev + every, per, ncclInt64, st.comm, s));
    cuda_call(k, "cudaMemcpyAsync",
              cudaMemcpyAsync(host + every, dev + every, static_cast<std::size_t>(st.size) * bytes,
                              cudaMemcpyDeviceToHost, s));
    cudaEvent_t ev = st.acquire_event(st.describe(k));
    cuda_call(k, "cudaEventRecord", cudaEventRecord(ev, s));
    st.checks.push_back({ev, slot, first, per});
  }
  /// A state's call schedule, from its options (`verify_every`, `verify_each_first`).
  static comm::detail::call_batch batch_of(const nccl_comm_options& o) {
    return comm::detail::call_batch(o.verify_every, o.verify_each_first);
  }
  /// Checks an NCCL call of operation k; ncclInProgress (non-blocking) is settled first.
  void call(std::string_view k, std::string_view name, ncclResult_t rc) const {
    if (rc == ncclSuccess) return;
    if (rc == ncclInProgress) {
      settle(k, name);
      return;
    }
    fail_with(k, name, rc);
  }
  [[noreturn]] void fail_with(std::string_view k, std::string_view name, ncclResult_t rc) const {
    const char* last = ncclGetLastError(state_->comm);
    const std::string message = comm::detail::failed_call_message(state_->describe(k), name, comm::detail::nccl_result_text(rc),
                                                            last != nullptr ? std::string_view(last) : std::string_view{});
    // Argument errors leave the communicator usable; anything else may have left it half-way
    // through a collective, so it is aborted and later calls are refused.
    if (comm::detail::failure_kind_of(rc) != comm::detail::comm_failure_kind::argument) state_->abort(message);
    comm::detail::throw_comm_failure(comm::detail::failure_kind_of(rc), message);
  }
  void cuda_call(std::string_view k, std::string_view name, cudaError_t rc) const {
    if (rc == cudaSuccess) return;
    comm::detail::check_cuda(rc, state_->describe(k), name);
  }
  /// Polls `ncclCommGetAsyncError` until a non-blocking call has been issued.
  void settle(std::string_view k, std::string_view name) const {
    const auto deadline = deadline_from_now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(state_->comm, &async);
      if (rc != ncclSuccess) fail_with(k, "ncclCommGetAsyncError", rc);
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) fail_with(k, name, async);
      if (deadline.passed()) {
        const std::string m = "meshlib: " + state_->describe(k) + ": " + std::string(name) +
                              " was not issued within the communicator's timeout (" +
                              std::to_string(state_->timeout_ms()) + " ms); the communicator was aborted";
        state_->abort(m, true);
        throw comm_timeout(m);
      }
      std::this_thread::yield();
    }
  }
  /// The first half of a split on a non-blocking parent: polls the parent until the split has
  /// left ncclInProgress there (then NCCL has written the new handle into `cell`), against the
  /// timeout, and returns the new handle. A failure reported on the parent aborts the parent (as
  /// any failed NCCL call does) and the half-made new communicator; a timeout leaks `cell`, which
  /// NCCL may still write.
  ncclComm_t settle_split(std::string_view k, int color, std::unique_ptr<ncclComm_t>& cell) const {
    const auto deadline = deadline_from_now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(state_->comm, &async);
      if (rc != ncclSuccess) {
        (void)cell.release();  // NCCL's state is unknown: the cell may still be written
        fail_with(k, "ncclCommGetAsyncError", rc);
      }
      if (async == ncclSuccess) break;
      if (async != ncclInProgress) {
        if (*cell != nullptr) (void)ncclCommAbort(*cell);
        fail_with(k, "ncclCommSplit", async);
      }
      if (deadline.passed()) {
        (void)cell.release();
        const std::string m = "meshlib: " + state_->describe(k) +
                              ": ncclCommSplit did not complete within the communicator's timeout (" +
                              std::to_string(state_->timeout_ms()) +
                              " ms); not every participant called split; the communicator was aborted";
        state_->abort(m, true);
        throw comm_timeout(m);
      }
      std::this_thread::yield();
    }
    if (*cell == nullptr)
      throw comm_error("meshlib: " + state_->describe(k) + ": ncclCommSplit completed (color " + std::to_string(color) +
                       ") but gave no new communicator (NULL); this NCCL does not fill the handle as meshlib expects (" +
                       comm::detail::nccl_versions_text(nccl_version()) + ")");
    return *cell;
  }
  static void settle_new(comm::detail::nccl_comm_state& s, const std::string& what, std::string_view name) {
    if (s.comm == nullptr)  // NCCL would answer ncclInvalidArgument ("comm argument is NULL"); say what happened
      throw comm_error("meshlib: " + what + ": " + std::string(name) +
                       " returned without a communicator (NULL); this NCCL does not fill the handle as meshlib expects (" +
                       comm::detail::nccl_versions_text(nccl_version()) + ")");
    const deadline_t deadline{s.options.timeout.count() > 0, std::chrono::steady_clock::now() + s.options.timeout};
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(s.comm, &async);
      if (rc != ncclSuccess) comm::detail::check_nccl(rc, what, "ncclCommGetAsyncError");
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) {
        const std::string last = ncclGetLastError(s.comm);
        (void)ncclCommAbort(s.comm);
        s.comm = nullptr;
        comm::detail::check_nccl(async, what, name, last.c_str());
      }
      if (deadline.passed()) {
        (void)ncclCommAbort(s.comm);
        s.comm = nullptr;
        throw comm_timeout("meshlib: " + what + ": " + std::string(name) + " did not complete within the timeout (" +
                           std::to_string(s.timeout_ms()) + " ms); not every participant joined the group");
      }
      std::this_thread::yield();
    }
  }
  /// The communicator's timeout from now; `passed()` is never true without a timeout. A flag and a
  /// time point, not an optional: GCC at -O1 warns that an optional's value may be read
  /// uninitialised (-Wmaybe-uninitialized), which -Werror turns into an error.
  struct deadline_t {
    bool timed;
    std::chrono::steady_clock::time_point at;
    [[nodiscard]] bool passed() const { return timed && std::chrono::steady_clock::now() > at; }
  };
  [[nodiscard]] deadline_t deadline_from_now() const {
    return {state_->options.timeout.count() > 0, std::chrono::steady_clock::now() + state_->options.timeout};
  }
  /// Runs the NCCL calls of `body` as one group (`ncclGroupStart`/`ncclGroupEnd`).
  template <class F>
  void group(std::string_view k, F&& body) const {
    call(k, "ncclGroupStart", ncclGroupStart());
    try {
      body();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    call(k, "ncclGroupEnd", ncclGroupEnd());
  }
  template <class T>
  void exchange_blocks(std::string_view k, const T* send, T* recv, std::size_t c, cudaStream_t s) const {
    group(k, [&] {
      for (int p = 0; p < size(); ++p) {
        const std::size_t off = static_cast<std::size_t>(p) * c;
        call(k, "ncclSend", ncclSend(send + off, c, nccl_datatype_of<T>, p, state_->comm, s));
        call(k, "ncclRecv", ncclRecv(recv + off, c, nccl_datatype_of<T>, p, state_->comm, s));
      }
    });
  }
  template <class T>
  void permute(std::string_view k, const T* send, T* recv, std::size_t n, std::span<const permute_pair> pairs,
               cudaStream_t s) const {
    const int me = rank();
    const permute_pair* incoming = nullptr;
    for (const auto& p : pairs)
      if (p.dest == me) incoming = &p;
    if (incoming == nullptr) {
      cuda_call(k, "cudaMemsetAsync", cudaMemsetAsync(recv, 0, n * sizeof(T), s));  // all-zero bits are 0 in every type
    } else if (incoming->source == me) {
      cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(recv, send, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
    }
    group(k, [&] {
      for (const auto& p : pairs) {
        if (p.source == p.dest) continue;
        if (p.source == me) call(k, "ncclSend", ncclSend(send, n, nccl_datatype_of<T>, p.dest, state_->comm, s));
        if (p.dest == me) call(k, "ncclRecv", ncclRecv(recv, n, nccl_datatype_of<T>, p.source, state_->comm, s));
      }
    });
  }
  /// Runs `body(copy)` with a stream-ordered device copy of buf (`cudaMallocAsync`, freed after).
  template <class T, class F>
  void with_copy(std::string_view k, std::span<T> buf, cudaStream_t s, F&& body) const {
    if (buf.empty()) {
      body(static_cast<const T*>(nullptr));
      return;
    }
    void* copy = nullptr;
    cuda_call(k, "cudaMallocAsync", cudaMallocAsync(&copy, buf.size_bytes(), s));
    struct release {
      void* p;
      cudaStream_t s;
      ~release() { (void)cudaFreeAsync(p, s); }
    } r{copy, s};
    cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(copy, buf.data(), buf.size_bytes(), cudaMemcpyDeviceToDevice, s));
    body(static_cast<const T*>(copy));
  }

  // ---- the front end's hooks ---------------------------------------------------------------------

  [[nodiscard]] std::string label() const { return "NCCL rank " + std::to_string(rank()); }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty nccl_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    state_->refuse_if_failed(state_->describe(k));
  }
  void ensure_usable(comm::detail::op_kind k) const { check_usable(comm::detail::op_name(k)); }
  /// A buffer of `elems` elements of T must be device memory of this GPU (stream_state's check).
  template <comm::detail::op_kind K, class T>
  void device_buffer(const char* name, const T* p, std::size_t elems) const {
    if (auto problem = state_->buffer_problem(name, p, elems * sizeof(T)); !problem.empty()) this->bad_argument(K, problem);
  }

  /// The NCCL transport of operation K, after the front end's checks.
  template <comm::detail::op_kind K, class T>
  request_type transport(const comm::detail::operation<T>& o, context_type ctx) {
    using comm::detail::op_kind;
    constexpr std::string_view k = comm::detail::op_name(K);
    const std::size_t n = static_cast<std::size_t>(size());
    const std::size_t c = o.count;
    const ncclDataType_t t = nccl_datatype_of<T>;
    const ncclRedOp_t r = to_nccl(o.op);
    auto fingerprint = [&](int root = -1, bool reducing = false) {
      return fp<T>(K, K == op_kind::all_to_all_v ? 0 : c, reducing ? std::optional(o.op) : std::nullopt, root);
    };
    if constexpr (K == op_kind::all_reduce) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(-1, true), [&](cudaStream_t s) {
        call(k, "ncclAllReduce", ncclAllReduce(o.send, o.recv, c, t, r, state_->comm, s));
      });
    } else if constexpr (K == op_kind::reduce) {
      device_buffer<K>("send", o.send, c);
      if (o.recv != nullptr) device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(o.root, true), [&](cudaStream_t s) {
        call(k, "ncclReduce", ncclReduce(o.send, o.recv, c, t, r, o.root, state_->comm, s));
      });
    } else if constexpr (K == op_kind::reduce_scatter) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(-1, true), [&](cudaStream_t s) {
        call(k, "ncclReduceScatter", ncclReduceScatter(o.send, o.recv, c, t, r, state_->comm, s));
      });
    } else if constexpr (K == op_kind::broadcast) {
      if (o.send != nullptr) device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(o.root), [&](cudaStream_t s) {
        call(k, "ncclBroadcast", ncclBroadcast(o.send, o.recv, c, t, o.root, state_->comm, s));
      });
    } else if constexpr (K == op_kind::all_gather) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c * n);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        call(k, "ncclAllGather", ncclAllGather(o.send, o.recv, c, t, state_->comm, s));
      });
    } else if constexpr (K == op_kind::all_to_all) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c * n);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        if (o.in_place)
          with_copy<T>(k, std::span<T>(o.recv, c * n), s, [&](const T* copy) { exchange_blocks<T>(k, copy, o.recv, c, s); });
        else
          exchange_blocks<T>(k, o.send, o.recv, c, s);
      });
    } else if constexpr (K == op_kind::all_to_all_v) {
      std::size_t send_end = 0;
      std::size_t recv_end = 0;
      for (std::size_t j = 0; j < n; ++j) {
        send_end = std::max(send_end, static_cast<std::size_t>(o.v[0][j] + o.v[1][j]));
        recv_end = std::max(recv_end, static_cast<std::size_t>(o.v[2][j] + o.v[3][j]));
      }
      device_buffer<K>("send", o.send, send_end);
      device_buffer<K>("receive", o.recv, recv_end);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        group(k, [&] {
          for (std::size_t j = 0; j < n; ++j) {
            const int p = static_cast<int>(j);
            if (o.v[0][j] > 0)
              call(k, "ncclSend", ncclSend(o.send + o.v[1][j], static_cast<std::size_t>(o.v[0][j]), t, p, state_->comm, s));
            if (o.v[2][j] > 0)
              call(k, "ncclRecv", ncclRecv(o.recv + o.v[3][j], static_cast<std::size_t>(o.v[2][j]), t, p, state_->comm, s));
          }
        });
      });
    } else if constexpr (K == op_kind::ppermute) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        if (o.in_place)
          with_copy<T>(k, std::span<T>(o.recv, c), s, [&](const T* copy) { permute<T>(k, copy, o.recv, c, o.pairs, s); });
        else
          permute<T>(k, o.send, o.recv, c, o.pairs, s);
      });
    } else if constexpr (K == op_kind::send || K == op_kind::recv) {
      if (o.tag != 0)
        this->bad_argument(K, "tag " + std::to_string(o.tag) +
                                  " given, but NCCL has no message tags; pass 0 (messages between two ranks match in order)");
      if constexpr (K == op_kind::send) {
        device_buffer<K>("send", o.send, c);
        return enqueue(k, ctx, std::nullopt, [&](cudaStream_t s) {
          call(k, "ncclSend", ncclSend(o.send, c, t, o.peer, state_->comm, s));
        });
      } else {
        device_buffer<K>("receive", o.recv, c);
        return enqueue(k, ctx, std::nullopt, [&](cudaStream_t s) {
          call(k, "ncclRecv", ncclRecv(o.recv, c, t, o.peer, state_->comm, s));
        });
      }
    } else {
      static_assert(K == op_kind::barrier);
      return enqueue(k, ctx, comm::detail::call_fingerprint{}, [&](cudaStream_t s) {
        call(k, "ncclAllReduce", ncclAllReduce(state_->scratch, state_->scratch, 1, ncclInt32, ncclSum, state_->comm, s));
      });
    }
  }

  std::shared_ptr<comm::detail::nccl_comm_state> state_;
};

static_assert(communicator<nccl_communicator>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief What the two device communicators' participants have in common: a GPU, a stream (owned
/// or borrowed), a pool of completion events, options, and the failure that refuses later calls.
/// The base of `nccl_comm_state` and `shared_gpu_state` (the `Channel`s of their requests).

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>

#include <atomic>
#include <concepts>
#include <type_traits>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib/comm/timeout.hpp"

namespace meshlib {

/// @brief The execution context of the device communicators: the CUDA stream an operation is
/// enqueued on. Default-constructed it means "the communicator's own stream"; it converts from a
/// `cudaStream_t` and from any execution-space instance with `cuda_stream()` (`Kokkos::Cuda`),
/// without meshlib including Kokkos' CUDA headers.
class cuda_stream_ref {
 public:
  /// The communicator's bound stream.
  constexpr cuda_stream_ref() noexcept = default;
  /// `s` (`nullptr` is CUDA's legacy default stream, not "unset").
  constexpr cuda_stream_ref(cudaStream_t s) noexcept : stream_(s), given_(true) {}  // NOLINT: implicit, as a stream
  /// The stream of a Kokkos CUDA execution-space instance (anything with `cuda_stream()`).
  template <class Exec>
    requires(!std::same_as<std::remove_cvref_t<Exec>, cuda_stream_ref>) && requires(const Exec& e) {
      { e.cuda_stream() } -> std::convertible_to<cudaStream_t>;
    }
  cuda_stream_ref(const Exec& exec) : cuda_stream_ref(static_cast<cudaStream_t>(exec.cuda_stream())) {}  // NOLINT

  /// Whether a stream was given.
  [[nodiscard]] constexpr bool given() const noexcept { return given_; }
  /// The given stream, or `fallback` when none was.
  [[nodiscard]] constexpr cudaStream_t or_else(cudaStream_t fallback) const noexcept { return given_ ? stream_ : fallback; }

 private:
  cudaStream_t stream_ = nullptr;
  bool given_ = false;
};

/// @brief Options of the device communicators (`nccl_communicator`, `shared_gpu_communicator`).
struct nccl_comm_options {
  /// The GPU of this participant; negative: the calling thread's current device.
  int device = -1;
  /// The stream the communicator is bound to; unset: a new non-blocking stream it owns.
  cuda_stream_ref stream{};
  /// How long `wait()` lets an operation run before the communicator is aborted with
  /// `comm_timeout`. Zero or negative: no deadline.
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// Check with `cudaPointerGetAttributes` that every buffer is device memory of this GPU (a host
  /// pointer would otherwise crash a kernel). About 0.2 us a buffer; off for measured code.
  bool check_pointers = true;
  /// NCCL communicator: check that every rank made the same collectives (operation, type, count,
  /// reduce op, root), so that ranks that disagree get `collective_mismatch` naming the call's
  /// number and each rank's call instead of a hang and a timeout. On by default (issue 40): the
  /// fingerprints of the calls are all-gathered on the stream, each of the first
  /// `verify_each_first` calls before its data moves, then `verify_every` calls at a time
  /// (`detail::call_batch` says why and what a batch leaves to the timeout), so the check costs
  /// one small all-gather and two tiny copies per batch (several microseconds), under 1 us per
  /// call at the default batch (docs/gpu.md). Every rank must use the same three settings. The
  /// shared-GPU communicator always checks every call, on its host rendezvous, whatever these say.
  bool verify_collectives = true;
  /// NCCL communicator: how many collectives one check covers after the first
  /// `verify_each_first` (1: every call checked before it runs, as before issue 40).
  std::size_t verify_every = 16;
  /// NCCL communicator: how many of a communicator's first collectives are each checked on their own.
  std::size_t verify_each_first = 64;
};

namespace comm::detail {

/// Makes `device` the calling thread's current CUDA device for a scope.
class cuda_device_scope {
 public:
  cuda_device_scope(int device, std::string_view what) {
    check_cuda(cudaGetDevice(&previous_), what, "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), what, "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~cuda_device_scope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;

 private:
  int previous_ = 0;
};

/// The same, for destructors: never throws, does nothing without a device.
struct cuda_device_scope_noexcept {
  int previous = -1;
  explicit cuda_device_scope_noexcept(int d) noexcept {
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    else if (previous != d) (void)cudaSetDevice(d);
  }
  ~cuda_device_scope_noexcept() {
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
  cuda_device_scope_noexcept(const cuda_device_scope_noexcept&) = delete;
  cuda_device_scope_noexcept& operator=(const cuda_device_scope_noexcept&) = delete;
};

/// What is wrong with a buffer that must be device (or managed) memory of GPU `device`, or empty:
/// a host pointer would crash a kernel instead of failing.
[[nodiscard]] inline std::string device_buffer_problem(std::string_view name, const void* p, std::size_t bytes, int device) {
  if (bytes == 0) return {};
  cudaPointerAttributes a{};
  const cudaError_t rc = cudaPointerGetAttributes(&a, p);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string(name) + " buffer is not memory CUDA knows (" + cuda_error_text(rc) +
           "); device communicators move device memory";
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return std::string(name) + " buffer is host memory; NCCL moves device memory (cudaMalloc, or a Kokkos::CudaSpace view)";
  if (a.type == cudaMemoryTypeDevice && a.device != device)
    return std::string(name) + " buffer is on GPU " + std::to_string(a.device) + ", not on this rank's GPU " +
           std::to_string(device);
  return {};
}

/// A participant's GPU, stream, events, options and failure.
struct stream_state {
  using event_type = cudaEvent_t;

  int device = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<void> stream_owner;  ///< holds a stream this participant (or its parent) created
  nccl_comm_options options;
  std::vector<cudaEvent_t> free_events;

  mutable std::mutex mutex;  ///< guards the failure (and the NCCL communicator) against abort() from another thread
  std::atomic<bool> failed{false};
  bool failed_by_timeout = false;
  std::string failure;

  stream_state() = default;
  stream_state(const stream_state&) = delete;
  stream_state& operator=(const stream_state&) = delete;
  ~stream_state() {
    cuda_device_scope_noexcept g(device);
    for (cudaEvent_t e : free_events) (void)cudaEventDestroy(e);
  }

  [[nodiscard]] long long timeout_ms() const noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout).count();
  }
  /// Records the root cause (without its "meshlib: " prefix); false when one was recorded already.
  bool record_failure(const std::string& reason, bool by_timeout) {
    if (failed.load()) return false;
    constexpr std::string_view prefix = "meshlib: ";
    failure = std::string_view(reason).starts_with(prefix) ? reason.substr(prefix.size()) : reason;
    failed_by_timeout = by_timeout;
    failed.store(true);
    return true;
  }
  /// What is wrong with a buffer of `bytes` bytes for this participant (`device_buffer_problem` on
  /// its GPU), or empty; always empty when `options.check_pointers` is off. Both device
  /// communicators' transports call this one check before they touch a pointer.
  [[nodiscard]] std::string buffer_problem(std::string_view name, const void* p, std::size_t bytes) const {
    if (!options.check_pointers) return {};
    return device_buffer_problem(name, p, bytes, device);
  }
  /// Throws the refusal of operation `where` when the participant has failed.
  void refuse_if_failed(const std::string& where) const {
    if (!failed.load()) return;
    std::lock_guard lock(mutex);
    const std::string m = "meshlib: refused " + where + ": the communicator has failed: " + failure;
    if (failed_by_timeout) throw comm_timeout(m);
    throw comm_aborted(m);
  }
  cudaEvent_t acquire_event(std::string_view what) {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what, "cudaEventCreateWithFlags");
    return e;
  }
  void release(cudaEvent_t e) noexcept {
    try {
      free_events.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }
};

}  // namespace comm::detail
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

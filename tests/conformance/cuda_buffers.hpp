// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The conformance kit's buffer policy for device communicators (conformance.hpp, `host_buffers`):
// every value row runs on cudaMalloc'ed buffers of the communicator's GPU, filled and read back
// on the communicator's stream, so that the rows are the kit's own, not a copy of them.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace conformance {

/// Throws with CUDA's text when `rc` is not cudaSuccess (a test failure, not a backend error).
inline void cuda_or_throw(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string("conformance (cuda_buffers): ") + call + " failed: " + cudaGetErrorName(rc) +
                             ": " + cudaGetErrorString(rc));
}

/// @brief Device buffers for communicators with `stream()` and `device()` (nccl_communicator,
/// shared_gpu_communicator).
struct cuda_buffers {
  /// One device array. `get()` first synchronises the stream: the kit drops some requests without
  /// wait(), and a device collective is complete for this participant when its stream passes it
  /// (the shared-GPU communicator's stream also waits for its peers' shares of the work).
  template <class T>
  class buffer {
   public:
    buffer(int device, cudaStream_t stream, const std::vector<T>& values)
        : device_(device), stream_(stream), n_(values.size()) {
      cuda_or_throw(cudaSetDevice(device_), "cudaSetDevice");
      // One byte more, so that an empty buffer still has a distinct, non-null device pointer.
      cuda_or_throw(cudaMalloc(reinterpret_cast<void**>(&p_), n_ * sizeof(T) + 1), "cudaMalloc");
      if (n_ != 0)
        cuda_or_throw(cudaMemcpyAsync(p_, values.data(), n_ * sizeof(T), cudaMemcpyHostToDevice, stream_),
                      "cudaMemcpyAsync (host to device)");
      cuda_or_throw(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
    }
    buffer(buffer&& o) noexcept : device_(o.device_), stream_(o.stream_), n_(o.n_), p_(std::exchange(o.p_, nullptr)) {}
    buffer(const buffer&) = delete;
    buffer& operator=(const buffer&) = delete;
    buffer& operator=(buffer&&) = delete;
    ~buffer() {
      if (p_ == nullptr) return;
      // Every operation on this stream waited for the peers' shares (reading or writing this
      // buffer) before it completes: once the stream is idle, no one uses the memory.
      (void)cudaSetDevice(device_);
      (void)cudaStreamSynchronize(stream_);
      (void)cudaFree(p_);
    }
    std::span<T> span() { return {p_, n_}; }
    std::span<const T> cspan() const { return {p_, n_}; }
    std::vector<T> get() const {
      std::vector<T> v(n_);
      cuda_or_throw(cudaSetDevice(device_), "cudaSetDevice");
      if (n_ != 0)
        cuda_or_throw(cudaMemcpyAsync(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost, stream_),
                      "cudaMemcpyAsync (device to host)");
      cuda_or_throw(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
      return v;
    }

   private:
    int device_;
    cudaStream_t stream_;
    std::size_t n_;
    T* p_ = nullptr;
  };

  template <class T, class Comm>
  static buffer<T> make(Comm& c, const std::vector<T>& values) {
    return buffer<T>(c.device(), c.stream(), values);
  }
  /// NCCL's send completes only when the peer receives (and the shared-GPU send waits for the
  /// receiver's event): the kit orders the ring.
  static constexpr bool buffered_sends = false;
  /// NCCL has no message tags: 0 is the only one it accepts.
  static constexpr int tag = 0;
};

}  // namespace conformance

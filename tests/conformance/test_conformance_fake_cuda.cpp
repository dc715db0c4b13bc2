// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The conformance kit's mismatch rows on the shared-GPU communicator over a fake CUDA runtime, so
// that the always-on mismatch check of the device communicators is tested on every machine, not
// only where a GPU is (tests/conformance/test_conformance_device.cpp runs the same rows on one).
//
// The fake: this executable defines the CUDA runtime functions that the shared-GPU communicator
// and the kit's device buffers call (cuda_buffers.hpp), so the linker binds them here rather than
// to libcudart (which stays linked for the rest). "Device memory" is host memory that the fake
// knows (so cudaPointerGetAttributes can tell it from a host pointer), copies and sets run at once
// (every participant's work lies between two host rendezvous, so doing it eagerly is one legal
// schedule of the stream), events are complete when recorded. The reduction kernel (NVRTC) is not
// faked: the rows that matter here fail before any data moves, which is the point of the check.
#include <cuda_runtime_api.h>

#include <meshlib/nccl.hpp>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "cuda_buffers.hpp"
#include "meshlib_catch.hpp"

struct CUstream_st {
  int device = 0;
};
struct CUevent_st {
  int recorded = 0;
};

namespace fake {

/// The allocations the fake knows, by start address (so an interior pointer is found too).
struct memory {
  std::mutex m;
  std::map<const char*, std::size_t> blocks;
  int bad_frees = 0;
  int live_events = 0;

  void* allocate(std::size_t bytes) {
    char* p = static_cast<char*>(std::malloc(bytes == 0 ? 1 : bytes));
    std::lock_guard g(m);
    blocks[p] = bytes;
    return p;
  }
  cudaError_t release(void* p) {
    if (p == nullptr) return cudaSuccess;
    std::lock_guard g(m);
    auto it = blocks.find(static_cast<const char*>(p));
    if (it == blocks.end()) {
      ++bad_frees;  // a double free or a free of the caller's memory: what the fake exists to catch
      return cudaErrorInvalidValue;
    }
    blocks.erase(it);
    std::free(p);
    return cudaSuccess;
  }
  bool knows(const void* p) {
    std::lock_guard g(m);
    const auto* c = static_cast<const char*>(p);
    auto it = blocks.upper_bound(c);
    if (it == blocks.begin()) return false;
    --it;
    return c < it->first + (it->second == 0 ? 1 : it->second);
  }
};
memory& mem() {
  static memory m;
  return m;
}
thread_local int current_device = 0;

}  // namespace fake

extern "C" {
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = fake::current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  fake::current_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t) { return "cudaErrorFake"; }
const char* cudaGetErrorString(cudaError_t) { return "an error of the fake CUDA runtime"; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned int) {
  *s = new CUstream_st{};
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t s) {
  delete s;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  *e = new CUevent_st{};
  std::lock_guard g(fake::mem().m);
  ++fake::mem().live_events;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
  ++e->recorded;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
  delete e;
  std::lock_guard g(fake::mem().m);
  --fake::mem().live_events;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = fake::mem().allocate(bytes);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) { return fake::mem().release(p); }
cudaError_t cudaMallocAsync(void** p, size_t bytes, cudaStream_t) { return cudaMalloc(p, bytes); }
cudaError_t cudaFreeAsync(void* p, cudaStream_t) { return fake::mem().release(p); }
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned int) {
  *p = std::malloc(bytes == 0 ? 1 : bytes);
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* to, const void* from, size_t bytes, enum cudaMemcpyKind, cudaStream_t) {
  if (bytes != 0) std::memmove(to, from, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  if (bytes != 0) std::memset(p, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(struct cudaPointerAttributes* a, const void* p) {
  *a = cudaPointerAttributes{};
  a->type = fake::mem().knows(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
  a->device = 0;
  return cudaSuccess;
}
}  // extern "C"

namespace {

using clk = std::chrono::steady_clock;
namespace ml = meshlib;

/// Runs `body` on `n` shared-GPU devices of the fake GPU and records what each one saw.
std::vector<conformance::outcome> run_devices(int n, const std::function<void(ml::shared_gpu_communicator&)>& body) {
  std::vector<conformance::outcome> seen(static_cast<std::size_t>(n));
  const auto t0 = clk::now();
  try {
    ml::run_on_shared_gpu(
        n,
        [&](ml::shared_gpu_communicator& c) {
          auto& mine = seen[static_cast<std::size_t>(c.rank())];
          try {
            body(c);
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
          } catch (...) {
            mine = conformance::classify(std::current_exception());
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
            throw;
          }
        },
        {.device = 0});
  } catch (const ml::participant_error&) {
  }
  return seen;
}

}  // namespace

TEST_CASE("fake CUDA: the fake knows its memory and frees each block once", "[conformance][shared_gpu][fake]") {
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
  CHECK(fake::mem().knows(static_cast<char*>(p) + 15));
  int host = 0;
  CHECK_FALSE(fake::mem().knows(&host));
  CHECK(cudaFree(p) == cudaSuccess);
  const int before = fake::mem().bad_frees;
  CHECK(cudaFree(p) == cudaErrorInvalidValue);
  CHECK(fake::mem().bad_frees == before + 1);
}

// The kit's own table (conformance.hpp): the same rows, words and bounds as on the GPU.
TEST_CASE("shared GPU on a fake CUDA runtime: the conformance mismatch rows, 2 and 4 devices",
          "[conformance][shared_gpu][fake]") {
  using comm = ml::shared_gpu_communicator;
  const int bad_frees = fake::mem().bad_frees;
  for (int n : {2, 4})
    for (const auto& row : conformance::mismatch_rows<comm, conformance::cuda_buffers>()) {
      const auto seen = run_devices(n, row.body);
      for (int r = 0; r < n; ++r) {
        INFO(row.name << ", " << n << " fake shared-GPU devices, device " << r);
        CHECK(row.check(r, n, seen[static_cast<std::size_t>(r)]) == "");
      }
    }
  CHECK(fake::mem().bad_frees == bad_frees);
}

// Issue 40 §3: two devices that call all_reduce with different counts do not hang: each gets
// collective_mismatch naming both devices and both calls, before anything moves.
TEST_CASE("shared GPU on a fake CUDA runtime: all_reduce of 8 and of 4 floats names both devices and calls",
          "[conformance][shared_gpu][fake]") {
  const auto seen = run_devices(2, [](ml::shared_gpu_communicator& c) {
    auto x = conformance::cuda_buffers::make(c, std::vector<float>(c.rank() == 0 ? 8 : 4, 1.0f));
    c.all_reduce(x.span(), ml::reduce_op::sum);
  });
  for (int r = 0; r < 2; ++r) {
    INFO("device " << r);
    const auto& o = seen[static_cast<std::size_t>(r)];
    CHECK(o.type == "mismatch");
    CHECK(o.what == "meshlib: collective mismatch on the devices of GPU 0 (seen by device " + std::to_string(r) +
                        "): device 0 called all_reduce(float32, count 8, op sum); device 1 called all_reduce(float32, "
                        "count 4, op sum)");
    CHECK(o.seconds < conformance::prompt_s);
  }
}

// The fake itself moves data as the GPU would, so agreeing calls complete with the right values
// (a fake that failed every call would pass the mismatch rows for the wrong reason).
TEST_CASE("shared GPU on a fake CUDA runtime: agreeing broadcast and all_gather move the data", "[conformance][shared_gpu][fake]") {
  const auto seen = run_devices(3, [](ml::shared_gpu_communicator& c) {
    auto b = conformance::cuda_buffers::make(c, std::vector<int>(5, c.rank() == 1 ? 7 : 0));
    c.broadcast(b.span(), 1).wait();
    if (b.get() != std::vector<int>(5, 7)) throw std::runtime_error("broadcast: wrong values");
    auto mine = conformance::cuda_buffers::make(c, std::vector<int>(2, c.rank() + 1));
    auto all = conformance::cuda_buffers::make(c, std::vector<int>(6, 0));
    c.all_gather(mine.cspan(), all.span()).wait();
    if (all.get() != std::vector<int>{1, 1, 2, 2, 3, 3}) throw std::runtime_error("all_gather: wrong values");
  });
  for (const auto& o : seen) CHECK(o.type == "");
}

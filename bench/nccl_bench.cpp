// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// nccl-tests style table for meshlib's NCCL communicator, against raw NCCL in the same run.
//
//   nccl_bench [--min-bytes B] [--max-bytes B] [--gpus N]
//
// One rank per GPU (the first N visible, default all), one thread each (run_on_gpus). For
// all_reduce, all_gather and reduce_scatter at every power-of-two size from --min-bytes (8) to
// --max-bytes (1 GiB), it prints: size (nccl-tests' convention: all_reduce the buffer, all_gather
// the gathered result, reduce_scatter the input), the time of one meshlib call, algbw = size / time,
// busbw = algbw * the op's bus factor (all_reduce 2(n-1)/n, the others (n-1)/n: 0 on one GPU,
// where NCCL only copies), the time of the raw NCCL call on the same communicator and stream, and
// meshlib / raw bandwidth. The ceiling is cudaMemcpy device-to-device bandwidth at each size.
// Then the wrapper overhead at 8 B: microseconds per call, enqueued back to back (throughput) and
// with a wait after each (latency), meshlib (default options: pointer checks and the batched mismatch
// check on) against ncclAllReduce, and the same enqueue loop with the mismatch check off.
// Without a CUDA device it prints "SKIP: no CUDA device (...)" and exits with 77. Bad options
// (bench/bench_options.hpp) end it with a message and exit status 2.
#include <cstddef>

#include "bench_options.hpp"

namespace {

struct options {
  std::size_t min_bytes = 8, max_bytes = std::size_t{1} << 30;
  int gpus = -1;  ///< -1: every visible GPU
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("nccl_bench", "usage: nccl_bench [--min-bytes B] [--max-bytes B] [--gpus N]\n", argc, argv);
  options o;
  o.min_bytes = cl.bytes("--min-bytes", "8");
  o.max_bytes = cl.bytes("--max-bytes", "1G");
  if (o.min_bytes > o.max_bytes)
    cl.fail("--min-bytes " + std::to_string(o.min_bytes) + " is more than --max-bytes " + std::to_string(o.max_bytes));
  o.gpus = static_cast<int>(cl.integer("--gpus", -1, 1, 1024));
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <cuda_runtime_api.h>

#include <meshlib/nccl.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <string>
#include <vector>

namespace ml = meshlib;

namespace {

void ok(cudaError_t rc, const char* what) {
  if (rc != cudaSuccess) {
    std::fprintf(stderr, "nccl_bench: %s: %s\n", what, cudaGetErrorString(rc));
    std::exit(1);
  }
}
void ok(ncclResult_t rc, const char* what) {
  if (rc != ncclSuccess && rc != ncclInProgress) {
    std::fprintf(stderr, "nccl_bench: %s: %s\n", what, ncclGetErrorString(rc));
    std::exit(1);
  }
}

int iterations_for(std::size_t bytes) {
  // About 1 GiB of traffic per measurement, at least 5 and at most 200 calls.
  const std::size_t it = (std::size_t{1} << 30) / std::max<std::size_t>(bytes, 1);
  return static_cast<int>(std::clamp<std::size_t>(it, 5, 200));
}

/// Seconds per call of `enqueue`, timed with events on `s` after `warmup` untimed calls.
double time_on_stream(cudaStream_t s, int iters, const std::function<void()>& enqueue) {
  for (int i = 0; i < 3; ++i) enqueue();
  cudaEvent_t a = nullptr;
  cudaEvent_t b = nullptr;
  ok(cudaEventCreate(&a), "cudaEventCreate");
  ok(cudaEventCreate(&b), "cudaEventCreate");
  ok(cudaEventRecord(a, s), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) enqueue();
  ok(cudaEventRecord(b, s), "cudaEventRecord");
  ok(cudaEventSynchronize(b), "cudaEventSynchronize");
  float ms = 0;
  ok(cudaEventElapsedTime(&ms, a, b), "cudaEventElapsedTime");
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return ms * 1e-3 / iters;
}

/// Host seconds per call of `f` over `iters` calls, after `s` drains.
double time_on_host(cudaStream_t s, int iters, const std::function<void()>& f) {
  for (int i = 0; i < 10; ++i) f();
  ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) f();
  ok(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_options(argc, argv);
  const std::size_t min_bytes = opt.min_bytes, max_bytes = opt.max_bytes;
  const int want = opt.gpus;
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    std::printf("SKIP: no CUDA device (cudaGetDeviceCount: %s)\n", cudaGetErrorString(rc));
    return 77;
  }
  const int n = want > 0 ? std::min(want, count) : count;
  std::vector<int> gpus(static_cast<std::size_t>(n));
  std::iota(gpus.begin(), gpus.end(), 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int nccl_version = 0;
  ncclGetVersion(&nccl_version);
  std::printf("# nccl_bench: %d rank(s), one per GPU (%s), NCCL %d, float32, times per call\n", n, prop.name, nccl_version);

  // Default options, pointer checks included: what a user's call costs.
  ml::nccl_comm_options options;
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) {
    const bool lead = c.rank() == 0;
    const cudaStream_t s = c.stream();
    const std::size_t nr = static_cast<std::size_t>(n);
    // One buffer pair, large enough for every op at max_bytes.
    float* a = nullptr;
    float* b = nullptr;
    ok(cudaMalloc(&a, max_bytes + 64), "cudaMalloc");
    ok(cudaMalloc(&b, max_bytes + 64), "cudaMalloc");
    ok(cudaMemset(a, 0, max_bytes + 64), "cudaMemset");
    ok(cudaMemset(b, 0, max_bytes + 64), "cudaMemset");

    struct op_row {
      const char* name;
      double bus;  // bus bandwidth factor
    };
    const op_row ops[] = {{"all_reduce", 2.0 * (n - 1) / n}, {"all_gather", double(n - 1) / n},
                          {"reduce_scatter", double(n - 1) / n}};
    if (lead)
      std::printf("\n%-14s %12s %10s %10s %10s %10s %8s %12s\n", "op", "size(B)", "time(us)", "algbw(GB/s)",
                  "busbw(GB/s)", "raw(us)", "vs raw", "memcpy(GB/s)");
    for (const op_row& op : ops) {
      for (std::size_t bytes = min_bytes; bytes <= max_bytes; bytes *= 2) {
        const std::size_t elems = bytes / sizeof(float);
        const std::size_t per_rank = elems / nr;  // all_gather: sent; reduce_scatter: received
        if (elems == 0 || (std::string(op.name) != "all_reduce" && per_rank == 0)) continue;
        const int iters = iterations_for(bytes);
        std::function<void()> mine;
        std::function<void()> raw;
        if (std::string(op.name) == "all_reduce") {
          mine = [&] { (void)c.all_reduce(std::span<const float>(a, elems), std::span<float>(b, elems), ml::reduce_op::sum); };
          raw = [&] { ok(ncclAllReduce(a, b, elems, ncclFloat32, ncclSum, c.native(), s), "ncclAllReduce"); };
        } else if (std::string(op.name) == "all_gather") {
          mine = [&] { (void)c.all_gather(std::span<const float>(a, per_rank), std::span<float>(b, per_rank * nr)); };
          raw = [&] { ok(ncclAllGather(a, b, per_rank, ncclFloat32, c.native(), s), "ncclAllGather"); };
        } else {
          mine = [&] {
            (void)c.reduce_scatter(std::span<const float>(a, per_rank * nr), std::span<float>(b, per_rank), ml::reduce_op::sum);
          };
          raw = [&] { ok(ncclReduceScatter(a, b, per_rank, ncclFloat32, ncclSum, c.native(), s), "ncclReduceScatter"); };
        }
        c.barrier().wait();
        const double t_raw = time_on_stream(s, iters, raw);
        c.barrier().wait();
        const double t_mine = time_on_stream(s, iters, mine);
        if (lead) {
          const double memcpy_t = time_on_stream(s, iters, [&] {
            ok(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync");
          });
          const double algbw = static_cast<double>(bytes) / t_mine / 1e9;
          std::printf("%-14s %12zu %10.2f %10.2f %10.2f %10.2f %8.3f %12.2f\n", op.name, bytes, t_mine * 1e6, algbw,
                      algbw * op.bus, t_raw * 1e6, t_raw / t_mine, static_cast<double>(bytes) / memcpy_t / 1e9);
          std::fflush(stdout);
        }
      }
    }

    // Wrapper overhead at 8 B (2 floats).
    const int iters = 20000;
    auto raw8 = [&] { ok(ncclAllReduce(a, b, 2, ncclFloat32, ncclSum, c.native(), s), "ncclAllReduce"); };
    auto mine8 = [&] { (void)c.all_reduce(std::span<const float>(a, 2), std::span<float>(b, 2), ml::reduce_op::sum); };
    c.barrier().wait();
    const double h_raw = time_on_host(s, iters, raw8);
    c.barrier().wait();
    const double h_mine = time_on_host(s, iters, mine8);
    c.barrier().wait();
    const double l_raw = time_on_host(s, 2000, [&] { raw8(); ok(cudaStreamSynchronize(s), "sync"); });
    c.barrier().wait();
    const double l_mine = time_on_host(s, 2000, [&] { c.all_reduce(std::span<const float>(a, 2), std::span<float>(b, 2), ml::reduce_op::sum).wait(); });
    if (lead) {
      std::printf("\n# wrapper overhead, all_reduce of 8 B (target: at most 2 us per call over raw ncclAllReduce)\n");
      std::printf("%-34s %12s %12s %12s\n", "", "meshlib(us)", "raw(us)", "overhead(us)");
      std::printf("%-34s %12.3f %12.3f %12.3f\n", "enqueue back to back (per call)", h_mine * 1e6, h_raw * 1e6,
                  (h_mine - h_raw) * 1e6);
      std::printf("%-34s %12.3f %12.3f %12.3f\n", "call + wait (latency)", l_mine * 1e6, l_raw * 1e6, (l_mine - l_raw) * 1e6);
    }
    cudaFree(a);
    cudaFree(b);
  }, options);
  // The cost of the default-on mismatch check (issue 40: target at most 1 us per call at 8 B):
  // the same enqueue loop with the check off. Its first verify_each_first calls are each checked,
  // so the loops above ran long past them; the difference is the batched steady state.
  ml::nccl_comm_options unchecked = options;
  unchecked.verify_collectives = false;
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) {
    float* a = nullptr;
    float* b = nullptr;
    ok(cudaMalloc(&a, 64), "cudaMalloc");
    ok(cudaMalloc(&b, 64), "cudaMalloc");
    const cudaStream_t s = c.stream();
    auto mine8 = [&] { (void)c.all_reduce(std::span<const float>(a, 2), std::span<float>(b, 2), ml::reduce_op::sum); };
    c.barrier().wait();
    const double h_off = time_on_host(s, 20000, mine8);
    if (c.rank() == 0)
      std::printf("%-34s %12.3f   (the row 'enqueue back to back' minus this: the mismatch check's cost per call)\n",
                  "enqueue, mismatch check off", h_off * 1e6);
    cudaFree(a);
    cudaFree(b);
  }, unchecked);
  if (n < 2)
    std::printf("\n# one GPU: NCCL copies within it, so busbw is 0 by definition; several ranks need several GPUs\n");

  // Several mesh devices sharing GPU 0: all_reduce against the device-to-device copy of the same
  // size (target: algbw at least 0.7x the copy's at 256 MiB).
  std::printf("\n# several mesh devices on GPU 0 (shared_gpu_communicator), all_reduce float32, in place\n");
  std::printf("%8s %12s %10s %12s %12s %8s\n", "devices", "size(B)", "time(us)", "algbw(GB/s)", "memcpy(GB/s)", "ratio");
  for (int devices : {2, 4}) {
    for (std::size_t bytes : {std::size_t{1} << 20, std::size_t{16} << 20, std::size_t{256} << 20}) {
      if (bytes > max_bytes) continue;
      const std::size_t elems = bytes / sizeof(float);
      const int iters = iterations_for(bytes);
      double t = 0;
      double copy = 0;
      ml::run_on_shared_gpu(devices, [&](ml::shared_gpu_communicator& c) {
        float* x = nullptr;
        ok(cudaMalloc(&x, bytes), "cudaMalloc");
        ok(cudaMemset(x, 0, bytes), "cudaMemset");
        const cudaStream_t s = c.stream();
        c.barrier().wait();
        const double mine = time_on_stream(s, iters, [&] { (void)c.all_reduce(std::span<float>(x, elems), ml::reduce_op::sum); });
        c.barrier().wait();
        if (c.rank() == 0) {
          float* y = nullptr;
          ok(cudaMalloc(&y, bytes), "cudaMalloc");
          copy = time_on_stream(s, iters, [&] { ok(cudaMemcpyAsync(y, x, bytes, cudaMemcpyDeviceToDevice, s), "cudaMemcpyAsync"); });
          cudaFree(y);
          t = mine;
        }
        c.barrier().wait();
        cudaFree(x);
      }, {.device = 0});
      const double algbw = static_cast<double>(bytes) / t / 1e9;
      const double cbw = static_cast<double>(bytes) / copy / 1e9;
      std::printf("%8d %12zu %10.2f %12.2f %12.2f %8.3f\n", devices, bytes, t * 1e6, algbw, cbw, algbw / cbw);
    }
  }
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

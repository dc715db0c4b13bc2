// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The NCCL communicator on real GPUs: every operation against results computed on the host, over
// one rank per visible GPU (one rank on a one-GPU machine), through run_on_gpus. Skipped (see
// device_main.cpp) where no CUDA device is.
#include <cuda_runtime_api.h>

#include <meshlib/nccl.hpp>

#include <cstdint>
#include <cstring>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace ml = meshlib;
using meshlib_test::message_of;

namespace {

int gpu_count() {
  int n = 0;
  (void)cudaGetDeviceCount(&n);
  return n;
}
std::vector<int> all_gpus() {
  std::vector<int> d(static_cast<std::size_t>(gpu_count()));
  std::iota(d.begin(), d.end(), 0);
  return d;
}

void cuda_ok(cudaError_t rc) {
  if (rc != cudaSuccess) throw std::runtime_error(std::string("CUDA: ") + cudaGetErrorString(rc));
}

/// A device array on the current GPU, filled from and read back to the host on a stream.
template <class T>
struct device_array {
  T* p = nullptr;
  std::size_t n = 0;
  explicit device_array(std::size_t count) : n(count) { cuda_ok(cudaMalloc(&p, count * sizeof(T) + 1)); }
  device_array(const std::vector<T>& v, cudaStream_t s) : device_array(v.size()) { put(v, s); }
  ~device_array() { (void)cudaFree(p); }
  device_array(const device_array&) = delete;
  device_array& operator=(const device_array&) = delete;
  void put(const std::vector<T>& v, cudaStream_t s) {
    cuda_ok(cudaMemcpyAsync(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice, s));
    cuda_ok(cudaStreamSynchronize(s));
  }
  std::vector<T> get(cudaStream_t s) const {
    std::vector<T> v(n);
    cuda_ok(cudaMemcpyAsync(v.data(), p, n * sizeof(T), cudaMemcpyDeviceToHost, s));
    cuda_ok(cudaStreamSynchronize(s));
    return v;
  }
  std::span<T> span() { return {p, n}; }
  std::span<const T> cspan() const { return {p, n}; }
};

/// The value rank r holds at index i in every test: distinct over ranks and indices, exact in float.
double value(int r, std::size_t i) { return static_cast<double>(r * 1000 + static_cast<int>(i % 997)); }

}  // namespace

/// Every collective of communicator `c` (n participants) against results computed on the host.
template <class Comm>
void check_collectives(Comm& c, int n) {
  constexpr std::size_t count = 4096;
  {
    const int r = c.rank();
    const cudaStream_t s = c.stream();
    std::vector<float> mine(count);
    for (std::size_t i = 0; i < count; ++i) mine[i] = static_cast<float>(value(r, i));

    // all_reduce sum, max and avg (ncclAvg), out of place and in place
    device_array<float> send(mine, s), recv(count);
    c.all_reduce(send.cspan(), recv.span(), ml::reduce_op::sum).wait();
    auto got = recv.get(s);
    for (std::size_t i = 0; i < count; ++i) {
      double e = 0;
      for (int q = 0; q < n; ++q) e += value(q, i);
      REQUIRE(got[i] == static_cast<float>(e));
    }
    c.all_reduce(send.span(), ml::reduce_op::max).wait();
    got = send.get(s);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(got[i] == static_cast<float>(value(n - 1, i)));
    send.put(mine, s);
    c.all_reduce(send.cspan(), recv.span(), ml::reduce_op::mean).wait();
    got = recv.get(s);
    for (std::size_t i = 0; i < count; ++i) {
      double e = 0;
      for (int q = 0; q < n; ++q) e += value(q, i);
      REQUIRE(got[i] == Approx(e / n));
    }

    // reduce to the last rank
    c.reduce(send.cspan(), recv.span(), ml::reduce_op::min, n - 1).wait();
    if (r == n - 1) {
      got = recv.get(s);
      for (std::size_t i = 0; i < count; ++i) REQUIRE(got[i] == static_cast<float>(value(0, i)));
    }

    // broadcast from rank 0
    c.broadcast(send.cspan(), recv.span(), 0).wait();
    got = recv.get(s);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(got[i] == static_cast<float>(value(0, i)));

    // all_gather and reduce_scatter
    device_array<float> gathered(count * static_cast<std::size_t>(n));
    c.all_gather(send.cspan(), gathered.span()).wait();
    got = gathered.get(s);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < count; ++i) REQUIRE(got[static_cast<std::size_t>(q) * count + i] == static_cast<float>(value(q, i)));
    const std::size_t block = count / static_cast<std::size_t>(n);
    device_array<float> scattered(block);
    c.reduce_scatter(send.cspan().first(block * static_cast<std::size_t>(n)), scattered.span(), ml::reduce_op::sum).wait();
    got = scattered.get(s);
    for (std::size_t i = 0; i < block; ++i) {
      double e = 0;
      for (int q = 0; q < n; ++q) e += value(q, static_cast<std::size_t>(r) * block + i);
      REQUIRE(got[i] == static_cast<float>(e));
    }

    // all_to_all: block j of rank q lands in block q of rank j
    device_array<float> a2a(block * static_cast<std::size_t>(n));
    c.all_to_all(send.cspan().first(block * static_cast<std::size_t>(n)), a2a.span()).wait();
    got = a2a.get(s);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < block; ++i)
        REQUIRE(got[static_cast<std::size_t>(q) * block + i] == static_cast<float>(value(q, static_cast<std::size_t>(r) * block + i)));

    // ppermute: a ring shift, and a permutation that leaves rank 0 without a source (zeros)
    std::vector<ml::permute_pair> ring;
    for (int q = 0; q < n; ++q) ring.push_back({q, (q + 1) % n});
    c.ppermute(send.cspan(), recv.span(), ring).wait();
    got = recv.get(s);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(got[i] == static_cast<float>(value((r + n - 1) % n, i)));
    std::vector<ml::permute_pair> shift;
    for (int q = 0; q + 1 < n; ++q) shift.push_back({q, q + 1});
    c.ppermute(send.span(), shift).wait();
    got = send.get(s);
    for (std::size_t i = 0; i < count; ++i) REQUIRE(got[i] == (r == 0 ? 0.0f : static_cast<float>(value(r - 1, i))));

    // barrier and split (every rank its own color: a group of one)
    c.barrier().wait();
    auto alone = c.split(r, 0);
    REQUIRE(alone.size() == 1);
    REQUIRE(alone.rank() == 0);
    send.put(mine, s);
    alone.all_reduce(send.span(), ml::reduce_op::sum).wait();
    REQUIRE(send.get(s) == mine);
  }
}

TEST_CASE("nccl device: every collective matches the host reference on one rank per GPU", "[device][nccl]") {
  const auto gpus = all_gpus();
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) { check_collectives(c, static_cast<int>(gpus.size())); });
}

TEST_CASE("nccl device: verify_collectives passes agreeing calls, and names each rank's call when they differ",
          "[device][nccl]") {
  const auto gpus = all_gpus();
  ml::nccl_comm_options checked;  // on by default since issue 40; every call checked here
  checked.verify_collectives = true;
  checked.verify_every = 1;
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) { check_collectives(c, static_cast<int>(gpus.size())); }, checked);
  if (gpus.size() < 2) {
    SUCCEED("a mismatch between NCCL ranks needs two GPUs; this machine has one");
    return;
  }
  const int two[] = {0, 1};
  const std::string m = message_of<ml::participant_error>([&] {
    ml::run_on_gpus(two, [&](ml::nccl_communicator& c) {
      device_array<float> d(8);
      if (c.rank() == 0) c.all_reduce(d.span(), ml::reduce_op::sum).wait();
      else c.all_gather(d.span()).wait();
    }, checked);
  });
  CHECK(m.find("collective mismatch in collective 1 on this communicator (seen by NCCL rank ") != std::string::npos);
  CHECK(m.find("rank 0 called all_reduce(float32, count 8, op sum); rank 1 called all_gather(float32, count 4)") !=
        std::string::npos);
}

TEST_CASE("shared GPU: every collective matches the host reference on 1, 3 and 4 devices of one GPU", "[device][shared_gpu]") {
  for (int n : {1, 3, 4}) {
    INFO(n << " devices on GPU 0");
    ml::run_on_shared_gpu(n, [&](ml::shared_gpu_communicator& c) { check_collectives(c, n); }, {.device = 0});
  }
}

TEST_CASE("shared GPU: every reduce op and type is bitwise the thread communicator's", "[device][shared_gpu]") {
  constexpr int n = 3;
  constexpr std::size_t count = 1000;
  auto input = [](int r, std::size_t i) { return static_cast<double>((static_cast<int>(i) * 7 + r * 13) % 23) - 11.5; };
  auto run = [&]<class T>(T) {
    for (ml::reduce_op op : ml::all_reduce_ops) {
      std::vector<std::vector<T>> expect(n, std::vector<T>(count));
      ml::run_on_threads(n, [&](ml::thread_communicator& c) {
        std::vector<T> x(count);
        for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(input(c.rank(), i));
        c.all_reduce(std::span<const T>(x), std::span<T>(expect[static_cast<std::size_t>(c.rank())]), op);
      });
      ml::run_on_shared_gpu(n, [&](ml::shared_gpu_communicator& c) {
        std::vector<T> x(count);
        for (std::size_t i = 0; i < count; ++i) x[i] = static_cast<T>(input(c.rank(), i));
        device_array<T> d(x, c.stream());
        c.all_reduce(d.span(), op).wait();
        const auto got = d.get(c.stream());
        REQUIRE(std::memcmp(got.data(), expect[static_cast<std::size_t>(c.rank())].data(), count * sizeof(T)) == 0);
      }, {.device = 0});
    }
  };
  run(float{});
  run(double{});
  run(std::int32_t{});
  run(std::int64_t{});
  run(ml::bfloat16{});
}

TEST_CASE("shared GPU: devices that call different collectives all get collective_mismatch", "[device][shared_gpu]") {
  const std::string m = message_of<ml::participant_error>([] {
    ml::run_on_shared_gpu(2, [&](ml::shared_gpu_communicator& c) {
      device_array<float> d(8);
      if (c.rank() == 0) c.all_reduce(d.span(), ml::reduce_op::sum).wait();
      else c.all_gather(d.span()).wait();
    }, {.device = 0});
  });
  // Both devices throw; which one run_on_shared_gpu reports first depends on the threads.
  const std::string calls = "device 0 called all_reduce(float32, count 8, op sum); device 1 called all_gather(float32, count 4)";
  CHECK((m == "meshlib: participant 0 of 2 failed: meshlib: collective mismatch on the devices of GPU 0 (seen by device 0): " + calls ||
         m == "meshlib: participant 1 of 2 failed: meshlib: collective mismatch on the devices of GPU 0 (seen by device 1): " + calls));
}

TEST_CASE("shared GPU: send and recv between devices of one GPU", "[device][shared_gpu]") {
  ml::run_on_shared_gpu(2, [&](ml::shared_gpu_communicator& c) {
    std::vector<float> v(100, static_cast<float>(c.rank() + 1));
    device_array<float> d(v, c.stream());
    if (c.rank() == 0) c.send(d.span(), 1, 5).wait();
    else c.recv(d.span(), 0, 5).wait();
    for (float x : d.get(c.stream())) REQUIRE(x == 1.0f);
  }, {.device = 0});
}

TEST_CASE("shared GPU: in-place all_to_all and ppermute of nothing leave the caller's buffer to the caller",
          "[device][shared_gpu]") {
  // With count 0 the in-place "scratch copy" was the caller's own buffer, which the communicator
  // then freed with cudaFreeAsync: the caller's cudaFree freed it a second time (the conformance
  // kit's in-place rows with count 0). The caller's cudaFree must be the only one, and succeed.
  for (int n : {2, 4}) {
    std::vector<cudaError_t> freed(static_cast<std::size_t>(n), cudaErrorUnknown);
    ml::run_on_shared_gpu(n, [&](ml::shared_gpu_communicator& c) {
      float* p = nullptr;
      cuda_ok(cudaMalloc(&p, 1));  // a distinct, non-null pointer for an empty buffer
      std::vector<ml::permute_pair> shift;
      for (int r = 0; r + 1 < c.size(); ++r) shift.push_back({r, r + 1});
      c.all_to_all(std::span<float>(p, 0)).wait();
      c.ppermute(std::span<float>(p, 0), std::span<const ml::permute_pair>(shift)).wait();
      cuda_ok(cudaStreamSynchronize(c.stream()));
      freed[static_cast<std::size_t>(c.rank())] = cudaFree(p);
    }, {.device = 0});
    for (cudaError_t rc : freed) CHECK(rc == cudaSuccess);
  }
}

TEST_CASE("nccl device: bfloat16 and int64 sums", "[device][nccl]") {
  const auto gpus = all_gpus();
  const int n = static_cast<int>(gpus.size());
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) {
    const cudaStream_t s = c.stream();
    std::vector<ml::bfloat16> b(64, ml::bfloat16(1.5f));
    device_array<ml::bfloat16> db(b, s);
    c.all_reduce(db.span(), ml::reduce_op::sum).wait();
    for (auto x : db.get(s)) REQUIRE(static_cast<float>(x) == 1.5f * static_cast<float>(n));
    std::vector<std::int64_t> v(64, (std::int64_t{1} << 40) + c.rank());
    device_array<std::int64_t> dv(v, s);
    c.all_reduce(dv.span(), ml::reduce_op::sum).wait();
    for (auto x : dv.get(s)) REQUIRE(x == n * (std::int64_t{1} << 40) + n * (n - 1) / 2);
  });
}

TEST_CASE("nccl device: stream ordering without host synchronisation", "[device][nccl]") {
  ml::run_on_gpus(all_gpus(), [&](ml::nccl_communicator& c) {
    const cudaStream_t s = c.stream();
    device_array<std::int32_t> x(1 << 20);
    // memset, all_reduce and the copy back are only ordered by the stream: no wait in between.
    cuda_ok(cudaMemsetAsync(x.p, 0, x.n * sizeof(std::int32_t), s));
    (void)c.all_reduce(x.span(), ml::reduce_op::sum);
    cuda_ok(cudaMemsetAsync(x.p, 1, sizeof(std::int32_t), s));  // 0x01010101 in element 0, after the reduction
    auto r = c.all_reduce(x.span(), ml::reduce_op::sum);
    r.wait();
    REQUIRE(x.get(s)[0] == 0x01010101 * c.size());
  });
}

TEST_CASE("nccl device: host memory, another GPU's memory and an aborted communicator are clear errors", "[device][nccl]") {
  const int gpus[] = {0};
  ml::run_on_gpus(gpus, [&](ml::nccl_communicator& c) {
    std::vector<float> host(16);
    CHECK(message_of<ml::comm_argument_error>([&] { (void)c.all_reduce(std::span(host), ml::reduce_op::sum); }) ==
          "meshlib: invalid argument to all_reduce on NCCL rank 0 of 1: send buffer is host memory; NCCL moves "
          "device memory (cudaMalloc, or a Kokkos::CudaSpace view)");
    c.abort("test");
    device_array<float> d(16);
    CHECK(message_of<ml::comm_aborted>([&] { (void)c.all_reduce(d.span(), ml::reduce_op::sum); }) ==
          "meshlib: refused all_reduce on NCCL rank 0 of 1 (GPU 0): the communicator has failed: abort on NCCL rank 0 "
          "of 1 (GPU 0): test");
  });
}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// CUDA compile check (scripts/cuda_compile_check.sh), and a GPU test where scripts/gpu-check.sh
// links and runs it: the typed collectives on blocks in CudaSpace over the stream backends, through
// gpu_runner (NCCL with one rank per GPU; the shared-GPU communicator for several mesh devices on
// one GPU) and through default_runner, which picks gpu_runner when a GPU is visible, and
// nn::pmax / nn::pmin under grad (a collective in the backward pass). Each result
// is compared on the host with values computed here independently. Exit 0: passed; 77: skipped
// (no GPU); 1: a value differs.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>
#if !MESHLIB_GPU_COLLECTIVES_ON_HOST
#include <meshlib/nccl.hpp>
#endif

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#if !MESHLIB_GPU_COLLECTIVES_ON_HOST  // (defined: the same checks on the thread runner, host memory)
static_assert(!meshlib::tensor::detail::host_accessible_v<meshlib::default_memory_space>,
              "the CUDA compile check must compile for device memory: Kokkos was not configured with CUDA");
static_assert(MESHLIB_HAS_GPU_RUNNER == 1, "gpu_runner must exist with NCCL and Kokkos CUDA");
static_assert(meshlib::runner<meshlib::gpu_runner>);
#endif

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

using mesh_t = meshlib::mesh<meshlib::axis<"x">>;

// Device d holds rows [2d, 2d + 2) of an (2n, 2) array with value 1 + row * 2 + column.
std::vector<float> input(std::size_t n) {
  std::vector<float> v(2 * n * 2);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 1.0f + static_cast<float>(i);
  return v;
}

// Every typed collective once, on the blocks of `x`, run by `runner`.
template <class Runner>
void check_collectives(const mesh_t& mesh, Runner runner, const std::string& where) {
  const std::size_t n = mesh.size();
  const meshlib::named_sharding<mesh_t, meshlib::P<"x", meshlib::none>> rows{mesh};
  const std::vector<float> host = input(n);
  const auto x = meshlib::from_host(rows, std::array<std::size_t, 2>{2 * n, 2}, host);

  // psum: every device's (2, 2) block summed; replicated.
  auto sum = meshlib::shard_map([](auto b) { return meshlib::psum<"x">(b); }, mesh, meshlib::P<"x", meshlib::none>{},
                                meshlib::P<>{}, runner);
  const std::vector<float> s = meshlib::to_host(sum(x));
  bool ok = s.size() == 4;
  for (std::size_t e = 0; ok && e < 4; ++e) {
    float want = 0;
    for (std::size_t d = 0; d < n; ++d) want += host[d * 4 + e];
    ok = s[e] == want;
  }
  expect(ok, where + ": psum");

  // all_gather along rows: the whole array on every device.
  auto gather = meshlib::shard_map([](auto b) { return meshlib::all_gather<"x", 0>(b); }, mesh,
                                   meshlib::P<"x", meshlib::none>{}, meshlib::P<>{}, runner);
  expect(meshlib::to_host(gather(x)) == host, where + ": all_gather");

  // psum_scatter over columns: device d gets columns [d * 2 / n, (d + 1) * 2 / n) of the sum S of
  // the blocks, so the global result (columns sharded) is S. (n divides 2: n is 1 or 2 here.)
  std::vector<float> total(4, 0.0f);
  for (std::size_t d = 0; d < n; ++d)
    for (std::size_t e = 0; e < 4; ++e) total[e] += host[d * 4 + e];
  using cols = meshlib::P<meshlib::none, "x">;
  auto scatter = meshlib::shard_map([](auto b) { return meshlib::psum_scatter<"x", 1>(b); }, mesh,
                                    meshlib::P<"x", meshlib::none>{}, cols{}, runner);
  expect(meshlib::to_host(scatter(x)) == total, where + ": psum_scatter");

  // ppermute of the scattered columns around the ring: device d gets device d-1's.
  auto shift = meshlib::shard_map(
      [n](auto b) {
        std::vector<std::pair<std::size_t, std::size_t>> ring;
        for (std::size_t i = 0; i < n; ++i) ring.push_back({i, (i + 1) % n});
        return meshlib::ppermute<"x">(meshlib::psum_scatter<"x", 1>(b), ring);
      },
      mesh, meshlib::P<"x", meshlib::none>{}, cols{}, runner);
  const std::size_t per = 2 / n;  // columns per device
  std::vector<float> shifted(4);
  for (std::size_t r = 0; r < 2; ++r)
    for (std::size_t d = 0; d < n; ++d)
      for (std::size_t c = 0; c < per; ++c) shifted[r * 2 + d * per + c] = total[r * 2 + ((d + n - 1) % n) * per + c];
  expect(meshlib::to_host(shift(x)) == shifted, where + ": ppermute");

  // all_to_all (split columns, concatenate rows): device j gets column chunk j of every block,
  // stacked in device order; with columns sharded that is the input array itself.
  auto swap = meshlib::shard_map([](auto b) { return meshlib::all_to_all<"x", 1, 0>(b); }, mesh,
                                 meshlib::P<"x", meshlib::none>{}, cols{}, runner);
  expect(meshlib::to_host(swap(x)) == host, where + ": all_to_all");

  // psum_start (the communication worker enqueues on the stream) gives psum's values.
  auto started = meshlib::shard_map([](auto b) { return meshlib::psum_start<"x">(b).wait(); }, mesh,
                                    meshlib::P<"x", meshlib::none>{}, meshlib::P<>{}, runner);
  expect(meshlib::to_host(started(x)) == s, where + ": psum_start");

  // nn::pmax / nn::pmin under grad (their backward kernels and the psum counting the ties): every
  // element's max is on the last device and its min on the first, which take the whole cotangent.
  auto extrema = meshlib::shard_map(
      [](auto b) {
        namespace nn = meshlib::nn;
        return nn::grad([](const auto& a) {
          return nn::sum<0>(nn::sum<1>(nn::pmax<"x">(a))) + nn::sum<0>(nn::sum<1>(nn::pmin<"x">(a))) * 2.0f;
        })(b);
      },
      mesh, meshlib::P<"x", meshlib::none>{}, meshlib::P<"x", meshlib::none>{}, runner);
  std::vector<float> want(4 * n, 0.0f);
  for (std::size_t e = 0; e < 4; ++e) {
    want[(n - 1) * 4 + e] += 1.0f;
    want[e] += 2.0f;
  }
  expect(meshlib::to_host(extrema(x)) == want, where + ": nn::pmax / nn::pmin under grad");
}

}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
#if MESHLIB_GPU_COLLECTIVES_ON_HOST
  check_collectives(mesh_t{2}, meshlib::thread_runner{}, "thread_runner, 2 devices");
  check_collectives(mesh_t{1}, meshlib::thread_runner{}, "thread_runner, 1 device");
  std::printf("%s: the expectations on the thread runner\n", failures == 0 ? "PASSED" : "FAILED");
  return failures == 0 ? 0 : 1;
#else
  const int gpus = meshlib::visible_gpu_count();
  if (gpus == 0) {
    std::printf("SKIP: no CUDA device\n");
    return 77;
  }
  const mesh_t two{2};
  if (gpus >= 2) check_collectives(two, meshlib::gpu_runner{}, "NCCL, one rank per GPU (2 GPUs)");
  // Two mesh devices on GPU 0: the shared-GPU communicator, one stream (and Kokkos instance) each.
  check_collectives(two, meshlib::gpu_runner({.gpus = {0}}), "shared-GPU, 2 devices on GPU 0");
  // default_runner picks gpu_runner here (a GPU build with a GPU).
  check_collectives(two, meshlib::default_runner{}, "default_runner");
  // A one-device mesh on NCCL (one rank): a collective over a group of one.
  check_collectives(mesh_t{1}, meshlib::gpu_runner{}, "NCCL, one rank");
  std::printf("%s: typed collectives on CudaSpace blocks over the stream backends\n", failures == 0 ? "PASSED" : "FAILED");
  return failures == 0 ? 0 : 1;
#endif
}

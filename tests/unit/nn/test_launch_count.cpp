// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Kernel launches per training step (issue 38 item 2: few kernels per step), counted with
// meshlib::launch_counter on the CPU backend: the count does not depend on the backend, so a change
// that adds a kernel to the flagship's step fails here. Also the counter's own laws: it counts what
// runs while it lives, nests, and puts back the callbacks it found. A binary of its own: the counter
// installs process-wide Kokkos Tools callbacks.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "synthetic_problem.hpp"

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

/// Whether this build's float products go to the BLAS (else they are meshlib's own Kokkos kernel).
bool blas_products() {
  const char* no = std::getenv("MESHLIB_NO_BLAS");
  return meshlib::config::kokkos_kernels && !(no != nullptr && std::string(no) == "1");
}

/// Runs `n` one-element kernels on the running instance.
void launch_n(std::size_t n, float* p) {
  for (std::size_t k = 0; k < n; ++k) meshlib::launch<meshlib::default_memory_space>(1, KOKKOS_LAMBDA(std::size_t) { *p += 1; });
}

}  // namespace

TEST_CASE("launch_counter counts the launches and products made while it lives, and nests", "[nn][launches]") {
  auto buf = meshlib::allocate<float, 1>({1}, "launch_counter_test");
  const auto before = Kokkos::Tools::Experimental::get_callbacks();
  for (std::size_t outer_n : {0, 1, 5}) {
    for (std::size_t inner_n : {0, 2, 7}) {
      meshlib::launch_counter outer;
      launch_n(outer_n, buf.data());
      {
        meshlib::launch_counter inner;
        launch_n(inner_n, buf.data());
        CHECK(inner.kernels() == inner_n);
        CHECK(inner.products() == 0);
      }
      launch_n(1, buf.data());
      CHECK(outer.kernels() == outer_n + inner_n + 1);
      outer.reset();
      CHECK(outer.launches() == 0);
      CHECK(outer.by_name().empty());
    }
  }
  // A product: one BLAS call (one region), or one Kokkos kernel without the BLAS.
  auto a = meshlib::allocate<float, 2>({3, 4}, "a");
  auto b = meshlib::allocate<float, 2>({4, 5}, "b");
  auto c = meshlib::allocate<float, 2>({3, 5}, "c");
  for (std::size_t n : {1, 3}) {
    meshlib::launch_counter count;
    for (std::size_t k = 0; k < n; ++k) meshlib::matmul_into(c, a, b);
    CHECK(count.products() == (blas_products() ? n : 0));
    CHECK(count.kernels() == (blas_products() ? 0 : n));
    if (blas_products()) CHECK(count.by_name().at(meshlib::blas_product_region) == n);
  }
  // Every counter gone: the callbacks found at the start are back (none are counting).
  const auto after = Kokkos::Tools::Experimental::get_callbacks();
  CHECK(after.begin_parallel_for == before.begin_parallel_for);
  CHECK(after.begin_parallel_reduce == before.begin_parallel_reduce);
  CHECK(after.push_region == before.push_region);
}

TEST_CASE("the MLP step launches a fixed number of kernels and products", "[nn][launches]") {
  // The flagship's model (issue 38) with 256-wide hidden layers: 784-256-256-10 of dense + relu,
  // Adam, on a 1x1 mesh. The counts do not depend on the batch.
  constexpr std::size_t features = 784, hidden = 256, classes = 10, batch = 32;
  const mesh_t m{1, 1};
  const nn::rng_key key{3};
  nn::train_state state(m,
                        nn::sequential(nn::dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                                       nn::dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::relu<float>(m),
                                       nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key)),
                        nn::adam(nn::constant(1e-3f)));
  const auto ds = meshlib_test::synthetic_problem(batch, features, classes);
  auto step = [&] {
    return nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch, 0, batch);
  };
  step();
  step();  // buffers are allocated (and zero-filled by kernels) in the first steps only
  meshlib::launch_counter count;
  (void)step();
  std::ostringstream text;
  text << count;
  INFO(text.str());
  // Products (BLAS calls): forward x W for the 3 layers; backward dW = x^T dy for the 3 layers and
  // dx = dy W^T for the 2 layers above the input (the input needs no gradient).
  constexpr std::size_t products = 3 + 3 + 2;
  // Kokkos kernels:
  //   forward: add_bias x 3, activation_forward (relu) x 2
  //   loss: row_max, exp_and_target, cross_entropy_terms x 2 (the loss terms, the gradient)
  //   backward: bias_grad x 3, activation_backward x 2
  //   gradient norm: one multi-tensor sum_of_squares over the 6 parameters' gradients, a kernel
  //     of partial sums per block and one that adds them (2; it was 9 per step: a pair per
  //     parameter of more than one block, one kernel for the others)
  //   optimizer: the fused Adam kernel (fused_body<adam_step, scale_step>), one per parameter (6)
  constexpr std::size_t kernels = (3 + 2) + 4 + (3 + 2) + 2 + 6;
  if (blas_products()) {
    CHECK(count.products() == products);
    CHECK(count.kernels() == kernels);
  } else {
    CHECK(count.products() == 0);
    CHECK(count.kernels() == kernels + products);
  }
  CHECK(count.launches() == kernels + products);
}
TEST_CASE("a device's sum of squares is one multi-tensor reduction, bitwise the per-run sums in run order",
          "[nn][launches][norm]") {
  namespace d = meshlib::nn::detail;
  constexpr std::size_t blk = d::kernel_block;
  // Runs of every length class: empty, one element, one block less one, exactly one block, just over,
  // several blocks and a tail; alone and together, in both orders.
  const std::vector<std::size_t> lengths{0, 1, blk - 1, blk, blk + 1, 3 * blk + 17, 2 * blk};
  std::vector<std::vector<std::size_t>> cases{{}, {0}};
  for (std::size_t n : lengths) cases.push_back({n});
  cases.push_back(lengths);
  cases.emplace_back(lengths.rbegin(), lengths.rend());
  for (const auto& lens : cases) {
    std::size_t total = 0;
    for (std::size_t n : lens) total += n;
    auto data = meshlib::allocate<float, 1>({total + 1}, "norm_runs");
    std::vector<float> host(total + 1);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(std::sin(0.7 * static_cast<double>(i)) * (1 + i % 13));
    meshlib::copy_from_host<meshlib::default_memory_space>(data.data(), host.data(), host.size());
    std::vector<d::float_run> runs;
    double expected = 0;  // each run's blocks added from 0 in order, the runs' sums added in run order
    std::size_t off = 0;
    for (std::size_t n : lens) {
      runs.push_back({data.data() + off, n});
      double s = 0;
      for (std::size_t i0 = 0; i0 < n; i0 += blk) s += d::squares_of_block(host.data() + off, i0, std::min(n, i0 + blk));
      expected += s;
      off += n;
    }
    std::vector<std::size_t> words;
    const std::size_t blocks = d::run_table(runs, words);
    auto table = meshlib::allocate<std::size_t, 1>({words.size() + 1}, "norm_table");
    meshlib::copy_from_host<meshlib::default_memory_space>(table.data(), words.data(), words.size());
    auto scratch = meshlib::allocate<double, 1>({blocks + 1}, "norm_scratch");
    meshlib::launch_counter count;
    const double got = d::sum_of_squares<meshlib::default_memory_space>(table.data(), words.size() / d::run_words, blocks,
                                                                        scratch.data());
    INFO("runs of " << lens.size() << ", " << blocks << " blocks");
    CHECK(got == expected);
    CHECK(count.kernels() == (blocks == 0 ? 0 : 2));
  }
}

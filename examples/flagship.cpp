// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// flagship: tensor parallelism on a 2-D (data, model) mesh, the Megatron MLP of JAX's shard_map
// tutorial: a column-parallel matmul, a nonlinearity, a row-parallel matmul, and one psum.
//
//   x  (B, D)  P<"data", none>      batch split over data, replicated over model
//   W1 (D, H)  P<none, "model">     column-parallel: every model device holds H/2 columns
//   W2 (H, D)  P<"model", none>     row-parallel: the matching H/2 rows
//   h = relu(x @ W1)                (B/2, H/2) per device, no communication
//   y = psum<"model">(h @ W2)       h @ W2 contracts the model-sharded H: a pending sum over model
//
// The types carry the layout: h @ W2 is `partial` over "model", and returning it without the psum
// does not compile (shard_map's check_vma). The result is checked against a host computation.
//
// `flagship --trace trace.json` also records a timeline of three steps (docs/debugging.md): every
// device's regions and its psum, written as Chrome trace JSON for Perfetto / chrome://tracing, and
// prints the trace summary.
#include <meshlib.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

namespace {
int run(const std::string& trace_path) {
  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const mesh_t mesh{2, 2};
  constexpr std::size_t B = 64, D = 32, H = 128;
  using meshlib::none;
  using meshlib::P;

  auto fill = [](std::size_t count, double scale, double phase) {
    std::vector<float> v(count);
    for (std::size_t i = 0; i < count; ++i) v[i] = static_cast<float>(scale * std::sin(0.731 * static_cast<double>(i) + phase));
    return v;
  };
  const auto xh = fill(B * D, 1.0, 0.0), w1h = fill(D * H, 0.2, 1.0), w2h = fill(H * D, 0.2, 2.0);
  const auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, P<"data", none>>{mesh}, std::array<std::size_t, 2>{B, D}, xh);
  const auto w1 = meshlib::from_host(meshlib::named_sharding<mesh_t, P<none, "model">>{mesh}, std::array<std::size_t, 2>{D, H}, w1h);
  const auto w2 = meshlib::from_host(meshlib::named_sharding<mesh_t, P<"model", none>>{mesh}, std::array<std::size_t, 2>{H, D}, w2h);

  auto mlp = meshlib::shard_map(
      [](auto xb, auto w1b, auto w2b) {
        meshlib::trace_region step("mlp");  // regions: free unless tracing or a Kokkos tool is on
        auto h = [&] {
          meshlib::trace_region r("x @ W1, relu");
          return meshlib::map([](float v) { return v > 0.0f ? v : 0.0f; }, meshlib::matmul(xb, w1b));  // column-parallel
        }();
        auto partial = [&] {
          meshlib::trace_region r("h @ W2");
          return meshlib::matmul(h, w2b);  // row-parallel
        }();
        static_assert(decltype(partial)::partial == mesh_t::mask_of<"model">(), "h @ W2 is a pending sum over model");
        return meshlib::psum<"model">(partial);  // the one psum
      },
      mesh, meshlib::specs<P<"data", none>, P<none, "model">, P<"model", none>>{}, P<"data", none>{});

  if (!trace_path.empty()) meshlib::start_trace(trace_path);
  const auto t0 = std::chrono::steady_clock::now();
  auto y = mlp(x, w1, w2);
  const auto t1 = std::chrono::steady_clock::now();
  if (!trace_path.empty()) {
    for (int step = 1; step < 3; ++step) {
      meshlib::trace_region r("step " + std::to_string(step));
      y = mlp(x, w1, w2);
    }
    std::cout << meshlib::stop_trace();
  }

  // Host reference in double.
  const auto got = meshlib::to_host(y);
  double max_err = 0;
  for (std::size_t i = 0; i < B; ++i) {
    std::vector<double> h(H, 0.0);
    for (std::size_t k = 0; k < H; ++k) {
      double s = 0;
      for (std::size_t j = 0; j < D; ++j) s += static_cast<double>(xh[i * D + j]) * w1h[j * H + k];
      h[k] = std::max(s, 0.0);
    }
    for (std::size_t j = 0; j < D; ++j) {
      double s = 0;
      for (std::size_t k = 0; k < H; ++k) s += h[k] * w2h[k * D + j];
      max_err = std::max(max_err, std::abs(s - got[i * D + j]) / (1.0 + std::abs(s)));
    }
  }
  std::cout << "flagship: Megatron MLP on " << mesh << "\n"
            << "  x  " << x << "\n  W1 " << w1 << "\n  W2 " << w2 << "\n  y  " << y << "\n"
            << "  per device: h = relu(x_b @ W1_b) is (" << B / 2 << ", " << H / 2 << "), y_b = psum<\"model\">(h @ W2_b)\n"
            << "  time " << std::chrono::duration<double, std::milli>(t1 - t0).count() << " ms, max relative error vs host "
            << max_err << "\n";
  if (!(max_err < 1e-4)) {
    std::cout << "FAILED: the result differs from the host computation\n";
    return 1;
  }
  std::cout << "OK: column-parallel then row-parallel matmul with one psum matches the host\n";
  return 0;
}
}  // namespace

int main(int argc, char* argv[]) {
  std::string trace;
  for (int i = 1; i < argc; ++i)
    if (std::string_view(argv[i]) == "--trace") {
      if (i + 1 >= argc) {
        std::cerr << "usage: flagship [--trace FILE.json]\n";
        return 2;
      }
      trace = argv[i + 1];
    }
  // Kokkos lives for the whole program; every view above is gone when run() returns.
  Kokkos::ScopeGuard kokkos(argc, argv);
  return run(trace);
}

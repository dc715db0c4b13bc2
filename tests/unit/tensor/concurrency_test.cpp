// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Every kernel family, launched from 8 device threads at once, many times, with exact results.
// Built twice: plainly and under ThreadSanitizer (tensor_concurrency_tsan), where any report fails
// the test (halt_on_error). This is the proof that meshlib's launch discipline (RangePolicy only,
// its own reductions, allocation under one mutex; see include/meshlib/tensor/view.hpp) is safe on
// Debian's Kokkos 3.4.1, whose team policies, scans and reductions are not.
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <string>
#include <mutex>
#include <thread>
#include <vector>

#include "meshlib/exec.hpp"  // installs the device threads global-view operations run on
#include "meshlib/tensor.hpp"
#include "meshlib_catch.hpp"
#include "reference.hpp"

namespace {
using namespace meshlib;
using mesh_t = mesh<axis<"data">, axis<"model">>;
using shape2 = std::array<std::size_t, 2>;

#if defined(MESHLIB_UNDER_TSAN)
constexpr int iterations = 200;
#else
constexpr int iterations = 1500;
#endif
constexpr std::size_t devices = 8;

template <class V>
auto values(const V& v) {
  return std::vector<typename V::non_const_value_type>(v.data(), v.data() + v.size());
}

bool near(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (std::abs(a[i] - b[i]) > 1e-9 * (1.0 + std::abs(b[i]))) return false;
  return true;
}
}  // namespace

TEST_CASE("all kernel families from 8 device threads at once give exact results", "[tensor][concurrency]") {
  mesh_t m{2, 4};
  named_sharding<mesh_t, P<"data", "model">> s_dm{m};
  named_sharding<mesh_t, P<"model">> s_m{m};
  // global: x 16 x 256 (blocks 8 x 64), w 256 x 48 (blocks 64 x 48): per-device matmul 8x64 . 64x48
  const shape2 xs{16, 256}, ws{256, 48};
  const auto hx = ref::iota<float>(16 * 256, 1, 13);
  const auto hw = ref::iota<float>(256 * 48, 3, 9);
  const auto hi = ref::iota<std::int32_t>(16 * 256, 7, 41);
  const auto hwi = ref::iota<std::int32_t>(256 * 48, 2, 11);
  const auto hd = ref::iota<double>(16 * 256, 5, 29);
  auto x = from_host(s_dm, xs, hx);
  auto w = from_host(s_m, ws, hw);
  auto xi = from_host(s_dm, xs, hi);
  auto wi = from_host(s_m, ws, hwi);
  auto xd = from_host(s_dm, xs, hd);

  // Expected per-device results, from plain loops over the device's block.
  struct expected {
    std::vector<float> affine, matmul_f, rowsum_f, transposed;
    std::vector<std::int32_t> zipped, matmul_i, colmax_i;
    std::vector<double> rowmean_d;
  };
  std::vector<expected> want(devices);
  for (std::size_t dev = 0; dev < devices; ++dev) {
    const auto bx = values(x.local(dev)), bw = values(w.local(dev));
    const auto bi = values(xi.local(dev)), bwi = values(wi.local(dev));
    const auto bd = values(xd.local(dev));
    auto& e = want[dev];
    for (float v : bx) e.affine.push_back(v * 2.0f + 1.0f);
    for (std::size_t i = 0; i < bi.size(); ++i) e.zipped.push_back(bi[i] * 3 - (bi[i] > 0 ? bi[i] : -bi[i]));
    e.matmul_f = ref::matmul(bx, bw, 8, 64, 48);
    e.matmul_i = ref::matmul(bi, bwi, 8, 64, 48);
    e.rowsum_f = ref::reduce<float>(bx, shape2{8, 64}, 1, ref::op::sum);
    e.colmax_i = ref::reduce<std::int32_t>(bi, shape2{8, 64}, 0, ref::op::max);
    e.rowmean_d = ref::reduce<double>(bd, shape2{8, 64}, 1, ref::op::sum);
    for (auto& v : e.rowmean_d) v /= 256.0;  // mean over the global extent: partial over 'model'
    e.transposed = ref::transpose(bx, 8, 64);
  }

  std::vector<std::array<int, 8>> failures(devices, std::array<int, 8>{});
  std::vector<std::thread> threads;
  std::atomic<int> ready{0};
  for (std::size_t dev = 0; dev < devices; ++dev) {
    threads.emplace_back([&, dev] {
      ready.fetch_add(1);
      while (ready.load() < static_cast<int>(devices)) std::this_thread::yield();  // start together
      auto& f = failures[dev];
      const auto& e = want[dev];
      const auto lx = x.local_value(dev);
      const auto lw = w.local_value(dev);
      const auto li = xi.local_value(dev);
      const auto lwi = wi.local_value(dev);
      const auto ld = xd.local_value(dev);
      for (int it = 0; it < iterations; ++it) {
        f[0] += values((lx * 2.0f + 1.0f).view()) != e.affine;                                     // map, scalar ops
        f[1] += values(zip([](std::int32_t a, std::int32_t b) { return a - (b > 0 ? b : -b); }, li * 3, li).view()) !=
                e.zipped;                                                                            // zip
        f[2] += values(matmul(lx, lw).view()) != e.matmul_f;                                         // BLAS path
        f[3] += values(matmul(li, lwi).view()) != e.matmul_i;                                        // own kernel
        f[4] += values(sum<1>(lx).view()) != e.rowsum_f;                                             // reductions
        f[5] += values(max<0>(li).view()) != e.colmax_i;
        f[6] += !near(values(mean<1>(ld).view()), e.rowmean_d);
        f[7] += values(transpose(lx).view()) != e.transposed;                                        // transpose
      }
    });
  }
  for (auto& t : threads) t.join();
  const char* names[8] = {"map", "zip", "matmul float", "matmul int", "sum", "max", "mean", "transpose"};
  for (std::size_t dev = 0; dev < devices; ++dev)
    for (std::size_t k = 0; k < 8; ++k) {
      INFO("device " << dev << ", kernel " << names[k]);
      CHECK(failures[dev][k] == 0);
    }
}

// The control experiment, hidden (run it by name): the same 8 threads launching Kokkos' own
// parallel_scan, which on Kokkos 3.4.1 Serial keeps its running value in the one process-wide
// team scratch buffer. ThreadSanitizer reports it (and the plain build can get wrong sums): this
// shows that the _tsan build sees races in inlined Kokkos code, so the clean run above means something.
TEST_CASE("control: Kokkos parallel_scan from 8 threads races on Kokkos 3.4.1", "[.][tensor][concurrency_control]") {
  std::vector<long> results(devices, 0);
  std::vector<std::thread> threads;
  for (std::size_t dev = 0; dev < devices; ++dev)
    threads.emplace_back([&, dev] {
      Kokkos::View<long*, Kokkos::HostSpace> out;
      {
        std::lock_guard<std::mutex> lock(meshlib::tensor::detail::kokkos_state_mutex());
        out = Kokkos::View<long*, Kokkos::HostSpace>("control", 1000);
      }
      long total = 0;
      for (int it = 0; it < iterations; ++it) {
        Kokkos::parallel_scan(Kokkos::RangePolicy<Kokkos::DefaultHostExecutionSpace>(0, 1000),
                              KOKKOS_LAMBDA(int i, long& acc, bool final) {
                                acc += i;
                                if (final) out(i) = acc;
                              });
        total += out(999);
      }
      results[dev] = total;
    });
  for (auto& t : threads) t.join();
  for (auto r : results) CHECK(r == 499500L * iterations);
}

// Global-view operations run every local device's block at once on the persistent device workers
// (exec/detail/device_workers.hpp, installed as the tensor layer's dispatcher when exec is
// included: tensor/for_each_device.hpp). Each call of the function below waits until all 4 devices have
// entered it: run in parallel, they all pass; run one after another, device 0 waits alone until
// the deadline and returns -1. Repeated, so that the same workers serve later calls.
namespace {
struct wait_for_all {
  std::atomic<int>* entered;
  int devices;
  float operator()(float v) const {
    entered->fetch_add(1);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (entered->load() < devices && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
    return entered->load() >= devices ? v : -1.0f;
  }
  float operator()(float a, float b) const { return (*this)(a + b); }
};
}  // namespace

TEST_CASE("global-view map and zip run every device at once", "[tensor][concurrency][global_view]") {
  using mesh1 = mesh<axis<"x">>;
  mesh1 m{4};
  named_sharding<mesh1, P<"x">> s{m};
  // Large enough to be worth the workers (detail::parallel_work_threshold).
  const std::size_t size = 4 * meshlib::tensor::detail::parallel_work_threshold;
  const auto h = ref::iota<float>(size, 1, 1000);
  std::vector<float> twice(size);
  for (std::size_t i = 0; i < size; ++i) twice[i] = h[i] + h[i];
  auto x = from_host(s, std::array<std::size_t, 1>{size}, h);
  for (int round = 0; round < 3; ++round) {
    INFO("round " << round);
    std::atomic<int> entered{0};
    CHECK(map(wait_for_all{&entered, 4}, x).to_host() == h);
    std::atomic<int> entered2{0};
    CHECK(zip(wait_for_all{&entered2, 4}, x, x).to_host() == twice);
  }
}

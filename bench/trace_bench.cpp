// trace_bench: what the debug layer's hook costs. An 8-byte all_reduce between two devices (one
// thread each), through the typed psum, in four variants measured in the same run:
//   raw        the thread communicator's all_reduce, no meshlib front end (the peer)
//   no hook    psum built with MESHLIB_DEBUG_HOOKS=0 (the child process trace_bench_nohook)
//   off        psum as shipped, tracing and debug mode off: one branch per collective
//   tracing    psum with tracing on (events recorded, no file written)
//   debug      psum with debug mode on (NaN/Inf checks, late-device watchdog)
// Each variant: the median, over rounds, of the slower device's mean time per call in a batch.
// `trace_bench --child` (used on trace_bench_nohook) prints only its own "psum" number.
#include <meshlib.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
using vec = meshlib::local_tensor<float, 1, mesh_t, mesh_t::all_axes>;

constexpr int iters = 20000;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Seconds per psum, the slower device's.
double time_psum() {
  const mesh_t m{2};
  auto per_device = meshlib::spmd(m, [&] {
    vec x(std::array<std::size_t, 1>{2}, m, meshlib::device_index());
    for (int i = 0; i < 200; ++i) (void)meshlib::psum<"x">(x);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) (void)meshlib::psum<"x">(x);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  });
  return std::max(per_device[0], per_device[1]);
}

double time_raw() {
  std::array<double, 2> t{};
  meshlib::run_on_threads(2, [&](meshlib::thread_communicator& c) {
    std::array<float, 2> buf{1, 2};
    for (int i = 0; i < 200; ++i) c.all_reduce(std::span<float>(buf), meshlib::reduce_op::sum);
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) c.all_reduce(std::span<float>(buf), meshlib::reduce_op::sum);
    t[static_cast<std::size_t>(c.rank())] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  });
  return std::max(t[0], t[1]);
}

double time_child(const char* path) {
  const std::string cmd = std::string(path) + " --child";
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return -1;
  double v = -1;
  if (std::fscanf(p, "%lf", &v) != 1) v = -1;
  pclose(p);
  return v;
}

}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  if (argc > 1 && std::string_view(argv[1]) == "--child") {
    std::printf("%.9f\n", time_psum());
    return 0;
  }
#ifndef MESHLIB_TRACE_BENCH_PEER
#define MESHLIB_TRACE_BENCH_PEER ""
#endif
  const char* peer = argc > 1 ? argv[1] : MESHLIB_TRACE_BENCH_PEER;
  const int rounds = 9;
  std::vector<double> raw, nohook, off, tracing, debug;
  for (int r = 0; r < rounds; ++r) {
    raw.push_back(time_raw());
    if (*peer) nohook.push_back(time_child(peer));
    off.push_back(time_psum());
    meshlib::start_trace("");
    tracing.push_back(time_psum());
    (void)meshlib::stop_trace();
    {
      meshlib::scoped_debug_mode on;
      debug.push_back(time_psum());
    }
  }
  const double base = nohook.empty() ? median(off) : median(nohook);
  auto row = [&](const char* name, const std::vector<double>& v) {
    if (v.empty()) return;
    const double m = median(v);
    std::printf("| %-52s | %8.3f | %+7.1f%% |\n", name, m * 1e6, (m / base - 1) * 100);
  };
  std::printf("8 B all_reduce, 2 devices (threads), %d calls per batch, median of %d batches\n\n", iters, rounds);
  std::printf("| %-52s | %8s | %8s |\n|---|---:|---:|\n", "variant", "us/call", "vs no hook");
  row("thread_communicator::all_reduce (raw, the peer)", raw);
  row("psum, debug hook compiled out (MESHLIB_DEBUG_HOOKS=0)", nohook);
  row("psum, tracing and debug mode off (as shipped)", off);
  row("psum, tracing on", tracing);
  row("psum, debug mode on", debug);
  return 0;
}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// trace_bench: what the debug layer's hook costs. An 8-byte all_reduce between two devices (one
// thread each), through the typed psum, in four variants measured in the same run:
//   raw        the thread communicator's all_reduce, no meshlib front end (the peer)
//   no hook    psum built with MESHLIB_DEBUG_HOOKS=0 (the child process trace_bench_nohook)
//   off        psum as shipped, tracing and debug mode off: one branch per collective
//   tracing    psum with tracing on (events recorded, no file written)
//   debug      psum with debug mode on (NaN/Inf checks, late-device watchdog)
// Each variant: the median, over rounds, of the slower device's mean time per call in a batch.
// A second table isolates the hook: the cost of fetching a device's communicator (what every typed
// collective does first, and where the hook's branch sits), with and without the hook; CPU-bound,
// so the minimum over rounds is reported (the least disturbed by other jobs on the machine).
// `trace_bench --child` (used on trace_bench_nohook) prints only its own two numbers. Bad options
// (bench/bench_options.hpp) end it with a message and exit status 2.
#include <filesystem>
#include <string>

#include "bench_options.hpp"

namespace {

struct options {
  bool child = false;  ///< --child: print this build's two times for the parent (the peer's side)
  std::string peer;    ///< the peer built without the hook; empty: none
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("trace_bench",
                         "usage: trace_bench [PEER]   (PEER: the same benchmark built with MESHLIB_DEBUG_HOOKS=0)\n"
                         "       trace_bench --child  (what the parent runs in the peer)\n",
                         argc, argv);
  options o;
  o.child = cl.flag("--child");
  const auto pos = cl.positional(1);
  cl.done();
  if (o.child && !pos.empty()) cl.fail("--child takes no peer");
#ifndef MESHLIB_TRACE_BENCH_PEER
#define MESHLIB_TRACE_BENCH_PEER ""
#endif
  o.peer = pos.empty() ? MESHLIB_TRACE_BENCH_PEER : pos.front();
  if (!o.child && !pos.empty() && !std::filesystem::is_regular_file(o.peer))
    cl.fail("the peer " + o.peer + " is not a file (give the path of trace_bench_nohook)");
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
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

/// Seconds per `comm(mask)` fetch (the hook's branch, when compiled in), the slower device's.
double time_lookup() {
  const mesh_t m{2};
  constexpr int n = 2000000;
  auto per_device = meshlib::spmd(m, [&] {
    auto& ctx = meshlib::collectives::detail::current_device("trace_bench");
    int sink = 0;
    for (int i = 0; i < 1000; ++i) sink += ctx.comm(mesh_t::all_axes).size();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) sink += ctx.comm(mesh_t::all_axes).size();
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n;
    return sink > 0 ? t : -t;
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

std::array<double, 2> time_child(const char* path) {
  const std::string cmd = std::string(path) + " --child";
  std::array<double, 2> v{-1, -1};
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return v;
  if (std::fscanf(p, "%lf %lf", &v[0], &v[1]) != 2) v = {-1, -1};
  pclose(p);
  return v;
}

}  // namespace

int main(int argc, char* argv[]) {
  const options o = parse_options(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  if (o.child) {
    std::printf("%.9f %.12f\n", time_psum(), time_lookup());
    return 0;
  }
  const char* peer = o.peer.c_str();
  const int rounds = 9;
  std::vector<double> raw, nohook, off, tracing, debug, lookup_nohook, lookup;
  for (int r = 0; r < rounds; ++r) {
    raw.push_back(time_raw());
    if (*peer) {
      const auto c = time_child(peer);
      nohook.push_back(c[0]);
      lookup_nohook.push_back(c[1]);
    }
    off.push_back(time_psum());
    lookup.push_back(time_lookup());
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
  if (!lookup_nohook.empty()) {
    const double a = *std::min_element(lookup_nohook.begin(), lookup_nohook.end());
    const double b = *std::min_element(lookup.begin(), lookup.end());
    std::printf("\nFetching a device's communicator, comm(mask) (min of %d rounds of 2e6 calls):\n\n", rounds);
    std::printf("| %-52s | %8s |\n|---|---:|\n", "variant", "ns/call");
    std::printf("| %-52s | %8.3f |\n", "hook compiled out", a * 1e9);
    std::printf("| %-52s | %8.3f |\n", "hook compiled in, off (the branch)", b * 1e9);
    std::printf("\nThe branch costs %.3f ns per collective: %.3f%% of the raw 8 B all_reduce measured above.\n",
                (b - a) * 1e9, (b - a) / median(raw) * 100);
  }
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

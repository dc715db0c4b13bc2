// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The fixed cost of one call on a hybrid mesh (P processes x T device threads): an empty `spmd` on
// a `hybrid_runner` on the process-wide device threads (the default runner's) and on one with its own threads,
// next to its peer in the same run: `MPI_Barrier` on the same processes, the least any call that
// spans the processes must pay. Each call builds its hybrid world (exec/mpi_runner.hpp).
//   mpirun -np 2 build/bench/hybrid_bench [--threads 2] [--calls 400]
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2 (on every process).
#include "bench_options.hpp"

namespace {
struct options {
  int threads = 2, calls = 400;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("hybrid_bench", "usage: mpirun -np P hybrid_bench [--threads T] [--calls N]\n", argc, argv);
  options o;
  o.threads = static_cast<int>(cl.integer("--threads", o.threads, 1, 256));
  o.calls = static_cast<int>(cl.integer("--calls", o.calls, 1, 100000000));
  cl.done();
  return o;
}
}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <meshlib.hpp>
#include <meshlib/mpi.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {
struct stats {
  double p10, median, p90;
};
template <class F>
stats time_calls(int calls, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < calls; ++i) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  const auto at = [&](double q) { return t[static_cast<std::size_t>(q * static_cast<double>(t.size() - 1))]; };
  return {at(0.1), at(0.5), at(0.9)};
}
}  // namespace

int main(int argc, char** argv) {
  const options o = parse_options(argc, argv);  // before MPI starts: a bad option needs no MPI
  meshlib::mpi::guard run;
  const int threads = o.threads, calls = o.calls;
  auto world = meshlib::mpi::world();
  const meshlib::mesh<meshlib::axis<"x">> m{static_cast<std::size_t>(world.size() * threads)};
  const meshlib::hybrid_runner shared(meshlib::exec::detail::process_wide_threads, world, threads);
  const meshlib::hybrid_runner own(world, threads);
  meshlib::spmd(m, [] {}, shared);  // warm-up: threads started, Kokkos instances made
  meshlib::spmd(m, [] {}, own);
  const stats barrier = time_calls(calls, [] { MPI_Barrier(MPI_COMM_WORLD); });
  const stats backend = time_calls(calls, [&] { meshlib::spmd(m, [] {}, shared); });
  const stats runner = time_calls(calls, [&] { meshlib::spmd(m, [] {}, own); });
  if (world.rank() == 0) {
    std::printf("%d processes x %d threads, %d calls each (us; p10 / median / p90)\n\n", world.size(), threads, calls);
    std::printf("| call | p10 | median | p90 | median / MPI_Barrier |\n| --- | ---: | ---: | ---: | ---: |\n");
    auto row = [&](const char* name, const stats& s) {
      std::printf("| %s | %.1f | %.1f | %.1f | %.0fx |\n", name, s.p10, s.median, s.p90, s.median / barrier.median);
    };
    row("MPI_Barrier (peer)", barrier);
    row("empty spmd, hybrid_runner on the process-wide threads", backend);
    row("empty spmd, hybrid_runner with its own threads", runner);
  }
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// meshlib's MPI all_reduce against MPI_Allreduce called directly: same run, same ranks, same
// buffers, measurements interleaved round by round so that both see the same machine, medians
// over the rounds. Prints a Markdown table (rank 0); bench/mpi_overhead.py puts it into
// docs/benchmarks.md.
//
//   mpirun -np N mpi_overhead [--sizes 1M,4M,16M] [--rounds 15]
//
// Every variant includes meshlib's always-on mismatch detection (a 16-byte fingerprint all-reduce
// before the data moves), so the overhead columns are its cost plus the timeout machinery's.
// Variants of meshlib's all_reduce (float, sum, out of place: the inputs stay the same every call):
//   default      timeout on (MESHLIB_COMM_TIMEOUT or 60 s), large_payload_mode::automatic
//   no timeout   mpi_comm_options::timeout = 0: MPI_Allreduce straight away
//   barrier      large_payload_mode::barrier_then_blocking: the polled fingerprint exchange (which
//                shows every rank arrived), then MPI_Allreduce
//   polled       large_payload_mode::nonblocking: MPI_Iallreduce polled against the deadline
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2 (on every rank).
#include <cstddef>
#include <string>
#include <vector>

#include "bench_options.hpp"

namespace {

struct options {
  std::vector<std::size_t> sizes;
  int rounds = 15;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("mpi_overhead", "usage: mpirun -np N mpi_overhead [--sizes 1M,4M,16M] [--rounds R]\n", argc, argv);
  options o;
  const std::string list = cl.text("--sizes", "1M,4M,16M");
  for (const std::string& s : cl.list_of("--sizes", list)) {
    o.sizes.push_back(cl.bytes_of("--sizes " + list + ":", s, sizeof(float)));
    if (o.sizes.back() / sizeof(float) > 0x7fffffff) cl.fail("--sizes " + list + ": " + s + " is more floats than MPI counts");
  }
  o.rounds = static_cast<int>(cl.integer("--rounds", o.rounds, 1, 1000000));
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <meshlib/comm/mpi/mpi_communicator.hpp>

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// Seconds per call of `f`, the slowest rank's, over `iters` calls.
template <class F>
double time_it(int iters, F&& f) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  for (int i = 0; i < iters; ++i) f();
  double t = (MPI_Wtime() - t0) / iters, worst = 0;
  MPI_Allreduce(&t, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return worst;
}

}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_options(argc, argv);  // before MPI_Init: a bad option needs no MPI
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const std::vector<std::size_t>& sizes = opt.sizes;
  const int rounds = opt.rounds;
  {
    meshlib::mpi_communicator with_timeout(MPI_COMM_WORLD);
    meshlib::mpi_comm_options o;
    o.timeout = std::chrono::nanoseconds(0);
    meshlib::mpi_communicator no_timeout(MPI_COMM_WORLD, o);
    o = {};
    o.large_payloads = meshlib::mpi_comm_options::large_payload_mode::nonblocking;
    meshlib::mpi_communicator polled(MPI_COMM_WORLD, o);
    o.large_payloads = meshlib::mpi_comm_options::large_payload_mode::barrier_then_blocking;
    meshlib::mpi_communicator barrier(MPI_COMM_WORLD, o);
    if (rank == 0) {
      std::printf("| bytes per rank | ranks | MPI_Allreduce (us) | meshlib default (us) | overhead | no timeout (us) | overhead | barrier + blocking (us) | overhead | polled Iallreduce (us) | overhead |\n");
      std::printf("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    }
    for (std::size_t bytes : sizes) {
      const std::size_t count = bytes / sizeof(float);
      std::vector<float> in(count, 1.0f), out(count, 0.0f);
      const int iters = std::max(3, static_cast<int>(20e-3 / (1e-6 + static_cast<double>(bytes) / 1e9)));
      std::vector<double> direct, dflt, none, bar, poll;
      auto run_direct = [&] {
        MPI_Allreduce(in.data(), out.data(), static_cast<int>(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
      };
      auto run_with = [&](meshlib::mpi_communicator& c) {
        return [&] { c.all_reduce(std::span<const float>(in), std::span(out), meshlib::reduce_op::sum); };
      };
      time_it(iters, run_direct);  // warm-up
      time_it(iters, run_with(with_timeout));
      for (int r = 0; r < rounds; ++r) {
        // The order rotates every round, so that no variant always runs right after another.
        for (int k = 0; k < 5; ++k) {
          switch ((r + k) % 5) {
            case 0: direct.push_back(time_it(iters, run_direct)); break;
            case 1: dflt.push_back(time_it(iters, run_with(with_timeout))); break;
            case 2: none.push_back(time_it(iters, run_with(no_timeout))); break;
            case 3: bar.push_back(time_it(iters, run_with(barrier))); break;
            default: poll.push_back(time_it(iters, run_with(polled))); break;
          }
        }
      }
      const double d = median(direct), a = median(dflt), b = median(none), e = median(bar), c = median(poll);
      if (rank == 0)
        std::printf("| %zu | %d | %.1f | %.1f | %+.1f%% (%+.2f us) | %.1f | %+.1f%% | %.1f | %+.1f%% | %.1f | %+.1f%% |\n",
                    bytes, n, d * 1e6, a * 1e6, (a / d - 1) * 100, (a - d) * 1e6, b * 1e6, (b / d - 1) * 100, e * 1e6,
                    (e / d - 1) * 100, c * 1e6, (c / d - 1) * 100);
    }
  }
  MPI_Finalize();
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The pure-MPI peer of comm_bench: the same operations, sizes, iteration counts and rows, through
// MPI_Allreduce, MPI_Allgather, MPI_Reduce_scatter_block, MPI_Alltoall and MPI_Bcast.
//
//   mpirun -np N mpi_bench [--ops all] [--min 8] [--max 64M] [--repeat R]
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2 (on every rank).
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

bench::sweep_options parse_options(int argc, char** argv) {
  bench::command_line cl("mpi_bench", "usage: mpirun -np N mpi_bench [--ops all|OP,...] [--min 8] [--max 64M] [--repeat R]\n",
                         argc, argv);
  const auto o = bench::read_sweep_options(cl);
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <mpi.h>

namespace {

void run_op(std::string_view op, std::vector<float>& a, std::vector<float>& b, std::size_t count) {
  const int c = static_cast<int>(count);
  if (op == "all_reduce") MPI_Allreduce(a.data(), b.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (op == "all_gather") MPI_Allgather(a.data(), c, MPI_FLOAT, b.data(), c, MPI_FLOAT, MPI_COMM_WORLD);
  else if (op == "reduce_scatter") MPI_Reduce_scatter_block(a.data(), b.data(), c, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
  else if (op == "all_to_all") MPI_Alltoall(a.data(), c, MPI_FLOAT, b.data(), c, MPI_FLOAT, MPI_COMM_WORLD);
  else MPI_Bcast(a.data(), c, MPI_FLOAT, 0, MPI_COMM_WORLD);
}

}  // namespace

int main(int argc, char** argv) {
  const bench::sweep_options o = parse_options(argc, argv);  // before MPI_Init: a bad option needs no MPI
  MPI_Init(&argc, &argv);
  int rank = 0, n = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  const std::string& ops = o.ops;
  const std::size_t lo = o.lo, hi = o.hi;
  const int repeat = static_cast<int>(o.repeat);
  if (rank == 0) bench::print_header("mpi");
  std::vector<float> a(hi / sizeof(float) + 64, 1.0f), b(hi / sizeof(float) + 64, 0.0f);
  for (const char* op : bench::ops) {
    if (!bench::selected(ops, op)) continue;
    for (std::size_t size : bench::sizes(lo, hi)) {
      const std::size_t count = bench::count_for(op, size, n);
      const std::size_t bytes = bench::bytes_for(op, count, n);
      const int iters = bench::iterations_for(bytes);
      for (int rep = 0; rep < repeat; ++rep) {
        for (int w = 0; w < std::max(2, iters / 10); ++w) run_op(op, a, b, count);
        const int per_batch = std::max(1, iters / bench::batches);
        double sec[bench::batches], worst[bench::batches];
        MPI_Barrier(MPI_COMM_WORLD);
        for (int k = 0; k < bench::batches; ++k) {
          const double t0 = MPI_Wtime();
          for (int it = 0; it < per_batch; ++it) run_op(op, a, b, count);
          sec[k] = (MPI_Wtime() - t0) / per_batch;
        }
        MPI_Reduce(sec, worst, bench::batches, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
        if (rank == 0)
          bench::print_row("mpi", op, size, bytes, n, per_batch * bench::batches, bench::median_of(worst, bench::batches));
      }
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

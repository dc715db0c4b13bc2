// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The thread communicator's benchmark: nccl-tests style rows (op, bytes per rank, participants,
// time, algbw, busbw) for all_reduce, all_gather, reduce_scatter, all_to_all and broadcast.
// Run by bench/run_comm_bench.py next to mpi_bench; see docs/benchmarks.md.
//
//   comm_bench [--participants 2,4,8] [--ops all] [--min 8] [--max 64M] [--one-shot-max BYTES]
//              [--spin-ns NS] [--repeat R]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "bench_common.hpp"
#include "meshlib/comm.hpp"

namespace {

using meshlib::reduce_op;
using meshlib::thread_communicator;

void run_op(thread_communicator& c, std::string_view op, std::vector<float>& a, std::vector<float>& b,
            std::size_t count) {
  const auto n = static_cast<std::size_t>(c.size());
  if (op == "all_reduce") {
    c.all_reduce(std::span<const float>(a.data(), count), std::span<float>(b.data(), count), reduce_op::sum);
  } else if (op == "all_gather") {
    c.all_gather(std::span<const float>(a.data(), count), std::span<float>(b.data(), count * n));
  } else if (op == "reduce_scatter") {
    c.reduce_scatter(std::span<const float>(a.data(), count * n), std::span<float>(b.data(), count), reduce_op::sum);
  } else if (op == "all_to_all") {
    c.all_to_all(std::span<const float>(a.data(), count * n), std::span<float>(b.data(), count * n));
  } else {
    c.broadcast(std::span<const float>(a.data(), count), std::span<float>(b.data(), count), 0);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string parts = bench::arg(argc, argv, "--participants", "2,4,8");
  const std::string ops = bench::arg(argc, argv, "--ops", "all");
  const std::size_t lo = bench::parse_size(bench::arg(argc, argv, "--min", "8"));
  const std::size_t hi = bench::parse_size(bench::arg(argc, argv, "--max", "64M"));
  const int repeat = std::stoi(bench::arg(argc, argv, "--repeat", "1"));
  meshlib::thread_comm_options opts;
  opts.one_shot_max_bytes = bench::parse_size(bench::arg(argc, argv, "--one-shot-max", "0"));
  const long long spin = std::stoll(bench::arg(argc, argv, "--spin-ns", "-1"));
  opts.spin = std::chrono::nanoseconds(spin);
  opts.streaming_min_bytes = bench::parse_size(bench::arg(argc, argv, "--stream-min", "0"));
  // Bind participants to cores as OpenMPI binds its ranks (its default), unless --pin 0.
  opts.pin_threads = bench::arg(argc, argv, "--pin", "1") == "1";
  const auto sizes = bench::sizes(lo, hi);
  bench::print_header("thread");

  std::stringstream ps(parts);
  std::string tok;
  while (std::getline(ps, tok, ',')) {
    const int n = std::stoi(tok);
    meshlib::run_on_threads(
        n,
        [&](thread_communicator& c) {
          std::vector<float> a(hi / sizeof(float) + 64, 1.0f), b(hi / sizeof(float) + 64, 0.0f);
          for (const char* op : bench::ops) {
            if (!bench::selected(ops, op)) continue;
            for (std::size_t size : sizes) {
              const std::size_t count = bench::count_for(op, size, n);
              const std::size_t bytes = bench::bytes_for(op, count, n);
              const int iters = bench::iterations_for(bytes);
              for (int rep = 0; rep < repeat; ++rep) {
                for (int w = 0; w < std::max(2, iters / 10); ++w) run_op(c, op, a, b, count);  // warm-up
                const int per_batch = std::max(1, iters / bench::batches);
                double sec[bench::batches];
                c.barrier();
                for (int k = 0; k < bench::batches; ++k) {
                  const auto t0 = std::chrono::steady_clock::now();
                  for (int it = 0; it < per_batch; ++it) run_op(c, op, a, b, count);
                  sec[k] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / per_batch;
                }
                c.all_reduce(std::span<double>(sec), reduce_op::max);  // the slowest rank's time, per batch
                if (c.rank() == 0)
                  bench::print_row("thread", op, size, bytes, n, per_batch * bench::batches, bench::median_of(sec, bench::batches));
              }
            }
          }
        },
        opts);
  }
  return 0;
}

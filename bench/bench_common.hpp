// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Shared by comm_bench (thread communicator) and mpi_bench (OpenMPI): the operations, the sizes,
// the iteration counts and the row format, so that both programs measure the same thing; and what
// every benchmark reports beside its table (the load average). Standard library only (see
// bench_options.hpp: a benchmark's options are checked without building the benchmark).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "bench_options.hpp"

namespace bench {

inline const char* const ops[] = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"};

/// Nominal sizes: 8 B to 64 MiB, every factor of 8 plus the sizes the targets name.
inline std::vector<std::size_t> sizes(std::size_t lo, std::size_t hi) {
  const std::size_t all[] = {8,        64,       512,       4u << 10,  32u << 10, 64u << 10,
                             256u << 10, 1u << 20, 4u << 20, 16u << 20, 64u << 20};
  std::vector<std::size_t> out;
  for (std::size_t s : all)
    if (s >= lo && s <= hi) out.push_back(s);
  return out;
}

/// Elements of float per rank, as nccl-tests counts them: `size` is the per-rank buffer of
/// all_reduce and broadcast, the gathered output of all_gather, the scattered input of
/// reduce_scatter, the whole send buffer of all_to_all. Returns the per-rank (per-block) count.
inline std::size_t count_for(std::string_view op, std::size_t size, int n) {
  const std::size_t elems = std::max<std::size_t>(1, size / sizeof(float));
  if (op == "all_reduce" || op == "broadcast") return elems;
  return std::max<std::size_t>(1, elems / static_cast<std::size_t>(n));
}

/// Bytes per rank actually moved for the row (size rounded to whole elements and blocks).
inline std::size_t bytes_for(std::string_view op, std::size_t count, int n) {
  if (op == "all_reduce" || op == "broadcast") return count * sizeof(float);
  return count * sizeof(float) * static_cast<std::size_t>(n);
}

/// nccl-tests' bus bandwidth factor: what each link carries relative to the algorithm bandwidth.
inline double bus_factor(std::string_view op, int n) {
  const double nn = n;
  if (op == "all_reduce") return 2 * (nn - 1) / nn;
  if (op == "broadcast") return 1;
  return (nn - 1) / nn;
}

/// Iterations of one measurement: enough to last ~20 ms, at least 5.
inline int iterations_for(std::size_t bytes) {
  const double per_iter_guess = 2e-7 + static_cast<double>(bytes) / 2e9;  // seconds
  return static_cast<int>(std::clamp(0.02 / per_iter_guess, 5.0, 20000.0));
}

/// Batches per measurement: each row reports the median over batches of the slowest rank's mean
/// time per call in the batch. On a machine shared with other jobs a preemption hits a few batches,
/// not the median (nccl-tests reports the mean of one long batch, which such stalls dominate).
inline constexpr int batches = 9;

inline double median_of(double* v, int n) {
  std::sort(v, v + n);
  return v[n / 2];
}

inline void print_header(const char* impl) {
  std::printf("# impl %s: op bytes participants iters time_us algbw_GBps busbw_GBps\n", impl);
}

inline void print_row(const char* impl, std::string_view op, std::size_t nominal, std::size_t bytes, int n, int iters,
                      double seconds) {
  const double algbw = static_cast<double>(bytes) / seconds / 1e9;
  std::printf("%s %.*s %zu %zu %d %d %.3f %.3f %.3f\n", impl, static_cast<int>(op.size()), op.data(), nominal, bytes, n,
              iters, seconds * 1e6, algbw, algbw * bus_factor(op, n));
  std::fflush(stdout);
}

/// `n` floats in [-1, 1] from a fixed linear congruential sequence (matmul_bench, exec_bench).
inline std::vector<float> random_matrix(std::size_t n, unsigned seed) {
  std::vector<float> v(n);
  unsigned x = seed;
  for (auto& e : v) {
    x = x * 1664525u + 1013904223u;
    e = static_cast<float>((x >> 8) % 2001) / 1000.0f - 1.0f;
  }
  return v;
}

inline bool selected(const std::string& list, std::string_view op) {
  return list == "all" || ("," + list + ",").find("," + std::string(op) + ",") != std::string::npos;
}

/// The options comm_bench and mpi_bench share: --ops all|<op>,<op>..., --min and --max (bytes, the
/// range of `sizes` to run: it must hold one), --repeat R.
struct sweep_options {
  std::string ops = "all";
  std::size_t lo = 8, hi = 64u << 20;
  std::size_t repeat = 1;
};

inline sweep_options read_sweep_options(command_line& cl) {
  sweep_options o;
  o.ops = cl.text("--ops", "all");
  if (o.ops != "all")
    for (const std::string& op : cl.list_of("--ops", o.ops))
      if (std::find_if(std::begin(ops), std::end(ops), [&](const char* k) { return op == k; }) == std::end(ops))
        cl.fail("--ops " + o.ops + ": unknown operation '" + op +
                "' (all, or a list of all_reduce, all_gather, reduce_scatter, all_to_all, broadcast)");
  o.lo = cl.bytes("--min", "8");
  o.hi = cl.bytes("--max", "64M");
  if (sizes(o.lo, o.hi).empty())
    cl.fail("--min " + std::to_string(o.lo) + " and --max " + std::to_string(o.hi) +
            ": no size to run between them (the sizes are 8 B, 64 B, ... 64 MiB)");
  o.repeat = cl.count("--repeat", 1);
  return o;
}

/// The 1-minute load average (-1 where /proc/loadavg cannot be read): printed with every table, since
/// a loaded machine makes any figure meaningless.
inline double load_average() {
  double load = -1;
  if (FILE* f = std::fopen("/proc/loadavg", "r")) {
    if (std::fscanf(f, "%lf", &load) != 1) load = -1;
    std::fclose(f);
  }
  return load;
}

}  // namespace bench

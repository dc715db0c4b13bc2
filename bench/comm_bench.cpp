// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The thread communicator's benchmark: nccl-tests style rows (op, bytes per rank, participants,
// time, algbw, busbw) for all_reduce, all_gather, reduce_scatter, all_to_all and broadcast.
// Run by bench/run_comm_bench.py next to mpi_bench; see docs/benchmarks.md. With --pin 0 the
// participants are left where the scheduler puts them, as a user's own threads are, and the rows
// say `thread_unpinned`.
//
//   comm_bench [--participants 2,4,8] [--ops all] [--min 8] [--max 64M] [--one-shot-max BYTES]
//              [--spin-ns NS] [--yield-ns NS] [--repeat R] [--pin 0|1]
//   comm_bench --wake-latency [--pin 0|1]
//
// --wake-latency: what the spin window (comm/detail/spin_then_block.hpp) is weighed against: the time
// from a thread's futex wake-up call to the woken thread running, the woken thread blocked for
// 300 us first (its CPU gone idle, or taken by another job), 400 rounds, median, p10 and p90.
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2.
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include "bench_common.hpp"

namespace {

struct options {
  bench::sweep_options sweep;
  std::vector<int> participants;
  std::size_t one_shot_max = 0, stream_min = 0;
  long long spin_ns = -1, yield_ns = -1;
  bool pin = true;
  bool wake_latency = false;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("comm_bench",
                         "usage: comm_bench [--participants 2,4,8] [--ops all|OP,...] [--min 8] [--max 64M] [--repeat R]\n"
                         "                  [--one-shot-max BYTES] [--spin-ns NS] [--yield-ns NS] [--stream-min BYTES]\n"
                         "                  [--pin 0|1]\n"
                         "       comm_bench --wake-latency [--pin 0|1]\n",
                         argc, argv);
  options o;
  o.wake_latency = cl.flag("--wake-latency");
  o.sweep = bench::read_sweep_options(cl);
  const std::string parts = cl.text("--participants", "2,4,8");
  for (const std::string& p : cl.list_of("--participants", parts))
    o.participants.push_back(static_cast<int>(cl.integer_of("--participants " + parts + ":", p, 1, 1024)));
  o.one_shot_max = cl.bytes("--one-shot-max", "0", 0);
  o.spin_ns = cl.integer("--spin-ns", -1, -1, 1000000000);  // -1: the communicator's adaptive spin
  o.yield_ns = cl.integer("--yield-ns", -1, -1, 1000000000);  // -1: the communicator's default
  o.stream_min = cl.bytes("--stream-min", "0", 0);
  // Bind participants to cores as OpenMPI binds its ranks (its default), unless --pin 0.
  o.pin = cl.choice("--pin", {"0", "1"}, "1") == "1";
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <atomic>
#include <chrono>
#include <thread>

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

/// --wake-latency (see the file comment): with `pin`, the waker on the first allowed CPU and the
/// sleeper on the second, so that every wake-up crosses CPUs, as it does between pinned ranks.
void wake_latency(bool pin) {
  using clock = std::chrono::steady_clock;
  constexpr int rounds = 400;
  std::atomic<std::uint32_t> word{0};
  std::atomic<int> asleep{0};
  std::atomic<clock::rep> sent{0};
  std::vector<double> us;
  us.reserve(rounds);
  const auto pin_to = [pin](int index) {
#if defined(__linux__)
    cpu_set_t allowed;
    if (pin && pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0 && CPU_COUNT(&allowed) > 1)
      meshlib::comm::detail::pin_to(allowed, index);
#else
    (void)pin;
    (void)index;
#endif
  };
  std::thread sleeper([&] {
    pin_to(1);
    for (int i = 0; i < rounds; ++i) {
      asleep.store(i + 1);
      word.wait(static_cast<std::uint32_t>(i), std::memory_order_acquire);
      us.push_back(static_cast<double>(clock::now().time_since_epoch().count() - sent.load()) *
                   clock::period::num / clock::period::den * 1e6);
    }
  });
  pin_to(0);
  for (int i = 0; i < rounds; ++i) {
    while (asleep.load() != i + 1) std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(300));  // the sleeper is blocked by now
    sent.store(clock::now().time_since_epoch().count());
    word.store(static_cast<std::uint32_t>(i + 1), std::memory_order_release);
    word.notify_one();
  }
  sleeper.join();
  std::sort(us.begin(), us.end());
  std::printf("# wake-up latency of a blocked thread (%s): median %.1f us, p10 %.1f us, p90 %.1f us (%d rounds)\n",
              pin ? "pinned to another CPU" : "not pinned", us[rounds / 2], us[rounds / 10], us[rounds * 9 / 10], rounds);
}

int main(int argc, char** argv) {
  const options o = parse_options(argc, argv);
  if (o.wake_latency) {
    wake_latency(o.pin);
    return 0;
  }
  const std::size_t lo = o.sweep.lo, hi = o.sweep.hi;
  const std::string& ops = o.sweep.ops;
  const int repeat = static_cast<int>(o.sweep.repeat);
  meshlib::thread_comm_options opts;
  opts.one_shot_max_bytes = o.one_shot_max;
  opts.spin = std::chrono::nanoseconds(o.spin_ns);
  opts.yield = std::chrono::nanoseconds(o.yield_ns);
  opts.streaming_min_bytes = o.stream_min;
  opts.pin_threads = o.pin;
  const auto sizes = bench::sizes(lo, hi);
  // Unpinned rows are another implementation's: a user's own threads, which no one binds (the
  // comm table's "not pinned" row, bench/run_comm_bench.py).
  const char* impl = o.pin ? "thread" : "thread_unpinned";
  bench::print_header(impl);

  for (const int n : o.participants) {
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
                  bench::print_row(impl, op, size, bytes, n, per_batch * bench::batches, bench::median_of(sec, bench::batches));
              }
            }
          }
        },
        opts);
  }
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

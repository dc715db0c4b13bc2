// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Execution-layer benchmarks (issue 9), each against a real peer in the same run, medians over
// interleaved launches (a launch of one side, then one of the other, repeated), so that a stall of
// the shared machine hits both sides alike:
//  1. an empty `spmd` and `shard_map` call on 2 and 8 devices on the persistent device threads (the
//     process-wide runner and an own `thread_runner`) against a thread started per device and call
//     (per call; target <= 10 us and <= 60 us);
//  2. typed `psum` (into the workspace, and donated) against the thread communicator's own `all_reduce`
//     (out of place, and in place) on 2 devices, at 8 B, 1 MiB and 16 MiB (targets: +0.1 us at 8 B,
//     >= 0.9x bandwidth at 1 and 16 MiB); `exec_bench psum quick` runs it once, briefly;
//  3. global-view column-parallel `matmul` 2048^3 (X replicated, W P<none, "x">) on 2 devices against
//     the same product on 1 device (target >= 1.8x), and the 1-device one against cblas_sgemm
//     (target >= 0.9x);
//  4. ten launches of a 2-device 8 B all_reduce: each launch's median call (target: all < 2 us);
//  5. (`exec_bench psum8 [--load N]`, issue 27) per-call latency of an 8 B typed psum inside spmd
//     against run_on_threads' all_reduce, interleaved rounds, median and p90 of every call, with
//     N CPU-bound processes spinning beside it for the duration (target: typed <= 2x raw).
// Prints markdown tables; the Kokkos version and OPENBLAS_CORETYPE are printed with them.
//
//   exec_bench [call | psum [quick] | matmul | latency | psum8 [--load N]]   (none: 1 to 4)
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2.
#include <string>

#include "bench_options.hpp"

namespace {

struct options {
  std::string only;  ///< one benchmark, or empty: 1 to 4
  bool quick = false;
  int load = 0;
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("exec_bench",
                         "usage: exec_bench [call | psum [quick] | matmul | latency | psum8 [--load N]]\n", argc, argv);
  options o;
  const bool load = cl.given("--load");
  o.load = static_cast<int>(cl.integer("--load", 0, 0, 256));
  const auto pos = cl.positional(2);
  cl.done();
  if (!pos.empty()) {
    o.only = pos[0];
    if (o.only != "call" && o.only != "psum" && o.only != "matmul" && o.only != "latency" && o.only != "psum8")
      cl.fail("unknown benchmark " + o.only + " (call, psum, matmul, latency or psum8)");
  }
  if (pos.size() == 2) {
    if (o.only != "psum" || pos[1] != "quick") cl.fail("unexpected argument " + pos[1] + " (only `psum quick`)");
    o.quick = true;
  }
  if (load && o.only != "psum8") cl.fail("--load goes with psum8");
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include <cblas.h>
#include <csignal>
#include <sys/wait.h>
#include <unistd.h>

#include "bench_common.hpp"
#include "meshlib.hpp"

namespace {
using namespace meshlib;
using clock_type = std::chrono::steady_clock;
using mesh1 = mesh<axis<"x">>;

double seconds_since(clock_type::time_point t0) { return std::chrono::duration<double>(clock_type::now() - t0).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// ---- 1. empty spmd / shard_map ------------------------------------------------------------------
// The peer: what every call did before the persistent runners, a new thread per device and call
// (`run_on_threads`, still meshlib's path for nested calls), as a runner of its own.
struct start_threads_per_call {
  using is_runner = void;
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    run_on_threads(static_cast<int>(n), [&](thread_communicator& c) { body(static_cast<std::size_t>(c.rank()), std::move(c)); });
  }
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const { return thread_runner(exec::detail::process_wide_threads).local_devices(n); }
};

void bench_empty_call() {
  constexpr int batches = 9;
  const thread_runner own;
  struct row {
    std::size_t devices;
    std::vector<double> start, pooled, owned, map_start, map_pooled;
  };
  std::array<row, 2> rows{row{2, {}, {}, {}, {}, {}}, row{8, {}, {}, {}, {}, {}}};
  auto per_call = [](int calls, auto&& call) {
    call();  // warm: threads started, instances made
    const auto t0 = clock_type::now();
    for (int c = 0; c < calls; ++c) call();
    return seconds_since(t0) / calls;
  };
  for (int b = 0; b < batches; ++b) {
    for (auto& r : rows) {
      const mesh1 m{r.devices};
      const int slow_calls = r.devices > 2 ? 20 : 100, fast_calls = 400;
      auto x = from_host(named_sharding<mesh1, P<"x">>{m}, std::array<std::size_t, 1>{r.devices}, std::vector<float>(r.devices));
      auto id = [](auto blk) { return blk; };
      const auto map_start = shard_map(id, m, P<"x">{}, P<"x">{}, start_threads_per_call{});
      const auto map_pooled = shard_map(id, m, P<"x">{}, P<"x">{});
      r.start.push_back(per_call(slow_calls, [&] { spmd(m, [] {}, start_threads_per_call{}); }));
      r.pooled.push_back(per_call(fast_calls, [&] { spmd(m, [] {}); }));
      r.owned.push_back(per_call(fast_calls, [&] { spmd(m, [] {}, own); }));
      r.map_start.push_back(per_call(slow_calls, [&] { (void)map_start(x); }));
      r.map_pooled.push_back(per_call(fast_calls, [&] { (void)map_pooled(x); }));
    }
  }
  std::printf("\n### Empty spmd / shard_map call: persistent device threads against a thread per device and call\n\n"
              "| devices | call | threads started per call (us) | process-wide runner (us) | own thread_runner (us) | speedup | target (us) | met |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (const auto& r : rows) {
    const double target = r.devices == 2 ? 10e-6 : 60e-6;
    const double start = median(r.start), pooled = median(r.pooled), owned = median(r.owned);
    std::printf("| %zu | spmd | %.1f | %.1f | %.1f | %.0fx | %.0f | %s |\n", r.devices, start * 1e6, pooled * 1e6,
                owned * 1e6, start / pooled, target * 1e6, std::max(pooled, owned) <= target ? "yes" : "no");
    const double ms = median(r.map_start), mp = median(r.map_pooled);
    std::printf("| %zu | shard_map, %zu floats | %.1f | %.1f | | %.0fx | %.0f | %s |\n", r.devices, r.devices, ms * 1e6,
                mp * 1e6, ms / mp, target * 1e6, mp <= target ? "yes" : "no");
  }
}

// ---- 2. psum against the communicator's all_reduce -----------------------------------------------
// `quick` (exec_bench psum quick): one batch, a tenth of the calls: a build-and-run check only.
void bench_psum(bool quick) {
  const mesh1 m{2};
  using L = local_tensor<float, 1, mesh1, mesh1::mask_of<"x">()>;
  const std::array<std::size_t, 3> sizes{8, 1u << 20, 16u << 20};
  const int batches = quick ? 1 : 7;
  std::printf("\n### Typed psum against the thread communicator's all_reduce, 2 devices\n\n"
              "psum writes out of place into the device's workspace (no allocation after the first call); its peer\n"
              "is the communicator's out-of-place all_reduce; the in-place one is the donated psum's peer.\n\n"
              "| size | all_reduce in place (us) | all_reduce out of place (us) | psum (us) | psum donated (us) | psum / out-of-place bandwidth | donated / in-place | target |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t bytes : sizes) {
    const std::size_t count = std::max<std::size_t>(1, bytes / sizeof(float));
    const int iters = (bytes <= 64 ? 20000 : bytes <= (1u << 20) ? 200 : 20) / (quick ? 10 : 1);
    std::vector<double> t_comm, t_oop, t_psum, t_don;
    for (int b = 0; b < batches; ++b) {
      // the peers: the communicator's own all_reduce on a buffer, in place and out of place
      run_on_threads(2, [&](thread_communicator& c) {
        std::vector<float> buf(count, 0.0f), in(count, 1.0f);
        c.barrier().wait();
        auto t0 = clock_type::now();
        for (int i = 0; i < iters; ++i) c.all_reduce(std::span<float>(buf), reduce_op::sum).wait();
        if (c.rank() == 0) t_comm.push_back(seconds_since(t0) / iters);
        c.barrier().wait();
        t0 = clock_type::now();
        for (int i = 0; i < iters; ++i)
          c.all_reduce(std::span<const float>(in), std::span<float>(buf), reduce_op::sum).wait();
        if (c.rank() == 0) t_oop.push_back(seconds_since(t0) / iters);
      });
      spmd(m, [&](std::size_t dev) {
        L x(std::array<std::size_t, 1>{count}, m, dev);
        // Untimed: both devices have filled x (the peers start after a barrier) and the workspace
        // has its buffer (the first call of a shape allocates it; later spmd calls reuse it).
        (void)psum<"x">(x);
        auto t0 = clock_type::now();
        for (int i = 0; i < iters; ++i) {
          auto r = psum<"x">(x);
          (void)r;
        }
        if (dev == 0) t_psum.push_back(seconds_since(t0) / iters);
        t0 = clock_type::now();
        for (int i = 0; i < iters; ++i) {
          auto r = psum<"x">(std::move(x));
          x = L(r.view(), m, dev);  // the sum, as the next varying input: x stays the only holder
        }
        if (dev == 0) t_don.push_back(seconds_since(t0) / iters);
      });
    }
    const double c = median(t_comm), o = median(t_oop), p = median(t_psum), d = median(t_don);
    const std::string target =
        bytes <= 64 ? "+0.1 us: " + std::string(p - o <= 0.1e-6 ? "met" : "missed") +
                          std::string(d - c <= 0.1e-6 ? ", met (donated)" : ", missed (donated)")
                    : ">= 0.9x: " + std::string(o / p >= 0.9 ? "met" : "missed") +
                          std::string(c / d >= 0.9 ? ", met (donated)" : ", missed (donated)");
    std::printf("| %zu B | %.2f | %.2f | %.2f | %.2f | %.2fx | %.2fx | %s |\n", bytes, c * 1e6, o * 1e6, p * 1e6, d * 1e6,
                o / p, c / d, target.c_str());
  }
}

// ---- 3. global-view matmul -----------------------------------------------------------------------
using bench::random_matrix;

void bench_matmul(std::size_t n) {
  const auto hx = random_matrix(n * n, 1), hw = random_matrix(n * n, 2);
  const std::array<std::size_t, 2> shape{n, n};
  const mesh1 m1{1}, m2{2};
  auto x1 = from_host(named_sharding<mesh1, P<>>(m1), shape, hx);
  auto w1 = from_host(named_sharding<mesh1, P<none, "x">>(m1), shape, hw);
  auto x2 = from_host(named_sharding<mesh1, P<>>(m2), shape, hx);
  auto w2 = from_host(named_sharding<mesh1, P<none, "x">>(m2), shape, hw);
  std::vector<float> c(n * n);
  constexpr int batches = 9;
  std::vector<double> t_blas, t1, t2;
  (void)matmul(x1, w1);  // warm up (BLAS threads set to 1 per device, workers started)
  (void)matmul(x2, w2);
  for (int b = 0; b < batches; ++b) {
    auto t0 = clock_type::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, static_cast<int>(n), static_cast<int>(n), static_cast<int>(n),
                1.0f, hx.data(), static_cast<int>(n), hw.data(), static_cast<int>(n), 0.0f, c.data(), static_cast<int>(n));
    t_blas.push_back(seconds_since(t0));
    t0 = clock_type::now();
    (void)matmul(x1, w1);
    t1.push_back(seconds_since(t0));
    t0 = clock_type::now();
    (void)matmul(x2, w2);
    t2.push_back(seconds_since(t0));
  }
  const double blas = median(t_blas), one = median(t1), two = median(t2);
  const double flop = 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  std::printf("\n### Global-view column-parallel matmul %zu^3 (X replicated, W P<none, \"x\">), one BLAS thread per device\n\n"
              "| run | time (ms) | GFLOP/s | ratio | target |\n| --- | --- | --- | --- | --- |\n",
              n);
  std::printf("| cblas_sgemm, 1 thread | %.1f | %.1f | | |\n", blas * 1e3, flop / blas / 1e9);
  std::printf("| meshlib, 1 device | %.1f | %.1f | %.2fx cblas | >= 0.9x: %s |\n", one * 1e3, flop / one / 1e9, blas / one,
              blas / one >= 0.9 ? "met" : "missed");
  std::printf("| meshlib, 2 devices | %.1f | %.1f | %.2fx 1 device | >= 1.8x: %s |\n", two * 1e3, flop / two / 1e9, one / two,
              one / two >= 1.8 ? "met" : "missed");
}

// ---- 4. latency stability ------------------------------------------------------------------------
void bench_latency_launches() {
  std::printf("\n### Ten launches of a 2-device 8 B all_reduce (each launch: median of 2000 calls)\n\n| launch | median (us) |\n| --- | --- |\n");
  double worst = 0;
  for (int launch = 0; launch < 10; ++launch) {
    double med = 0;
    run_on_threads(2, [&](thread_communicator& c) {
      std::array<float, 2> buf{};
      std::vector<double> t(2000);
      c.barrier().wait();
      for (auto& e : t) {
        const auto t0 = clock_type::now();
        c.all_reduce(std::span<float>(buf), reduce_op::sum).wait();
        e = seconds_since(t0);
      }
      if (c.rank() == 0) med = median(t);
    });
    worst = std::max(worst, med);
    std::printf("| %d | %.2f |\n", launch, med * 1e6);
  }
  std::printf("\nWorst launch %.2f us: target (every launch < 2 us) %s.\n", worst * 1e6, worst < 2e-6 ? "met" : "missed");
}

// ---- 5. 8 B typed psum against the raw communicator, quiet or loaded --------------------------------
// N CPU-bound processes for as long as this object lives (each also ends itself after `limit_s`,
// so a killed benchmark leaves nothing spinning).
class cpu_load {
 public:
  cpu_load(int n, unsigned limit_s) {
    for (int i = 0; i < n; ++i) {
      const pid_t pid = ::fork();
      if (pid == 0) {
        ::alarm(limit_s);  // the default action of SIGALRM ends the child
        volatile unsigned long spin = 0;
        for (;;) spin = spin + 1;
      }
      if (pid > 0) kids_.push_back(pid);
    }
  }
  ~cpu_load() {
    for (pid_t p : kids_) ::kill(p, SIGKILL);
    for (pid_t p : kids_) ::waitpid(p, nullptr, 0);
  }
  cpu_load(const cpu_load&) = delete;
  cpu_load& operator=(const cpu_load&) = delete;

 private:
  std::vector<pid_t> kids_;
};

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(q * static_cast<double>(v.size())))];
}

void bench_psum8(int load) {
  constexpr int rounds = 15, calls = 2000;
  const mesh1 m{2};
  using L = local_tensor<float, 1, mesh1, mesh1::mask_of<"x">()>;
  std::vector<double> raw, typed, pooled, raw_round, typed_round;
  const cpu_load loader(load, 120);
  for (int round = 0; round < rounds; ++round) {
    // Interleaved: a round of the raw communicator, then one of the typed path, so that a stall of
    // the shared machine hits both alike. Device 0's time of every call.
    std::vector<double> t(calls);
    run_on_threads(2, [&](thread_communicator& c) {
      std::array<float, 2> buf{};
      c.barrier().wait();
      for (int i = 0; i < calls; ++i) {
        const auto t0 = clock_type::now();
        c.all_reduce(std::span<float>(buf), reduce_op::sum).wait();
        if (c.rank() == 0) t[static_cast<std::size_t>(i)] = seconds_since(t0);
      }
    });
    raw.insert(raw.end(), t.begin(), t.end());
    raw_round.push_back(median(t));
    // The raw communicator on spmd's device threads (the process-wide pool): what the typed path
    // runs on, without the typed layer.
    thread_runner(exec::detail::process_wide_threads).run(2, [&](std::size_t dev, thread_communicator c) {
      std::array<float, 2> buf{};
      c.barrier().wait();
      for (int i = 0; i < calls; ++i) {
        const auto t0 = clock_type::now();
        c.all_reduce(std::span<float>(buf), reduce_op::sum).wait();
        if (dev == 0) t[static_cast<std::size_t>(i)] = seconds_since(t0);
      }
    });
    pooled.insert(pooled.end(), t.begin(), t.end());
    spmd(m, [&](std::size_t dev) {
      L x(std::array<std::size_t, 1>{2}, m, dev);
      (void)psum<"x">(x);  // the workspace's buffer, and both devices inside
      for (int i = 0; i < calls; ++i) {
        const auto t0 = clock_type::now();
        auto r = psum<"x">(x);
        if (dev == 0) t[static_cast<std::size_t>(i)] = seconds_since(t0);
        (void)r;
      }
    });
    typed.insert(typed.end(), t.begin(), t.end());
    typed_round.push_back(median(t));
  }
  const double rm = median(raw), r9 = percentile(raw, 0.9), tm = median(typed), t9 = percentile(typed, 0.9);
  std::printf("\n### 8 B psum inside spmd against run_on_threads' all_reduce, 2 devices, %d CPU-bound processes beside\n\n"
              "%d interleaved rounds of %d calls each; device 0's time of every call.\n\n"
              "| load | raw median (us) | raw p90 (us) | typed median (us) | typed p90 (us) | median ratio | p90 ratio | worst round median raw / typed (us) | target (<= 2x) |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
              load, rounds, calls);
  const double worst_raw = *std::max_element(raw_round.begin(), raw_round.end());
  const double worst_typed = *std::max_element(typed_round.begin(), typed_round.end());
  std::printf("| %d | %.2f | %.2f | %.2f | %.2f | %.2fx | %.2fx | %.2f / %.2f | %s |\n", load, rm * 1e6, r9 * 1e6, tm * 1e6,
              t9 * 1e6, tm / rm, t9 / r9, worst_raw * 1e6, worst_typed * 1e6, tm <= 2 * rm ? "met" : "missed");
  auto slow = [](const std::vector<double>& v) { return std::count_if(v.begin(), v.end(), [](double x) { return x > 10e-6; }); };
  std::printf("\nRounds whose median call took over 10 us: raw %td of %d, typed %td of %d.\n", slow(raw_round), rounds,
              slow(typed_round), rounds);
  std::printf("\nThe raw all_reduce on spmd's device threads (thread_runner::run, no typed layer): median %.2f us, p90 %.2f us.\n",
              median(pooled) * 1e6, percentile(pooled, 0.9) * 1e6);
}

}  // namespace

int main(int argc, char** argv) {
  const options o = parse_options(argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("## Execution layer (bench/exec_bench.cpp)\n\nKokkos %d.%d.%d (%s), OPENBLAS_CORETYPE=%s, %u hardware threads.\n",
              KOKKOS_VERSION / 10000, KOKKOS_VERSION / 100 % 100, KOKKOS_VERSION % 100,
              Kokkos::DefaultExecutionSpace::name(), coretype ? coretype : "(unset)",
              std::thread::hardware_concurrency());
  const std::string& only = o.only;
  if (only.empty() || only == "call") bench_empty_call();
  if (only.empty() || only == "psum") bench_psum(o.quick);
  if (only.empty() || only == "matmul") bench_matmul(2048);
  if (only.empty() || only == "latency") bench_latency_launches();
  if (only == "psum8") bench_psum8(o.load);
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

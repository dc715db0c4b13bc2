// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Trains the hand-written peer (bench/handwritten_mlp.hpp) on Fashion-MNIST with 2 OpenBLAS
// threads, with the flagship's defaults (Adam, peak lr 1e-3, linear warm-up over min(100, steps/10)
// steps, cosine decay to 2% of the peak at the last step, batch 256, 5 epochs), and prints, per epoch, the mean loss, test accuracy and training samples/s; then the
// sgemm rates that say how close to the BLAS floor its step runs:
//   - the step's sgemm calls alone (same shapes, same order), and
//   - one large square sgemm (2048^3), OpenBLAS's best case on this machine,
// each by wall clock (best of 40) and by CPU time per thread (robust to other jobs on the machine).
// meshlib is used only to read the IDX files and for the epoch order (epoch_permutation, the
// flagship's shuffle), never in the trainer.
//
// Usage: handwritten_mlp [--epochs N] [--hidden H] [--batch B] [--optimizer adam|sgd] [--lr X]
//                        [--momentum X] [--threads T] [--elementwise-threads E] [--seed S] [--data DIR]
//                        [--steps N] [--no-floor]
// --steps N stops each epoch after N steps (the schedule is then over epochs x N steps), and
// --no-floor leaves out the sgemm rates (seconds of 2048^3 products): together they make the short
// runs of bench/scaling.py, which times the peer at several core counts within minutes.
//
// Bad options (bench/bench_options.hpp) end it with a message and exit status 2.
#include <cstdint>
#include <optional>
#include <string>

#include "bench_options.hpp"

namespace {

/// The command line; what is not given keeps handwritten::mlp_config's default.
struct options {
  std::size_t epochs = 5;
  std::optional<std::size_t> hidden, batch;
  std::optional<float> lr, momentum;
  std::optional<std::string> method;
  std::optional<std::uint64_t> seed;
  int threads = 2;
  int elementwise_threads = 1;  // see handwritten_mlp.hpp
  std::optional<std::string> dir;
  std::optional<std::size_t> steps;  // per epoch; default: the whole training set
  bool floor = true;                 // time the sgemm floor after training
};

options parse_options(int argc, char** argv) {
  bench::command_line cl("handwritten_mlp",
                         "usage: handwritten_mlp [--epochs N] [--hidden H] [--batch B] [--optimizer adam|sgd] [--lr X]\n"
                         "                       [--momentum X] [--threads T] [--elementwise-threads E] [--seed S] [--data DIR]\n"
                         "                       [--steps N] [--no-floor]\n",
                         argc, argv);
  options o;
  o.epochs = cl.count("--epochs", o.epochs);
  if (cl.given("--hidden")) o.hidden = cl.count("--hidden", 1);
  if (cl.given("--batch")) o.batch = cl.count("--batch", 1);
  if (cl.given("--optimizer")) o.method = cl.choice("--optimizer", {"adam", "sgd"}, "adam");
  if (cl.given("--lr")) o.lr = static_cast<float>(cl.real("--lr", 0, 0, 1e6));
  if (cl.given("--momentum")) o.momentum = static_cast<float>(cl.real("--momentum", 0, 0, 1));
  o.threads = static_cast<int>(cl.integer("--threads", o.threads, 1, 1024));
  o.elementwise_threads = static_cast<int>(cl.integer("--elementwise-threads", o.elementwise_threads, 1, 1024));
  if (cl.given("--seed"))
    o.seed = static_cast<std::uint64_t>(cl.integer("--seed", 0, 0, std::numeric_limits<long long>::max()));
  if (cl.given("--data")) o.dir = cl.text("--data", "");
  if (cl.given("--steps")) o.steps = cl.count("--steps", 1);
  o.floor = !cl.flag("--no-floor");
  cl.done();
  return o;
}

}  // namespace

#if !MESHLIB_BENCH_OPTIONS_ONLY
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <sys/resource.h>

#include <cblas.h>

#include "handwritten_mlp.hpp"
#include "meshlib/nn/data.hpp"
#include "meshlib/nn/number_text.hpp"

namespace {
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

/// User + system CPU seconds of all threads of this process.
double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}
}  // namespace

int main(int argc, char** argv) {
  const options opt = parse_options(argc, argv);
  handwritten::mlp_config config;
  const std::size_t epochs = opt.epochs;
  const int threads = opt.threads;
  const int elementwise_threads = opt.elementwise_threads;
  if (opt.hidden) config.hidden = *opt.hidden;
  if (opt.batch) config.batch = *opt.batch;
  if (opt.lr) config.learning_rate = *opt.lr;
  if (opt.method) config.method = *opt.method == "sgd" ? handwritten::optimizer::sgd : handwritten::optimizer::adam;
  if (opt.momentum) config.momentum = *opt.momentum;
  if (opt.seed) config.seed = *opt.seed;
  const std::string dir = opt.dir ? *opt.dir : meshlib::nn::default_fashion_mnist_dir().string();
  openblas_set_num_threads(threads);
  config.threads = elementwise_threads;
  const char* coretype = std::getenv("OPENBLAS_CORETYPE");
  std::printf("OpenBLAS %s, core %s, %d threads, OPENBLAS_CORETYPE=%s\n", openblas_get_config(),
              openblas_get_corename(), threads, coretype ? coretype : "(unset)");
  // Other jobs on the machine distort every time below: say how busy it was.
  if (std::FILE* f = std::fopen("/proc/loadavg", "r")) {
    double one = 0;
    if (std::fscanf(f, "%lf", &one) == 1) std::printf("load average at start: %.1f\n", one);
    std::fclose(f);
  }

  meshlib::nn::fashion_mnist data;
  try {
    data = meshlib::nn::load_fashion_mnist(dir);
  } catch (const meshlib::error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  const auto& train = data.train;
  const auto& test = data.test;
  const std::size_t steps = std::min(train.count / config.batch, opt.steps.value_or(train.count));
  // The flagship's schedule: warm-up over min(100, total / 10) steps, cosine to 2% at the end.
  config.total = steps * epochs;
  config.warmup = std::min<std::size_t>(100, config.total / 10);
  config.final_fraction = 0.02f;
  handwritten::mlp model(config);
  std::printf("hand-written MLP %zu-%zu-%zu-%zu, %s peak lr %s (warm-up %zu steps, cosine to 2%% at step %zu)%s, "
              "batch %zu, seed %llu\n",
              config.inputs, config.hidden, config.hidden, config.classes,
              config.method == handwritten::optimizer::sgd ? "SGD" : "Adam",
              meshlib::nn::detail::number_text(config.learning_rate).c_str(), config.warmup, config.total,
              config.method == handwritten::optimizer::sgd ? (" momentum " + meshlib::nn::detail::number_text(config.momentum)).c_str() : "",
              config.batch, static_cast<unsigned long long>(config.seed));
  std::vector<float> x(config.batch * train.features);
  std::vector<std::int32_t> y(config.batch);

  if (epochs > 0) {
    std::printf("\n| epoch | mean loss | test accuracy | samples/s | GFLOP/s | time (s) |\n");
    std::printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
  }
  double total_train_seconds = 0, last_test_accuracy = 0;
  for (std::size_t epoch = 0; epoch < epochs; ++epoch) {
    const auto order = meshlib::nn::epoch_permutation(train.count, config.seed, epoch);
    double loss_sum = 0, step_seconds = 0;
    for (std::size_t s = 0; s < steps; ++s) {
      for (std::size_t r = 0; r < config.batch; ++r) {
        const std::size_t e = order[s * config.batch + r];
        std::memcpy(x.data() + r * train.features, train.x.data() + e * train.features,
                    train.features * sizeof(float));
        y[r] = train.y[e];
      }
      const auto t0 = clock_type::now();
      loss_sum += model.step(x.data(), y.data(), config.batch);
      step_seconds += seconds_since(t0);
    }
    total_train_seconds += step_seconds;
    const std::size_t right = model.correct(test.x.data(), test.y.data(), test.count);
    last_test_accuracy = 100.0 * static_cast<double>(right) / static_cast<double>(test.count);
    const double samples = static_cast<double>(steps * config.batch);
    std::printf("| %zu | %.4f | %.2f%% | %.0f | %.1f | %.2f |\n", epoch + 1,
                loss_sum / static_cast<double>(steps), last_test_accuracy, samples / step_seconds,
                model.step_flops(config.batch) * static_cast<double>(steps) / step_seconds / 1e9,
                step_seconds);
    std::fflush(stdout);
  }

  const auto summary = [&] {
    if (epochs > 0)
      std::printf("summary: %zu epochs, test accuracy %.2f%%, %.0f samples/s over the training steps\n", epochs,
                  last_test_accuracy, static_cast<double>(epochs * steps * config.batch) / total_train_seconds);
  };
  if (!opt.floor) {
    summary();
    return 0;
  }
  // The BLAS floor: the step's own sgemm calls, then one large square sgemm. Timed on the first
  // training rows (--epochs 0 times without training). Best of many: the machine is shared.
  for (std::size_t r = 0; r < config.batch; ++r) {
    std::memcpy(x.data() + r * train.features, train.x.data() + r * train.features, train.features * sizeof(float));
    y[r] = train.y[r];
  }
  // Two clocks: wall time (best of `reps`), and CPU time of all threads / threads (mean), which
  // is what the same work takes on `threads` otherwise idle cores when other jobs share the machine
  // (OpenBLAS's threads spin between calls, so idle gaps inside a step still count).
  const int reps = 40;
  struct timing {
    double wall_best, cpu_per_thread;
  };
  auto measure = [&](auto&& body) {
    double best = 1e30;
    const double cpu0 = cpu_seconds();
    for (int r = 0; r < reps; ++r) {
      const auto t0 = clock_type::now();
      body();
      best = std::min(best, seconds_since(t0));
    }
    return timing{best, (cpu_seconds() - cpu0) / reps / threads};
  };
  const timing step_t = measure([&] { model.step(x.data(), y.data(), config.batch); });
  const timing gemm_t = measure([&] { (void)model.sgemm_only_seconds(x.data(), config.batch, 1); });
  const int square = 2048;
  std::vector<float> sa(std::size_t{square} * square, 0.5f), sb(sa.size(), 0.25f), sc(sa.size());
  const timing square_t = measure([&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, square, square, square, 1.0f, sa.data(),
                square, sb.data(), square, 0.0f, sc.data(), square);
  });
  const double flops = model.step_flops(config.batch);
  const double square_flops = 2.0 * square * square * square;
  auto gflops = [](double f, double s) { return f / s / 1e9; };
  std::printf("\n| %d threads, best of %d (wall) / mean CPU time per thread | wall ms | GFLOP/s | CPU ms | GFLOP/s |\n",
              threads, reps);
  std::printf("| --- | ---: | ---: | ---: | ---: |\n");
  std::printf("| training step, batch %zu (%.0f samples/s wall) | %.2f | %.1f | %.2f | %.1f |\n", config.batch,
              static_cast<double>(config.batch) / step_t.wall_best, step_t.wall_best * 1e3,
              gflops(flops, step_t.wall_best), step_t.cpu_per_thread * 1e3, gflops(flops, step_t.cpu_per_thread));
  std::printf("| the step's 8 sgemm calls alone | %.2f | %.1f | %.2f | %.1f |\n", gemm_t.wall_best * 1e3,
              gflops(flops, gemm_t.wall_best), gemm_t.cpu_per_thread * 1e3, gflops(flops, gemm_t.cpu_per_thread));
  std::printf("| square sgemm %d^3 | %.2f | %.1f | %.2f | %.1f |\n", square, square_t.wall_best * 1e3,
              gflops(square_flops, square_t.wall_best), square_t.cpu_per_thread * 1e3,
              gflops(square_flops, square_t.cpu_per_thread));
  std::printf("step rate / its sgemm calls' rate: %.0f%% (wall), %.0f%% (CPU)\n",
              100.0 * gemm_t.wall_best / step_t.wall_best, 100.0 * gemm_t.cpu_per_thread / step_t.cpu_per_thread);
  std::printf("step rate / square sgemm rate: %.0f%% (wall), %.0f%% (CPU)\n",
              100.0 * gflops(flops, step_t.wall_best) / gflops(square_flops, square_t.wall_best),
              100.0 * gflops(flops, step_t.cpu_per_thread) / gflops(square_flops, square_t.cpu_per_thread));
  summary();
  return 0;
}
#else
int main(int argc, char** argv) {  // MESHLIB_BENCH_OPTIONS_ONLY: the options, checked (bench/CMakeLists.txt)
  (void)parse_options(argc, argv);
  return 0;
}
#endif

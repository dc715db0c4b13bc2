// Trains the hand-written peer (bench/handwritten_mlp.hpp) on Fashion-MNIST with 2 OpenBLAS
// threads, with the flagship's defaults (Adam, peak lr 1e-3, linear warm-up over min(100, steps/10)
// steps, cosine decay to 2% of the peak at the last step, batch 256, 5 epochs), and prints, per epoch, the mean loss, test accuracy and training samples/s; then the
// sgemm rates that say how close to the BLAS floor its step runs:
//   - the step's sgemm calls alone (same shapes, same order), and
//   - one large square sgemm (2048^3), OpenBLAS's best case on this machine.
// meshlib is used only to read the IDX files and for the epoch order (epoch_permutation, the
// flagship's shuffle), never in the trainer.
//
// Usage: handwritten_mlp [--epochs N] [--hidden H] [--batch B] [--optimizer adam|sgd] [--lr X]
//                        [--momentum X] [--threads T] [--seed S] [--data DIR]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <cblas.h>

#include "handwritten_mlp.hpp"
#include "meshlib/nn/data.hpp"

namespace {
using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

double square_sgemm_gflops(int n, int reps) {
  std::vector<float> a(static_cast<std::size_t>(n) * n, 0.5f), b(a.size(), 0.25f), c(a.size());
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = clock_type::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    best = std::min(best, seconds_since(t0));
  }
  return 2.0 * n * n * n / best / 1e9;
}
}  // namespace

int main(int argc, char** argv) {
  handwritten::mlp_config config;
  std::size_t epochs = 5;
  int threads = 2;
  std::string dir = meshlib::nn::default_fashion_mnist_dir().string();
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "handwritten_mlp: %s needs a value\n", arg.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (arg == "--epochs") epochs = std::strtoul(value(), nullptr, 10);
    else if (arg == "--hidden") config.hidden = std::strtoul(value(), nullptr, 10);
    else if (arg == "--batch") config.batch = std::strtoul(value(), nullptr, 10);
    else if (arg == "--lr") config.learning_rate = std::strtof(value(), nullptr);
    else if (arg == "--optimizer") {
      const std::string name = value();
      if (name != "adam" && name != "sgd") {
        std::fprintf(stderr, "handwritten_mlp: --optimizer is adam or sgd, not '%s'\n", name.c_str());
        return 2;
      }
      config.method = name == "sgd" ? handwritten::optimizer::sgd : handwritten::optimizer::adam;
    }
    else if (arg == "--momentum") config.momentum = std::strtof(value(), nullptr);
    else if (arg == "--threads") threads = std::atoi(value());
    else if (arg == "--seed") config.seed = std::strtoull(value(), nullptr, 10);
    else if (arg == "--data") dir = value();
    else {
      std::fprintf(stderr,
                   "usage: handwritten_mlp [--epochs N] [--hidden H] [--batch B] [--optimizer adam|sgd] "
                   "[--lr X] [--momentum X] [--threads T] [--seed S] [--data DIR]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  openblas_set_num_threads(threads);
  config.threads = threads;
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
  const std::size_t steps = train.count / config.batch;
  // The flagship's schedule: warm-up over min(100, total / 10) steps, cosine to 2% at the end.
  config.total = steps * epochs;
  config.warmup = std::min<std::size_t>(100, config.total / 10);
  config.final_fraction = 0.02f;
  handwritten::mlp model(config);
  std::printf("hand-written MLP %zu-%zu-%zu-%zu, %s peak lr %g (warm-up %zu steps, cosine to 2%% at step %zu)%s, "
              "batch %zu, seed %llu\n",
              config.inputs, config.hidden, config.hidden, config.classes,
              config.method == handwritten::optimizer::sgd ? "SGD" : "Adam",
              static_cast<double>(config.learning_rate), config.warmup, config.total,
              config.method == handwritten::optimizer::sgd ? (" momentum " + std::to_string(config.momentum)).c_str() : "",
              config.batch, static_cast<unsigned long long>(config.seed));
  std::vector<float> x(config.batch * train.features);
  std::vector<std::int32_t> y(config.batch);

  std::printf("\n| epoch | mean loss | test accuracy | samples/s | GFLOP/s | time (s) |\n");
  std::printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
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

  // The BLAS floor: the step's own sgemm calls, then one large square sgemm.
  const double step_seconds_best = [&] {
    double best = 1e30;
    for (int r = 0; r < 20; ++r) {
      const auto t0 = clock_type::now();
      model.step(x.data(), y.data(), config.batch);
      best = std::min(best, seconds_since(t0));
    }
    return best;
  }();
  const double gemm_seconds = model.sgemm_only_seconds(x.data(), config.batch, 20);
  const double flops = model.step_flops(config.batch);
  const double step_rate = flops / step_seconds_best / 1e9;
  const double gemm_rate = flops / gemm_seconds / 1e9;
  const double square_rate = square_sgemm_gflops(2048, 5);
  std::printf("\nstep (best of 20): %.2f ms, %.1f GFLOP/s, %.0f samples/s\n", step_seconds_best * 1e3,
              step_rate, static_cast<double>(config.batch) / step_seconds_best);
  std::printf("the step's sgemm calls alone: %.2f ms, %.1f GFLOP/s -> step at %.0f%% of it\n",
              gemm_seconds * 1e3, gemm_rate, 100.0 * step_rate / gemm_rate);
  std::printf("square sgemm 2048^3, %d threads: %.1f GFLOP/s -> step at %.0f%% of it\n", threads,
              square_rate, 100.0 * step_rate / square_rate);
  std::printf("summary: %zu epochs, test accuracy %.2f%%, %.0f samples/s over the training steps\n",
              epochs, last_test_accuracy,
              static_cast<double>(epochs * steps * config.batch) / total_train_seconds);
  return 0;
}

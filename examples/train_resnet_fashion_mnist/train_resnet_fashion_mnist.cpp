// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// train_resnet_fashion_mnist: trains a small ResNet on Fashion-MNIST, data-parallel with synchronised
// batch norm, on a (data, model) mesh, (4, 1) by default where the machine has 4 cores (fewer devices
// on fewer cores, flagship::default_mesh; the header line says so). The network (NHWC images, W = --width):
//
//   stem   3x3 conv 1 -> W, batch norm, relu            28x28xW
//   pool   2x2 max pooling                              14x14xW
//   b1     basic_block W -> W, stride 1                 14x14xW     (identity shortcut)
//   b2     basic_block W -> 2W, stride 2                7x7x2W      (1x1 projection shortcut)
//   b3     basic_block 2W -> 4W, stride 2               4x4x4W      (1x1 projection shortcut)
//   gap    global average pooling                       4W
//   fc     dense 4W -> 10
//
// The batch is split over "data"; every weight is replicated and its gradient synchronised over
// "data" by train_step; every batch norm's statistics are reduced over "data" (PyTorch's
// SyncBatchNorm), so the training does not depend on the mesh: the same seed gives the same losses
// on (1, 1) or (4, 1), up to float rounding (the sums run in another order). A model axis larger
// than 1 is accepted: its devices hold the same replicas and compute the same numbers (a network
// this small has nothing worth splitting).
// Evaluation uses the batch norms' running statistics (nn::evaluate switches them to evaluation).
//
//   train_resnet_fashion_mnist [--mesh 4x1] [--epochs 6] [--batch 128] [--lr 2e-3] ... (--help)
//   train_resnet_fashion_mnist --advise [--mesh 4x1] ...: measures every (data, model) shape of the
//   mesh's device count on this model and batch (nn::advise_mesh), prints the ranked table and exits.
// --threads-per-device N runs each thread device's products on N BLAS threads (default: the cores /
// the devices, when that is more than 1); the header line says what was chosen and why.
// A mistake in the options is found before the data is loaded: usage line, message, exit status 2.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include "../common/flagship_main.hpp"
#include "../common/flagship_options.hpp"

#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace {

struct options {
  std::size_t data = 4, model = 1, epochs = 6, batch = 128, width = 16;
  float lr = 2e-3f;
  std::string optimizer = "adamw", data_dir = meshlib::nn::default_fashion_mnist_dir().string();
  std::string checkpoint_dir;
  std::string loss_log;
  bool resume = false, advise = false, gpu = false;
  std::uint64_t seed = 0;
  std::size_t limit_steps = 0;
  std::string mesh_why;  // the header line's note on a mesh the flagship chose (no --mesh)
  std::optional<std::size_t> threads_given;  // --threads-per-device
  flagship::threads_choice threads;          // what runs, and the header line's note (empty with --gpu)
};

using flagship::usage_error;

constexpr const char* usage_line =
    "usage: train_resnet_fashion_mnist [--mesh DxM] [--epochs N] [--batch B] [--lr R] [--width W] [--optimizer NAME]\n"
    "                                  [--checkpoint-dir DIR] [--resume] [--data DIR] [--seed S] [--steps N] [--advise]\n"
    "                                  [--gpu] [--loss-log FILE] [--threads-per-device N] [--help]\n";

void usage() {
  std::cout << usage_line
            << "  --mesh DxM            (data, model) mesh shape; default 4x1 (4 thread devices, data parallel) with 4\n"
               "                        cores or more, else one device per core (2x1 on 2 or 3 cores, 1x1 on 1; the\n"
               "                        first line says which); 4x1 with --gpu\n"
               "  --threads-per-device N\n"
               "                        BLAS threads each device's products (convolutions as im2col products\n"
               "                        included) run on, at most the cores; default: the cores / the devices\n"
               "                        where that is more than 1, else 1; the first line says which\n"
               "  --epochs N            default 6\n"
               "  --batch B             global batch, a multiple of D; default 128\n"
               "  --lr R                peak learning rate (linear warm-up, cosine decay); default 2e-3\n"
               "  --optimizer NAME      adamw | adam | sgd (momentum 0.9); default adamw (weight decay 1e-4)\n"
               "  --width W             channels of the first stage (the stages have W, 2W, 4W); default 16\n"
               "  --checkpoint-dir DIR  save a checkpoint there after every epoch (restorable on any mesh)\n"
               "  --resume              restore the checkpoint in --checkpoint-dir first (parameters, optimizer\n"
               "                        state and batch norm's running statistics), continue from its step\n"
               "  --data DIR            Fashion-MNIST IDX files; default " << meshlib::nn::default_fashion_mnist_dir().string() << "\n"
               "  --seed S              initialisation and shuffling seed; default 0\n"
               "  --steps N             stop after N steps (smoke runs)\n"
               "  --advise              time a few steps of every (data, model) shape of the D x M devices on this\n"
               "                        model and batch, print the ranked table and exit (no training)\n"
               "  --gpu                 train on the GPU mesh (gpu_runner: NCCL, or devices sharing a GPU); needs a\n"
               "                        build with Kokkos CUDA and NCCL, and a visible GPU\n"
               "  --loss-log FILE       write each step's loss to FILE, one 'step loss' line per step\n"
               "Every check of the options (numbers, mesh, batch) runs before the data is loaded; a mistake\n"
               "exits with status 2.\n";
}

using flagship::positive_integer;
std::pair<std::size_t, std::size_t> mesh_shape(const std::string& v) { return flagship::mesh_shape(v, "4x1"); }

options parse(int argc, char** argv) {
  options o;
  bool mesh_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") { usage(); std::exit(0); }
    else if (a == "--mesh") {
      mesh_given = true;
      std::tie(o.data, o.model) = mesh_shape(value());
    }
    else if (a == "--epochs") o.epochs = positive_integer(a, value());
    else if (a == "--batch") o.batch = positive_integer(a, value());
    else if (a == "--lr") o.lr = flagship::positive_number(a, value());
    else if (a == "--optimizer") o.optimizer = value();
    else if (a == "--width") o.width = positive_integer(a, value());
    else if (a == "--checkpoint-dir") o.checkpoint_dir = value();
    else if (a == "--resume") o.resume = true;
    else if (a == "--data") o.data_dir = value();
    else if (a == "--seed") o.seed = flagship::seed_number(a, value());
    else if (a == "--steps") o.limit_steps = positive_integer(a, value());
    else if (a == "--advise") o.advise = true;
    else if (a == "--gpu") o.gpu = true;
    else if (a == "--loss-log") o.loss_log = value();
    else if (a == "--threads-per-device") o.threads_given = positive_integer(a, value());
    else throw usage_error("unknown option '" + a + "' (see --help)");
  }
  if (o.optimizer != "adam" && o.optimizer != "adamw" && o.optimizer != "sgd")
    throw usage_error("--optimizer is adamw, adam or sgd, not '" + o.optimizer + "'");
  if (o.resume && o.checkpoint_dir.empty()) throw usage_error("--resume needs --checkpoint-dir");
  flagship::check_gpu_flag(o.gpu);
  if (o.gpu && o.advise) throw usage_error("--advise measures CPU thread devices: leave out --gpu");
  if (!mesh_given && !o.gpu) {  // thread devices: one per core at most
    const auto c = flagship::default_mesh(flagship::available_cores(), 4, 1);
    o.data = c.data;
    o.model = c.model;
    o.mesh_why = c.why;
  }
  if (o.gpu && o.threads_given)
    throw usage_error("--threads-per-device sets the BLAS threads of CPU thread devices: leave it out with --gpu");
  if (!o.gpu)  // applied by train (flagship::use_threads_per_device); a GPU's products run on cuBLAS
    o.threads = flagship::threads_per_device(o.threads_given, flagship::available_cores(), o.data * o.model);
  // The checks that need no data, in the options' words, before the seconds of loading (the
  // library would reject the batch later, in its own terms).
  if (!o.advise && o.batch % o.data != 0)  // --advise lists the shapes the batch does not split over
    throw usage_error("--batch " + std::to_string(o.batch) + " is not divisible by the data axis (--mesh " +
                      std::to_string(o.data) + "x" + std::to_string(o.model) + ": " + std::to_string(o.data) + ")");
  if (o.width > 4096) throw usage_error("--width " + std::to_string(o.width) + " is too large (at most 4096)");
  return o;
}

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;

/// The network of the file comment, widths W, 2W, 4W.
auto resnet(const mesh_t& m, std::size_t w, meshlib::nn::rng_key key) {
  namespace nn = meshlib::nn;
  nn::conv2d<float, mesh_t> stem(m, "stem", {28, 28, 1}, w, 3, key, {.padding = 1, .use_bias = false});
  nn::max_pool2d<float, mesh_t> pool(m, "pool", stem.output_shape(), 2);
  nn::basic_block<float, mesh_t> b1(m, "b1", pool.output_shape(), w, 1, key);
  nn::basic_block<float, mesh_t> b2(m, "b2", b1.output_shape(), 2 * w, 2, key);
  nn::basic_block<float, mesh_t> b3(m, "b3", b2.output_shape(), 4 * w, 2, key);
  const auto last = b3.output_shape();
  return nn::sequential(stem, nn::batch_norm<float, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<float>(m),
                        pool, b1, b2, b3, nn::global_avg_pool<float, mesh_t>(m, "gap", last),
                        nn::dense<float, mesh_t>(m, "fc", last.channels, 10, key));
}

/// `--advise`: every (data, model) shape of the D x M devices, measured on this model and the first
/// --batch training images (nn::advise_mesh), ranked; nothing is trained.
int advise(const options& o, const meshlib::nn::fashion_mnist& fm) {
  namespace nn = meshlib::nn;
  const nn::rng_key key{o.seed};
  const std::size_t rows = std::min(o.batch, fm.train.count), devices = o.data * o.model;
  nn::batch b;
  b.x.assign(fm.train.x.begin(), fm.train.x.begin() + static_cast<std::ptrdiff_t>(rows * fm.train.features));
  b.y.assign(fm.train.y.begin(), fm.train.y.begin() + static_cast<std::ptrdiff_t>(rows));
  b.rows = b.global_rows = rows;
  b.features = fm.train.features;
  nn::advise_options ao;
  ao.opt = nn::adamw(nn::constant(o.lr), 1e-4f);
  std::printf("train_resnet_fashion_mnist --advise: ResNet (stem %zu), batch %zu, %zu thread devices%s: %zu warm-up + %zu "
              "timed steps per shape\n",
              o.width, rows, devices, o.threads.why.empty() ? "" : (" (" + o.threads.why + ")").c_str(), ao.warmup_steps,
              ao.timed_steps);
  std::fflush(stdout);
  const auto a = nn::advise_mesh<mesh_t>(devices, [&](const mesh_t& m) { return resnet(m, o.width, key); }, b, ao);
  std::printf("\n%s\nbest: --mesh %s --threads-per-device %zu%s\n", a.markdown().c_str(), a.best.flag().c_str(),
              a.best_threads_per_device, a.best_overlap ? " (gradient sync overlapped: data_parallel overlap)" : "");
  return 0;
}

template <class Runner>
int train_on(const options& o, const meshlib::nn::fashion_mnist& fm, const Runner& runner) {
  namespace nn = meshlib::nn;
  const mesh_t mesh{o.data, o.model};
  const nn::rng_key key{o.seed};
  nn::data_loader loader(fm.train, {.global_batch = o.batch, .seed = o.seed});
  nn::device_prefetcher batches(loader);  // batches into the devices' memory (a no-op copy on CPU devices)
  const std::size_t steps = loader.steps_per_epoch();
  const std::size_t total = o.limit_steps ? std::min(o.limit_steps, steps * o.epochs) : steps * o.epochs;
  const auto lr = nn::warmup_cosine(o.lr, std::min<std::size_t>(steps / 2, total / 10), total, 0.01f);
  nn::optimizer opt = o.optimizer == "sgd" ? nn::sgd(lr, 0.9f) : o.optimizer == "adam" ? nn::adam(lr) : nn::adamw(lr, 1e-4f);
  nn::train_state state(mesh, resnet(mesh, o.width, key), opt, nn::data_parallel<"data">{});  // plain DDP over 'data'

  std::printf("train_resnet_fashion_mnist: ResNet (stem %zu, stages %zu-%zu-%zu, one basic block each) on %s (%zu %s%s)%s\n",
              o.width, o.width, 2 * o.width, 4 * o.width, mesh.to_string().c_str(), mesh.size(),
              o.gpu ? "GPU mesh devices" : "thread devices", o.mesh_why.empty() ? "" : (", " + o.mesh_why).c_str(),
              o.threads.why.empty() ? "" : (", " + o.threads.why).c_str());
  std::printf("  data: %zu training / %zu test images from %s\n", fm.train.count, fm.test.count, o.data_dir.c_str());
  std::printf("  batch %zu (%zu images per data device), %s, lr %s warm-up + cosine, batch norm synchronised over 'data'\n",
              o.batch, o.batch / o.data, opt.name().c_str(), flagship::number_text(o.lr).c_str());
  std::size_t count = 0;
  for (const auto& p : state.params) {
    std::size_t n = 1;
    for (auto e : p.shape) n *= e;
    count += n;
  }
  std::printf("  %zu parameters in %zu arrays (all replicated)\n", count, state.params.size());
  if (o.resume) {
    nn::restore_checkpoint(o.checkpoint_dir, state);
    std::printf("  resumed from %s at step %zu\n", o.checkpoint_dir.c_str(), static_cast<std::size_t>(state.step));
  }
  std::fflush(stdout);

  flagship::loss_log losses(o.loss_log);
  const auto start = std::chrono::steady_clock::now();
  std::size_t done = state.step;
  double acc_test = 0;
  for (std::size_t epoch = done / steps; epoch < o.epochs && done < total; ++epoch) {
    const auto t0 = std::chrono::steady_clock::now();
    batches.start_epoch(epoch);  // on a GPU: the next batch is copied while this step computes
    double loss_sum = 0, sync = 0;
    std::size_t correct = 0, seen = 0, n = 0;
    for (std::size_t skip = done % steps; skip > 0; --skip) static_cast<void>(batches.next());  // resumed mid-epoch
    while (auto b = batches.next()) {
      if (done == total) break;
      const auto m = nn::train_step(state, *b, runner);
      ++done;
      losses.write(done, m.loss);
      loss_sum += m.loss;
      correct += m.correct;
      seen += m.rows;
      sync += m.sync_seconds;
      ++n;
      if (n % 47 == 0 || n == steps) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("\r  epoch %zu  [%3zu%%] step %zu/%zu  loss %.4f  %.0f samples/s", epoch + 1, n * 100 / steps, n, steps,
                    loss_sum / static_cast<double>(n), static_cast<double>(seen) / s);
        std::fflush(stdout);
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto t = nn::evaluate(state, fm.test, 1000, runner);  // batch norm on its running statistics
    acc_test = static_cast<double>(t.correct) / static_cast<double>(t.rows);
    if (!o.checkpoint_dir.empty()) nn::save_checkpoint(o.checkpoint_dir, state);
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("\r  epoch %zu: loss %.4f  train acc %.2f%%  test loss %.4f  test acc %.2f%%  %.0f samples/s  %.1f s (sync %.0f%%)  [%.0f s]\n",
                epoch + 1, loss_sum / static_cast<double>(n), 100.0 * static_cast<double>(correct) / static_cast<double>(seen),
                t.loss, 100.0 * acc_test, static_cast<double>(seen) / secs, secs, 100.0 * sync / secs, elapsed);
    std::fflush(stdout);
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("done: %zu steps in %.1f s, test accuracy %.2f%% on %s\n", done, total_s, 100.0 * acc_test,
              mesh.to_string().c_str());
  return 0;
}

int train(const options& given, const meshlib::nn::fashion_mnist& fm) {
  options o = given;
  if (!o.gpu) flagship::use_threads_per_device(o.threads);  // before any device thread multiplies
  if (o.advise) return advise(o, fm);
  return flagship::with_runner(o.gpu, [&](const auto& runner) { return train_on(o, fm, runner); });
}

}  // namespace

int main(int argc, char** argv) {
  const auto load = [](const options& o) { return meshlib::nn::load_fashion_mnist(o.data_dir); };
  return flagship::run_main("train_resnet_fashion_mnist", usage_line, argc, argv, parse, load, train);
}

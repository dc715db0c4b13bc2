// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// train_fashion_mnist: trains an MLP (784-1024-1024-10) on Fashion-MNIST on a (data, model) mesh,
// by default one that fits the machine's cores ((4, 2) with 8 or more, (2, 1) on 2: see
// flagship::default_mesh; the header line says which it chose): the batch is split over "data",
// the hidden layers Megatron-style over "model"
// (fc1 column-parallel, fc2 row-parallel with one psum), the gradients synchronised over "data".
// The numbers do not depend on the mesh: the same seed gives the same losses on (1, 1) or (2, 4).
// `--fsdp N` adds an fsdp axis of N devices (mesh (data, fsdp, model)): parameters, gradients and
// optimizer state are stored sharded over it (FSDP / ZeRO-3), and the run prints the bytes per device.
// Under `mpirun -np P` (built with MPI) the mesh spans P processes x (D*M/P) threads, each process
// loading only its share of every batch, with the same losses as the single-process run.
// `--gpu` trains on the GPU mesh (meshlib::gpu_runner: built with Kokkos CUDA and NCCL): every
// block in GPU memory, one NCCL rank per GPU, or several mesh devices sharing one GPU, or one
// process per GPU under a launcher; without such a build or a visible GPU it refuses, saying why.
// `--loss-log FILE` writes every step's loss ("step loss" lines), to compare runs (gpu-check.sh).
// `--threads-per-device N`: each thread device's products on N BLAS threads (default: the cores this
// process may run on / the devices, when that is more than 1), so a mesh smaller than the machine
// still multiplies on every core; the header line says what was chosen and why.
//
//   train_fashion_mnist [--mesh DxM] [--epochs 6] [--batch 256] [--lr 1e-3] ... (--help)
//   train_fashion_mnist --advise [--mesh DxM] ...: measures every (data, fsdp, model) shape of the
//   mesh's device count (x --fsdp) on this model and batch (nn::advise_mesh), prints the ranked
//   table and exits.
// A mistake in the options is found before the data is loaded: usage line, message, exit status 2.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include "../common/flagship_main.hpp"
#include "../common/flagship_options.hpp"
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
#include <meshlib/mpi.hpp>
#endif

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <span>
#include <vector>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <tuple>
#include <utility>

namespace {

struct options {
  std::size_t data = 4, model = 2, fsdp = 1, epochs = 6, batch = 256, hidden = 1024, accumulation = 1;
  float lr = 1e-3f;
  std::string optimizer = "adam", precision = "f32", reduce = "f32", data_dir = meshlib::nn::default_fashion_mnist_dir().string();
  std::string checkpoint_dir, trace;
  bool zero = false, resume = false, advise = false, gpu = false;
  bool mesh_given = false;  // --mesh given; else main picks the mesh for the machine's cores
  std::string mesh_why;     // the header line's note on a mesh main picked
  std::optional<std::size_t> threads_given;  // --threads-per-device; else main picks (flagship::threads_per_device)
  std::string threads_why;  // the header line's note on the threads per device
  std::string loss_log;
  std::uint64_t seed = 0;
  std::size_t limit_steps = 0;
};

using flagship::usage_error;

constexpr const char* usage_line =
    "usage: train_fashion_mnist [--mesh DxM] [--epochs N] [--batch B] [--lr R] [--hidden H] [--accumulation K]\n"
    "                           [--optimizer NAME] [--precision P] [--reduce-in R] [--zero] [--checkpoint-dir DIR]\n"
    "                           [--resume] [--fsdp N] [--data DIR] [--seed S] [--steps N] [--trace FILE] [--advise]\n"
    "                           [--gpu] [--loss-log FILE] [--threads-per-device N] [--help]\n";

void usage() {
  std::cout << usage_line
            << "  --mesh DxM            (data, model) mesh shape (D x M thread devices); default: one that fits\n"
               "                        this machine's cores: 4x2 with 8 cores or more, else Dx1 with D the largest\n"
               "                        of 1, 2, 4 up to the cores (2x1 on 2 cores); the first line says which\n"
               "  --threads-per-device N\n"
               "                        BLAS threads each device's matrix products run on, at most the cores;\n"
               "                        default: the cores / the devices where that is more than 1, else 1 (1 under\n"
               "                        mpirun); the first line says which\n"
               "  --epochs N            default 6\n"
               "  --batch B             global batch, a multiple of D x accumulation; default 256\n"
               "  --lr R                peak learning rate (linear warm-up, cosine decay); default 1e-3\n"
               "  --optimizer NAME      adam | adamw | sgd; default adam\n"
               "  --hidden H            hidden width, divisible by M; default 1024\n"
               "  --accumulation K      micro-batches per step (one gradient sync per step); default 1\n"
               "  --precision P         f32 | bf16 | f16: the type parameters, activations and gradients are\n"
               "                        computed in (bf16/f16: float master weights; f16: dynamic loss scaling);\n"
               "                        default f32\n"
               "  --reduce-in R         f32 | bf16: the gradient reduction's type on the wire; default f32\n"
               "  --zero                ZeRO-1: optimizer state sharded over the data axis\n"
               "  --fsdp N              FSDP over an fsdp axis of N devices (mesh D x N x M, the batch split over\n"
               "                        D x N): parameters, gradients and optimizer state sharded over it, each\n"
               "                        layer's parameters gathered just before it runs; default 1 (off)\n"
               "  --checkpoint-dir DIR  save a checkpoint there after every epoch (restorable on any mesh)\n"
               "  --resume              restore the checkpoint in --checkpoint-dir first, continue from its step\n"
               "  --data DIR            Fashion-MNIST IDX files; default " << meshlib::nn::default_fashion_mnist_dir().string() << "\n"
               "  --seed S              initialisation and shuffling seed; default 0\n"
               "  --steps N             stop after N steps (smoke runs)\n"
               "  --trace FILE          record a trace of every step (Chrome trace JSON, docs/debugging.md); use with --steps\n"
               "  --gpu                 train on the GPU mesh (gpu_runner: NCCL, or devices sharing a GPU); needs a\n"
               "                        build with Kokkos CUDA and NCCL, and a visible GPU\n"
               "  --loss-log FILE       write each step's loss to FILE, one 'step loss' line per step\n"
               "  --advise              time a few steps of every (data, fsdp, model) shape of the D x --fsdp x M\n"
               "                        devices on this model and batch, print the ranked table and exit (no training)\n"
               "Every check of the options (numbers, mesh, batch, hidden width, trace file) runs before the data\n"
               "is loaded; a mistake exits with status 2.\n";
}

using flagship::positive_integer;
std::pair<std::size_t, std::size_t> mesh_shape(const std::string& v) { return flagship::mesh_shape(v, "4x2"); }

options parse(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--help" || a == "-h") { usage(); std::exit(0); }
    else if (a == "--mesh") {
      std::tie(o.data, o.model) = mesh_shape(value());
      o.mesh_given = true;
    }
    else if (a == "--epochs") o.epochs = positive_integer(a, value());
    else if (a == "--batch") o.batch = positive_integer(a, value());
    else if (a == "--lr") o.lr = flagship::positive_number(a, value());
    else if (a == "--optimizer") o.optimizer = value();
    else if (a == "--hidden") o.hidden = positive_integer(a, value());
    else if (a == "--accumulation") o.accumulation = positive_integer(a, value());
    else if (a == "--precision") o.precision = value();
    else if (a == "--reduce-in") o.reduce = value();
    else if (a == "--zero") o.zero = true;
    else if (a == "--fsdp") o.fsdp = positive_integer(a, value());
    else if (a == "--checkpoint-dir") o.checkpoint_dir = value();
    else if (a == "--resume") o.resume = true;
    else if (a == "--data") o.data_dir = value();
    else if (a == "--seed") o.seed = flagship::seed_number(a, value());
    else if (a == "--steps") o.limit_steps = positive_integer(a, value());
    else if (a == "--trace") o.trace = value();
    else if (a == "--advise") o.advise = true;
    else if (a == "--gpu") o.gpu = true;
    else if (a == "--loss-log") o.loss_log = value();
    else if (a == "--threads-per-device") o.threads_given = positive_integer(a, value());
    else throw usage_error("unknown option '" + a + "' (see --help)");
  }
  if (o.precision != "f32" && o.precision != "bf16" && o.precision != "f16")
    throw usage_error("--precision is f32, bf16 or f16, not '" + o.precision + "'");
#if !MESHLIB_HAS_FLOAT16
  if (o.precision == "f16") throw usage_error("--precision f16: this compiler has no _Float16");
#endif
  if (o.reduce != "f32" && o.reduce != "bf16") throw usage_error("--reduce-in is f32 or bf16, not '" + o.reduce + "'");
  if (o.optimizer != "adam" && o.optimizer != "adamw" && o.optimizer != "sgd")
    throw usage_error("--optimizer is adam, adamw or sgd, not '" + o.optimizer + "'");
  if (o.resume && o.checkpoint_dir.empty()) throw usage_error("--resume needs --checkpoint-dir");
  if (o.gpu) {
#if !MESHLIB_HAS_GPU_RUNNER
    throw usage_error("--gpu: this build has no GPU runner; build meshlib's examples with Kokkos CUDA and NCCL "
                      "(Kokkos_ENABLE_CUDA, MESHLIB_ENABLE_NCCL), or leave out --gpu to train on CPU thread devices");
#endif
    if (o.advise) throw usage_error("--advise measures CPU thread devices: leave out --gpu");
    if (!o.trace.empty()) throw usage_error("--trace with --gpu: the trace layer is not checked on device memory yet; leave out one");
    if (o.threads_given)
      throw usage_error("--threads-per-device sets the BLAS threads of CPU thread devices: leave it out with --gpu");
  }
  return o;
}

/// The checks that need no data, in the options' words, run before the minute of loading: the
/// library would reject the same mistakes later, in its own terms (sharding errors, a trace file
/// it cannot write after the whole run).
void check_options(const options& o, std::size_t processes) {
  const std::string mesh = "--mesh " + std::to_string(o.data) + "x" + std::to_string(o.model);
  if (o.advise && processes > 1) throw usage_error("--advise measures this process's thread devices: run it without mpirun");
  if (o.advise) return;  // every shape is tried: the advisor lists the ones these sizes do not fit
  if (o.hidden % o.model != 0)
    throw usage_error("--hidden " + std::to_string(o.hidden) + " is not divisible by the model axis (" + mesh + ": " +
                      std::to_string(o.model) + ")");
  // d x k divides the batch when d does and k divides the quotient (no product to overflow).
  if (o.fsdp > 1) {
    // FSDP shards dimension 0 of every parameter block: fc1's 784 input rows and its hidden / M
    // outputs, fc2's hidden / M input rows and hidden outputs, fc3's 10 outputs (its bias).
    const std::size_t split[] = {784, o.hidden / o.model, o.hidden, 10};
    for (std::size_t n : split)
      if (n % o.fsdp != 0)
        throw usage_error("--fsdp " + std::to_string(o.fsdp) + " does not divide " + std::to_string(n) +
                          ", the first dimension of a parameter block (fc1 784 x hidden/M, fc2 hidden/M x hidden, "
                          "fc3 bias 10); use --fsdp 2");
    if (o.zero) throw usage_error("--fsdp already shards the optimizer state: leave out --zero");
  }
  const std::size_t dp = o.data * o.fsdp;  // the batch splits over data x fsdp
  if (o.batch % dp != 0 || (o.batch / dp) % o.accumulation != 0)
    throw usage_error("--batch " + std::to_string(o.batch) + " is not divisible by the data axis x --accumulation (" + mesh +
                      (o.fsdp > 1 ? " --fsdp " + std::to_string(o.fsdp) : std::string()) + ": " + std::to_string(dp) +
                      " x --accumulation " + std::to_string(o.accumulation) + ")");
  if (processes > 1 && (dp * o.model) % processes != 0)
    throw usage_error(mesh + ": its " + std::to_string(dp * o.model) + " devices do not split over the " +
                      std::to_string(processes) + " processes of mpirun");
  if (processes > 1 && o.batch % processes != 0)
    throw usage_error("--batch " + std::to_string(o.batch) + " does not split over the " + std::to_string(processes) +
                      " processes of mpirun");
  if (!o.trace.empty()) {
    // The trace is written at the end of the run: a file that cannot be written is refused now.
    // Opened for appending and removed again when new, so that nothing is lost or left behind
    // (under mpirun each process writes its own file, trace.p1.json).
    std::error_code ec;
    const bool existed = std::filesystem::exists(o.trace, ec);
    std::FILE* f = std::fopen(o.trace.c_str(), "a");
    if (f == nullptr) {
      const int e = errno;
      throw usage_error("--trace " + o.trace + ": cannot open the file for writing (" + std::strerror(e) + ")");
    }
    std::fclose(f);
    if (!existed) std::filesystem::remove(o.trace, ec);
  }
}

// An fsdp axis of size 1 (the default) changes nothing: the batch splits over data x 1.
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;

/// Where this process runs: its devices, its index, the process count, and the backend.
template <class Backend>
struct placement {
  std::vector<std::size_t> devices;
  std::size_t process = 0, processes = 1;
  Backend backend;
  std::string kind = "thread devices";  // what a device is, as the header line says
};

/// `--advise`: every (data, fsdp, model) shape of the D x F x M devices, measured on this model and
/// the first --batch training images (nn::advise_mesh), ranked; nothing is trained.
int advise(const options& o, const meshlib::nn::fashion_mnist& fm) {
  namespace nn = meshlib::nn;
  const nn::rng_key key{o.seed};
  const std::size_t rows = std::min(o.batch, fm.train.count), devices = o.data * o.fsdp * o.model;
  nn::batch b;
  b.x.assign(fm.train.x.begin(), fm.train.x.begin() + static_cast<std::ptrdiff_t>(rows * fm.train.features));
  b.y.assign(fm.train.y.begin(), fm.train.y.begin() + static_cast<std::ptrdiff_t>(rows));
  b.rows = b.global_rows = rows;
  b.features = fm.train.features;
  nn::advise_options ao;
  ao.opt = nn::adam(nn::constant(o.lr));
  ao.train.accumulation = o.accumulation;
  std::cout << "train_fashion_mnist --advise: MLP 784-" << o.hidden << "-" << o.hidden << "-10, batch " << rows << ", "
            << devices << " thread devices" << (o.mesh_why.empty() ? std::string() : " (" + o.mesh_why + ")")
            << (o.threads_why.empty() ? std::string() : ", " + o.threads_why) << ": "
            << ao.warmup_steps << " warm-up + " << ao.timed_steps << " timed steps per shape\n" << std::flush;
  const auto a = nn::advise_mesh<mesh_t>(devices, [&](const mesh_t& m) {
    return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", 784, o.hidden, key), nn::relu<float>(m),
                          nn::row_dense<float, mesh_t>(m, "fc2", o.hidden, o.hidden, key), nn::relu<float>(m),
                          nn::dense<float, mesh_t>(m, "fc3", o.hidden, 10, key));
  }, b, ao);
  const std::size_t f = a.best.size("fsdp");
  std::cout << "\n" << a.markdown() << "\nbest: --mesh " << a.best.size("data") << "x" << a.best.size("model")
            << (f > 1 ? " --fsdp " + std::to_string(f) : std::string()) << " --threads-per-device "
            << a.best_threads_per_device << (a.best_overlap ? " (gradient sync overlapped: data_parallel overlap)" : "") << "\n";
  return 0;
}

template <meshlib::comm_element Wire, class Compute, class Backend>
int train(const options& o, const meshlib::nn::fashion_mnist& fm, const placement<Backend>& where) {
  namespace nn = meshlib::nn;
  const mesh_t mesh{o.data, o.fsdp, o.model};
  const nn::rng_key key{o.seed};
  const std::span<const std::size_t> local(where.devices);
  const bool lead = where.process == 0;
  nn::sequential net(nn::column_dense<float, mesh_t>(mesh, "fc1", 784, o.hidden, key, local), nn::relu<float>(mesh),
                     nn::row_dense<float, mesh_t>(mesh, "fc2", o.hidden, o.hidden, key, local), nn::relu<float>(mesh),
                     nn::dense<float, mesh_t>(mesh, "fc3", o.hidden, 10, key, local));
  nn::data_loader loader(fm.train, {.global_batch = o.batch, .seed = o.seed, .process_index = where.process,
                                    .process_count = where.processes});
  nn::device_prefetcher batches(loader);  // batches into the devices' memory (a no-op copy on CPU devices)
  const std::size_t steps = loader.steps_per_epoch();
  const std::size_t total = o.limit_steps ? o.limit_steps : steps * o.epochs;
  const auto lr = nn::warmup_cosine(o.lr, std::min<std::size_t>(100, total / 10), total, 0.02f);
  nn::optimizer opt = o.optimizer == "sgd" ? nn::sgd(lr, 0.9f) : o.optimizer == "adamw" ? nn::adamw(lr, 1e-4f) : nn::adam(lr);
  // The parallelism as policies: data parallelism over 'data' (ZeRO-1 with --zero), and FSDP over
  // 'fsdp' when that axis has more than one device (of size 1 it only splits the batch, as data does).
  using state_t = nn::train_state<mesh_t, decltype(net), "data", Wire, Compute>;
  const nn::train_options to{.accumulation = o.accumulation};
  const nn::data_parallel<"data"> dp{.zero = o.zero ? 1 : 0};
  state_t state = o.fsdp > 1 ? state_t(mesh, std::move(net), opt, to, key, local, dp, nn::fully_shard<"fsdp">{})
                             : state_t(mesh, std::move(net), opt, to, key, local, dp);
  static std::ostream silent(nullptr);
  std::ostream& out = lead ? std::cout : silent;  // one process prints

  out << "train_fashion_mnist: MLP 784-" << o.hidden << "-" << o.hidden << "-10 on " << mesh << " ("
            << (where.processes > 1 ? std::to_string(where.processes) + " processes x " + std::to_string(where.devices.size()) + " " + where.kind + ")"
                                    : std::to_string(mesh.size()) + " " + where.kind + ")")
            << (o.mesh_why.empty() ? std::string() : ", " + o.mesh_why)
            << (o.threads_why.empty() ? std::string() : ", " + o.threads_why) << "\n"
            << "  data: " << fm.train.count << " training / " << fm.test.count << " test images from " << o.data_dir << "\n"
            << "  batch " << o.batch << " (" << o.batch / (o.data * o.fsdp) << " rows per data device"
            << (o.accumulation > 1 ? ", " + std::to_string(o.accumulation) + " micro-batches" : std::string()) << "), "
            << opt.name() << ", lr " << flagship::number_text(o.lr) << " warm-up + cosine, gradients reduced in "
            << nn::precision_name<Wire>() << ", computed in " << nn::precision_name<Compute>()
            << (state.mixed ? " with float master weights" : "")
            << (state.loss_scaling() ? ", dynamic loss scaling from " + std::to_string(static_cast<long long>(state.loss_scale())) : std::string())
            << (o.zero ? ", ZeRO-1 optimizer state" : "")
            << (o.fsdp > 1 ? ", FSDP over 'fsdp' (" + std::to_string(o.fsdp) + " devices)" : std::string()) << "\n"
            << "  parameters:\n";
  std::size_t count = 0;
  for (const auto& p : state.params) {
    std::size_t n = 1;
    for (auto e : p.shape) n *= e;
    count += n;
    std::string shape = "(";
    for (std::size_t d = 0; d < p.shape.size(); ++d) shape += (d ? ", " : "") + std::to_string(p.shape[d]);
    out << "    " << p.name << std::string(8 - p.name.size(), ' ') << shape << ")" << std::string(14 - shape.size(), ' ')
              << p.sharding << "\n";
  }
  out << "  " << count << " parameters; optimizer state per device: " << state.optimizer_state_size(where.devices.front())
      << " floats\n";
  const nn::training_memory mem = state.memory(where.devices.front());
  const auto mib = [](std::size_t b) {
    char t[32];
    std::snprintf(t, sizeof t, "%.2f MiB", static_cast<double>(b) / (1 << 20));
    return std::string(t);
  };
  out << "  memory per device: " << mib(mem.total()) << " (parameters " << mib(mem.parameters) << ", gradients "
      << mib(mem.gradients) << ", optimizer state " << mib(mem.optimizer_state)
      << (o.fsdp > 1 ? ", gathered layer " + mib(mem.unsharded) : std::string()) << ")\n";
  if (!o.trace.empty()) meshlib::start_trace(o.trace);  // every device's collectives, per step
  if (o.resume) {
    nn::restore_checkpoint(o.checkpoint_dir, state);  // under mpirun: every process, its own blocks
    out << "  resumed from " << o.checkpoint_dir << " at step " << state.step << "\n";
  }

  flagship::loss_log losses(lead ? o.loss_log : std::string());  // one process writes it
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
      meshlib::trace_region step_region("step " + std::to_string(done + 1));
      const auto m = nn::train_step(state, *b, where.backend);
      ++done;
      if (m.skipped) continue;  // f16 loss scaling: gradients overflowed, the scale was halved, no update
      losses.write(done, m.loss);
      loss_sum += m.loss;
      correct += m.correct;
      seen += m.rows;
      sync += m.sync_seconds;
      ++n;
      if (lead && (n % 47 == 0 || n == steps)) {
        const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::printf("\r  epoch %zu  [%3zu%%] step %zu/%zu  loss %.4f  %.0f samples/s", epoch + 1, n * 100 / steps, n, steps,
                    loss_sum / static_cast<double>(n), static_cast<double>(seen) / s);
        std::fflush(stdout);
      }
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const auto t = nn::evaluate(state, fm.test, 1000, where.backend);
    acc_test = static_cast<double>(t.correct) / static_cast<double>(t.rows);
    if (!o.checkpoint_dir.empty()) nn::save_checkpoint(o.checkpoint_dir, state);
    if (lead) std::printf("\r  epoch %zu: loss %.4f  train acc %.2f%%  test loss %.4f  test acc %.2f%%  %.0f samples/s  %.1f s (sync %.0f%%)\n",
                epoch + 1, loss_sum / static_cast<double>(n), 100.0 * static_cast<double>(correct) / static_cast<double>(seen),
                t.loss, 100.0 * acc_test, static_cast<double>(seen) / secs, secs, 100.0 * sync / secs);
  }
  if (!o.trace.empty()) {
    const auto summary = meshlib::stop_trace();  // writes the file
    if (lead) std::cout << summary;
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (lead) std::printf("done: %zu steps in %.1f s, test accuracy %.2f%% on %s\n", done, total_s, 100.0 * acc_test,
              mesh.to_string().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t processes = 1;
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"})
    if (const char* e = std::getenv(v)) processes = std::max<std::size_t>(processes, std::strtoul(e, nullptr, 10));
  options o;
  try {
    o = parse(argc, argv);
    if (!o.mesh_given && processes == 1) {  // under mpirun the mesh spans the processes: 4x2, as always
      const auto c = flagship::default_mesh(flagship::available_cores());
      o.data = c.data;
      o.model = c.model;
      o.mesh_why = c.why;
    }
    check_options(o, processes);
    if (!o.gpu) {  // a GPU's products run on cuBLAS, not on host threads
      auto t = flagship::threads_per_device(o.threads_given, flagship::available_cores(), o.data * o.fsdp * o.model,
                                            processes > 1);
      flagship::use_threads_per_device(t);
      o.threads_why = t.why;
    }
  } catch (const usage_error& e) {
    std::cerr << usage_line << "train_fashion_mnist: error: " << e.what() << "\n";
    return 2;
  }
  try {
    (void)meshlib::tracing();  // MESHLIB_TRACE naming a file that cannot be written: say so now, not after the run
  } catch (const meshlib::error& e) {
    std::cerr << "train_fashion_mnist: " << e.what() << "\n";
    return 1;
  }
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
  std::unique_ptr<meshlib::mpi::guard> mpi;
  if (processes > 1) mpi = std::make_unique<meshlib::mpi::guard>();
#else
  if (processes > 1) {
    std::cerr << "train_fashion_mnist: started by an MPI launcher, but built without MPI\n";
    return 1;
  }
#endif
  // Under mpirun mpi::guard has initialised Kokkos already (after MPI); Kokkos 4 aborts on a
  // second ScopeGuard, so the example holds one only when it is the first.
  std::optional<Kokkos::ScopeGuard> kokkos;
  if (!Kokkos::is_initialized()) kokkos.emplace(argc, argv);
  meshlib::nn::fashion_mnist fm;
  try {
    fm = meshlib::nn::load_fashion_mnist(o.data_dir);
  } catch (const meshlib::data_error& e) {
    std::cerr << "train_fashion_mnist: " << e.what() << "\n";
    return 1;
  }
  try {
    if (o.advise) return advise(o, fm);
    auto run = [&](const auto& where) {
      using meshlib::bfloat16;
      const bool wire16 = o.reduce == "bf16";
      if (o.precision == "bf16") return wire16 ? train<bfloat16, bfloat16>(o, fm, where) : train<float, bfloat16>(o, fm, where);
#if MESHLIB_HAS_FLOAT16
      if (o.precision == "f16") return train<float, meshlib::float16>(o, fm, where);  // float16 is no wire type
#endif
      return wire16 ? train<bfloat16, float>(o, fm, where) : train<float, float>(o, fm, where);
    };
    const std::size_t devices = o.data * o.fsdp * o.model;  // check_options: divisible by processes
#if MESHLIB_HAS_GPU_RUNNER
    if (o.gpu) {
      // The GPU mesh: the runner's plan says which devices this process runs (one GPU each, or
      // all of them sharing one GPU), and refuses a mesh that does not fit, saying why.
      meshlib::gpu_runner runner;
      const meshlib::gpu_plan plan = runner.plan(devices);
      const auto launch = meshlib::distributed::launch();
      placement<meshlib::gpu_runner> where{plan.local_devices, launch.process_index, launch.process_count, runner,
                                           std::string("GPU mesh devices, ") + std::string(meshlib::to_string(plan.layout))};
      return run(where);
    }
#endif
    if (processes == 1) {
      placement<meshlib::default_runner> where;  // this process's device threads
      for (std::size_t d = 0; d < devices; ++d) where.devices.push_back(d);
      return run(where);
    }
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
    auto world = meshlib::mpi::world();
    const auto p = static_cast<std::size_t>(world.rank());
    const std::size_t t = devices / processes;
    placement<meshlib::hybrid_runner> where{{}, p, processes, meshlib::hybrid_runner(world, static_cast<int>(t))};
    for (std::size_t d = 0; d < t; ++d) where.devices.push_back(p * t + d);
    return run(where);
#endif
  } catch (const std::exception& e) {
    std::cerr << "train_fashion_mnist: " << e.what() << "\n";
    return 1;
  }
}

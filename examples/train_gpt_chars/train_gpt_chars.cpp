// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// train_gpt_chars: trains a decoder-only character-level Transformer (a small GPT) on the text of
// Debian's fortunes (or any text file or directory given by --data) on a (data, tensor) mesh, (2, 2)
// by default where the machine has 4 cores (fewer devices on fewer cores, flagship::default_mesh; the
// header line says so) (--mesh DxM: D devices on 'data', M on 'tensor'), or on the 4-axis mesh ('data', 'fsdp',
// 'tensor', 'pipeline') of --mesh DxFxTxP (fsdp splits the batch as data does; pipeline cuts the
// layers into stages, nn/parallel/pipeline.hpp); a (D, M) mesh is the 4-axis mesh (D, 1, M, 1), so the run
// prints 'tensor' as this help does, then writes a few hundred characters from a prompt. The vocabulary is the 256 byte
// values (no tokenizer). The network (W = --width, T = --context, L = --layers, H = --heads):
//
//   tok    embedding 256 -> W, vocabulary sharded over 'tensor'    (one psum)
//   pos    learned positional embedding T x W
//   h0..   L pre-norm blocks: x + attn(ln1(x)), then + mlp(ln2(.)), H heads and the MLP's 4W
//          hidden units sharded over 'tensor' (Megatron: two psums forward, two backward)
//   ln_f   layer norm
//   head   tied to tok: logits x E^T, sharded over the vocabulary, never gathered: the
//          cross-entropy reduces its max and sum-exp over 'tensor'; with --untie a column_dense
//          W -> 256 of its own (sharded over the vocabulary the same way), so that on a mesh with an
//          fsdp axis every parameter is stored sharded over it (FSDP; a tied table is not)
//
// The batch (--batch windows of T bytes at random places of the training text) is split over
// 'data'; gradients are averaged over 'data' by train_step. The last 10% of the text (files in name
// order, concatenated) is held out: the validation loss is in nats per character, next to the
// count-based unigram and bigram models on the same split.
//
//   train_gpt_chars [--mesh 2x2] [--steps 2000] [--batch 16] [--lr 3e-3] ... (--help)
//   --remat wraps every block in nn::remat (its activations recomputed in backward: less memory,
//   one more forward per block); the run prints the activation memory per device either way.
//   --threads-per-device N runs each thread device's products on N BLAS threads (default: the cores
//   / the devices, when that is more than 1); the header line says what was chosen and why.
//   train_gpt_chars --advise [--mesh 2x2] ...: measures every (data, fsdp, tensor, pipeline) shape of the
//   mesh's device count on this model and batch (nn::advise_mesh), prints the ranked table and exits.
// A mistake in the options is found before the text is loaded: usage line, message, exit status 2.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include "../common/flagship_main.hpp"
#include "../common/flagship_options.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

struct options {
  std::size_t data = 2, fsdp = 1, model = 2, pipeline = 1, microbatches = 0;
  bool gpipe = false;
  std::size_t steps = 2000, batch = 16, context = 64, layers = 4, heads = 4, width = 128;
  float lr = 3e-3f, temperature = 0.8f;
  std::string data_path = "/usr/share/games/fortunes", prompt = "Q: What is the meaning of life?\nA: ";
  std::uint64_t seed = 0;
  std::size_t eval_every = 250, eval_windows = 256, generate = 300, final_windows = 0;
  bool advise = false, remat = false, untie = false, gpu = false;
  std::string loss_log;
  std::string mesh_why;  // the header line's note on a mesh the flagship chose (no --mesh)
  std::optional<std::size_t> threads_given;  // --threads-per-device
  flagship::threads_choice threads;          // what runs, and the header line's note (empty with --gpu)
};

using flagship::usage_error;

constexpr const char* usage_line =
    "usage: train_gpt_chars [--mesh DxM] [--steps N] [--batch B] [--lr R] [--context T] [--layers L] [--heads H]\n"
    "                       [--width W] [--eval-every N] [--eval-windows N] [--data PATH] [--seed S]\n"
    "                       [--prompt TEXT] [--temperature X] [--generate N] [--remat] [--untie] [--advise]\n"
    "                       [--final-windows N] [--gpu] [--loss-log FILE] [--threads-per-device N] [--help]\n"
    "       train_gpt_chars --mesh DxFxTxP [--microbatches N] [--schedule gpipe|1f1b] ...   (the 4-axis mesh)\n";

void usage() {
  std::cout << usage_line
            << "  --mesh DxM          (data, tensor) mesh shape: D devices on 'data', M on 'tensor'; the same as\n"
               "                      --mesh Dx1xMx1 (batch split over 'data', heads, MLP and vocabulary over 'tensor');\n"
               "                      default 2x2 (4 thread devices) with 4 cores or more, else one device per core\n"
               "                      (2x1 on 2 or 3 cores, 1x1 on 1; the first line says which); 2x2 with --gpu\n"
               "  --mesh DxFxTxP      the 4-axis mesh ('data', 'fsdp', 'tensor', 'pipeline'): batch over data x fsdp,\n"
               "                      heads, MLP and vocabulary over tensor, the layers cut into P pipeline stages\n"
               "  --microbatches N    pipeline micro-batches per step (P > 1), dividing B / (D F); default P\n"
               "  --schedule S        pipeline schedule, gpipe or 1f1b; default 1f1b\n"
               "  --threads-per-device N\n"
               "                      BLAS threads each device's matrix products run on, at most the cores;\n"
               "                      default: the cores / the devices where that is more than 1, else 1; the\n"
               "                      first line says which\n"
               "  --steps N           training steps, default 2000\n"
               "  --batch B           windows per step (global), a multiple of D; default 16\n"
               "  --lr R              peak learning rate (linear warm-up, cosine decay to 10%); default 3e-3\n"
               "  --context T         characters per window (the model's context); default 64\n"
               "  --layers L          Transformer blocks; default 4\n"
               "  --heads H           attention heads, a multiple of M (the tensor axis); default 4\n"
               "  --width W           model width, a multiple of H; default 128 (MLP 4W)\n"
               "  --eval-every N      validation loss on --eval-windows windows every N steps; default 250\n"
               "  --eval-windows N    windows of that progress estimate, spread over the held-out text; default 256\n"
               "                      (the final validation loss reads every held-out window)\n"
               "  --final-windows N   the final validation on N windows spread over the held-out text; default all\n"
               "  --data PATH         a text file, or a directory whose files without an extension are read in\n"
               "                      name order; default /usr/share/games/fortunes (Debian's fortunes)\n"
               "  --seed S            initialisation, batches and sampling; default 0\n"
               "  --prompt TEXT       the start of the generated text; default \"Q: What is the meaning of life?\\nA: \"\n"
               "  --temperature X     sampling temperature (lower: more likely characters); default 0.8\n"
               "  --generate N        characters to generate after training (0: none); default 300\n"
               "  --remat             recompute each block's activations in backward (nn::remat): less memory\n"
               "  --untie             a head of its own instead of the embedding's transpose; with F > 1 the\n"
               "                      parameters are then sharded over 'fsdp' (FSDP), not only the batch\n"
               "  --advise            time a few steps of every (data, fsdp, tensor, pipeline) shape of the mesh's\n"
               "                      devices on this model and batch, print the ranked table and exit (no training)\n"
               "  --gpu               train on the GPU mesh (gpu_runner: NCCL, or devices sharing a GPU); needs a\n"
               "                      build with Kokkos CUDA and NCCL, and a visible GPU\n"
               "  --loss-log FILE     write each step's loss to FILE, one 'step loss' line per step\n"
               "Every check of the options runs before the text is loaded; a mistake exits with status 2.\n";
}

using flagship::positive_integer;

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
      const std::string v = value();
      if (std::count(v.begin(), v.end(), 'x') == 3) {  // DxFxTxP
        std::size_t* axes[] = {&o.data, &o.fsdp, &o.model, &o.pipeline};
        std::size_t at = 0;
        for (auto* axis : axes) {
          const std::size_t x = v.find('x', at);
          const auto n = flagship::whole_number(v.substr(at, x == std::string::npos ? std::string::npos : x - at));
          if (!n || *n == 0 || *n > 64)
            throw usage_error("--mesh wants DxFxTxP, four positive integers (data x fsdp x tensor x pipeline "
                              "devices, at most 64 each) such as 1x2x2x2, not '" + v + "'");
          *axis = *n;
          at = x + 1;
        }
      } else {
        std::tie(o.data, o.model) = flagship::mesh_shape(v, "2x2", "tensor");
        o.fsdp = o.pipeline = 1;
      }
    } else if (a == "--microbatches") o.microbatches = positive_integer(a, value());
    else if (a == "--schedule") {
      const std::string v = value();
      if (v != "gpipe" && v != "1f1b") throw usage_error("--schedule wants gpipe or 1f1b, not '" + v + "'");
      o.gpipe = v == "gpipe";
    }
    else if (a == "--steps") o.steps = positive_integer(a, value());
    else if (a == "--batch") o.batch = positive_integer(a, value());
    else if (a == "--lr") o.lr = flagship::positive_number(a, value());
    else if (a == "--context") o.context = positive_integer(a, value());
    else if (a == "--layers") o.layers = positive_integer(a, value());
    else if (a == "--heads") o.heads = positive_integer(a, value());
    else if (a == "--width") o.width = positive_integer(a, value());
    else if (a == "--eval-every") o.eval_every = positive_integer(a, value());
    else if (a == "--eval-windows") o.eval_windows = positive_integer(a, value());
    else if (a == "--data") o.data_path = value();
    else if (a == "--seed") o.seed = flagship::seed_number(a, value());
    else if (a == "--prompt") o.prompt = value();
    else if (a == "--advise") o.advise = true;
    else if (a == "--gpu") o.gpu = true;
    else if (a == "--loss-log") o.loss_log = value();
    else if (a == "--final-windows") o.final_windows = positive_integer(a, value());
    else if (a == "--remat") o.remat = true;
    else if (a == "--untie") o.untie = true;
    else if (a == "--threads-per-device") o.threads_given = positive_integer(a, value());
    else if (a == "--temperature") o.temperature = flagship::positive_number(a, value());
    else if (a == "--generate") {
      const std::string v = value();
      const auto n = flagship::whole_number(v);
      if (!n) throw usage_error("--generate wants a non-negative integer, not '" + v + "'");
      o.generate = *n;
    } else throw usage_error("unknown option '" + a + "' (see --help)");
  }
  flagship::check_gpu_flag(o.gpu);
  if (o.gpu && o.advise) throw usage_error("--advise measures CPU thread devices: leave out --gpu");
  if (!mesh_given && !o.gpu) {  // thread devices: one per core at most
    const auto c = flagship::default_mesh(flagship::available_cores(), 2, 2);
    o.data = c.data;
    o.model = c.model;
    o.mesh_why = c.why;
  }
  if (o.gpu && o.threads_given)
    throw usage_error("--threads-per-device sets the BLAS threads of CPU thread devices: leave it out with --gpu");
  if (!o.gpu)  // applied by train (flagship::use_threads_per_device); a GPU's products run on cuBLAS
    o.threads = flagship::threads_per_device(o.threads_given, flagship::available_cores(),
                                             o.data * o.fsdp * o.model * o.pipeline);
  // The checks that need no data, in the options' words, before the text is read (the library
  // would refuse these sizes later, in its own terms).
  const bool four = o.fsdp != 1 || o.pipeline != 1;
  const std::string mesh = "(--mesh " + std::to_string(o.data) + "x" +
                           (four ? std::to_string(o.fsdp) + "x" + std::to_string(o.model) + "x" + std::to_string(o.pipeline)
                                 : std::to_string(o.model));
  // --advise tries every shape of the devices and lists the ones these sizes do not fit.
  if (!o.advise && o.batch % (o.data * o.fsdp) != 0)
    throw usage_error("--batch " + std::to_string(o.batch) + " is not divisible by the data axis " + mesh + ": " +
                      std::to_string(o.data * o.fsdp) + ")");
  if (o.microbatches == 0) o.microbatches = o.pipeline;
  if (!o.advise && o.pipeline > 1 && (o.batch / (o.data * o.fsdp)) % o.microbatches != 0)
    throw usage_error("--microbatches " + std::to_string(o.microbatches) + " does not divide the " +
                      std::to_string(o.batch / (o.data * o.fsdp)) + " windows of each data device " + mesh + ")");

  if (!o.advise && o.heads % o.model != 0)
    throw usage_error("--heads " + std::to_string(o.heads) + " is not divisible by the tensor axis " + mesh + ": " +
                      std::to_string(o.model) + ")");
  if (!o.advise && 256 % o.model != 0)
    throw usage_error("the vocabulary of 256 bytes is not divisible by the tensor axis " + mesh + ": " +
                      std::to_string(o.model) + "); use a tensor axis of 1, 2, 4, ... 256");
  if (o.width % o.heads != 0)
    throw usage_error("--width " + std::to_string(o.width) + " is not divisible by --heads " + std::to_string(o.heads));
  if (o.width > 4096) throw usage_error("--width " + std::to_string(o.width) + " is too large (at most 4096)");
  if (o.context > 4096) throw usage_error("--context " + std::to_string(o.context) + " is too large (at most 4096)");
  if (o.layers > 64) throw usage_error("--layers " + std::to_string(o.layers) + " is too many (at most 64)");
  if (o.prompt.empty() && o.generate > 0) throw usage_error("--prompt is empty; give at least one character to start from");
  return o;
}

/// The seed's mesh: a (D, M) mesh is (D, 1, M, 1).
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"tensor">,
                             meshlib::axis<"pipeline">>;
using block_t = meshlib::nn::transformer_block<float, mesh_t, "tensor">;
// The heads, named here: nvcc (13.0) cannot spell a string template argument written inside a
// lambda of a function template ("'__T28' was not declared").
using untied_head_t = meshlib::nn::column_dense<float, mesh_t, "tensor">;
using tied_head_t = meshlib::nn::tied_head<float, mesh_t, "tensor">;

/// Transformer blocks chained, a layer of `sequential` like any other (forward, backward,
/// collect): the number of blocks is a run-time option, while a `sequential`'s layers are types.
/// The model holds four of these groups (some may be empty), so a pipeline has layers to cut.
/// `Block` is `block_t`, or `nn::remat<block_t>` (--remat).
template <class Block>
struct block_stack {
  std::vector<Block> blocks;
  template <meshlib::local_tensor_type X>
  X forward(const X& x) {
    X h = x;
    for (auto& b : blocks) h = b.forward(h);
    return h;
  }
  template <meshlib::local_tensor_type DY>
  DY backward(const DY& dy, bool need_dx = true) {
    DY g = dy;
    for (std::size_t i = blocks.size(); i-- > 0;) g = blocks[i].backward(g, i > 0 || need_dx);
    return g;
  }
  void collect(std::vector<meshlib::nn::param_ref<float>>& out) {
    for (auto& b : blocks) b.collect(out);
  }
};

/// The network of the file comment (every block in `nn::remat` when `Remat`; a head of its own when
/// `Untie`); block `i` of L in group `4 i / L`.
template <bool Remat, bool Untie>
auto gpt(const mesh_t& m, const options& o, meshlib::nn::rng_key key) {
  namespace nn = meshlib::nn;
  nn::embedding<float, mesh_t, "tensor"> tok(m, "tok", 256, o.width, key);
  block_stack<std::conditional_t<Remat, nn::remat<block_t>, block_t>> h[4];
  for (std::size_t i = 0; i < o.layers; ++i) {
    block_t b(m, "h" + std::to_string(i), o.width, o.heads, 4 * o.width, o.context, key);
    if constexpr (Remat) h[4 * i / o.layers].blocks.emplace_back(m, std::move(b));
    else h[4 * i / o.layers].blocks.push_back(std::move(b));
  }
  auto head = [&] {
    if constexpr (Untie) return untied_head_t(m, "head", o.width, 256, key);
    else return tied_head_t(tok);
  }();
  return nn::sequential(tok, nn::positional_embedding<float, mesh_t>(m, "pos", o.context, o.width, o.context, key),
                        std::move(h[0]), std::move(h[1]), std::move(h[2]), std::move(h[3]),
                        nn::layer_norm<float, mesh_t>(m, "ln_f", o.width), std::move(head));
}

/// `count` evaluation windows spread evenly over `text` (the progress estimate: the whole held-out
/// text would cost as much as dozens of training steps each time).
meshlib::nn::token_batch spread_windows(std::span<const std::uint8_t> text, std::size_t context, std::size_t count) {
  const std::size_t total = meshlib::nn::count_windows(text, context);
  count = std::min(count, total);
  meshlib::nn::token_batch b{count, context, {}, {}};
  for (std::size_t k = 0; k < count; ++k) {
    const auto w = meshlib::nn::tile_windows(text, context, k * total / count, 1);
    b.inputs.insert(b.inputs.end(), w.inputs.begin(), w.inputs.end());
    b.targets.insert(b.targets.end(), w.targets.begin(), w.targets.end());
  }
  return b;
}

/// Generates `n` bytes after `prompt`: each from the model's next-byte distribution at temperature
/// `temperature`, given the last `context` bytes (padded at the end: the causal mask makes the
/// padding invisible to the position read). Every data replica reads the same window; the device of
/// data rank 0 of each model group copies its block of the vocabulary's logits out.
template <bool Remat, bool Untie, class State, class Runner>
std::string generate(State& state, const options& o, meshlib::nn::rng_key key, const Runner& runner) {
  namespace nn = meshlib::nn;
  if (state.pipeline() != nullptr || state.fully_shard_policy()) {
    // A device holds only its pipeline stage's parameters (under FSDP, its shards of them):
    // generate on one device, from a checkpoint of the state (a checkpoint restores on any mesh).
    const auto dir = std::filesystem::temp_directory_path() / ("train_gpt_chars_" + std::to_string(::getpid()));
    nn::save_checkpoint(dir, state);
    const mesh_t one{1, 1, 1, 1};
    State single(one, gpt<Remat, Untie>(one, o, key), state.opt);
    nn::restore_checkpoint(dir, single);
    std::filesystem::remove_all(dir);
    return generate<Remat, Untie>(single, o, key, runner);
  }
  using ids_t = typename State::ids_type;
  constexpr auto model_mask = mesh_t::mask_of<"tensor">();
  constexpr auto data_mask = mesh_t::mask_of<"data", "fsdp">();
  std::string text = o.prompt;
  std::vector<std::int32_t> window(o.context);
  std::vector<float> logits(256), p(256);
  // The window where the model's kernels read it (device memory on a GPU; nn::device_put's rule).
  const Kokkos::View<std::int32_t*, meshlib::default_memory_space> ids_window("window", o.context);
  state.model.begin_step(key, false);
  for (std::size_t k = 0; k < o.generate; ++k) {
    const std::size_t len = std::min(text.size(), o.context);
    std::fill(window.begin(), window.end(), std::int32_t{' '});
    for (std::size_t t = 0; t < len; ++t)
      window[t] = static_cast<unsigned char>(text[text.size() - len + t]);
    Kokkos::deep_copy(ids_window, Kokkos::View<const std::int32_t*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
                                      window.data(), window.size()));
    meshlib::spmd(state.mesh, [&](std::size_t dev) {
      const ids_t ids(typename ids_t::view_type(ids_window.data(), o.context), state.mesh, dev);
      const auto z = state.model.forward(ids);
      if (state.mesh.group_rank(dev, data_mask) != 0) return;
      const std::size_t c0 = state.mesh.group_rank(dev, model_mask) * z.extent(1);
      const std::vector<float> block = meshlib::to_host(z);
      for (std::size_t j = 0; j < z.extent(1); ++j) logits[c0 + j] = block[(len - 1) * z.extent(1) + j];
    }, runner);
    const float mx = *std::max_element(logits.begin(), logits.end());
    double sum = 0;
    for (std::size_t v = 0; v < 256; ++v) sum += (p[v] = std::exp((logits[v] - mx) / o.temperature));
    double u = nn::uniform(key, k) * sum;
    std::size_t pick = 255;
    for (std::size_t v = 0; v < 256; ++v)
      if ((u -= p[v]) < 0) {
        pick = v;
        break;
      }
    text.push_back(static_cast<char>(pick));
  }
  return text;
}

/// `--advise`: every (data, fsdp, tensor, pipeline) shape of the mesh's device count, measured on this model and a
/// batch of the training text (nn::advise_mesh), ranked; nothing is trained.
template <bool Remat, bool Untie>
int advise(const options& o, const meshlib::nn::text_corpus& corpus) {
  namespace nn = meshlib::nn;
  const nn::rng_key key{o.seed};
  const auto split = nn::split_text(corpus, 0.1, o.context + 1);
  const auto batch = nn::sample_windows(split.train, o.batch, o.context, key.fold_in(1'000'000));
  nn::advise_options ao;
  ao.opt = nn::adamw(nn::constant(o.lr), 0.01f, 0.9f, 0.99f);
  const std::size_t devices = o.data * o.fsdp * o.model * o.pipeline;
  std::printf("train_gpt_chars --advise: GPT (%zu layers, %zu heads, width %zu, context %zu), batch %zu windows, %zu "
              "thread devices%s: %zu warm-up + %zu timed steps per shape\n",
              o.layers, o.heads, o.width, o.context, o.batch, devices,
              o.threads.why.empty() ? "" : (" (" + o.threads.why + ")").c_str(), ao.warmup_steps, ao.timed_steps);
  std::fflush(stdout);
  const auto a = nn::advise_mesh<mesh_t>(devices, [&](const mesh_t& m) { return gpt<Remat, Untie>(m, o, key); }, batch, ao);
  std::printf("\n%s\nbest: --mesh %s --threads-per-device %zu%s\n", a.markdown().c_str(), a.best.flag().c_str(),
              a.best_threads_per_device, a.best_overlap ? " (gradient sync overlapped: data_parallel overlap)" : "");
  return 0;
}

template <bool Remat, bool Untie, class Runner>
int train_model(const options& o, const meshlib::nn::text_corpus& corpus, const Runner& runner) {
  namespace nn = meshlib::nn;
  if (o.advise) return advise<Remat, Untie>(o, corpus);
  const mesh_t mesh{o.data, o.fsdp, o.model, o.pipeline};
  const nn::rng_key key{o.seed};
  const auto split = nn::split_text(corpus, 0.1, o.context + 1);
  const auto lr = nn::warmup_cosine(o.lr, std::max<std::size_t>(1, o.steps / 20), o.steps, 0.1f);
  const nn::optimizer opt = nn::chain(nn::clip_by_global_norm(1.0f), nn::adamw(lr, 0.01f, 0.9f, 0.99f));
  // Untied, an fsdp axis shards the parameters (FSDP); tied, it splits the batch only.
  const bool fsdp = Untie && o.fsdp > 1;
  // The pipeline policy over 'pipeline' (with one device there, no stages: the step is the plain one).
  const nn::pipeline<"pipeline"> pipe{.schedule = o.gpipe ? nn::pipeline_kind::gpipe : nn::pipeline_kind::one_f_one_b,
                                      .microbatches = o.microbatches};
  // Either way the state's type is the same (its batch axes 'data' and 'fsdp'); the policies say
  // what 'fsdp' does: FSDP's shards (HSDP with 'data'), or the batch only.
  using state_t = nn::train_state<mesh_t, decltype(gpt<Remat, Untie>(mesh, o, key))>;
  state_t state = fsdp ? state_t(mesh, gpt<Remat, Untie>(mesh, o, key), opt, nn::data_parallel<"data">{},
                                 nn::fully_shard<"fsdp">{}, pipe)
                       : state_t(mesh, gpt<Remat, Untie>(mesh, o, key), opt, nn::data_parallel<"data", "fsdp">{}, pipe);

  std::size_t count = 0;
  for (const auto& p : state.params) {
    std::size_t n = 1;
    for (auto e : p.shape) n *= e;
    count += n;
  }
  std::printf("train_gpt_chars: GPT (%zu layers, %zu heads, width %zu, context %zu, vocabulary 256 bytes) on %s (%zu %s%s)%s\n",
              o.layers, o.heads, o.width, o.context, mesh.to_string().c_str(), mesh.size(),
              o.gpu ? "GPU mesh devices" : "thread devices", o.mesh_why.empty() ? "" : (", " + o.mesh_why).c_str(),
              o.threads.why.empty() ? "" : (", " + o.threads.why).c_str());
  std::printf("  data: %zu bytes from %zu files of %s: %zu training, %zu validation (the last 10%%)\n", corpus.bytes.size(),
              corpus.files.size(), o.data_path.c_str(), split.train.size(), split.validation.size());
  std::printf("  %zu parameters in %zu arrays; batch %zu windows of %zu (%zu tokens, %zu windows per data device), %s,\n"
              "  lr %s warm-up + cosine\n",
              count, state.params.size(), o.batch, o.context, o.batch * o.context, o.batch / (o.data * o.fsdp),
              opt.name().c_str(), flagship::number_text(o.lr).c_str());
  if (fsdp) {
    const auto mem = state.memory(0);
    std::printf("  fsdp: parameters, gradients and optimizer state sharded over %zu devices: device 0 stores %zu "
                "parameter bytes of the model's %zu\n",
                o.fsdp, mem.parameters, count * sizeof(float));
  }
  if (o.pipeline > 1) {
    std::printf("  pipeline: %zu stages (%s, %zu micro-batches):", o.pipeline, o.gpipe ? "GPipe" : "1F1B", o.microbatches);
    for (auto [b, e] : state.pipeline_stages()) std::printf(" layers [%zu, %zu)", b, e);
    std::printf("\n");
  }
  const double uni = nn::unigram_nats(split.train, split.validation), bi = nn::bigram_nats(split.train, split.validation);
  std::printf("  baselines on the validation text: unigram %.3f, bigram %.3f nats/char (add-one smoothing); uniform %.3f\n",
              uni, bi, std::log(256.0));
  std::fflush(stdout);

  const auto progress = spread_windows(split.validation, o.context, o.eval_windows);
  flagship::loss_log losses(o.loss_log);
  const auto start = std::chrono::steady_clock::now();
  auto since = start;
  double loss_sum = 0, sync = 0;
  std::size_t n = 0, held = 0, peak = 0;
  for (std::size_t s = 0; s < o.steps; ++s) {
    const auto m =
        nn::train_step(state, nn::sample_windows(split.train, o.batch, o.context, key.fold_in(1'000'000 + s)), runner);
    losses.write(s + 1, m.loss);
    held = std::max(held, m.activation_bytes);
    peak = std::max(peak, m.peak_activation_bytes);
    loss_sum += m.loss;
    sync += m.sync_seconds;
    ++n;
    const bool eval = (s + 1) % o.eval_every == 0 && s + 1 < o.steps;
    if ((s + 1) % 25 == 0 || eval || s + 1 == o.steps) {
      const auto now = std::chrono::steady_clock::now();
      const double secs = std::chrono::duration<double>(now - since).count();
      const double elapsed = std::chrono::duration<double>(now - start).count();
      std::printf("\r  step %zu/%zu  loss %.4f  lr %.2e  %.0f tokens/s (sync %.0f%%)  [%.0f s]", s + 1, o.steps,
                  loss_sum / static_cast<double>(n), static_cast<double>(lr(s)),
                  static_cast<double>(n * o.batch * o.context) / secs, 100.0 * sync / secs, elapsed);
      if (eval) {
        const auto v = nn::evaluate(state, progress, 64, runner);
        std::printf("  validation ~%.4f (%zu windows)\n", v.loss, progress.rows);
        since = std::chrono::steady_clock::now();
        loss_sum = sync = 0;
        n = 0;
      }
      std::fflush(stdout);
    }
  }
  const double train_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto all = o.final_windows ? spread_windows(split.validation, o.context, o.final_windows)
                                   : nn::tile_windows(split.validation, o.context, 0, nn::count_windows(split.validation, o.context));
  const auto v = nn::evaluate(state, all, 64, runner);
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::printf("\n  validation: %.4f nats/char (%.3f bits), next-character accuracy %.1f%% over %zu characters (%.1f s)\n",
              v.loss, v.loss / std::log(2.0), 100.0 * static_cast<double>(v.correct) / static_cast<double>(v.rows),
              v.rows, total_s - train_s);
  std::printf("  activations per device%s: %.2f MiB held between forward and backward, %.2f MiB at the step's peak\n",
              Remat ? " (every block in remat)" : "", static_cast<double>(held) / 1048576.0,
              static_cast<double>(peak) / 1048576.0);
  if (o.generate > 0) {
    const std::string text = generate<Remat, Untie>(state, o, key.fold_in(2'000'000), runner);
    std::printf("  sample (temperature %s, seed %llu):\n----\n%s\n----\n", flagship::number_text(o.temperature).c_str(),
                static_cast<unsigned long long>(o.seed), text.c_str());
  }
  std::printf("done: %zu steps in %.1f s, validation loss %.4f nats/char (unigram %.3f, bigram %.3f) on %s\n", o.steps,
              total_s, v.loss, uni, bi, mesh.to_string().c_str());
  return 0;
}

int train(const options& given, const meshlib::nn::text_corpus& corpus) {
  options o = given;
  if (!o.gpu) flagship::use_threads_per_device(o.threads);  // before any device thread multiplies
  return flagship::with_runner(o.gpu, [&](const auto& runner) {
    if (o.untie) return o.remat ? train_model<true, true>(o, corpus, runner) : train_model<false, true>(o, corpus, runner);
    return o.remat ? train_model<true, false>(o, corpus, runner) : train_model<false, false>(o, corpus, runner);
  });
}

}  // namespace

int main(int argc, char** argv) {
  const auto load = [](const options& o) { return meshlib::nn::load_text(o.data_path); };
  return flagship::run_main("train_gpt_chars", usage_line, argc, argv, parse, load, train);
}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The ResNet as a whole (the composition examples/train_resnet_fashion_mnist trains, at small
// sizes): 20 training steps give the same per-step losses on (1, 1), (2, 1), (1, 2), (4, 2) and
// (2, 4), synchronised batch norm included; checkpoints keep batch norm's running statistics (the
// model's buffers) with the parameters, restore on another mesh, evaluate as the saved model and
// continue with the same losses; a checkpoint without buffers still restores, and one whose
// buffers are not the model's is refused naming the layer.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
namespace fs = std::filesystem;

constexpr nn::image_shape image{8, 8, 1};
constexpr std::size_t classes = 4, batch = 16, steps = 20, width = 4;

/// The flagship's ResNet at a small size: stem conv-BN-ReLU, 2x2 max pooling, an identity block,
/// a projection block with stride 2, global average pooling, a dense head.
auto make_resnet(const mesh_t& m) {
  const nn::rng_key key{31};
  nn::conv2d<float, mesh_t> stem(m, "stem", image, width, 3, key, {.padding = 1, .use_bias = false});
  nn::max_pool2d<float, mesh_t> pool(m, "pool", stem.output_shape(), 2);
  nn::basic_block<float, mesh_t> b1(m, "b1", pool.output_shape(), width, 1, key);
  nn::basic_block<float, mesh_t> b2(m, "b2", b1.output_shape(), 2 * width, 2, key);
  const nn::image_shape last = b2.output_shape();
  return nn::sequential(stem, nn::batch_norm<float, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<float>(m),
                        pool, b1, b2, nn::global_avg_pool<float, mesh_t>(m, "gap", last),
                        nn::dense<float, mesh_t>(m, "fc", last.channels, classes, key));
}
using resnet_state = nn::train_state<mesh_t, decltype(make_resnet(std::declval<const mesh_t&>()))>;

const nn::dataset& data() {
  static const nn::dataset ds = meshlib_test::synthetic_problem(batch * steps, image.size(), classes);
  return ds;
}

resnet_state make_state(const mesh_t& m) { return resnet_state(m, make_resnet(m), nn::adam(nn::constant(1e-2f))); }

double step(resnet_state& s, std::size_t i) {
  const auto& ds = data();
  return nn::train_step(s, std::span<const float>(ds.x).subspan(i * batch * image.size(), batch * image.size()),
                        std::span<const std::int32_t>(ds.y).subspan(i * batch, batch), batch, 0, batch)
      .loss;
}

/// The model's logits in evaluation mode (batch norms on their running statistics) for the first
/// `batch` rows, gathered in row order from the devices of model index 0.
std::vector<float> eval_logits(resnet_state& s) {
  auto x = std::vector<float>(data().x.begin(), data().x.begin() + batch * image.size());
  using X = resnet_state::input_type;
  s.model.begin_step(s.key, false);
  const std::size_t dp = s.mesh.axes_size(resnet_state::data_axes);
  auto blocks = meshlib::spmd(s.mesh, [&](std::size_t dev) {
    const std::size_t di = s.mesh.group_rank(dev, resnet_state::data_axes);
    const std::size_t lo = batch * di / dp, hi = batch * (di + 1) / dp;
    X xb(typename X::view_type(x.data() + lo * image.size(), hi - lo, image.size()), s.mesh, dev);
    auto y = s.model.forward(xb);
    return std::vector<float>(y.data(), y.data() + y.size());
  });
  std::vector<float> out;
  for (std::size_t dev = 0; dev < s.mesh.size(); ++dev)
    if (s.mesh.coords(dev)[1] == 0) out.insert(out.end(), blocks[dev].begin(), blocks[dev].end());
  return out;
}

/// Every buffer of the model (the batch norms' running statistics), device 0's copy, concatenated.
std::vector<float> statistics_of(const resnet_state& s) {
  std::vector<nn::param_ref<float>> bs;
  s.model.collect_buffers(bs);
  std::vector<float> out;
  for (const auto& b : bs) out.insert(out.end(), b.value[0], b.value[0] + b.count[0]);
  return out;
}

std::vector<double> train(const mesh_t& m) {
  auto s = make_state(m);
  std::vector<double> losses;
  for (std::size_t i = 0; i < steps; ++i) losses.push_back(step(s, i));
  losses.push_back(nn::evaluate(s, data(), batch * steps).loss);  // evaluation: the running statistics
  return losses;
}

void require_losses(const std::vector<double>& got, const std::vector<double>& ref, std::size_t from, const mesh_t& m) {
  for (std::size_t i = from; i < got.size(); ++i) {
    INFO("step " << i << " on " << m << ": " << got[i] << " vs " << ref[i]);
    REQUIRE(std::abs(got[i] - ref[i]) <= 1e-5 * std::abs(ref[i]));
  }
}

fs::path scratch(const std::string& name) {
  auto p = fs::temp_directory_path() / ("meshlib_nn_resnet_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

std::string read_all(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("a small ResNet trains to the same 20 per-step losses on (1, 1), (2, 1), (1, 2), (4, 2), (2, 4)",
          "[nn][resnet][training]") {
  const auto ref = train(mesh_t{1, 1});  // 20 training losses, then the evaluation loss
  CHECK(ref[steps - 1] < 0.8 * ref[0]);  // it learns
  for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{2, 1}, {1, 2}, {4, 2}, {2, 4}}) {
    const mesh_t m{d, mo};
    require_losses(train(m), ref, 0, m);
  }
}

TEST_CASE("a ResNet checkpoint keeps the batch-norm running statistics and restores on another mesh",
          "[nn][resnet][checkpoint]") {
  const auto ref = train(mesh_t{1, 1});
  for (auto [from, to] : {std::pair{mesh_t{4, 2}, mesh_t{2, 4}}, std::pair{mesh_t{2, 1}, mesh_t{1, 2}}}) {
    INFO("saved on " << from << ", restored on " << to);
    const auto dir = scratch("reshard");
    auto first = make_state(from);
    std::vector<double> losses;
    for (std::size_t i = 0; i < steps / 2; ++i) losses.push_back(step(first, i));
    require_losses(losses, ref, 0, from);
    nn::save_checkpoint(dir, first);
    const auto saved_logits = eval_logits(first);
    const auto saved_stats = statistics_of(first);
    CHECK(saved_stats.size() == 2 * (width + 2 * width + 3 * 2 * width));  // stem, b1 (2 BN), b2 (3 BN)

    // The index names every running statistic beside the parameters.
    const auto index = read_all(dir / "index");
    CHECK(index.find("\nbuffers 12\nbuffer stem_bn.running_mean float32 4 ") != std::string::npos);
    CHECK(index.find("\nbuffer b2.proj_bn.running_var float32 8 ") != std::string::npos);

    auto second = make_state(to);
    CHECK(statistics_of(second) != saved_stats);  // a fresh model: means 0, variances 1
    nn::restore_checkpoint(dir, second);
    CHECK(statistics_of(second) == saved_stats);  // bit for bit
    const auto logits = eval_logits(second);
    REQUIRE(logits.size() == saved_logits.size());
    for (std::size_t i = 0; i < logits.size(); ++i) {
      INFO("logit " << i);
      REQUIRE(std::abs(logits[i] - saved_logits[i]) <= 1e-6f * (1.0f + std::abs(saved_logits[i])));
    }
    // On the mesh it was saved on, evaluation is the same bits.
    auto same = make_state(from);
    nn::restore_checkpoint(dir, same);
    CHECK(eval_logits(same) == saved_logits);

    losses.resize(steps / 2);
    for (std::size_t i = steps / 2; i < steps; ++i) losses.push_back(step(second, i));
    losses.push_back(nn::evaluate(second, data(), batch * steps).loss);
    require_losses(losses, ref, steps / 2, to);
    fs::remove_all(dir);
  }
}

TEST_CASE("a checkpoint without buffers restores the parameters and leaves the running statistics",
          "[nn][resnet][checkpoint]") {
  const mesh_t m{2, 1};
  const auto dir = scratch("old");
  auto first = make_state(m);
  for (std::size_t i = 0; i < 3; ++i) (void)step(first, i);
  nn::save_checkpoint(dir, first);
  // The index as a meshlib that did not save buffers wrote it: no buffer lines, checksummed.
  auto text = read_all(dir / "index");
  const auto at = text.find("buffers ");
  REQUIRE(at != std::string::npos);
  const std::string body = text.substr(0, at);
  { std::ofstream(dir / "index", std::ios::binary | std::ios::trunc) << body << nn::detail::checksum_line(body); }

  auto second = make_state(mesh_t{1, 2});
  const auto fresh = statistics_of(second);
  nn::restore_checkpoint(dir, second);
  CHECK(second.step == 3);
  CHECK(statistics_of(second) == fresh);  // left as they were
  std::vector<nn::param_ref<float>> a, b;
  first.model.collect(a);
  second.model.collect(b);
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO(a[i].name);
    CHECK(std::vector<float>(a[i].value[0], a[i].value[0] + a[i].count[0]) ==
          std::vector<float>(b[i].value[0], b[i].value[0] + b[i].count[0]));
  }
  fs::remove_all(dir);
}

namespace {
/// dense -> batch_norm or layer_norm named `x`, then the other kind named `y`: the same parameters
/// (`x.g`, `x.b`, `y.g`, `y.b`), but the buffers of the batch norm only.
template <bool BatchFirst>
auto make_norms(const mesh_t& m) {
  const nn::rng_key key{5};
  nn::dense<float, mesh_t> fc(m, "fc", image.size(), classes, key);
  if constexpr (BatchFirst)
    return nn::sequential(fc, nn::batch_norm<float, mesh_t>(m, "x", classes), nn::layer_norm<float, mesh_t>(m, "y", classes));
  else
    return nn::sequential(fc, nn::layer_norm<float, mesh_t>(m, "x", classes), nn::batch_norm<float, mesh_t>(m, "y", classes));
}
}  // namespace

TEST_CASE("a checkpoint whose buffers are not the model's is refused, naming the buffer and its layer",
          "[nn][resnet][checkpoint][errors]") {
  const mesh_t m{2, 1};
  const auto& ds = data();
  const auto opt = nn::adam(nn::constant(1e-2f));
  const auto dir = scratch("mismatch");
  nn::train_state s(m, make_norms<true>(m), opt);
  (void)nn::train_step(s, std::span<const float>(ds.x).first(batch * image.size()),
                       std::span<const std::int32_t>(ds.y).first(batch), batch, 0, batch);
  nn::save_checkpoint(dir, s);
  const std::string idx = (dir / "index").string();

  nn::train_state swapped(m, make_norms<false>(m), opt);  // the batch norm is `y` there
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, swapped); }) ==
        "meshlib::nn: restore_checkpoint: '" + idx +
            "': buffer 0 is 'x.running_mean' (running statistics of layer 'x'), the model's is 'y.running_mean' "
            "(running statistics of layer 'y'): a checkpoint of another model; restore into the model it was saved "
            "from");
  const nn::rng_key key{5};
  nn::train_state none(m,
                       nn::sequential(nn::dense<float, mesh_t>(m, "fc", image.size(), classes, key),
                                      nn::layer_norm<float, mesh_t>(m, "x", classes),
                                      nn::layer_norm<float, mesh_t>(m, "y", classes)),
                       opt);
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, none); }) ==
        "meshlib::nn: restore_checkpoint: '" + idx +
            "': holds the buffer 'x.running_mean' (running statistics of layer 'x'), which the model does not have: a "
            "checkpoint of another model; restore into the model it was saved from");
  // A corrupted statistics file names the buffer; nothing is restored.
  {
    std::fstream f(dir / "x.running_var.g1.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(2);
    f.put('\x7f');
  }
  nn::train_state other(m, make_norms<true>(m), opt);
  CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
        "meshlib::nn: restore_checkpoint: '" + (dir / "x.running_var.g1.bin").string() +
            "' (buffer 'x.running_var') does not match its checksum in the index: the file is corrupted");
  CHECK(other.step == 0);
  fs::remove_all(dir);
}

}  // namespace MESHLIB_TEST_UNIT

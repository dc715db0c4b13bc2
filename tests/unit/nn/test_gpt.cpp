// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A language model trained through train_step and evaluate (issue 25): a network that starts at
// int32 token ids (vocabulary-parallel embedding, positional embedding, pre-norm blocks, tied
// head) with next-token targets and the vocabulary-parallel cross-entropy. The first step's loss
// and update against a plain reference loop written here (its gradient by central differences);
// 20 steps of a small GPT on (1, 1), (2, 1), (1, 2), (4, 2), (2, 4) giving the same losses; a
// checkpoint saved on one mesh continuing on another; bad ids, targets and batches refused with
// messages naming the layer, the sizes and the fix.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "small_gpt.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

/// The global values of a parameter, assembled from the devices' blocks.
std::vector<double> global_values(const nn::param_ref<float>& p) {
  std::size_t total = 1;
  for (auto e : p.shape) total *= e;
  std::vector<double> g(total);
  for (std::size_t dev = 0; dev < p.value.size(); ++dev)
    for (std::size_t i = 0; i < p.count[dev]; ++i) g[nn::detail::global_index(p, dev, i)] = p.value[dev][i];
  return g;
}

// ---- the reference: embedding + positional embedding + rms_norm + tied head, by the definition ----

/// The mean next-token cross-entropy of `ids` -> `next` (sequences of `seq`) with tables `e`
/// (vocab x d), `p` (positions x d) and scale `g` (d).
double reference_loss(const std::vector<double>& e, const std::vector<double>& p, const std::vector<double>& g,
                      std::size_t vocab, std::size_t d, std::size_t seq, const std::vector<std::int32_t>& ids,
                      const std::vector<std::int32_t>& next) {
  double total = 0;
  std::vector<double> h(d), z(vocab);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    double ms = 0;
    for (std::size_t j = 0; j < d; ++j) {
      h[j] = e[static_cast<std::size_t>(ids[i]) * d + j] + p[(i % seq) * d + j];
      ms += h[j] * h[j];
    }
    const double r = 1.0 / std::sqrt(ms / static_cast<double>(d) + 1e-6);
    double mx = -1e300;
    for (std::size_t v = 0; v < vocab; ++v) {
      z[v] = 0;
      for (std::size_t j = 0; j < d; ++j) z[v] += h[j] * r * g[j] * e[v * d + j];
      mx = std::max(mx, z[v]);
    }
    double s = 0;
    for (double zv : z) s += std::exp(zv - mx);
    total += std::log(s) + mx - z[static_cast<std::size_t>(next[i])];
  }
  return total / static_cast<double>(ids.size());
}

// The small GPT and its text: small_gpt.hpp.
using meshlib_test::gpt_text;
using meshlib_test::gpt_windows;
using meshlib_test::small_gpt;

/// Per-step losses of 20 steps of the small GPT on `m` (adam), and the validation loss after them.
std::vector<double> gpt_losses(const mesh_t& m, std::size_t steps = 20) {
  nn::train_state state(m, small_gpt(m), nn::adam(nn::constant(1e-2f)));
  std::vector<double> out;
  for (std::size_t s = 0; s < steps; ++s) out.push_back(nn::train_step(state, gpt_windows(s)).loss);
  // 4 windows per batch: several batches, split over data.
  out.push_back(nn::evaluate(state, meshlib_test::gpt_validation(), 4).loss);
  return out;
}

}  // namespace

TEST_CASE("train_step on token ids: the first loss and update equal a reference loop on 1 and 4 devices",
          "[nn][gpt]") {
  constexpr std::size_t vocab = 8, d = 4, seq = 4;
  // Two sequences of four tokens, each target the next token (ids repeat, so rows of the table
  // gather several tokens' gradients and the tied head adds its own).
  const std::vector<std::int32_t> ids{3, 1, 4, 1, 5, 2, 6, 5}, next{1, 4, 1, 5, 2, 6, 5, 3};
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}, std::array<std::size_t, 2>{1, 4}}) {
    const mesh_t m{shape[0], shape[1]};
    INFO("mesh " << m);
    const nn::rng_key key{4};
    nn::embedding<float, mesh_t> tok(m, "tok", vocab, d, key, 0.5f);
    nn::sequential net(tok, nn::positional_embedding<float, mesh_t>(m, "pos", seq, d, seq, key, 0.5f),
                       nn::rms_norm<float, mesh_t>(m, "norm", d), nn::tied_head<float, mesh_t>(tok));
    const float lr = 1.0f;
    nn::train_state state(m, std::move(net), nn::sgd(nn::constant(lr), 0.0f));
    REQUIRE(state.params.size() == 3);  // the table once, positions, scale
    auto e = global_values(state.params[0]), p = global_values(state.params[1]), g = global_values(state.params[2]);
    const double want = reference_loss(e, p, g, vocab, d, seq, ids, next);
    const auto r = nn::train_step(state, std::span<const std::int32_t>(ids), std::span<const std::int32_t>(next),
                                  ids.size(), 0, ids.size());
    CHECK(r.rows == ids.size());
    CHECK(std::abs(r.loss - want) <= 1e-5 * want);
    // The update is -lr * gradient; the gradient by central differences of the reference (double).
    std::vector<std::vector<double>*> tables{&e, &p, &g};
    const double h = 1e-6;
    for (std::size_t pi = 0; pi < 3; ++pi) {
      const auto after = global_values(state.params[pi]);
      auto& t = *tables[pi];
      for (std::size_t i = 0; i < t.size(); ++i) {
        const double keep = t[i];
        t[i] = keep + h;
        const double up = reference_loss(e, p, g, vocab, d, seq, ids, next);
        t[i] = keep - h;
        const double down = reference_loss(e, p, g, vocab, d, seq, ids, next);
        t[i] = keep;
        const double fd = (up - down) / (2 * h), step = (keep - after[i]) / lr;
        INFO(state.params[pi].name << " element " << i);
        REQUIRE(std::abs(step - fd) <= 2e-5 + 1e-3 * std::abs(fd));
      }
    }
    // evaluate on the same windows (after the step) equals the reference on the updated tables.
    nn::token_batch w{2, seq, ids, next};
    const auto v = nn::evaluate(state, w, 1);
    const double after = reference_loss(global_values(state.params[0]), global_values(state.params[1]),
                                        global_values(state.params[2]), vocab, d, seq, ids, next);
    CHECK(v.rows == ids.size());
    CHECK(std::abs(v.loss - after) <= 1e-5 * after);
    CHECK(v.loss < r.loss);  // a step of gradient descent lowered it
  }
}

TEST_CASE("a small GPT: 20 steps give the same losses on (1, 1), (2, 1), (1, 2), (4, 2) and (2, 4)", "[nn][gpt]") {
  const auto ref = gpt_losses(mesh_t{1, 1});
  CHECK(ref[19] < ref[0] - 0.5);  // it learns (log 32 = 3.47 at the start)
  for (auto shape : {std::array<std::size_t, 2>{2, 1}, std::array<std::size_t, 2>{1, 2}, std::array<std::size_t, 2>{4, 2},
                     std::array<std::size_t, 2>{2, 4}}) {
    const mesh_t m{shape[0], shape[1]};
    const auto got = gpt_losses(m);
    for (std::size_t s = 0; s < got.size(); ++s) {
      INFO("mesh " << m << (s < 20 ? " step " : " validation ") << s);
      CHECK(std::abs(got[s] - ref[s]) <= 1e-5 * ref[s]);
    }
  }
}

TEST_CASE("a small GPT's checkpoint saved on (2, 2) continues on (1, 4) and (4, 1) with the same losses", "[nn][gpt]") {
  namespace fs = std::filesystem;
  const auto ref = gpt_losses(mesh_t{1, 1}, 6);
  const auto dir = fs::temp_directory_path() / ("meshlib_nn_gpt_ckpt_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  const mesh_t a{2, 2};
  nn::train_state first(a, small_gpt(a), nn::adam(nn::constant(1e-2f)));
  for (std::size_t s = 0; s < 3; ++s) CHECK(std::abs(nn::train_step(first, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
  nn::save_checkpoint(dir, first);
  for (auto shape : {std::array<std::size_t, 2>{1, 4}, std::array<std::size_t, 2>{4, 1}}) {
    const mesh_t b{shape[0], shape[1]};
    nn::train_state second(b, small_gpt(b), nn::adam(nn::constant(1e-2f)));
    nn::restore_checkpoint(dir, second);
    CHECK(second.step == 3);
    for (std::size_t s = 3; s < 6; ++s) {
      INFO("mesh " << b << " step " << s);
      CHECK(std::abs(nn::train_step(second, gpt_windows(s)).loss - ref[s]) <= 1e-5 * ref[s]);
    }
  }
  fs::remove_all(dir);
}

TEST_CASE("train_step on token ids: bad ids, targets and batches are clear errors", "[nn][gpt][errors]") {
  const mesh_t one{1, 1};
  nn::train_state state(one, small_gpt(one), nn::adam(nn::constant(1e-2f)));
  auto b = gpt_windows(0);
  const std::size_t n = b.inputs.size();
  const auto cause = [&](auto&& f) {
    try {
      f();
    } catch (const meshlib::device_error& e) {
      return meshlib_test::message_of<std::out_of_range>([&] { e.rethrow_cause(); });
    }
    return std::string("no device_error");
  };
  SECTION("an id outside the vocabulary names the embedding and its vocabulary size") {
    b.inputs[13] = 40;
    CHECK(cause([&] { (void)nn::train_step(state, b); }) ==
          "meshlib::nn: tok (embedding 32 x 16, vocabulary sharded over 'model'): token 13 on device 0 has id 40, not "
          "in [0, 32); map the text to ids below the vocabulary size");
    b.inputs[13] = -1;
    CHECK(cause([&] { (void)nn::evaluate(state, b); }).find("token 13 on device 0 has id -1, not in [0, 32)") !=
          std::string::npos);
    CHECK(state.step == 0);
  }
  SECTION("a target outside the vocabulary") {
    b.targets[5] = 32;
    CHECK(cause([&] { (void)nn::train_step(state, b); }) ==
          "meshlib::nn: softmax_cross_entropy: label 32 of row 5 on device 0 is not in [0, 32)");
  }
  SECTION("ids that are not one per row") {
    CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
            (void)nn::train_step(state, std::span<const std::int32_t>(b.inputs), std::span<const std::int32_t>(b.targets),
                                 n / 2, 0, n / 2);
          }) == "meshlib::nn: train_step: 64 token ids for 32 rows: a model that starts at an embedding takes one id per "
                "row (rows = sequences x sequence length, sequence-major)");
  }
  SECTION("a batch whose sequences do not split over the data axis: refused in sequences before any kernel") {
    const mesh_t two{2, 1};
    nn::train_state s2(two, small_gpt(two), nn::adam(nn::constant(1e-2f)));
    auto three = nn::sample_windows(gpt_text(100), 3, 8, nn::rng_key{1});  // 24 tokens: 12 per device
    for (auto& v : three.inputs) v %= 32;
    for (auto& v : three.targets) v %= 32;
    const std::string want =
        "meshlib::nn: train_step: the global batch of 3 sequences (of 8 tokens) does not split evenly over the 2 "
        "devices of the data axis; choose a batch size that is a multiple of 2 sequences";
    // A sharding_error of train_step itself (no device_error: no device ran), in the float path's words.
    CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { (void)nn::train_step(s2, three); }) == want);
    // The same batch as token ids: the sequence length is the model's positional embedding's.
    CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
            (void)nn::train_step(s2, std::span<const std::int32_t>(three.inputs),
                                 std::span<const std::int32_t>(three.targets), 24, 0, 24);
          }) == want);
    // Tokens that are not whole sequences at all.
    CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
            (void)nn::train_step(s2, std::span<const std::int32_t>(three.inputs).first(20),
                                 std::span<const std::int32_t>(three.targets).first(20), 20, 0, 20);
          }) == "meshlib::nn: train_step: the global batch of 20 tokens is not a whole number of sequences of 8 "
                "tokens; give sequences x 8 tokens (rows are sequence-major)");
    CHECK(s2.step == 0);
    // With accumulation, the sequences split over the data axis x the accumulation steps: 6 over 2 x 2.
    nn::train_state s3(two, small_gpt(two), nn::adam(nn::constant(1e-2f)), {.accumulation = 2});
    auto six = nn::sample_windows(gpt_text(200), 6, 8, nn::rng_key{1});
    for (auto& v : six.inputs) v %= 32;
    for (auto& v : six.targets) v %= 32;
    CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { (void)nn::train_step(s3, six); }) ==
          "meshlib::nn: train_step: the global batch of 6 sequences (of 8 tokens) does not split evenly over the 2 "
          "devices of the data axis x 2 accumulation steps; choose a batch size that is a multiple of 4 sequences");
    // 4 sequences over (2, 1): each device gets 2 whole sequences and the step runs.
    auto four = nn::sample_windows(gpt_text(200), 4, 8, nn::rng_key{1});
    for (auto& v : four.inputs) v %= 32;
    for (auto& v : four.targets) v %= 32;
    CHECK(std::isfinite(nn::train_step(s2, four).loss));
    CHECK(s2.step == 1);
  }
}

}  // namespace MESHLIB_TEST_UNIT

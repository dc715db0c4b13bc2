// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// The small GPT the training tests share (test_gpt.cpp, test_remat.cpp, test_pipeline.cpp,
// test_overlap.cpp, test_advisor.cpp) and the text it learns: written once, so that the tests that
// compare it across meshes, schedules, remat and overlap train the same model on the same data, and
// so that the same model type is instantiated once per unity batch of nn_unit.
#include <meshlib/nn.hpp>

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace meshlib_test {

/// A text with structure to learn (words repeating with variations), as `n` bytes.
inline std::vector<std::uint8_t> gpt_text(std::size_t n) {
  const std::string words[] = {"the ", "cat ", "sat ", "on ", "a ", "mat. ", "dog ", "ran "};
  std::vector<std::uint8_t> t;
  for (std::size_t i = 0; t.size() < n; ++i)
    for (char c : words[(i * 7 + i / 3) % 8]) t.push_back(static_cast<std::uint8_t>(c));
  t.resize(n);
  return t;
}

/// `gpt_text(4000)`, made once: the text the small GPT trains on.
inline const std::vector<std::uint8_t>& gpt_text() {
  static const std::vector<std::uint8_t> t = gpt_text(4000);
  return t;
}

/// Step `s`'s training batch: 8 windows of 8 ids sampled from `gpt_text()`, ids below the
/// vocabulary of 32.
inline meshlib::nn::token_batch gpt_windows(std::size_t s) {
  auto b = meshlib::nn::sample_windows(gpt_text(), 8, 8, meshlib::nn::rng_key{5}.fold_in(s));
  for (auto& v : b.inputs) v %= 32;
  for (auto& v : b.targets) v %= 32;
  return b;
}

/// The validation windows: `gpt_text()` tiled from offset 100 into 16 windows of 8 ids below 32.
inline meshlib::nn::token_batch gpt_validation() {
  auto v = meshlib::nn::tile_windows(gpt_text(), 8, 100, 16);
  for (auto& x : v.inputs) x %= 32;
  for (auto& x : v.targets) x %= 32;
  return v;
}

/// `block` itself, or `nn::remat(m, block)` (its activations recomputed in backward).
template <bool Remat, class Mesh, class Block>
auto maybe_remat(const Mesh& m, Block block) {
  if constexpr (Remat) return meshlib::nn::remat(m, std::move(block));
  else return block;
}

/// The small GPT of the tests: `Blocks` (1 or 2) pre-norm blocks of width 16, 4 heads, MLP 32,
/// sequences of 8, vocabulary 32, a final layer norm and the head tied to the embedding (on
/// another stage once a pipeline cuts the model: the table is mirrored there). Its
/// tensor-parallel layers split over the mesh axis `Model`; with `Remat` every block is in
/// `nn::remat`.
template <meshlib::fixed_string Model = "model", bool Remat = false, std::size_t Blocks = 2, class Mesh>
auto small_gpt(const Mesh& m) {
  static_assert(Blocks == 1 || Blocks == 2, "small_gpt: 1 or 2 blocks");
  namespace nn = meshlib::nn;
  const nn::rng_key key{21};
  nn::embedding<float, Mesh, Model> tok(m, "tok", 32, 16, key, 0.5f);
  const auto block = [&](const char* name) {
    return maybe_remat<Remat>(m, nn::transformer_block<float, Mesh, Model>(m, name, 16, 4, 32, 8, key));
  };
  if constexpr (Blocks == 1)
    return nn::sequential(tok, nn::positional_embedding<float, Mesh>(m, "pos", 8, 16, 8, key, 0.1f), block("h0"),
                          nn::layer_norm<float, Mesh>(m, "ln_f", 16), nn::tied_head<float, Mesh, Model>(tok));
  else
    return nn::sequential(tok, nn::positional_embedding<float, Mesh>(m, "pos", 8, 16, 8, key, 0.1f), block("h0"),
                          block("h1"), nn::layer_norm<float, Mesh>(m, "ln_f", 16),
                          nn::tied_head<float, Mesh, Model>(tok));
}

}  // namespace meshlib_test

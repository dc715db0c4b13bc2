// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The one-block Transformer of docs/fast-builds.md's timings (docs/layers.md's GPT example): token
// and position embeddings, one transformer_block, a tied head, trained with train_step on (2, 2).
#include <cstdint>
#include <cstdio>

#include <meshlib.hpp>
#include <meshlib/nn.hpp>

namespace nn = meshlib::nn;
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;

int run() {
  const mesh_t m{2, 2};
  constexpr std::size_t vocab = 16, width = 16, seq = 8;
  const nn::rng_key key{0};
  nn::embedding<float, mesh_t> tok(m, "tok", vocab, width, key);
  nn::sequential gpt(tok, nn::positional_embedding<float, mesh_t>(m, "pos", seq, width, seq, key),
                     nn::transformer_block<float, mesh_t>(m, "h0", width, 2, 4 * width, seq, key),
                     nn::layer_norm<float, mesh_t>(m, "ln_f", width), nn::tied_head<float, mesh_t>(tok));
  nn::train_state state(m, std::move(gpt), nn::adam(nn::constant(1e-2f)));
  auto windows = [&](std::size_t step) {  // counting sequences: the target is the next number
    nn::token_batch b{8, seq, std::vector<std::int32_t>(8 * seq), std::vector<std::int32_t>(8 * seq)};
    for (std::size_t i = 0; i < b.inputs.size(); ++i) {
      b.inputs[i] = static_cast<std::int32_t>((step * 3 + i / seq * 5 + i % seq) % vocab);
      b.targets[i] = (b.inputs[i] + 1) % static_cast<std::int32_t>(vocab);
    }
    return b;
  };
  const double first = nn::train_step(state, windows(0)).loss;
  for (std::size_t step = 1; step < 60; ++step) nn::train_step(state, windows(step));
  const nn::step_metrics v = nn::evaluate(state, windows(1000));
  std::printf("transformer block: loss %.3f -> %.3f on %s\n", first, v.loss, m.to_string().c_str());
  return v.loss < 0.25 * first ? 0 : 1;
}

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);  // outlives every tensor of run()
  return run();
}

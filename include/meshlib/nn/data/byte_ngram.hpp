// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The count-based baselines a byte-level language model is judged against: unigram and
/// bigram models with add-one (Laplace) smoothing over the 256 byte values, fitted on the
/// training text and scored on held-out text as mean cross-entropy in nats per byte. A model that
/// does not beat the bigram has learnt little beyond which byte follows which.
/// @code
/// double uni = meshlib::nn::unigram_nats(split.train, split.validation);   // ~3.37 on fortunes
/// double bi  = meshlib::nn::bigram_nats(split.train, split.validation);    // ~2.62
/// @endcode

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "meshlib/nn/data/errors.hpp"

namespace meshlib::nn {

/// @brief Mean -log p(byte) over `held_out`, p from the byte counts of `train` plus one each.
/// @throws data_error when `held_out` is empty.
inline double unigram_nats(std::span<const std::uint8_t> train, std::span<const std::uint8_t> held_out) {
  if (held_out.empty()) throw data_error("meshlib::nn::unigram_nats: the held-out text is empty");
  std::array<double, 256> count{};
  for (std::uint8_t b : train) count[b] += 1.0;
  const double total = static_cast<double>(train.size()) + 256.0;
  double nats = 0.0;
  for (std::uint8_t b : held_out) nats -= std::log((count[b] + 1.0) / total);
  return nats / static_cast<double>(held_out.size());
}

/// @brief Mean -log p(next | previous) over the `held_out.size() - 1` transitions of `held_out`, p from
/// the pair counts of `train` plus one for each of the 256 next bytes.
/// @throws data_error when `held_out` has fewer than 2 bytes.
inline double bigram_nats(std::span<const std::uint8_t> train, std::span<const std::uint8_t> held_out) {
  if (held_out.size() < 2) throw data_error("meshlib::nn::bigram_nats: the held-out text has fewer than 2 bytes");
  std::vector<double> pair(256 * 256, 0.0);
  std::array<double, 256> from{};
  for (std::size_t i = 0; i + 1 < train.size(); ++i) {
    pair[train[i] * 256u + train[i + 1]] += 1.0;
    from[train[i]] += 1.0;
  }
  double nats = 0.0;
  for (std::size_t i = 0; i + 1 < held_out.size(); ++i) {
    const std::uint8_t a = held_out[i], b = held_out[i + 1];
    nats -= std::log((pair[a * 256u + b] + 1.0) / (from[a] + 256.0));
  }
  return nats / static_cast<double>(held_out.size() - 1);
}

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The seeded shuffle of a data loader: a permutation of [0, count) that depends only on
/// (seed, epoch), computed the same way on every process and every platform, so processes that
/// each load their share of a global batch agree on which examples that batch holds.
///
/// @code
/// auto order = meshlib::nn::epoch_permutation(60000, /*seed=*/42, /*epoch=*/3);
/// // order[i]: the example at position i of epoch 3; a permutation of 0..59999
/// @endcode

#include <cstddef>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "meshlib/nn/random.hpp"

namespace meshlib::nn {
namespace detail {

/// SplitMix64 (Steele, Lea, Flood 2014), the mixer of nn/random.hpp: fully specified, so the
/// permutation does not depend on the standard library (std::shuffle and the std distributions
/// are implementation-defined and differ between libstdc++ and libc++).
inline std::uint64_t splitmix64(std::uint64_t x) noexcept { return mix64(x); }

/// A uniform integer in [0, range) from the stream keyed by `key`: draws below 2^64 mod range are
/// rejected so that every residue is equally likely (arc4random_uniform's method).
class key_stream {
 public:
  explicit key_stream(std::uint64_t key) noexcept : key_(key) {}
  std::uint64_t below(std::uint64_t range) noexcept {
    const std::uint64_t threshold = (0 - range) % range;
    std::uint64_t r = draw();
    while (r < threshold) r = draw();
    return r % range;
  }

 private:
  std::uint64_t draw() noexcept { return splitmix64(key_ + counter_++ * 0x9E3779B97F4A7C15ull); }
  std::uint64_t key_;
  std::uint64_t counter_ = 0;
};

}  // namespace detail

/// @brief The order of the examples in epoch `epoch`: a uniformly random permutation of
/// [0, count) (Fisher-Yates) drawn from a stream keyed by (seed, epoch) alone.
[[nodiscard]] inline std::vector<std::size_t> epoch_permutation(std::size_t count, std::uint64_t seed,
                                                                std::uint64_t epoch) {
  std::vector<std::size_t> order(count);
  std::iota(order.begin(), order.end(), std::size_t{0});
  detail::key_stream stream(detail::splitmix64(detail::splitmix64(seed) ^ epoch));
  for (std::size_t i = count; i > 1; --i) {
    const std::size_t j = static_cast<std::size_t>(stream.below(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Counter-based random numbers for training: every value is a pure function of
/// `(seed, stream, index)`, so a parameter initialised from its *global* element index, or a dropout
/// mask drawn per global activation index, is the same on every mesh and every sharding. JAX's
/// `jax.random` values for a sharded array change with the shard count; these do not.
///
/// The function is SplitMix64's finaliser (Steele, Lea, Flood, "Fast splittable pseudorandom number
/// generators", OOPSLA 2014) applied to a combination of the three words, a stateless hash as
/// Philox/Threefry are for JAX: no state, so any device computes any element on its own.
/// @code
/// meshlib::nn::rng_key key{42};
/// float u = meshlib::nn::uniform(key.fold_in(7), 1234);   // parameter 7, element 1234: in [0, 1)
/// float z = meshlib::nn::normal(key.fold_in(7), 1234);    // standard normal
/// @endcode

#include <cmath>
#include <cstdint>

namespace meshlib::nn {

namespace detail {
/// SplitMix64's output function: a bijective avalanche mix of 64 bits.
constexpr std::uint64_t mix64(std::uint64_t z) noexcept {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
}  // namespace detail

/// @brief A random key (JAX's `PRNGKey`): a 64-bit value; `fold_in` derives independent streams
/// (per parameter id, per step, per layer) as `jax.random.fold_in` does.
struct rng_key {
  std::uint64_t value = 0;
  [[nodiscard]] constexpr rng_key fold_in(std::uint64_t data) const noexcept {
    return rng_key{detail::mix64(value ^ detail::mix64(data + 0x632BE59BD9B4E019ull))};
  }
  friend constexpr bool operator==(rng_key, rng_key) = default;
};

/// @brief 64 random bits of element `index` of stream `key`.
[[nodiscard]] constexpr std::uint64_t random_bits(rng_key key, std::uint64_t index) noexcept {
  return detail::mix64(key.value + detail::mix64(index));
}

/// @brief A uniform float in [0, 1) for element `index` of `key` (24 random bits).
[[nodiscard]] constexpr float uniform(rng_key key, std::uint64_t index) noexcept {
  return static_cast<float>(random_bits(key, index) >> 40) * (1.0f / 16777216.0f);
}

/// @brief A standard normal for element `index` of `key` (Box-Muller on two independent words).
[[nodiscard]] inline float normal(rng_key key, std::uint64_t index) noexcept {
  const std::uint64_t bits = random_bits(key, index);
  const double u1 = (static_cast<double>(bits >> 11) + 1.0) * (1.0 / 9007199254740993.0);  // (0, 1]
  const double u2 = static_cast<double>(detail::mix64(bits) >> 11) * (1.0 / 9007199254740992.0);
  return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

}  // namespace meshlib::nn

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief FNV-1a (64-bit), the one hash meshlib uses: parameter names' random streams, checkpoint
/// checksums and the fingerprints by which communicators compare their participants' calls.
/// FNV-1a is a bijection of its state for each input unit, so any single substitution changes
/// the result (what the checkpoint's damage check relies on); it is not cryptographic.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace meshlib::core::detail {

/// @brief A running FNV-1a hash: feed it bytes or whole words, read `value`.
struct fnv1a {
  /// The FNV-1a 64-bit offset basis and prime (Fowler, Noll, Vo).
  static constexpr std::uint64_t offset_basis = 0xcbf29ce484222325ull, prime = 0x100000001b3ull;
  /// The hash so far.
  std::uint64_t value = offset_basis;

  /// Mixes in one unit (a byte, or a whole word where the caller hashes words).
  constexpr fnv1a& add(std::uint64_t unit) noexcept {
    value = (value ^ unit) * prime;
    return *this;
  }
  /// Mixes in each byte of `bytes`, in order.
  constexpr fnv1a& add_bytes(std::string_view bytes) noexcept {
    for (char c : bytes) add(static_cast<unsigned char>(c));
    return *this;
  }
};

/// FNV-1a of a byte string (the standard 64-bit FNV-1a of those bytes).
constexpr std::uint64_t fnv1a_of(std::string_view bytes) noexcept { return fnv1a{}.add_bytes(bytes).value; }

}  // namespace meshlib::core::detail

namespace meshlib::experimental {
/// FNV-1a, the one hash of the library: call fingerprints, plan keys.
using core::detail::fnv1a;
}  // namespace meshlib::experimental

namespace meshlib {
/// @brief FNV-1a, for the layers above core (parameter streams, checkpoint checksums) and a user's
/// own checksums: the same entities as `detail::fnv1a` and `detail::fnv1a_of`.
using core::detail::fnv1a;
using core::detail::fnv1a_of;
}  // namespace meshlib

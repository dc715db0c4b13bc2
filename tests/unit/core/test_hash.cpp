// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// FNV-1a, the one hash meshlib uses (parameter streams, checkpoint checksums, call fingerprints):
// the published 64-bit test vectors, and the word form the communicators' fingerprints use.
#include <cstdint>
#include <string_view>

#include "meshlib/core/hash.hpp"
#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {

using meshlib::core::detail::fnv1a;
using meshlib::core::detail::fnv1a_of;

TEST_CASE("fnv1a_of gives the published FNV-1a 64-bit values", "[hash]") {
  // Test vectors of the FNV reference (Fowler, Noll, Vo): "", "a", "foobar".
  static_assert(fnv1a_of("") == 0xcbf29ce484222325ull);
  CHECK(fnv1a_of("a") == 0xaf63dc4c8601ec8cull);
  CHECK(fnv1a_of("foobar") == 0x85944171f73967e8ull);
}

TEST_CASE("fnv1a over words mixes each word as one unit, in order", "[hash]") {
  const std::uint64_t p = fnv1a::prime, b = fnv1a::offset_basis;
  // By the definition: h = (h ^ w) * p per word, arithmetic modulo 2^64.
  CHECK(fnv1a{}.add(3).add(5).value == (((b ^ 3u) * p) ^ 5u) * p);
  CHECK(fnv1a{}.add(3).add(5).value != fnv1a{}.add(5).add(3).value);
  // A byte fed as a word is the byte form's step.
  CHECK(fnv1a{}.add('a').value == fnv1a_of("a"));
}

}  // namespace MESHLIB_TEST_UNIT

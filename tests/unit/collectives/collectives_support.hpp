// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Helpers of the collectives tests: per-device blocks with values that name their device and
// position, so that every expected value is computed on the host from first principles (which
// device's element should land where), never by running a collective.
// Catch2 assertions are not thread-safe: device code returns what it saw; the test checks it on
// the main thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace coll_test {

/// Element `i` (flat, row-major) of device `dev`'s input block: distinct per (device, position),
/// exactly representable in every tested type (< 2^24), signed, so min/max/sum are all meaningful.
template <class T>
T value(std::size_t dev, std::size_t i) {
  const long long v = static_cast<long long>(dev) * 1000 + static_cast<long long>(i) * 3 - 7;
  return static_cast<T>(v);
}

/// A block of `shape` on the running device filled with `value<T>(device, i)`, typed as `L`.
template <class L>
L make_block(const typename L::mesh_type& m, const typename L::shape_type& shape) {
  const std::size_t dev = meshlib::device_index();
  L x(shape, m, dev);
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = value<typename L::value_type>(dev, i);
  return x;
}

/// What a device returns to the test: its block's shape and contents.
template <class T>
struct seen {
  std::vector<std::size_t> shape;
  std::vector<T> data;
};

template <class L>
seen<typename L::value_type> capture(const L& x) {
  seen<typename L::value_type> s;
  for (std::size_t d = 0; d < L::rank; ++d) s.shape.push_back(x.extent(d));
  s.data.assign(x.data(), x.data() + x.size());
  return s;
}

/// Row-major flat index of (r, c) in a (rows, cols) block.
constexpr std::size_t at2(std::size_t r, std::size_t c, std::size_t cols) { return r * cols + c; }

using meshlib_test::message_of;

}  // namespace coll_test

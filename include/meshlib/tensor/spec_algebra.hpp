// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Building the partition spec of a kernel's result from its operands' specs (the global
/// view's sharding propagation). Result specs drop trailing `none`s, so that the type a kernel
/// returns is the one a user writes: the row sum of a `P<"data", none>` tensor is `P<"data">`.

#include <array>
#include <cstddef>
#include <utility>

#include "meshlib/core/fixed_string.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/core/partition_spec.hpp"

namespace meshlib::tensor::detail {

template <std::size_t N>
constexpr std::size_t trimmed_length(const std::array<dim_spec, N>& dims) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < N; ++i)
    if (!dims[i].replicated()) n = i + 1;
  return n;
}

template <auto Dims, class Seq = std::make_index_sequence<trimmed_length(Dims)>>
struct spec_from_array;
template <auto Dims, std::size_t... I>
struct spec_from_array<Dims, std::index_sequence<I...>> {
  using type = P<Dims[I]...>;
};

/// The partition spec whose entries are `Dims` (a `std::array<dim_spec, N>`), trailing `none`s dropped.
template <auto Dims>
using spec_from_array_t = typename spec_from_array<Dims>::type;

/// The entries of `Spec` for a rank-`Rank` array, trailing ones filled with `none`.
template <class Spec, std::size_t Rank>
constexpr std::array<dim_spec, Rank> spec_entries() {
  std::array<dim_spec, Rank> out{};
  for (std::size_t i = 0; i < Rank; ++i) out[i] = Spec::dim(i);
  return out;
}

/// Length of `'data', 'model'` (or `none` for an empty mask) for the axes of `Mesh` in `Mask`.
template <class Mesh, axis_mask Mask>
consteval std::size_t axes_names_length() {
  std::size_t n = 0;
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(Mask & (axis_mask{1} << i))) continue;
    n += Mesh::axis_names[i].size() + 2 + (first ? 0 : 2);
    first = false;
  }
  return first ? 4 : n;
}

/// `'data', 'model'` as a `fixed_string`, so that compile-time diagnostics can name axes in the
/// template arguments the compiler prints; `none` for an empty mask.
template <class Mesh, axis_mask Mask>
inline constexpr auto axes_names_v = [] {
  fixed_string<axes_names_length<Mesh, Mask>() + 1> s;
  std::size_t k = 0;
  auto put = [&](std::string_view v) {
    for (char c : v) s.chars[k++] = c;
  };
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(Mask & (axis_mask{1} << i))) continue;
    if (!first) put(", ");
    put("'");
    put(Mesh::axis_names[i]);
    put("'");
    first = false;
  }
  if (first) put("none");
  return s;
}();

}  // namespace meshlib::tensor::detail

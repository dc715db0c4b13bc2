// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief One-line type descriptions and plan descriptions, as JAX prints avals
/// (`f32[8@data,4@model]`), and `visualize` for any sharded tensor.
/// @code
/// meshlib::describe(x);      // "f32[8@data,4]": dim 0 split over 'data', dim 1 replicated
/// meshlib::visualize(x);     // that line, then the picture of the blocks (visualize_sharding)
/// meshlib::describe(meshlib::plan_reshard<meshlib::P<meshlib::none, "data">>(x));
/// // reshard P<"data", none> -> P<none, "data">: 1 step(s), 48 bytes in all
/// //   1. all_to_all over 'data' along dims 1 <-> 0 -> P<none, "data">
/// //      bytes sent: device 0: 24, device 1: 24
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>

#include "meshlib/collectives/reshard_plan.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/debug/visualize_sharding.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

namespace debug::detail {

/// JAX's short dtype names.
template <class T>
constexpr const char* short_dtype_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, double>) return "f64";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "i32";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "i64";
  else if constexpr (std::is_same_v<T, std::int16_t>) return "i16";
  else if constexpr (std::is_same_v<T, std::int8_t>) return "i8";
  else if constexpr (std::is_same_v<T, std::uint32_t>) return "u32";
  else if constexpr (std::is_same_v<T, std::uint8_t>) return "u8";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else return "?";
}

}  // namespace debug::detail

/// @brief `f32[8@data,4@model]`: element type, then each global dimension with the mesh axes that
/// split it (`@(data,model)` for several; nothing for a replicated dimension).
template <sharded_tensor_type X>
[[nodiscard]] std::string describe(const X& x) {
  using S = typename X::sharding_type;
  using Mesh = typename X::mesh_type;
  std::string s = std::string(debug::detail::short_dtype_name<typename X::value_type>()) + "[";
  for (std::size_t d = 0; d < X::rank; ++d) {
    s += (d ? "," : "") + std::to_string(x.global_shape()[d]);
    const std::size_t k = S::dim_axis_count(d);
    const auto axes = S::dim_axes(d);
    if (k == 0) continue;
    s += k == 1 ? "@" : "@(";
    for (std::size_t j = 0; j < k; ++j) s += (j ? "," : "") + std::string(Mesh::axis_names[axes[j]]);
    if (k > 1) s += ")";
  }
  return s + "]";
}

/// @brief Every step of a reshard plan and the bytes each device sends in it.
[[nodiscard]] inline std::string describe(const reshard_plan& plan) {
  std::ostringstream os;
  std::size_t devices = 0;
  for (const auto& st : plan.steps()) devices = std::max(devices, st.bytes_sent.size());
  const std::string head = plan.to_string();
  os << head.substr(0, head.find('\n')) << ' ' << plan.steps().size() << " step(s), " << plan.total_bytes_sent()
     << " bytes sent in all\n";
  std::size_t i = 0;
  for (const auto& st : plan.steps()) {
    os << "  " << ++i << ". " << st.description << "\n     bytes sent:";
    for (std::size_t d = 0; d < st.bytes_sent.size(); ++d) os << (d ? "," : "") << " device " << d << ": " << st.bytes_sent[d];
    if (st.bytes_sent.empty()) os << " none";
    os << '\n';
  }
  return os.str();
}

/// @brief `describe(x)` on one line, then the blocks of `x` (`visualize_sharding`): a grid for 1-D
/// and 2-D arrays, one row per device for higher ranks.
template <sharded_tensor_type X>
[[nodiscard]] std::string visualize(const X& x) {
  return describe(x) + "\n" + visualize_sharding(x.sharding(), x.global_shape());
}

}  // namespace meshlib

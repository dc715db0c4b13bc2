// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `debug_print(format, values...)` inside `shard_map` / `spmd`, as `jax.debug.print`: every
/// device prints one line, prefixed with its id and mesh coordinates, in device order, each line
/// whole. `{}` in the format stands for the next value; a `local_tensor` prints its elements.
/// @code
/// meshlib::spmd(m, [&] { meshlib::debug_print("x = {}, step {}", x, step); });
/// // [device 0 (data=0, model=0)] x = [1, 2], step 3
/// // [device 1 (data=0, model=1)] x = [3, 4], step 3
/// @endcode
///
/// Every device of the mesh must call it (it is collective, as every SPMD statement): the devices
/// take turns in id order, one whole-mesh barrier per turn, so lines never interleave and come in
/// order whatever the thread timing. Outside `shard_map` / `spmd` it prints the line once, unprefixed.
/// In multi-process runs each process prints its own devices' lines in turn; how the launcher
/// merges the processes' outputs is up to it.

#include <cstddef>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/debug/observe.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib {

namespace debug::detail {

template <class T>
void print_value(std::ostream& os, const T& v) {
  if constexpr (local_tensor_type<T>) {
    // Elements in row-major order, nested by dimension: [[1, 2], [3, 4]].
    const auto shape = v.shape();
    std::array<std::size_t, T::rank> idx{};
    const std::size_t n = v.size();
    if (n == 0) {
      os << "[]";
      return;
    }
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t open = 0;
      for (std::size_t d = T::rank; d-- > 0 && idx[d] == 0;) ++open;
      if (k != 0) os << ", ";
      for (std::size_t i = 0; i < open; ++i) os << '[';
      const auto& x = std::apply([&](auto... i) -> decltype(auto) { return v.view()(i...); }, idx);
      if constexpr (sizeof(x) == 1) os << +x;
      else os << x;
      std::size_t close = 0;
      for (std::size_t d = T::rank; d-- > 0;) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
        ++close;
      }
      for (std::size_t i = 0; i < close; ++i) os << ']';
    }
  } else {
    os << v;
  }
}

inline void format_into(std::ostream& os, std::string_view fmt) { os << fmt; }

template <class A, class... Rest>
void format_into(std::ostream& os, std::string_view fmt, const A& a, const Rest&... rest) {
  const std::size_t at = fmt.find("{}");
  if (at == std::string_view::npos) {
    os << fmt;
    return;
  }
  os << fmt.substr(0, at);
  print_value(os, a);
  format_into(os, fmt.substr(at + 2), rest...);
}

/// Where `debug_print` writes (std::cout unless a test redirects it).
inline std::ostream*& debug_print_stream() noexcept {
  static std::ostream* s = &std::cout;
  return s;
}

}  // namespace debug::detail

/// @brief Prints `format` with each `{}` replaced by the next value, once per device in device
/// order (see the file comment). Values: anything with `operator<<`, and `local_tensor`s.
template <class... Args>
void debug_print(std::string_view format, const Args&... values) {
  std::ostringstream line;
  experimental::device_context* ctx = experimental::current_device_slot();
  std::ostream& out = *debug::detail::debug_print_stream();
  if (ctx == nullptr) {
    debug::detail::format_into(line, format, values...);
    line << '\n';
    out << line.str() << std::flush;
    return;
  }
  std::size_t n = 1;
  for (std::size_t a = 0; a < ctx->axis_count(); ++a) n *= ctx->axis_size(a);
  line << "[device " << ctx->device() << " (";
  for (std::size_t a = 0; a < ctx->axis_count(); ++a) line << (a ? ", " : "") << ctx->axis_name(a) << '=' << ctx->coord(a);
  line << ")] ";
  debug::detail::format_into(line, format, values...);
  line << '\n';
  const axis_mask all = (axis_mask{1} << ctx->axis_count()) - 1;  // every axis: the whole mesh
  experimental::unobserved_scope quiet;
  auto& world = ctx->comm(all);
  for (std::size_t d = 0; d < n; ++d) {
    if (d == ctx->device()) out << line.str() << std::flush;
    std::int32_t turn = 0;
    world.all_reduce(&turn, 1, datatype::int32, reduce_op::sum);
  }
}

}  // namespace meshlib

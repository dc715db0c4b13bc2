// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `parallel_policy`: what `data_parallel`, `fully_shard` and `pipeline` have in common. Each
/// names the mesh axis it applies to and says which parallelism it is (torchtitan's `apply_*`
/// functions, one per parallelism over a sub-mesh); a `train_state` takes any of them, each at most
/// once and each over an axis of its own, and checks that at compile time
/// (`detail::check_policies`, nn/train/train_state.hpp). Tensor parallelism is not a policy: it is
/// in the layer types (`column_dense`, `row_dense`, ...), checked when the model is composed.
/// @code
/// meshlib::nn::train_state state(mesh, std::move(net), opt, meshlib::nn::data_parallel<"data">{.zero = 1},
///                                meshlib::nn::pipeline<"pipe">{.microbatches = 8});
/// @endcode

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <type_traits>

#include "meshlib/core/fixed_string.hpp"

namespace meshlib::nn {

/// @brief Which parallelism a `parallel_policy` applies.
enum class parallelism : std::uint8_t {
  data,           ///< `data_parallel`: the batch split, gradients averaged (ZeRO-1 and overlap as options)
  fully_sharded,  ///< `fully_shard`: parameters, gradients and optimizer state sharded (FSDP, ZeRO-3)
  pipelined,      ///< `pipeline`: the model's layers cut into stages, micro-batches in a schedule
};

/// @brief A parallelism applied over one named mesh axis: a type with `static constexpr
/// parallelism kind` and `static constexpr fixed_string axis` (`data_parallel`, `fully_shard`,
/// `pipeline`).
template <class P>
concept parallel_policy = requires {
  { P::kind } -> std::convertible_to<parallelism>;
  P::axis.view();
};

namespace detail {
/// `value`: the axis of the policy of kind `K` among `Ps` (the first), else `Default`. Well-formed
/// for any types, policies or not (Clang forms a deduction guide's result before its constraints).
template <parallelism K, fixed_string Default, class... Ps>
struct policy_axis {
  static constexpr auto value = Default;
};
template <class P>
struct policy_axis_found {
  static constexpr auto value = P::axis;
};
template <parallelism K, fixed_string Default, class P, class... Ps>
  requires parallel_policy<P>
struct policy_axis<K, Default, P, Ps...>
    : std::conditional_t<P::kind == K, policy_axis_found<P>, policy_axis<K, Default, Ps...>> {};

/// How many of the policies `Ps` are of kind `K`.
template <parallelism K, class... Ps>
inline constexpr std::size_t policy_count_v = (std::size_t{0} + ... + std::size_t{Ps::kind == K});

/// Whether two of the policies `Ps` name the same mesh axis.
template <class... Ps>
constexpr bool policies_share_an_axis() {
  constexpr std::size_t n = sizeof...(Ps);
  if constexpr (n < 2) {
    return false;
  } else {
    const std::string_view names[n] = {Ps::axis.view()...};
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t j = i + 1; j < n; ++j)
        if (names[i] == names[j]) return true;
    return false;
  }
}
}  // namespace detail

}  // namespace meshlib::nn

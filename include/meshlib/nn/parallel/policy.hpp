// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `parallel_policy`: what `data_parallel`, `fully_shard` and `pipeline` have in common. Each
/// names the mesh axis it applies to and says which parallelism it is (torchtitan's `apply_*`
/// functions, one per parallelism over a sub-mesh); a `train_state` takes any of them, each at most
/// once and each over an axis of its own, and checks that at compile time
/// (`detail::check_policies`, below). Tensor parallelism is not a policy: it is
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

#include "meshlib/core/diagnostics.hpp"
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

/// Whether the policy `P` is a `data_parallel` over a second axis (`data_parallel<"data", "fsdp">`).
template <class P>
constexpr bool has_second_axis() {
  if constexpr (requires { P::second_axis.view(); }) return !P::second_axis.view().empty();
  else return false;
}
/// `value`: the second axis of the `data_parallel` among `Ps` that has one, else `Default` (the
/// train state's second batch axis when no `fully_shard` names it).
template <fixed_string Default, class... Ps>
struct second_data_axis {
  static constexpr auto value = Default;
};
template <class P>
struct second_data_axis_found {
  static constexpr auto value = P::second_axis;
};
template <fixed_string Default, class P, class... Ps>
  requires parallel_policy<P>
struct second_data_axis<Default, P, Ps...>
    : std::conditional_t<has_second_axis<P>(), second_data_axis_found<P>, second_data_axis<Default, Ps...>> {};

/// How many of the policies `Ps` are of kind `K`.
template <parallelism K, class... Ps>
inline constexpr std::size_t policy_count_v = (std::size_t{0} + ... + std::size_t{Ps::kind == K});

/// The second axis of the policy `P` ("" for a policy without one).
template <class P>
constexpr std::string_view second_axis_text() {
  if constexpr (has_second_axis<P>()) return P::second_axis.view();
  else return {};
}

/// Whether two of the policies `Ps` (a `data_parallel`'s two axes included) name the same mesh axis.
template <class... Ps>
constexpr bool policies_share_an_axis() {
  const std::string_view names[] = {std::string_view{}, Ps::axis.view()..., second_axis_text<Ps>()...};
  constexpr std::size_t n = 1 + 2 * sizeof...(Ps);
  for (std::size_t i = 1; i < n; ++i)
    for (std::size_t j = i + 1; j < n; ++j)
      if (!names[i].empty() && names[i] == names[j]) return true;
  return false;
}

/// The text of a `fixed_string` template argument (an axis's name in `train_state`'s checks and messages).
template <std::size_t N>
constexpr std::string_view text_of(const fixed_string<N>& s) noexcept {
  return s.view();
}
/// The text of a template argument nvcc's front end has turned into a `const char*`.
constexpr std::string_view text_of(const char* s) noexcept { return s; }

/// The axis name of the policy `P`, with static storage (what a diagnostic's `axis` reads).
template <class P>
struct policy_axis_name {
  static constexpr std::string_view value = P::axis.view();
};

template <class Policy, class Axis, class MeshAxes>
consteval bool policy_axis_not_in_mesh() {
  static_assert(meshlib::diagnostic::always_false<Policy, Axis, MeshAxes>,
                "meshlib::nn: train_state: a parallel policy names an axis the mesh does not have (the policy, its "
                "axis and the mesh's axes are spelled out in the condition); add the axis to the mesh or give the "
                "policy one of the mesh's axes");
  return false;
}

/// The second axis name of the `data_parallel` `P`, with static storage (what a diagnostic's `axis` reads).
template <class P>
struct policy_second_axis_name {
  static constexpr std::string_view value = P::second_axis.view();
};

/// Whether the mesh `Mesh` has the second axis of the policy `P` (true for a policy without one).
template <class Mesh, class P>
constexpr bool second_axis_in_mesh() {
  if constexpr (has_second_axis<P>()) return Mesh::template has_axis<P::second_axis>;
  else return true;
}

/// Fires `policy_axis_not_in_mesh` for the first of the policies `P, Ps...` over an axis `Mesh` lacks.
template <class Mesh, class P, class... Ps>
consteval bool diagnose_policy_axes() {
  if constexpr (!Mesh::template has_axis<P::axis>)
    return policy_axis_not_in_mesh<P, meshlib::diagnostic::axis_named_t<policy_axis_name<P>>,
                                   meshlib::diagnostic::axes_t<Mesh, Mesh::all_axes>>();
  else if constexpr (!second_axis_in_mesh<Mesh, P>())
    return policy_axis_not_in_mesh<P, meshlib::diagnostic::axis_named_t<policy_second_axis_name<P>>,
                                   meshlib::diagnostic::axes_t<Mesh, Mesh::all_axes>>();
  else if constexpr (sizeof...(Ps) == 0)
    return true;
  else
    return diagnose_policy_axes<Mesh, Ps...>();
}

/// Whether `Model` is a `sequential` (what FSDP's hooks and the pipeline's stages need).
template <class Model>
concept sequential_model = requires(Model& net) {
  net.hooks;
  net.template params_per_layer<float>();
};

/// The compile-time checks of the policies `Ps` of a `train_state<Mesh, Model, Data, ..., Fsdp, Pipe>`
/// (`Fsdp`: the state's second batch axis, `fully_shard`'s or `data_parallel`'s second):
/// one `static_assert`, on the first unmet requirement.
template <class Mesh, class Model, fixed_string Data, fixed_string Fsdp, fixed_string Pipe, class... Ps>
constexpr void check_policies() {
  constexpr bool once = policy_count_v<parallelism::data, Ps...> <= 1 &&
                        policy_count_v<parallelism::fully_sharded, Ps...> <= 1 &&
                        policy_count_v<parallelism::pipelined, Ps...> <= 1;
  constexpr bool two_batch_axes =
      (std::size_t{0} + ... + std::size_t{has_second_axis<Ps>()}) == 0 ||
      policy_count_v<parallelism::fully_sharded, Ps...> == 0;
  constexpr bool own_axes = !policies_share_an_axis<Ps...>();
  constexpr bool in_mesh = ((Mesh::template has_axis<Ps::axis> && second_axis_in_mesh<Mesh, Ps>()) && ...);
  constexpr bool state_axes = ((Ps::axis.view() == (Ps::kind == parallelism::data            ? text_of(Data)
                                                    : Ps::kind == parallelism::fully_sharded ? text_of(Fsdp)
                                                                                             : text_of(Pipe)) &&
                                (!has_second_axis<Ps>() || second_axis_text<Ps>() == text_of(Fsdp))) &&
                               ...);
  constexpr bool layered = sequential_model<Model> || (policy_count_v<parallelism::fully_sharded, Ps...> +
                                                        policy_count_v<parallelism::pipelined, Ps...>) == 0;
  if constexpr (!once) {
    static_assert(once, "meshlib::nn: train_state: a parallel policy is given twice (two data_parallel, two "
                        "fully_shard or two pipeline); give each parallelism once, over its own mesh axis");
  } else if constexpr (!two_batch_axes) {
    static_assert(two_batch_axes, "meshlib::nn: train_state: data_parallel over two axes beside fully_shard: a "
                                  "train_state splits the batch over at most two axes, and fully_shard's axis is "
                                  "one of them (it splits the batch as it shards the parameters); give data_parallel "
                                  "one axis: data_parallel<\"data\">{} with fully_shard<\"fsdp\">{} is HSDP");
  } else if constexpr (!own_axes) {
    static_assert(own_axes, "meshlib::nn: train_state: two parallel policies (or data_parallel's two axes) name the "
                            "same mesh axis; "
                            "data_parallel, fully_shard and pipeline each need an axis of their own: name another "
                            "axis of the mesh (or add one: mesh<axis<\"data\">, axis<\"fsdp\">>)");
  } else if constexpr (!in_mesh) {
    static_cast<void>(diagnose_policy_axes<Mesh, Ps...>());  // one error, naming the policy and its axis
  } else if constexpr (!state_axes) {
    static_assert(state_axes, "meshlib::nn: train_state: a parallel policy's axis is not the train_state's "
                              "(its Data, Fsdp or Pipe template argument); let the constructor deduce the "
                              "state's type (train_state state(mesh, net, opt, policies...)) or spell the "
                              "same axis in both");
  } else if constexpr (!layered) {
    static_assert(layered, "meshlib::nn: train_state: fully_shard and pipeline need a sequential model (its "
                           "layers are FSDP's units and the pipeline's stages); wrap the layers in nn::sequential");
  }
}
}  // namespace detail

}  // namespace meshlib::nn

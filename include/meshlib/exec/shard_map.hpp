// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `shard_map(fn, mesh, in_specs, out_specs)`: global sharded arrays in, `fn` once per device
/// on its blocks, global sharded arrays out, as `jax.shard_map`.
///
/// Entering, each input is laid out by its in-spec (resharded first when it is not already; even
/// rule, as JAX requires) and each device's block becomes a `local_tensor` that varies over the
/// spec's axes. Leaving, each output is checked at compile time as JAX's `check_vma` does: it must
/// be invariant over every axis its out-spec does not shard it over, and partial over none; the
/// blocks are then assembled by the out-spec. Like every `sharded_tensor`, the result is a handle:
/// an output that is an input block returned unchanged shares that block's memory.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
/// mesh_t m{4};
/// auto f = meshlib::shard_map([](auto b) { return meshlib::psum<"x">(b); }, m,
///                             meshlib::P<"x">{}, meshlib::P<>{});
/// auto total = f(x);   // x: a P<"x"> array of shape (8,); total: replicated (2,), the sum of the blocks
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib/collectives/reshard.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/named_sharding.hpp"
#include "meshlib/core/partition_spec.hpp"
#include "meshlib/core/shard_layout.hpp"
#include "meshlib/debug/check_replicated.hpp"
#include "meshlib/exec/default_runner.hpp"
#include "meshlib/exec/detail/run_devices.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/runtime/kokkos_runtime.hpp"
#include "meshlib/tensor/local_tensor.hpp"
#include "meshlib/tensor/sharded_tensor.hpp"

namespace meshlib {

/// @brief A list of partition specs: the in_specs (or out_specs) of a `shard_map` with several
/// inputs (outputs). A single `P<...>` stands for a list of one.
template <partition_spec_type... Specs>
struct specs {
  /// Tag that marks the type as a list of specs, one per argument or result.
  using is_spec_list = void;
  /// How many specs the list holds (one per argument or result).
  static constexpr std::size_t size = sizeof...(Specs);
};

namespace exec::detail {

template <class S>
struct spec_list {
  static_assert(partition_spec_type<S>, "meshlib: shard_map: in_specs / out_specs must be a P<...> or a specs<P<...>, ...>");
  using type = specs<S>;
  static constexpr bool single = true;
};
template <class... S>
struct spec_list<specs<S...>> {
  using type = specs<S...>;
  static constexpr bool single = false;
};

template <std::size_t I, class List>
struct spec_at;
template <std::size_t I, class... S>
struct spec_at<I, specs<S...>> {
  using type = std::tuple_element_t<I, std::tuple<S...>>;
};

// The diagnostics below name the output, the axis, the out_spec and the value's layout in their
// failing condition (see core/diagnostics.hpp): one error on GCC and Clang.

template <class Output, class Value>
consteval bool shard_map_output_is_not_a_local_tensor() {
  static_assert(diagnostic::always_false<Output, Value>,
                "meshlib: shard_map: the function must return a local_tensor (or a std::tuple of them, one per "
                "out_spec)");
  return false;
}

template <class Output, class Axes, class OutSpec, class Value>
consteval bool shard_map_output_is_partial() {
  static_assert(diagnostic::always_false<Output, Axes, OutSpec, Value>,
                "meshlib: shard_map: an output is a pending sum (partial) over a mesh axis; complete it with psum, or "
                "psum_scatter, over that axis before returning it");
  return false;
}

template <class Output, class Axes, class OutSpec, class Value>
consteval bool shard_map_output_varies_over_unsharded_axis() {
  static_assert(diagnostic::always_false<Output, Axes, OutSpec, Value>,
                "meshlib: shard_map: an output varies over a mesh axis that its out_spec does not shard it over: its "
                "blocks differ along that axis, so no one global array holds them; psum / pmean / all_gather over the "
                "axis, or shard the output over it in out_specs");
  return false;
}

template <class Output, class Value>
consteval bool shard_map_output_on_another_mesh() {
  static_assert(diagnostic::always_false<Output, Value>,
                "meshlib: shard_map: an output lives on another mesh type than the shard_map's");
  return false;
}

/// JAX's check_vma for output `Output`, one static_assert on the first unmet requirement.
template <std::size_t Output, class Mesh, class OutSpec, class L>
consteval bool check_output() {
  using out_t = diagnostic::dim<Output>;
  if constexpr (!local_tensor_type<L>) {
    return shard_map_output_is_not_a_local_tensor<out_t, L>();
  } else if constexpr (!std::is_same_v<typename L::mesh_type, Mesh>) {
    return shard_map_output_on_another_mesh<out_t, L>();
  } else if constexpr (!experimental::diagnose_sharding<Mesh, OutSpec>() || !named_sharding<Mesh, OutSpec>::template check_rank<L::rank>()) {
    return false;
  } else if constexpr (OutSpec::size > L::rank) {
    return false;  // check_rank fired the diagnostic
  } else {
    using S = named_sharding<Mesh, OutSpec>;
    constexpr axis_mask unsharded_vary = L::vary & ~S::sharded_axes;
    if constexpr (L::partial != 0)
      return shard_map_output_is_partial<out_t, diagnostic::axes_t<Mesh, L::partial>, diagnostic::spec_t<OutSpec>, diagnostic::value_t<L>>();
    else if constexpr (unsharded_vary != 0)
      return shard_map_output_varies_over_unsharded_axis<out_t, diagnostic::axes_t<Mesh, unsharded_vary>, diagnostic::spec_t<OutSpec>,
                                                         diagnostic::value_t<L>>();
    else return true;
  }
}

template <class R>
struct as_tuple {
  using type = std::tuple<R>;
  static std::tuple<R> wrap(R r) { return std::tuple<R>(std::move(r)); }
};
template <class... R>
struct as_tuple<std::tuple<R...>> {
  using type = std::tuple<R...>;
  static std::tuple<R...> wrap(std::tuple<R...> r) { return r; }
};

/// The global type an output of local type `L` assembles into under `OutSpec`.
template <class Mesh, class OutSpec, class L>
using global_of_t = sharded_tensor<typename L::value_type, L::rank, named_sharding<Mesh, OutSpec>, typename L::memory_space>;

}  // namespace exec::detail

/// @brief The function `shard_map` returns: call it with the global inputs.
template <class Fn, mesh_type Mesh, class InSpecs, class OutSpecs, class Backend>
class shard_map_fn {
  using in_list = typename exec::detail::spec_list<InSpecs>::type;
  using out_list = typename exec::detail::spec_list<OutSpecs>::type;
  static constexpr bool single_output = exec::detail::spec_list<OutSpecs>::single;

 public:
  /// Wraps `fn` to run on every device of `mesh` through `backend`.
  shard_map_fn(Fn fn, const Mesh& mesh, Backend backend) : fn_(std::move(fn)), mesh_(mesh), backend_(std::move(backend)) {}

  /// Runs the function on every device. `xs` are global `sharded_tensor`s on this mesh, one per in-spec.
  /// @returns one global `sharded_tensor` (or a `std::tuple` of them, for `specs<...>` out_specs).
  /// @throws device_error when a device throws; sharding_error when an input does not fit its in-spec.
  template <sharded_tensor_type... Xs>
  auto operator()(const Xs&... xs) const {
    static_assert(sizeof...(Xs) == in_list::size,
                  "meshlib: shard_map: the number of arguments differs from the number of in_specs");
    static_assert((std::is_same_v<typename Xs::mesh_type, Mesh> && ...),
                  "meshlib: shard_map: every input must be sharded over the shard_map's mesh type");
    // A bad in_spec fires its one diagnostic here and stops: the body is not instantiated on a
    // local type that cannot exist, which would add a screenful of follow-on errors.
    constexpr bool specs_ok = check_in_specs(std::index_sequence_for<Xs...>{});
    if constexpr (!specs_ok) return;
    else return call(std::index_sequence_for<Xs...>{}, xs...);
  }

 private:
  template <std::size_t I, class X>
  auto prepare(const X& x) const {
    using spec_t = typename exec::detail::spec_at<I, in_list>::type;
    using sharding_t = named_sharding<Mesh, spec_t>;
    if (!(x.mesh() == mesh_))
      throw sharding_error("meshlib: shard_map: input " + std::to_string(I) + " lives on mesh " + x.mesh().to_string() +
                           " but the shard_map runs on " + mesh_.to_string());
    if constexpr (std::is_same_v<typename X::sharding_type, sharding_t>) {
      if (x.sharding().rule() == shard_rule::even) return x;
    }
    // shard_map gives every device a block of one shape (as JAX's), so an input must split evenly
    // under its in_spec; say so in shard_map's words (the layout's own advice, shard_rule::uneven,
    // is what this input may already use).
    const sharding_t even(mesh_, shard_rule::even);
    for (std::size_t d = 0; d < X::rank; ++d)
      if (x.global_shape()[d] % even.num_shards(d) != 0)
        throw sharding_error("meshlib: shard_map: input " + std::to_string(I) + " has global shape " +
                             experimental::describe_shape(x.global_shape()) + ", whose dimension " + std::to_string(d) +
                             " (size " + std::to_string(x.global_shape()[d]) + ") does not split evenly into the " +
                             std::to_string(even.num_shards(d)) + " shards of " + experimental::describe_dim_axes(even, d) +
                             " in its in_spec " + spec_t::to_string() +
                             "; shard_map needs equal blocks on every device (as JAX's): pad the dimension to a "
                             "multiple of " + std::to_string(even.num_shards(d)) + ", or shard it over fewer devices");
    return reshard(x, even, backend_);
  }

  template <std::size_t... I, class... Xs>
  auto call(std::index_sequence<I...>, const Xs&... xs) const {
    experimental::require_kokkos("shard_map");
    auto inputs = std::make_tuple(prepare<I>(xs)...);
    using result_t = std::invoke_result_t<const Fn&, typename std::tuple_element_t<I, decltype(inputs)>::local_type...>;
    using results_t = typename exec::detail::as_tuple<std::remove_cvref_t<result_t>>::type;
    constexpr std::size_t n_out = std::tuple_size_v<results_t>;
    static_assert(n_out == out_list::size,
                  "meshlib: shard_map: the function returns a different number of outputs than out_specs has specs");
    constexpr bool ok = check_outputs<results_t>(std::make_index_sequence<n_out>{});
    if constexpr (!ok) {
      return;
    } else {
      const std::size_t n = mesh_.size();
      std::vector<results_t> per_device(n);
      exec::detail::run_devices(mesh_, backend_, [&](std::size_t dev) {
        per_device[dev] = exec::detail::as_tuple<std::remove_cvref_t<result_t>>::wrap(fn_(std::get<I>(inputs).local_value(dev)...));
        experimental::debug_check_outputs(per_device[dev]);  // debug mode: replicated outputs must agree
      });
      auto outs = assemble<results_t>(per_device, std::make_index_sequence<n_out>{});
      if constexpr (single_output) return std::get<0>(std::move(outs));
      else return outs;
    }
  }

  template <std::size_t... I>
  static consteval bool check_in_specs(std::index_sequence<I...>) {
    return (experimental::diagnose_sharding<Mesh, typename exec::detail::spec_at<I, in_list>::type>() && ...);
  }

  template <class Results, std::size_t... O>
  static consteval bool check_outputs(std::index_sequence<O...>) {
    return (exec::detail::check_output<O, Mesh, typename exec::detail::spec_at<O, out_list>::type, std::tuple_element_t<O, Results>>() &&
            ...);
  }

  template <class Results, std::size_t... O>
  auto assemble(std::vector<Results>& per_device, std::index_sequence<O...>) const {
    return std::make_tuple(assemble_one<O, Results>(per_device)...);
  }

  template <std::size_t O, class Results>
  auto assemble_one(std::vector<Results>& per_device) const {
    using local_t = std::tuple_element_t<O, Results>;
    using spec_t = typename exec::detail::spec_at<O, out_list>::type;
    using global_t = exec::detail::global_of_t<Mesh, spec_t, local_t>;
    using sharding_t = typename global_t::sharding_type;
    const sharding_t sharding(mesh_, shard_rule::even);
    const std::size_t n = mesh_.size();
    std::vector<typename global_t::view_type> blocks(n);
    std::vector<bool> local(n, false);
    std::vector<std::array<std::size_t, local_t::rank>> shapes(n);
    for (std::size_t dev : backend_.local_devices(n)) {
      const local_t& v = std::get<O>(per_device[dev]);
      blocks[dev] = v.view();
      local[dev] = true;
      shapes[dev] = v.shape();
    }
    // Devices another process runs (MPI backends): under the even rule every block has the shape
    // of this process's blocks.
    const std::size_t first_local = backend_.local_devices(n).front();
    for (std::size_t dev = 0; dev < n; ++dev)
      if (!local[dev]) shapes[dev] = shapes[first_local];
    const auto global = global_shape_from_locals(sharding, std::span<const std::array<std::size_t, local_t::rank>>(shapes));
    return global_t(sharding, global, std::move(blocks), std::move(local));
  }

  Fn fn_;
  Mesh mesh_;
  Backend backend_;
};

/// @brief `fn` mapped over the blocks of its inputs on `mesh` (JAX `shard_map(fn, mesh=, in_specs=,
/// out_specs=)`). `in_specs` / `out_specs`: a `P<...>{}` for one input / output, or
/// `specs<P<...>, ...>{}` for several (then `fn` returns a `std::tuple`). `fn` is called once per
/// device with that device's `local_tensor` blocks, on `backend`, a `runner` (default:
/// `default_runner`: this process's device threads, or the processes' once `mpi::initialize` has
/// started several; exec/default_runner.hpp).
template <class Fn, mesh_type Mesh, class InSpecs, class OutSpecs, runner Backend = default_runner>
[[nodiscard]] auto shard_map(Fn fn, const Mesh& mesh, InSpecs, OutSpecs, Backend backend = {}) {
  return shard_map_fn<Fn, Mesh, InSpecs, OutSpecs, Backend>(std::move(fn), mesh, std::move(backend));
}

}  // namespace meshlib

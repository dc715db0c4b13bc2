// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief What the layers and `sequential` check about the shapes and shardings they receive, and
/// the words their errors use, written once so every layer's message reads alike.
///
/// Why: a layer that takes its input width from the data and never compares it with its weight
/// reads past the weight (a segfault) or, when the sizes happen to fit, trains on garbage. Every
/// layer with parameters compares the widths it receives with its parameters' (forward and
/// backward), and `sequential` compares consecutive layers once, at construction; the shardings of a
/// composition are checked at compile time, in one `static_assert` naming both layers.
///
/// The layer protocol `sequential` reads (each part optional, so a user's layer needs none of it):
/// - `in_features()`, `out_features()`: the global widths the layer takes and returns;
/// - `keeps_features` (a `static constexpr bool`): the layer returns the width it receives
///   (activations, dropout), so the widths before and after it must agree;
/// - `name()`, `to_string()`: how messages name the layer (`fc1`, `fc1 (column_dense 8 -> 16, ...)`);
/// - `accepts_input<X>` (a `static constexpr bool` template), `diagnostic_name` and
///   `input_requirement` (types): whether `forward(X)` is legal, and how a compile-time error names
///   the layer and what it needs;
/// - `backward_names_input` (a `static constexpr bool`): its backward is `backward<X>(dy, need_dx)`
///   with `X` the forward's input type (`sequential`, `remat`), which `sequential` supplies.

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/tensor/local_tensor.hpp"

namespace meshlib::diagnostic {
/// Layer `Index` of a `sequential`, of kind `Kind` (an `op` naming it, or the layer's type).
template <std::size_t Index, class Kind>
struct layer {};
/// What the first layer of a `sequential` receives: the network's input.
struct network_input {};
/// A layer's need: the feature dimension (the last) sharded over exactly `Axes` (none: complete
/// on every device), and not a pending sum.
template <class Axes>
struct features_sharded_over {};
/// A layer's need: the rows (the batch, dimension 0) sharded over exactly `Axes` (`batch_norm`'s data axis).
template <class Axes>
struct rows_sharded_over {};
/// A layer's need: values that are not a pending sum (an elementwise map of a sum is not the sum
/// of the maps).
struct complete_values {};
/// A layer's need: values that do not vary over `Axes` (the same on every device of them):
/// `transformer_block` adds its input to the attention's output, which a psum over them completes.
template <class Axes>
struct replicated_over {};
/// A layer's need: a block of rank `R` (`dropout`: rank 2, rows and features).
template <std::size_t R>
struct rank {};
}  // namespace meshlib::diagnostic

namespace meshlib::nn::detail {

/// `"16 features (8 per device over 2 devices of 'model')"`, or `"10 features"` when `axes` is empty
/// (`unit`: "features", "rows").
template <mesh_type Mesh>
std::string width_text(std::size_t local, axis_mask axes, const Mesh& mesh, const char* unit = "features") {
  const std::size_t n = mesh.axes_size(axes);
  if (axes == 0 || n == 1) return std::to_string(local) + " " + unit;
  std::string names;
  for (std::size_t i = 0; i < Mesh::ndim; ++i)
    if (axes & (axis_mask{1} << i)) names += (names.empty() ? "'" : " x '") + std::string(Mesh::axis_names[i]) + "'";
  return std::to_string(local * n) + " " + unit + " (" + std::to_string(local) + " per device over " +
         std::to_string(n) + " devices of " + names + ")";
}

/// `" sharded over 'model'"` for an axis set (empty: `""`).
template <mesh_type Mesh>
std::string sharded_over_text(axis_mask axes) {
  std::string names;
  for (std::size_t i = 0; i < Mesh::ndim; ++i)
    if (axes & (axis_mask{1} << i)) names += (names.empty() ? "'" : " x '") + std::string(Mesh::axis_names[i]) + "'";
  return names.empty() ? "" : " sharded over " + names;
}

/// The check of a layer's backward: `dy` (`rows x cols` on device `dev`) must be shaped as the last
/// forward's output there (`fwd_rows x fwd_cols`; `ran`: a forward ran there), whether the layer
/// keeps its input's shape (`relu`, norms) or not (`conv2d`, pools, `embedding`, `tied_head`).
/// `who`: `"relu"`, `"ln1 (...)"`.
inline void check_output_cotangent(const std::string& who, std::size_t dev, std::size_t rows, std::size_t cols,
                                   bool ran, std::size_t fwd_rows, std::size_t fwd_cols) {
  const std::string head = "meshlib::nn: " + who + ".backward";
  if (!ran)
    throw sharding_error(head + " ran on device " + std::to_string(dev) +
                         " before any forward there; run forward first (backward uses what it saved)");
  if (rows != fwd_rows || cols != fwd_cols)
    throw sharding_error(head + " received a cotangent of (" + std::to_string(rows) + ", " + std::to_string(cols) +
                         ") on device " + std::to_string(dev) + ", but the forward output there was (" +
                         std::to_string(fwd_rows) + ", " + std::to_string(fwd_cols) +
                         "); pass the cotangent of the last forward's output");
}

/// The check every layer that reads the sequence layout makes: a device's rows are whole sequences.
inline void check_whole_sequences(const std::string& who, std::size_t rows, std::size_t seq, std::size_t dev) {
  if (seq == 0 || rows % seq != 0)
    throw sharding_error("meshlib::nn: " + who + " received " + std::to_string(rows) + " tokens on device " +
                         std::to_string(dev) + ", not a whole number of sequences of " + std::to_string(seq) +
                         "; feed each device batch * " + std::to_string(seq) +
                         " tokens (rows are sequence-major) or set the layer's sequence length to the data's");
}

// ---- the protocol, read with defaults -----------------------------------------------------------

template <class L, class X>
consteval bool layer_accepts() {
  if constexpr (requires { L::template accepts_input<X>; }) return L::template accepts_input<X>;
  else return true;
}

template <class L>
struct layer_diagnostic_name {
  using type = L;
};
template <class L>
  requires requires { typename L::diagnostic_name; }
struct layer_diagnostic_name<L> {
  using type = typename L::diagnostic_name;
};

template <class L>
struct layer_input_requirement {
  using type = diagnostic::complete_values;
};
template <class L>
  requires requires { typename L::input_requirement; }
struct layer_input_requirement<L> {
  using type = typename L::input_requirement;
};

template <class L>
concept has_widths = requires(const L& l) {
  { l.in_features() } -> std::convertible_to<std::size_t>;
  { l.out_features() } -> std::convertible_to<std::size_t>;
};

template <class L>
consteval bool keeps_features() {
  if constexpr (requires { L::keeps_features; }) return L::keeps_features;
  else return false;
}

/// `l.backward(dy, need_dx)`, or `l.backward<X>(dy, need_dx)` for a layer that says its backward
/// names its forward's input type `X` (`backward_names_input`: `sequential`, `remat`), so
/// compositions nest.
template <class X, class L, class DY>
auto layer_backward(L& l, const DY& dy, bool need_dx) {
  if constexpr (requires { L::backward_names_input; }) return l.template backward<X>(dy, need_dx);
  else return l.backward(dy, need_dx);
}

/// `"layer 2, fc2 (row_dense 32 -> 4, input sharded over 'model'),"` for a message.
template <class L>
std::string layer_text(std::size_t index, const L& l) {
  std::string s = "layer " + std::to_string(index);
  if constexpr (requires { l.to_string(); }) s += ", " + l.to_string() + ",";
  else if constexpr (requires { l.name(); }) s += ", " + std::string(l.name()) + ",";
  return s;
}

/// The layer's name for "declare NAME with ...", else "layer I".
template <class L>
std::string layer_name(std::size_t index, const L& l) {
  if constexpr (requires { l.name(); }) return std::string(l.name());
  else return "layer " + std::to_string(index);
}

// ---- the compile-time errors a layer's forward shares ----------------------------------------------

/// The one error of a layer's `forward` given values of another element type than its parameters'
/// and buffers' (`Takes`, the layer's `T`): `Layer` is its `diagnostic_name`. Layers check it
/// before their layout, so the user reads the two types rather than a layout that looks right.
template <class Layer, class Takes, class Receives>
consteval bool layer_input_element_type_differs() {
  static_assert(meshlib::diagnostic::always_false<Layer, Takes, Receives>,
                "meshlib::nn: the layer computes in another element type than its input's: the condition spells out "
                "layer_input_element_type_differs<the layer, the element type it was declared with (its T), the "
                "input's element type>; declare the layer with the input's element type, or give it values of its own");
  return false;
}

/// The one error of a layer's `forward` given an input it cannot take, for the layers whose fix is
/// said by what they need (`Needs`, their `input_requirement`) and no error of their own: `Layer`
/// is its `diagnostic_name`, `Receives` the input's layout (`diagnostic::value_t`).
template <class Layer, class Receives, class Needs>
consteval bool layer_input_does_not_fit() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, Needs>,
                "meshlib::nn: the layer cannot take this input: the condition spells out layer_input_does_not_fit<"
                "the layer, the input's layout (one dims<...> entry per dimension), what it needs>. "
                "features_sharded_over<axes<>>: a rank-2 block (tokens, features) of the layer's mesh whose features "
                "are complete and unsharded and not a pending sum (all_gather or psum them first; a batch of "
                "sequences is batch * sequence rows, sequence-major); replicated_over<axes<...>>: values that do not vary "
                "over those axes (the layout's vary<...> names none of them; do not pvary the input over them); "
                "rank<2>: a rank-2 block (rows, features)");
  return false;
}

/// What a diagnostic that compares two tensor types shows of `A` beside `B`: their layouts where
/// those differ, else the whole types (`sequential`'s cotangent check, `residual`'s branches).
template <class A, class B>
struct diagnostic_of {
  using type = A;
};
template <local_tensor_type A, local_tensor_type B>
  requires(!std::is_same_v<meshlib::diagnostic::value_t<A>, meshlib::diagnostic::value_t<B>>)
struct diagnostic_of<A, B> {
  using type = meshlib::diagnostic::value_t<A>;
};

// ---- the one compile-time error of sequential ------------------------------------------------------

template <class Layer, class Receives, class From, class Needs>
consteval bool sequential_layers_do_not_chain() {
  static_assert(meshlib::diagnostic::always_false<Layer, Receives, From, Needs>,
                "meshlib::nn: sequential: a layer cannot take what the layer before it returns: their shardings do "
                "not chain. The condition spells out sequential_layers_do_not_chain<the layer (index, kind), the "
                "layout it receives, the layer it receives it from (or the network input), what it needs>. A "
                "row_dense needs its features sharded over its model axis (put a column_dense before it); a dense, "
                "column_dense or layer_norm needs complete, unsharded features (put a row_dense before it, or "
                "all_gather the features); reorder the layers or reshard between them");
  return false;
}

}  // namespace meshlib::nn::detail

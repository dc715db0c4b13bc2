// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The argument checks and input blocks every step and evaluation share (the plain
/// `train_step`, `evaluate` and the pipeline's schedule, nn/parallel/pipeline_run.hpp): the
/// batch splits over the data axes, the runner runs the state's devices, a device's rows as the
/// model's input block.

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/nn/train/train_state.hpp"

namespace meshlib::nn {

namespace detail {
/// Throws unless a global batch of `count` units (rows; or sequences of `seq` tokens, `seq > 0`)
/// splits evenly over the data axis and `groups` (accumulation steps, or 1).
template <class State>
void check_batch(const State& s, std::size_t count, std::size_t groups, const char* what, std::size_t seq = 0) {
  const std::size_t dp = s.mesh.axes_size(State::data_axes);
  if (count != 0 && count % (dp * groups) == 0) return;
  const std::string unit = seq == 0 ? " rows" : " sequences";
  throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(count) + unit +
                       (seq == 0 ? std::string() : " (of " + std::to_string(seq) + " tokens)") +
                       " does not split evenly over the " + std::to_string(dp) + " devices of the data axis" +
                       (groups > 1 ? " x " + std::to_string(groups) + " accumulation steps" : std::string()) +
                       "; choose a batch size that is a multiple of " + std::to_string(dp * groups) +
                       (seq == 0 ? std::string() : unit));
}

/// The tokens per sequence of a model that starts at token ids: the `sequence_length()` of the
/// first of its top-level layers that has one (a `positional_embedding`), else 0 (unknown).
template <class Model>
std::size_t sequence_length_of(const Model& model) {
  if constexpr (requires { model.sequence_length(); }) {
    return model.sequence_length();
  } else if constexpr (requires { std::tuple_size<std::remove_cvref_t<decltype(model.layers)>>::value; }) {
    std::size_t seq = 0;
    std::apply([&](const auto&... l) { ((seq = seq != 0 ? seq : sequence_length_of(l)), ...); }, model.layers);
    return seq;
  } else {
    return 0;
  }
}

/// The batch check of a model that starts at token ids, in sequences: `tokens` global tokens are
/// whole sequences of `seq` (0: the model's, when it has one) and the sequences split evenly over
/// the data axis and `groups`, so that every device gets whole sequences (checked before any
/// kernel, which would otherwise refuse a device's share in tokens).
template <class State>
void check_token_batch(const State& s, std::size_t tokens, std::size_t groups, const char* what, std::size_t seq = 0) {
  if (seq == 0) seq = sequence_length_of(s.model);
  if (seq == 0) return;  // no layer reads sequences: the batch is checked in rows
  if (tokens % seq != 0)
    throw sharding_error(std::string("meshlib::nn: ") + what + ": the global batch of " + std::to_string(tokens) +
                         " tokens is not a whole number of sequences of " + std::to_string(seq) +
                         " tokens; give sequences x " + std::to_string(seq) + " tokens (rows are sequence-major)");
  check_batch(s, tokens / seq, groups, what, seq);
}

/// Throws unless `runner` runs exactly the devices whose state `s` holds in this process: a runner
/// that runs others would read blocks this process does not have, and one that runs fewer would
/// leave the state's other devices a step behind.
template <class State, class Runner>
void check_runner(const State& s, const Runner& runner, const char* what) {
  const std::vector<std::size_t> run = runner.local_devices(s.mesh.size());
  if (run == s.local_devices()) return;
  throw sharding_error("meshlib::nn: " + std::string(what) + ": the runner runs devices " +
                       meshlib::describe_devices(run) + " in this process, but the train state holds devices " +
                       meshlib::describe_devices(s.local_devices()) +
                       "; pass the runner the state was made for, or make the state with the runner's devices "
                       "(train_state(..., runner.local_devices(mesh.size())))");
}
}  // namespace detail

namespace detail {
/// The element types a model's input may have: float feature rows, or `std::int32_t` token ids
/// (one per row; a language model whose first layer is an `embedding`).
template <class In>
concept input_element = std::same_as<In, float> || std::same_as<In, std::int32_t>;

/// A device's block of the model input for elements `In`: `State::input_type` (float rows of
/// `features`) or `State::ids_type` (one token id per row).
template <class State, input_element In>
using input_block_t = std::conditional_t<std::is_same_v<In, std::int32_t>, typename State::ids_type,
                                         typename State::input_type>;

/// Device `dev`'s block of `rows` input rows at `x` (`features` each) as the model takes it: float
/// rows through `State::input_block` (rounded to the compute type), ids as they are (ids are not
/// rounded, and the embedding checks their range).
template <input_element In, class State>
input_block_t<State, In> make_input_block(State& s, std::size_t dev, const In* x, std::size_t rows, std::size_t features) {
  using X = input_block_t<State, In>;
  if constexpr (std::is_same_v<In, std::int32_t>)
    return X(typename X::view_type(s.ids_block(dev, x, rows), rows), s.mesh, dev);
  else
    return X(typename X::view_type(s.input_block(dev, x, rows * features), rows, features), s.mesh, dev);
}

/// Throws unless `n` token ids are one per row of `rows`.
template <class In>
void check_input_rows(std::size_t n, std::size_t rows, const char* what) {
  if constexpr (std::is_same_v<In, std::int32_t>)
    if (n != rows)
      throw sharding_error("meshlib::nn: " + std::string(what) + ": " + std::to_string(n) + " token ids for " +
                           std::to_string(rows) + " rows: a model that starts at an embedding takes one id per row "
                           "(rows = sequences x sequence length, sequence-major)");
}

/// The argument checks of every `train_step` (the plain step and the pipelined one): the global
/// batch splits over the data axes and `groups` (accumulation steps, or 1), `backend` runs the
/// state's devices, `n_in` inputs are one id per row when `In` is a token id, and the `n_targets`
/// targets give every one of the `rows` rows the same number.
template <class In, class State, class Backend>
void check_step_inputs(const State& s, const Backend& backend, std::size_t n_in, std::size_t n_targets,
                       std::size_t rows, std::size_t global_rows, std::size_t groups) {
  if constexpr (std::is_same_v<In, std::int32_t>) check_token_batch(s, global_rows, groups, "train_step");
  check_batch(s, global_rows, groups, "train_step");
  check_runner(s, backend, "train_step");
  check_input_rows<In>(n_in, rows, "train_step");
  if (rows != 0 && n_targets % rows != 0)
    throw sharding_error("meshlib::nn: train_step: " + std::to_string(n_targets) + " target values for " +
                         std::to_string(rows) +
                         " rows: give every row the same number of targets (one label per row for "
                         "softmax_cross_entropy, one value per output column for mean_squared_error)");
}
}  // namespace detail

}  // namespace meshlib::nn

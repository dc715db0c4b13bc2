// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A layer fed the wrong width never reads past its weight or trains on garbage: every mistake is a
// sharding_error naming the layer, both widths (global, and per device when sharded) and the fix.
// Inside spmd it reaches the caller as device_error with that sharding_error as its cause.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
using rows_t = meshlib::named_sharding<mesh_t, meshlib::P<"data">>;
using rows_model_t = meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">>;
const nn::rng_key key{3};

/// A sharded array of `rows x cols` values (their contents do not matter here).
template <class S>
auto input(const mesh_t& m, std::size_t rows, std::size_t cols) {
  return meshlib::from_host(S{m}, std::array<std::size_t, 2>{rows, cols}, std::vector<float>(rows * cols, 0.5f));
}

/// The what() of the cause of the device_error that `spmd(m, body)` throws, when the cause is a
/// sharding_error (anything else escapes and fails the test).
template <class Body>
std::string device_cause(const mesh_t& m, Body&& body) {
  try {
    meshlib::spmd(m, [&](std::size_t dev) { body(dev); });
  } catch (const meshlib::device_error& e) {
    return meshlib_test::message_of<meshlib::sharding_error>([&] { e.rethrow_cause(); });
  }
  return "(no exception)";
}

/// A layer that says nothing about its widths: sequential compares nothing across it.
struct opaque_layer {
  template <class X>
  X forward(const X& x) { return x; }
  template <class DY>
  DY backward(const DY& dy, bool) { return dy; }
  void collect(std::vector<nn::param_ref<float>>&) const {}
};

}  // namespace

TEST_CASE("a dense layer fed the wrong number of features names itself, both widths and the fix",
          "[nn][shapes][errors]") {
  const mesh_t m{1, 2};
  nn::column_dense<float, mesh_t> fc1(m, "fc1", 8, 16, key);
  const auto x = input<rows_t>(m, 4, 10);
  // Before: a segfault (the product read 10 rows of an 8-row weight).
  CHECK(device_cause(m, [&](std::size_t dev) { fc1.forward(x.local_value(dev)); }) ==
        "meshlib::nn: fc1 (column_dense 8 -> 16, output sharded over 'model') received 10 features; it takes 8: feed "
        "it 8 features or declare fc1 with 10 inputs");
  nn::dense<float, mesh_t> fc(m, "fc", 8, 4, key);
  CHECK(device_cause(m, [&](std::size_t dev) { fc.forward(x.local_value(dev)); }) ==
        "meshlib::nn: fc (dense 8 -> 4) received 10 features; it takes 8: feed it 8 features or declare fc with 10 "
        "inputs");
  // A row-parallel layer's input is sharded: the message gives the global width and the blocks.
  nn::row_dense<float, mesh_t> fc2(m, "fc2", 32, 4, key);
  const auto h = input<rows_model_t>(m, 4, 16);
  CHECK(device_cause(m, [&](std::size_t dev) { fc2.forward(h.local_value(dev)); }) ==
        "meshlib::nn: fc2 (row_dense 32 -> 4, input sharded over 'model') received 16 features (8 per device over 2 "
        "devices of 'model'); it takes 32 (16 per device): feed it 32 features or declare fc2 with 16 inputs");
}

TEST_CASE("train_step on data of the wrong width fails naming the layer, before any arithmetic",
          "[nn][shapes][errors]") {
  const mesh_t m{2, 1};
  nn::train_state state(m, nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", 8, 16, key), nn::relu<float>(m),
                                          nn::row_dense<float, mesh_t>(m, "fc2", 16, 4, key)),
                        nn::sgd(nn::constant(0.1f)), {});
  REQUIRE(state.model.in_features() == 8);
  const auto ds = meshlib_test::synthetic_problem(8, 10, 4);
  std::string cause;
  try {
    nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), 8, 0, 8);
  } catch (const meshlib::device_error& e) {
    cause = meshlib_test::message_of<meshlib::sharding_error>([&] { e.rethrow_cause(); });
  }
  CHECK(cause ==
        "meshlib::nn: fc1 (column_dense 8 -> 16, output sharded over 'model') received 10 features; it takes 8: feed "
        "it 8 features or declare fc1 with 10 inputs");
}

TEST_CASE("sequential refuses layers whose widths do not chain, naming both layers", "[nn][shapes][errors]") {
  const mesh_t m{1, 2};
  // Before: this trained and checkpointed without any error, on wrong arithmetic.
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", 8, 16, key),
                         nn::row_dense<float, mesh_t>(m, "fc2", 32, 4, key));
        }) ==
        "meshlib::nn: sequential: layer 1, fc2 (row_dense 32 -> 4, input sharded over 'model'), takes 32 features, but "
        "layer 0, fc1 (column_dense 8 -> 16, output sharded over 'model'), before it outputs 16; declare fc2 with 16 "
        "inputs or fc1 with 32 outputs");
  // Activations and dropout keep the width: the layers around them are compared.
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::sequential(nn::dense<float, mesh_t>(m, "fc1", 8, 16, key), nn::gelu<float>(m),
                         nn::dropout<float>(m, "drop1", 0.5f), nn::layer_norm<float, mesh_t>(m, "ln1", 12));
        }) ==
        "meshlib::nn: sequential: layer 3, ln1 (layer_norm over 12 features), takes 12 features, but layer 0, fc1 "
        "(dense 8 -> 16), before it outputs 16; declare ln1 with 16 inputs or fc1 with 12 outputs");
  // A layer of unknown width between them: nothing to compare, no error.
  CHECK_NOTHROW(nn::sequential(nn::dense<float, mesh_t>(m, "fc1", 8, 16, key), opaque_layer{},
                               nn::dense<float, mesh_t>(m, "fc2", 32, 4, key)));
  // Widths that chain.
  const auto net = nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", 8, 16, key), nn::relu<float>(m),
                                  nn::row_dense<float, mesh_t>(m, "fc2", 16, 4, key),
                                  nn::layer_norm<float, mesh_t>(m, "ln", 4));
  CHECK(net.in_features() == 8);
}

TEST_CASE("a dense backward checks its cotangent against its output and its last forward", "[nn][shapes][errors]") {
  const mesh_t one{1, 1};
  nn::dense<float, mesh_t> fc(one, "fc1", 8, 4, key);
  const auto x = input<rows_t>(one, 4, 8);
  const auto dy4 = input<rows_t>(one, 4, 4), dy5 = input<rows_t>(one, 4, 5), dy_rows = input<rows_t>(one, 3, 4);
  CHECK(device_cause(one, [&](std::size_t dev) { fc.backward(dy4.local_value(dev)); }) ==
        "meshlib::nn: fc1 (dense 8 -> 4).backward ran on device 0 before any forward there; run forward first "
        "(backward uses its saved input)");
  CHECK(device_cause(one, [&](std::size_t dev) {
          fc.forward(x.local_value(dev));
          fc.backward(dy5.local_value(dev));
        }) == "meshlib::nn: fc1 (dense 8 -> 4).backward received a cotangent of 5 features, but the layer outputs 4; "
              "pass the cotangent of this layer's output");
  CHECK(device_cause(one, [&](std::size_t dev) {
          fc.forward(x.local_value(dev));
          fc.backward(dy_rows.local_value(dev));
        }) == "meshlib::nn: fc1 (dense 8 -> 4).backward received a cotangent of 3 rows on device 0, but the forward "
              "input there had 4; pass the cotangent of the last forward's output");
  // Column-parallel: the output is sharded, so is the cotangent.
  const mesh_t m{1, 2};
  nn::column_dense<float, mesh_t> col(m, "fc1", 8, 16, key);
  const auto xm = input<rows_t>(m, 4, 8);
  const auto dy = input<rows_model_t>(m, 4, 6);
  CHECK(device_cause(m, [&](std::size_t dev) {
          col.forward(xm.local_value(dev));
          col.backward(dy.local_value(dev));
        }) == "meshlib::nn: fc1 (column_dense 8 -> 16, output sharded over 'model').backward received a cotangent of 6 "
              "features (3 per device over 2 devices of 'model'), but the layer outputs 16 (8 per device); pass the "
              "cotangent of this layer's output");
}

TEST_CASE("layer norm, activations and dropout check their input and cotangent shapes", "[nn][shapes][errors]") {
  const mesh_t one{1, 1};
  nn::layer_norm<float, mesh_t> ln(one, "ln1", 16);
  const auto x12 = input<rows_t>(one, 4, 12), x8 = input<rows_t>(one, 4, 8), x2 = input<rows_t>(one, 2, 16);
  CHECK(device_cause(one, [&](std::size_t dev) { ln.forward(x12.local_value(dev)); }) ==
        "meshlib::nn: ln1 (layer_norm over 16 features) received 12 features; feed it 16 features or declare ln1 with "
        "12 features");
  const auto x = input<rows_t>(one, 4, 16);
  CHECK(device_cause(one, [&](std::size_t dev) {
          ln.forward(x.local_value(dev));
          ln.backward(x12.local_value(dev));
        }) == "meshlib::nn: ln1 (layer_norm over 16 features).backward received a cotangent of (4, 12) on device 0, "
              "but the forward output there was (4, 16); pass the cotangent of the last forward's output");
  nn::relu<float> act(one);
  CHECK(device_cause(one, [&](std::size_t dev) { act.backward(x.local_value(dev)); }) ==
        "meshlib::nn: relu.backward ran on device 0 before any forward there; run forward first (backward uses what "
        "it saved)");
  CHECK(device_cause(one, [&](std::size_t dev) {
          act.forward(x.local_value(dev));
          act.backward(x2.local_value(dev));
        }) == "meshlib::nn: relu.backward received a cotangent of (2, 16) on device 0, but the forward output there was "
              "(4, 16); pass the cotangent of the last forward's output");
  nn::dropout<float> drop(one, "drop1", 0.25f);
  drop.begin_step(key, true);
  CHECK(device_cause(one, [&](std::size_t dev) {
          drop.forward(x.local_value(dev));
          drop.backward(x8.local_value(dev));
        }) == "meshlib::nn: drop1 (dropout 0.25).backward received a cotangent of (4, 8) on device 0, but the forward "
              "output there was (4, 16); pass the cotangent of the last forward's output");
}

}  // namespace MESHLIB_TEST_UNIT

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Activation recomputation (nn/remat.hpp, issue 26 item 3): the GPT and an MLP with dropout train to
// bitwise the same losses, gradient norms and parameters with every block wrapped in remat as
// without, on (1, 1) and (2, 2); batch norm's running statistics move once per step under remat;
// the activation memory a step reports falls by the amount computed here from the layers' shapes;
// backward before forward is a clear error.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "small_gpt.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

using meshlib_test::maybe_remat;

/// Every parameter's local blocks, device after device, as host floats (bitwise comparisons).
template <class State>
std::vector<float> all_values(const State& s) {
  std::vector<float> out;
  for (const auto& p : s.params)
    for (std::size_t dev : s.local_devices()) out.insert(out.end(), p.value[dev], p.value[dev] + p.count[dev]);
  return out;
}

/// What a run gives: per-step losses and gradient norms, the final parameters, the last step's metrics.
struct trace {
  std::vector<double> losses, norms;
  std::vector<float> params;
  nn::step_metrics last;
};

// ---- the small GPT (small_gpt.hpp), with its two blocks optionally wrapped ------------------------

template <bool Remat>
trace gpt_run(const mesh_t& m, std::size_t steps) {
  nn::train_state state(m, meshlib_test::small_gpt<"model", Remat>(m), nn::adam(nn::constant(1e-2f)));
  trace t;
  for (std::size_t s = 0; s < steps; ++s) {
    t.last = nn::train_step(state, meshlib_test::gpt_windows(s));
    t.losses.push_back(t.last.loss);
    t.norms.push_back(t.last.grad_norm);
  }
  t.params = all_values(state);
  return t;
}

// ---- an MLP of residual-free blocks with tensor-parallel products and dropout ----------------------

constexpr std::size_t features = 12, width = 16, hidden = 32, classes = 4, batch = 32;

/// One block: `width -> hidden` sharded over the model axis, relu, dropout (mask over the global
/// activation), `hidden -> width` with one psum.
auto mlp_block(const mesh_t& m, const std::string& name, nn::rng_key key) {
  return nn::sequential(nn::column_dense<float, mesh_t>(m, name + ".fc1", width, hidden, key), nn::relu<float>(m),
                        nn::dropout<float>(m, name + ".drop", 0.25f),
                        nn::row_dense<float, mesh_t>(m, name + ".fc2", hidden, width, key), nn::gelu<float>(m));
}

template <bool Remat>
auto make_mlp(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::dense<float, mesh_t>(m, "in", features, width, key),
                        maybe_remat<Remat>(m, mlp_block(m, "b0", key)), maybe_remat<Remat>(m, mlp_block(m, "b1", key)),
                        maybe_remat<Remat>(m, mlp_block(m, "b2", key)),
                        nn::dense<float, mesh_t>(m, "head", width, classes, key));
}

template <bool Remat>
trace mlp_run(const mesh_t& m, std::size_t steps) {
  const auto ds = meshlib_test::synthetic_problem(batch * steps, features, classes);
  nn::train_state state(m, make_mlp<Remat>(m), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{3});
  trace t;
  for (std::size_t s = 0; s < steps; ++s) {
    t.last = nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                            std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch);
    t.losses.push_back(t.last.loss);
    t.norms.push_back(t.last.grad_norm);
  }
  t.params = all_values(state);
  return t;
}

void require_identical(const trace& with, const trace& without) {
  REQUIRE(with.losses.size() == without.losses.size());
  for (std::size_t s = 0; s < with.losses.size(); ++s) {
    INFO("step " << s);
    CHECK(with.losses[s] == without.losses[s]);  // bitwise
    CHECK(with.norms[s] == without.norms[s]);
  }
  CHECK(with.params == without.params);
}

// ---- composition: remat under FSDP (parameters gathered for the rerun) and in bfloat16 ----------

using mesh3_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;

template <bool Remat, class Mesh>
auto fsdp_mlp(const Mesh& m) {
  const nn::rng_key key{13};
  return nn::sequential(
      nn::dense<float, Mesh>(m, "in", features, width, key),
      maybe_remat<Remat>(m, nn::sequential(nn::column_dense<float, Mesh>(m, "b0.fc1", width, hidden, key),
                                           nn::relu<float>(m), nn::dropout<float>(m, "b0.drop", 0.25f),
                                           nn::row_dense<float, Mesh>(m, "b0.fc2", hidden, width, key))),
      maybe_remat<Remat>(m, nn::sequential(nn::column_dense<float, Mesh>(m, "b1.fc1", width, hidden, key),
                                           nn::gelu<float>(m),
                                           nn::row_dense<float, Mesh>(m, "b1.fc2", hidden, width, key))),
      nn::dense<float, Mesh>(m, "head", width, classes, key));
}

/// 8 steps of `fsdp_mlp` with the parallel policies `ps` and compute type `Compute`.
template <bool Remat, class Compute = float, class Mesh, class... Policies>
trace composed_run(const Mesh& m, const Policies&... ps) {
  const auto ds = meshlib_test::synthetic_problem(batch * 8, features, classes);
  using model_t = decltype(fsdp_mlp<Remat>(m));
  nn::train_state<Mesh, model_t, "data", float, Compute> state(m, fsdp_mlp<Remat>(m), nn::adam(nn::constant(1e-2f)), {},
                                                               nn::rng_key{3}, {}, ps...);
  trace t;
  for (std::size_t s = 0; s < 8; ++s) {
    t.last = nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                            std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch);
    t.losses.push_back(t.last.loss);
    t.norms.push_back(t.last.grad_norm);
  }
  t.params = all_values(state);
  return t;
}

/// Nesting: a remat of a sequential of two remats, and a remat as the main branch of a residual.
template <bool Remat>
auto nested_mlp(const mesh_t& m) {
  const nn::rng_key key{17};
  auto inner = [&](const std::string& name) {
    return maybe_remat<Remat>(m, nn::sequential(nn::dense<float, mesh_t>(m, name, width, width, key), nn::gelu<float>(m),
                                                nn::dropout<float>(m, name + ".drop", 0.2f)));
  };
  return nn::sequential(nn::dense<float, mesh_t>(m, "in", features, width, key),
                        maybe_remat<Remat>(m, nn::sequential(inner("a"), inner("b"))),
                        nn::make_residual<float>(m, inner("c")), nn::dense<float, mesh_t>(m, "head", width, classes, key));
}

template <bool Remat>
trace nested_run(const mesh_t& m) {
  const auto ds = meshlib_test::synthetic_problem(batch * 8, features, classes);
  nn::train_state state(m, nested_mlp<Remat>(m), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{9});
  trace t;
  for (std::size_t s = 0; s < 8; ++s) {
    t.last = nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                            std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch);
    t.losses.push_back(t.last.loss);
    t.norms.push_back(t.last.grad_norm);
  }
  t.params = all_values(state);
  return t;
}

// ---- the small ResNet of test_resnet.cpp: batch norms inside the wrapped blocks -------------------

constexpr nn::image_shape image{8, 8, 1};

template <bool Remat>
auto small_resnet(const mesh_t& m) {
  const nn::rng_key key{31};
  nn::conv2d<float, mesh_t> stem(m, "stem", image, 4, 3, key, {.padding = 1, .use_bias = false});
  nn::max_pool2d<float, mesh_t> pool(m, "pool", stem.output_shape(), 2);
  nn::basic_block<float, mesh_t> b1(m, "b1", pool.output_shape(), 4, 1, key);
  nn::basic_block<float, mesh_t> b2(m, "b2", b1.output_shape(), 8, 2, key);
  const nn::image_shape last = b2.output_shape();
  return nn::sequential(stem, nn::batch_norm<float, mesh_t>(m, "stem_bn", stem.output_shape()), nn::relu<float>(m),
                        pool, maybe_remat<Remat>(m, b1), maybe_remat<Remat>(m, b2),
                        nn::global_avg_pool<float, mesh_t>(m, "gap", last),
                        nn::dense<float, mesh_t>(m, "fc", last.channels, classes, key));
}

/// Losses of 6 steps, then the evaluation loss (on the running statistics) and the statistics.
template <bool Remat>
std::pair<std::vector<double>, std::vector<float>> resnet_run(const mesh_t& m) {
  constexpr std::size_t rows = 16, steps = 6;
  const auto ds = meshlib_test::synthetic_problem(rows * steps, image.size(), classes);
  nn::train_state state(m, small_resnet<Remat>(m), nn::adam(nn::constant(1e-2f)));
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s)
    losses.push_back(nn::train_step(state, std::span<const float>(ds.x).subspan(s * rows * image.size(), rows * image.size()),
                                    std::span<const std::int32_t>(ds.y).subspan(s * rows, rows), rows, 0, rows)
                         .loss);
  losses.push_back(nn::evaluate(state, ds, rows * steps).loss);
  std::vector<nn::param_ref<float>> bs;
  state.model.collect_buffers(bs);
  std::vector<float> stats;
  for (const auto& b : bs) stats.insert(stats.end(), b.value[0], b.value[0] + b.count[0]);
  return {losses, stats};
}

// ---- the memory stack: blocks of dense + relu, whose buffers are counted here by hand ----------------

constexpr std::size_t stack_rows = 16, stack_width = 32, stack_classes = 10, stack_blocks = 6;

template <bool Remat>
auto dense_relu_stack(const mesh_t& m) {
  const nn::rng_key key{7};
  auto block = [&](std::size_t i) {
    return maybe_remat<Remat>(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc" + std::to_string(i), stack_width,
                                                                         stack_width, key),
                                                nn::relu<float>(m)));
  };
  return nn::sequential(block(0), block(1), block(2), block(3), block(4), block(5),
                        nn::dense<float, mesh_t>(m, "head", stack_width, stack_classes, key));
}

template <bool Remat>
nn::step_metrics stack_metrics() {
  const mesh_t m{1, 1};
  const auto ds = meshlib_test::synthetic_problem(stack_rows, stack_width, stack_classes);
  nn::train_state state(m, dense_relu_stack<Remat>(m), nn::sgd(nn::constant(1e-2f)));
  nn::step_metrics r;
  for (int s = 0; s < 3; ++s)  // from the second step on, every buffer exists at the step's start
    r = nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), stack_rows, 0, stack_rows);
  return r;
}

}  // namespace

TEST_CASE("remat: the GPT trains to bitwise the same losses and parameters on (1, 1) and (2, 2)", "[nn][remat][gpt]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    INFO("mesh " << m);
    const trace without = gpt_run<false>(m, 12), with = gpt_run<true>(m, 12);
    CHECK(without.losses.back() < without.losses.front() - 0.3);  // it learns
    require_identical(with, without);
    // Each block's internals (attention probabilities, MLP activations) are gone between forward and backward.
    CHECK(with.last.activation_bytes < without.last.activation_bytes);
    CHECK(with.last.peak_activation_bytes < without.last.peak_activation_bytes);
  }
}

TEST_CASE("remat: an MLP with dropout replays the same masks: bitwise the same on (1, 1) and (2, 2)", "[nn][remat]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    INFO("mesh " << m);
    const trace without = mlp_run<false>(m, 12), with = mlp_run<true>(m, 12);
    CHECK(without.losses.back() < without.losses.front());
    require_identical(with, without);
  }
}

TEST_CASE("remat: composes with FSDP (both resharding modes) and bfloat16 compute, bitwise", "[nn][remat][fsdp]") {
  for (bool reshard : {true, false}) {
    INFO("reshard_after_forward " << reshard);
    const mesh3_t m{1, 2, 2};
    const nn::fully_shard<"fsdp"> o{.reshard_after_forward = reshard};
    require_identical(composed_run<true>(m, o), composed_run<false>(m, o));
  }
  const mesh_t m{2, 2};
  const trace without = composed_run<false, meshlib::bfloat16>(m), with = composed_run<true, meshlib::bfloat16>(m);
  CHECK(without.losses.back() < without.losses.front());
  require_identical(with, without);
}

TEST_CASE("remat: nested remats and a remat inside a residual are bitwise the same", "[nn][remat]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    INFO("mesh " << m);
    const trace without = nested_run<false>(m), with = nested_run<true>(m);
    require_identical(with, without);
    CHECK(with.last.activation_bytes < without.last.activation_bytes);
  }
}

TEST_CASE("remat: batch norms inside remat blocks move their running statistics once per step", "[nn][remat][resnet]") {
  for (auto shape : {std::array<std::size_t, 2>{1, 1}, std::array<std::size_t, 2>{2, 1}}) {
    const mesh_t m{shape[0], shape[1]};
    INFO("mesh " << m);
    const auto [losses, stats] = resnet_run<false>(m);
    const auto [rlosses, rstats] = resnet_run<true>(m);
    CHECK(rlosses == losses);  // bitwise, the evaluation on the running statistics included
    CHECK(rstats == stats);
  }
}

TEST_CASE("remat: activation memory falls by the amount the layers' shapes give", "[nn][remat][memory]") {
  // The buffers of the layers (rows r, width W, classes C, floats): a dense keeps its output (r x out)
  // and its input's cotangent (r x in), a relu its output and its input's cotangent (r x W each), a
  // sequential nothing. Without remat all of them stay between steps: N blocks of 4 r W, the head's
  // r C + r W, held between forward and backward and the step's peak alike.
  constexpr std::size_t r = stack_rows, w = stack_width, c = stack_classes, n = stack_blocks, f = sizeof(float);
  const std::size_t head = r * c + r * w;
  const auto without = stack_metrics<false>();
  CHECK(without.activation_bytes == (head + n * 4 * r * w) * f);
  CHECK(without.peak_activation_bytes == (head + n * 4 * r * w) * f);
  // With every block in remat, between forward and backward a block holds only its output (the
  // relu's r x W). In backward, block k reruns its forward (the dense's output again), runs its
  // backward (relu and dense cotangents) and then keeps only its input's cotangent: while it runs,
  // blocks 0..k hold their outputs (k + 1), blocks k+1..N-1 their input cotangents (N - 1 - k), and
  // it has three r x W buffers of its own, one of them its output: N + 3 of r x W whatever k is, the
  // peak (the forward's is N + 2).
  const auto with = stack_metrics<true>();
  CHECK(with.activation_bytes == (head + n * r * w) * f);
  CHECK(with.peak_activation_bytes == (head + (n + 3) * r * w) * f);
  CHECK(without.peak_activation_bytes - with.peak_activation_bytes == (3 * n - 3) * r * w * f);
  CHECK(with.loss == without.loss);
}

TEST_CASE("remat: backward before forward is a clear error naming the block", "[nn][remat][errors]") {
  const mesh_t m{1, 1};
  auto block = nn::remat(m, nn::sequential(nn::dense<float, mesh_t>(m, "fc", 4, 4, nn::rng_key{1}), nn::relu<float>(m)));
  using X = nn::train_state<mesh_t, decltype(block)>::input_type;
  CHECK(block.to_string() == "remat");
  auto named = nn::remat(m, nn::dense<float, mesh_t>(m, "fc", 4, 4, nn::rng_key{1}));
  CHECK(named.name() == "fc");
  X dy(typename X::shape_type{2, 4}, m, 0);  // made on this thread (tensors are not made on device threads)
  const std::string msg = meshlib_test::message_of<std::exception>([&] {
    meshlib::spmd(m, [&](std::size_t) { (void)named.backward<X>(dy); });
  });
  INFO(msg);
  CHECK(msg.find("meshlib::nn: remat(fc (dense 4 -> 4)): backward on device 0 before any forward there; run forward "
                 "first") != std::string::npos);
}

}  // namespace MESHLIB_TEST_UNIT

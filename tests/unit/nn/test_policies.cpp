// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Parallelism as policies (nn/parallel/, issue 37): data_parallel, fully_shard and pipeline over any
// axis names give bitwise the losses of the same policies on the default names, alone and composed;
// the state's type is deduced from them and keeps them; what a value cannot say at compile time is
// refused (ZeRO-1 with FSDP or overlap; overlap with no layer hooks to start its buckets: a pipeline,
// a model that is not a sequential); an axis is pipelined, fully sharded or split by the batch by a
// policy only, never by its name (data_parallel over two axes for the batch alone).
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

namespace nn = meshlib::nn;
using meshlib::axis;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32, steps = 4;

const nn::dataset& problem() {
  static const nn::dataset ds = meshlib_test::synthetic_problem(batch * steps, features, classes);
  return ds;
}

template <class Mesh>
auto make_net(const Mesh& m) {
  const nn::rng_key key{17};
  return nn::sequential(nn::column_dense<float, Mesh>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, Mesh>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, Mesh>(m, "fc3", hidden, classes, key));
}

template <class State>
std::vector<double> losses(State& s) {
  const auto& ds = problem();
  std::vector<double> out;
  for (std::size_t i = 0; i < steps; ++i)
    out.push_back(nn::train_step(s, std::span<const float>(ds.x).subspan(i * batch * features, batch * features),
                                 std::span<const std::int32_t>(ds.y).subspan(i * batch, batch), batch, 0, batch)
                      .loss);
  out.push_back(nn::evaluate(s, ds, 40).loss);
  return out;
}

nn::optimizer opt() {
  return nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(nn::constant(1e-2f), 1e-2f));
}

/// A model that is not a `sequential` (a user's own struct of layers, as train_state accepts): it
/// has no layer hooks for data_parallel's overlap to start the gradient buckets from.
template <class Mesh>
struct plain_model {
  nn::dense<float, Mesh> fc;
  void begin_step(nn::rng_key, bool) {}
  template <class X>
  auto forward(const X& x) {
    return fc.forward(x);
  }
  template <class DY>
  auto backward(const DY& dy, bool need_dx = true) {
    return fc.backward(dy, need_dx);
  }
  void collect(std::vector<nn::param_ref<float>>& out) { fc.collect(out); }
};

}  // namespace

TEST_CASE("data_parallel over any axis name: bitwise the losses on 'data'", "[nn][policies]") {
  using ref_mesh = meshlib::mesh<axis<"data">, axis<"model">>;
  using dp_mesh = meshlib::mesh<axis<"dp">, axis<"model">>;
  const ref_mesh rm{4, 2};
  const dp_mesh dm{4, 2};
  for (const bool zero : {false, true}) {
    for (const bool overlap : {false, true}) {
      if (zero && overlap) continue;  // overlap applies without ZeRO
      INFO("zero " << zero << ", overlap " << overlap);
      nn::train_state ref(rm, make_net(rm), opt(), nn::data_parallel<"data">{.zero = zero ? 1 : 0, .overlap = overlap});
      nn::train_state dp(dm, make_net(dm), opt(), nn::data_parallel<"dp">{.zero = zero ? 1 : 0, .overlap = overlap});
      static_assert(std::is_same_v<decltype(dp)::mesh_type, dp_mesh>);
      STATIC_REQUIRE(decltype(dp)::data_axes == dp_mesh::mask_of<"dp">());
      CHECK(dp.data_parallel_policy().zero == (zero ? 1 : 0));
      CHECK(dp.data_parallel_policy().overlap == overlap);
      CHECK(dp.optimizer_state_size(0) == ref.optimizer_state_size(0));
      CHECK(losses(dp) == losses(ref));
    }
  }
}

TEST_CASE("fully_shard and data_parallel compose over any axis names (HSDP)", "[nn][policies][fsdp]") {
  using ref_mesh = meshlib::mesh<axis<"data">, axis<"fsdp">, axis<"model">>;
  using my_mesh = meshlib::mesh<axis<"replica">, axis<"shard">, axis<"model">>;
  const ref_mesh rm{2, 2, 2};
  const my_mesh mm{2, 2, 2};
  for (const bool reshard : {true, false}) {
    INFO("reshard_after_forward " << reshard);
    nn::train_state ref(rm, make_net(rm), opt(), nn::fully_shard<"fsdp">{.reshard_after_forward = reshard});
    nn::train_state mine(mm, make_net(mm), opt(), nn::data_parallel<"replica">{},
                         nn::fully_shard<"shard">{.reshard_after_forward = reshard});
    STATIC_REQUIRE(decltype(mine)::fsdp_axes == my_mesh::mask_of<"shard">());
    STATIC_REQUIRE(decltype(mine)::replica_axes == my_mesh::mask_of<"replica">());
    CHECK(mine.memory(0).optimizer_state == ref.memory(0).optimizer_state);
    CHECK(losses(mine) == losses(ref));
  }
}

TEST_CASE("pipeline over any axis name: bitwise the losses of the 'pipeline' axis", "[nn][policies][pipeline]") {
  using ref_mesh = meshlib::mesh<axis<"data">, axis<"model">, axis<"pipeline">>;
  using my_mesh = meshlib::mesh<axis<"dp">, axis<"model">, axis<"pipe">>;
  const ref_mesh rm{2, 1, 2};
  const my_mesh mm{2, 1, 2};
  for (const auto kind : {nn::pipeline_kind::gpipe, nn::pipeline_kind::one_f_one_b}) {
    nn::train_state ref(rm, make_net(rm), opt(), nn::pipeline<"pipeline">{.schedule = kind, .microbatches = 4});
    nn::train_state mine(mm, make_net(mm), opt(), nn::data_parallel<"dp">{},
                         nn::pipeline<"pipe">{.schedule = kind, .microbatches = 4});
    STATIC_REQUIRE(decltype(mine)::pipeline_axes == my_mesh::mask_of<"pipe">());
    REQUIRE(mine.pipeline() != nullptr);
    CHECK(mine.pipeline_stages() == ref.pipeline_stages());
    CHECK(losses(mine) == losses(ref));
  }
}

TEST_CASE("a ZeRO stage data_parallel does not shard is refused, naming fully_shard", "[nn][policies][errors]") {
  using mesh_t = meshlib::mesh<axis<"data">, axis<"model">>;
  const mesh_t m{2, 1};
  const std::string what = meshlib_test::message_of([&] {
    nn::train_state s(m, make_net(m), opt(), nn::data_parallel<"data">{.zero = 3});
  });
  CHECK(what.find("data_parallel: zero = 3") != std::string::npos);
  CHECK(what.find("fully_shard") != std::string::npos);
}

TEST_CASE("data_parallel's ZeRO-1 beside fully_shard, and ZeRO-1 with overlap, are refused naming the policies",
          "[nn][policies][errors]") {
  using mesh_t = meshlib::mesh<axis<"replica">, axis<"shard">, axis<"model">>;
  const mesh_t m{2, 2, 1};
  CHECK(meshlib_test::message_of([&] {
          nn::train_state s(m, make_net(m), opt(), nn::data_parallel<"replica">{.zero = 1}, nn::fully_shard<"shard">{});
        }) == "meshlib::nn: train_state: data_parallel<\"replica\">{.zero = 1} and fully_shard<\"shard\"> both shard the "
              "optimizer state; fully_shard already shards it (over 'shard', the data_parallel<\"replica\"> axis "
              "holding replicas of the shards: HSDP): drop .zero");
  // The order of the policies does not matter.
  CHECK(meshlib_test::message_of([&] {
          nn::train_state s(m, make_net(m), opt(), nn::fully_shard<"shard">{}, nn::data_parallel<"replica">{.zero = 1});
        }).find("both shard the optimizer state") != std::string::npos);
  CHECK(meshlib_test::message_of([&] {
          nn::train_state s(m, make_net(m), opt(), nn::data_parallel<"replica">{.zero = 1, .overlap = true});
        }) == "meshlib::nn: train_state: data_parallel<\"replica\">{.zero = 1, .overlap = true}: ZeRO-1 reduce-scatters "
              "the gradients after the backward, so there is nothing to overlap; drop .overlap (or .zero)");
  // ZeRO-1 alone, and fully_shard beside a plain data_parallel, are fine.
  nn::train_state zero(m, make_net(m), opt(), nn::data_parallel<"replica">{.zero = 1});
  CHECK(zero.data_parallel_policy().zero == 1);
  CHECK_FALSE(zero.fully_shard_policy().has_value());
  nn::train_state hsdp(m, make_net(m), opt(), nn::data_parallel<"replica">{}, nn::fully_shard<"shard">{});
  CHECK(hsdp.fully_shard_policy().has_value());
  CHECK(hsdp.data_parallel_policy().zero == 0);
}

TEST_CASE("data_parallel's overlap where no layer hook would start the buckets is refused, naming the policy",
          "[nn][policies][overlap][errors]") {
  // A pipelined step synchronises the gradients after its schedule's last backward: the overlap
  // would do nothing, and is refused rather than ignored, whatever the order of the policies.
  using piped_mesh = meshlib::mesh<axis<"dp">, axis<"model">, axis<"pipe">>;
  const piped_mesh two{2, 1, 2};
  const std::string piped =
      "meshlib::nn: train_state: data_parallel<\"dp\">{.overlap = true} with pipeline<\"pipe\"> over 2 stages: a "
      "pipelined step synchronises the gradients after its schedule's last backward, not from the layer hooks, so "
      "there is nothing to overlap; drop .overlap (or the pipeline)";
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(two, make_net(two), opt(), nn::data_parallel<"dp">{.overlap = true},
                            nn::pipeline<"pipe">{.microbatches = 4});
        }) == piped);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(two, make_net(two), opt(), nn::pipeline<"pipe">{.microbatches = 4},
                            nn::data_parallel<"dp">{.overlap = true});
        }) == piped);
  // Over a pipeline axis of one device the step is the unpipelined one (the policy does nothing):
  // there the hooks start the buckets during the backward, and the losses are bitwise those without.
  const piped_mesh one{2, 1, 1};
  nn::train_state overlapped(one, make_net(one), opt(), nn::data_parallel<"dp">{.overlap = true, .bucket_elements = 100},
                             nn::pipeline<"pipe">{.microbatches = 4});
  nn::train_state plain(one, make_net(one), opt(), nn::data_parallel<"dp">{.bucket_elements = 100},
                        nn::pipeline<"pipe">{.microbatches = 4});
  REQUIRE(overlapped.pipeline() == nullptr);
  CHECK(losses(overlapped) == losses(plain));
  CHECK(overlapped.sync().started_early(0) > 0);
  CHECK(plain.sync().started_early(0) == 0);
  // A model that is not a sequential has no layer hooks: refused; without overlap it is fine.
  using mesh_t = meshlib::mesh<axis<"data">, axis<"model">>;
  const mesh_t m{2, 1};
  const auto model = [&] { return plain_model<mesh_t>{nn::dense<float, mesh_t>(m, "fc", features, classes, nn::rng_key{3})}; };
  STATIC_REQUIRE_FALSE(nn::detail::sequential_model<plain_model<mesh_t>>);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(m, model(), opt(), nn::data_parallel<"data">{.overlap = true});
        }) == "meshlib::nn: train_state: data_parallel<\"data\">{.overlap = true} on a model that is not an "
              "nn::sequential: the overlap starts each gradient bucket from the hooks sequential calls after each "
              "layer's backward, and this model has none; wrap the layers in nn::sequential or drop .overlap");
  nn::train_state fine(m, model(), opt(), nn::data_parallel<"data">{});
  CHECK_FALSE(fine.data_parallel_policy().overlap);
}

TEST_CASE("an axis is pipelined by a pipeline policy, not by its name", "[nn][policies][pipeline][errors]") {
  using mesh_t = meshlib::mesh<axis<"data">, axis<"model">, axis<"pipeline">>;
  // Without a policy, an axis named 'pipeline' of more than one device is refused with the fix
  // (pipelining silently, or replicating the model over it silently, would both surprise).
  const mesh_t two{2, 1, 2};
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(two, make_net(two), opt());
        }) == "meshlib::nn: train_state: the mesh's 'pipeline' axis has 2 devices but no pipeline policy was given; an "
              "axis is pipelined only by a policy, not by its name: pass meshlib::nn::pipeline<\"pipeline\">{} (with "
              ".microbatches and .schedule) to the train_state, or make the axis size 1");
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(two, make_net(two), opt(), nn::data_parallel<"data">{});
        }).find("no pipeline policy was given") != std::string::npos);
  // With the policy it pipelines; the policy is kept.
  nn::train_state piped(two, make_net(two), opt(), nn::pipeline<"pipeline">{.microbatches = 4});
  REQUIRE(piped.pipeline() != nullptr);
  REQUIRE(piped.pipeline_policy().has_value());
  CHECK(piped.pipeline_policy()->microbatches == 4);
  // The axis named by a data_parallel policy is a data axis, whatever its name.
  using named_mesh = meshlib::mesh<axis<"pipeline">, axis<"model">>;
  const named_mesh nm{4, 2};
  using ref_mesh_t = meshlib::mesh<axis<"data">, axis<"model">>;
  const ref_mesh_t rm{4, 2};
  nn::train_state as_data(nm, make_net(nm), opt(), nn::data_parallel<"pipeline">{});
  CHECK(as_data.pipeline() == nullptr);
  nn::train_state ref(rm, make_net(rm), opt());
  CHECK(losses(as_data) == losses(ref));
  // Over an axis of one device there are no stages: the step is the unpipelined one, bit for bit.
  const mesh_t one{2, 1, 1};
  nn::train_state single(one, make_net(one), opt(), nn::pipeline<"pipeline">{.microbatches = 4});
  CHECK(single.pipeline() == nullptr);
  nn::train_state plain(one, make_net(one), opt());
  CHECK(losses(single) == losses(plain));
}

TEST_CASE("an fsdp axis splits the batch by a policy, not by its name", "[nn][policies][fsdp][errors]") {
  using mesh_t = meshlib::mesh<axis<"data">, axis<"fsdp">, axis<"model">>;
  const mesh_t m{2, 2, 2};
  // No policy names 'fsdp': refused with both fixes, rather than the batch split over it silently.
  const std::string refusal =
      "meshlib::nn: train_state: the mesh's 'fsdp' axis has 2 devices but no policy names it; an axis splits the "
      "batch or shards the parameters only by a policy, not by its name: pass meshlib::nn::fully_shard<\"fsdp\">{} "
      "(parameters, gradients and optimizer state sharded over it, the batch split over it) or "
      "meshlib::nn::data_parallel<\"data\", \"fsdp\">{} (the batch only) to the train_state, or make the axis size 1";
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::train_state s(m, make_net(m), opt()); }) ==
        refusal);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(m, make_net(m), opt(), nn::data_parallel<"data">{.zero = 1});
        }) == refusal);
  // data_parallel over both axes: the batch over data x fsdp (rows of device (d, f) those of device
  // 2d + f of a 4-device data axis), the parameters replicated: the losses of data_parallel over 4.
  using ref_mesh = meshlib::mesh<axis<"data">, axis<"model">>;
  const ref_mesh rm{4, 2};
  for (const int zero : {0, 1}) {
    INFO("zero " << zero);
    nn::train_state both(m, make_net(m), opt(), nn::data_parallel<"data", "fsdp">{.zero = zero});
    STATIC_REQUIRE(decltype(both)::data_axes == mesh_t::mask_of<"data", "fsdp">());
    CHECK(both.data_parallel_policy().zero == zero);
    CHECK_FALSE(both.fully_shard_policy().has_value());
    nn::train_state ref(rm, make_net(rm), opt(), nn::data_parallel<"data">{.zero = zero});
    CHECK(both.memory(0).parameters == ref.memory(0).parameters);
    CHECK(both.optimizer_state_size(0) == ref.optimizer_state_size(0));
    CHECK(losses(both) == losses(ref));
  }
  // A refusal of its values names both axes, as written.
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_state s(m, make_net(m), opt(), nn::data_parallel<"data", "fsdp">{.zero = 1, .overlap = true});
        }).starts_with("meshlib::nn: train_state: data_parallel<\"data\", \"fsdp\">{.zero = 1, .overlap = true}: "
                       "ZeRO-1 reduce-scatters"));
  // The same state type either way (what a program choosing FSDP at run time needs): the policies,
  // not the type, say what 'fsdp' does.
  nn::train_state hsdp(m, make_net(m), opt(), nn::data_parallel<"data">{}, nn::fully_shard<"fsdp">{});
  nn::train_state batch_only(m, make_net(m), opt(), nn::data_parallel<"data", "fsdp">{});
  STATIC_REQUIRE(std::is_same_v<decltype(hsdp), decltype(batch_only)>);
  CHECK(hsdp.memory(0).parameters < batch_only.memory(0).parameters);
  // An fsdp axis of one device needs no policy; nor one that data_parallel names alone.
  const mesh_t one{4, 1, 2};
  nn::train_state plain(one, make_net(one), opt());
  nn::train_state ref_plain(rm, make_net(rm), opt());
  CHECK(losses(plain) == losses(ref_plain));
  using shard_mesh = meshlib::mesh<axis<"fsdp">, axis<"model">>;
  const shard_mesh sm{4, 2};
  nn::train_state as_data(sm, make_net(sm), opt(), nn::data_parallel<"fsdp">{});
  nn::train_state ref_data(rm, make_net(rm), opt());
  CHECK(losses(as_data) == losses(ref_data));
}

}  // namespace MESHLIB_TEST_UNIT

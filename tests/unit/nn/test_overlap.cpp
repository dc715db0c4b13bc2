// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Overlapped gradient synchronisation (data_parallel{.overlap = true}, issue 26 item 4): the
// buckets started during backward give bitwise the losses and parameters of the synchronisation
// after backward, for the MLP and the GPT on (2, 1) and (2, 2), with small buckets (many, packed
// and in place), accumulation, a bfloat16 wire, mixed precision and FSDP; the same number of
// collectives; the exposed synchronisation time is reported.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "small_gpt.hpp"
#include "synthetic_problem.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
using mesh3_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"fsdp">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32, steps = 5;

template <class Mesh>
auto make_mlp(const Mesh& m) {
  const nn::rng_key key{7};
  return nn::sequential(nn::column_dense<float, Mesh>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, Mesh>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, Mesh>(m, "fc3", hidden, classes, key));
}

/// Everything a run leaves that must not depend on overlap: per-step losses and norms, the final
/// parameter blocks, the collectives issued; and the reported synchronisation times.
struct outcome {
  std::vector<double> losses, norms;
  std::vector<std::vector<float>> params;
  std::vector<std::size_t> collectives;
  std::size_t started_early = 0;  ///< buckets device 0 started during backward
  double sync_seconds = 0;
};

template <class State>
outcome finish(State& state, outcome o) {
  for (const auto& p : state.params)
    for (std::size_t dev = 0; dev < p.value.size(); ++dev)
      o.params.emplace_back(p.value[dev], p.value[dev] + p.count[dev]);
  for (std::size_t dev = 0; dev < state.mesh.size(); ++dev) o.collectives.push_back(state.sync().collectives(dev));
  o.started_early = state.sync().started_early(0);
  return o;
}

template <class State>
outcome train_mlp(State state) {
  static const nn::dataset ds = meshlib_test::synthetic_problem(batch * steps, features, classes);
  outcome o;
  for (std::size_t s = 0; s < steps; ++s) {
    const auto r = nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                  std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch);
    o.losses.push_back(r.loss);
    o.norms.push_back(r.grad_norm);
    o.sync_seconds += r.sync_seconds;
  }
  return finish(state, std::move(o));
}

/// Bitwise: the same doubles and floats, not merely close ones.
bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

void require_identical(const outcome& off, const outcome& on) {
  INFO("losses off " << off.losses.front() << " .. " << off.losses.back() << ", on " << on.losses.front() << " .. "
                     << on.losses.back());
  REQUIRE(same_bits(off.losses, on.losses));
  REQUIRE(same_bits(off.norms, on.norms));
  REQUIRE(off.params == on.params);  // float ==: bit equality for non-NaN values
  REQUIRE(off.collectives == on.collectives);
  REQUIRE(on.sync_seconds > 0);
  REQUIRE(off.started_early == 0);
}

nn::optimizer clipped_adam() {
  return nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(nn::constant(1e-2f), 1e-2f));
}

// ---- the small GPT (small_gpt.hpp) --------------------------------------------------------------

outcome train_gpt(const mesh_t& m, const nn::data_parallel<"data">& dp) {
  nn::train_state state(m, meshlib_test::small_gpt(m), nn::adam(nn::constant(1e-2f)), dp);
  outcome r;
  for (std::size_t s = 0; s < steps; ++s) {
    const auto st = nn::train_step(state, meshlib_test::gpt_windows(s));
    r.losses.push_back(st.loss);
    r.norms.push_back(st.grad_norm);
    r.sync_seconds += st.sync_seconds;
  }
  return finish(state, std::move(r));
}

}  // namespace

TEST_CASE("overlap_grad_sync: the MLP trains bitwise alike with overlap on and off", "[nn][training][overlap]") {
  for (auto shape : {std::array<std::size_t, 2>{2, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    // 0: one bucket; 64: many buckets, packed and in place; 1 << 20 the default.
    for (std::size_t bucket : {std::size_t{0}, std::size_t{64}, std::size_t{1} << 20}) {
      for (std::size_t acc : {1u, 2u}) {
        INFO("mesh " << m << ", bucket " << bucket << ", accumulation " << acc);
        const nn::train_options o{.accumulation = acc};
        const nn::data_parallel<"data"> off{.overlap = false, .bucket_elements = bucket};
        nn::data_parallel<"data"> on = off;
        on.overlap = true;
        const outcome with = train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), o, nn::rng_key{7}, {}, on));
        require_identical(train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), o, nn::rng_key{7}, {}, off)), with);
        // Every bucket starts from a hook: one bucket (holding fc1's weight) when fc1's backward
        // ends; with 64-element buckets, fc3's and fc2's while the earlier layers' backward runs.
        if (bucket == 0) REQUIRE(with.started_early == steps);
        if (bucket == 64) REQUIRE(with.started_early > 3 * steps);
      }
    }
    INFO("mesh " << m << ": bfloat16 wire, bfloat16 compute");
    using model_t = decltype(make_mlp(m));
    using wire_state = nn::train_state<mesh_t, model_t, "data", meshlib::bfloat16>;
    using mixed_state = nn::train_state<mesh_t, model_t, "data", float, meshlib::bfloat16>;
    for (std::size_t bucket : {std::size_t{64}, std::size_t{1} << 20}) {
      const nn::data_parallel<"data"> off{.overlap = false, .bucket_elements = bucket};
      const nn::data_parallel<"data"> on{.overlap = true, .bucket_elements = bucket};
      require_identical(train_mlp(wire_state(m, make_mlp(m), clipped_adam(), off)),
                        train_mlp(wire_state(m, make_mlp(m), clipped_adam(), on)));
      require_identical(train_mlp(mixed_state(m, make_mlp(m), clipped_adam(), off)),
                        train_mlp(mixed_state(m, make_mlp(m), clipped_adam(), on)));
    }
  }
  // Off by default (docs/benchmarks.md, "Overlapped gradient synchronisation": no gain on a quiet machine).
  CHECK_FALSE(nn::data_parallel<"data">{}.overlap);
}

TEST_CASE("overlap_grad_sync: FSDP and a data axis, and ZeRO (not overlapped), alike on and off",
          "[nn][training][overlap][fsdp]") {
  const mesh3_t m{2, 2, 1};
  for (std::size_t bucket : {std::size_t{16}, std::size_t{1} << 20}) {
    INFO("bucket " << bucket);
    const nn::data_parallel<"data"> off{.overlap = false, .bucket_elements = bucket};
    nn::data_parallel<"data"> on = off;
    on.overlap = true;
    require_identical(train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), off, nn::fully_shard<"fsdp">{})),
                      train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), on, nn::fully_shard<"fsdp">{})));
  }
  // FSDP keeping the gathered parameters from forward: the next layer's all-gathers prefetched
  // (fully_shard's prefetch) or not, with and without overlapped gradient buckets.
  for (const mesh3_t mesh : {mesh3_t{2, 2, 1}, mesh3_t{1, 2, 2}}) {
    INFO("mesh " << mesh << ", FSDP prefetch");
    const nn::data_parallel<"data"> no_overlap{.overlap = false}, overlap{.overlap = true};
    const nn::fully_shard<"fsdp"> no_prefetch{.reshard_after_forward = false, .prefetch = false};
    const nn::fully_shard<"fsdp"> prefetch{.reshard_after_forward = false, .prefetch = true};
    const outcome ref = train_mlp(nn::train_state(mesh, make_mlp(mesh), clipped_adam(), no_overlap, no_prefetch));
    require_identical(ref, train_mlp(nn::train_state(mesh, make_mlp(mesh), clipped_adam(), overlap, prefetch)));
    require_identical(ref, train_mlp(nn::train_state(mesh, make_mlp(mesh), clipped_adam(), no_overlap, prefetch)));
  }
  // ZeRO-1 with overlap is refused (nothing to overlap: test_policies.cpp); ZeRO-1 (over both batch
  // axes) trains as before.
  const nn::data_parallel<"data", "fsdp"> zero{.zero = 1};
  require_identical(train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), zero)),
                    train_mlp(nn::train_state(m, make_mlp(m), clipped_adam(), zero)));
}

TEST_CASE("overlap_grad_sync: the GPT trains bitwise alike with overlap on and off", "[nn][gpt][overlap]") {
  for (auto shape : {std::array<std::size_t, 2>{2, 1}, std::array<std::size_t, 2>{2, 2}}) {
    const mesh_t m{shape[0], shape[1]};
    for (std::size_t bucket : {std::size_t{100}, std::size_t{1} << 20}) {
      INFO("mesh " << m << ", bucket " << bucket);
      const outcome with = train_gpt(m, {.overlap = true, .bucket_elements = bucket});
      require_identical(train_gpt(m, {.overlap = false, .bucket_elements = bucket}), with);
      if (bucket == 100) REQUIRE(with.started_early > 3 * steps);
    }
  }
}

}  // namespace MESHLIB_TEST_UNIT

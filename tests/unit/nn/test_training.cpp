// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training on a synthetic problem: per-step losses do not depend on the mesh, ZeRO-1 equals the
// replicated optimizer, k micro-batches equal one batch, bucketing issues the expected number of
// collectives, bad batches are refused with a clear error.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "synthetic_problem.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;

constexpr std::size_t features = 12, hidden = 16, classes = 4, batch = 32;

nn::dataset synthetic(std::size_t count) { return meshlib_test::synthetic_problem(count, features, classes); }

auto make_net(const mesh_t& m) {
  const nn::rng_key key{11};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key), nn::gelu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key));
}

template <class... Policies>
std::vector<double> run(const mesh_t& m, nn::optimizer opt, nn::train_options o, std::size_t steps = 6,
                        const Policies&... policies) {
  const auto ds = synthetic(batch * steps);
  nn::train_state state(m, make_net(m), opt, o, nn::rng_key{11}, {}, policies...);
  std::vector<double> losses;
  for (std::size_t s = 0; s < steps; ++s) {
    const auto r = nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                  std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch);
    losses.push_back(r.loss);
  }
  return losses;
}

void require_close(const std::vector<double>& a, const std::vector<double>& b, double rel) {
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(std::abs(a[i] - b[i]) <= rel * std::abs(b[i]));
  }
}

}  // namespace

TEST_CASE("per-step losses agree on every mesh shape (data, tensor and hybrid parallel)", "[nn][training]") {
  for (const auto& opt : {nn::adam(nn::constant(1e-2f)), nn::sgd(nn::warmup_cosine(5e-2f, 2, 6), 0.9f),
                          nn::adamw(nn::constant(1e-2f), 1e-2f)}) {
    INFO(opt.name());
    const auto ref = run(mesh_t{1, 1}, opt, {});
    CHECK(ref.back() < ref.front());  // it learns
    for (auto [d, mo] : {std::pair<std::size_t, std::size_t>{8, 1}, {4, 2}, {2, 4}, {1, 8}}) {
      INFO("mesh (" << d << ", " << mo << ")");
      require_close(run(mesh_t{d, mo}, opt, {}), ref, 1e-5);
    }
  }
}

TEST_CASE("ZeRO-1 gives the replicated optimizer's losses with 1/n of its state", "[nn][training][zero]") {
  // Clipping over the shards too.
  const nn::optimizer opt = nn::chain(nn::clip_by_global_norm(0.5f), nn::adamw(nn::constant(1e-2f), 1e-2f));
  const auto ref = run(mesh_t{4, 2}, opt, {});
  require_close(run(mesh_t{4, 2}, opt, {}, 6, nn::data_parallel<"data">{.zero = 1}), ref, 1e-6);
  require_close(run(mesh_t{2, 1}, opt, {}, 6, nn::data_parallel<"data">{.zero = 1}), ref, 1e-5);
  const mesh_t m{4, 2};
  nn::train_state replicated(m, make_net(m), opt, {});
  nn::train_state sharded(m, make_net(m), opt, nn::data_parallel<"data">{.zero = 1});
  CHECK(sharded.optimizer_state_size(0) == (replicated.optimizer_state_size(0) / 2 + 3) / 4 * 2);
}

TEST_CASE("parameters and optimizer state are tensors laid out by core's blocks", "[nn][training][zero][layout]") {
  const mesh_t m{4, 2};
  const auto ds = synthetic(batch);
  const float b1 = 0.9f, b2 = 0.999f;
  for (const bool zero : {false, true}) {
    INFO("zero " << zero);
    nn::train_state state(m, make_net(m), nn::adam(nn::constant(1e-2f), b1, b2), nn::data_parallel<"data">{.zero = zero ? 1 : 0});
    using state_t = decltype(state);
    static_assert(state_t::zero_state_type::vary == mesh_t::all_axes);  // a slice that differs on every device
    static_assert(state_t::zero_state_type::dims_type::at(1) == state_t::data_axes);  // blocked over data
    // Blocks: every global element of a parameter is held by exactly the devices of one replica
    // group, and the blocks are the views the tensors hold.
    for (const auto& p : state.params) {
      INFO(p.name);
      std::size_t total = 1;
      for (auto e : p.shape) total *= e;
      const std::size_t copies = m.axes_size(mesh_t::all_axes & ~p.sharded_axes);
      std::vector<std::size_t> hits(total, 0);
      for (std::size_t dev = 0; dev < m.size(); ++dev) {
        std::size_t n = 1;
        for (std::size_t d = 0; d < p.shape.size(); ++d) {
          CHECK(p.offset[dev][d] + p.extent[dev][d] <= p.shape[d]);
          n *= p.extent[dev][d];
        }
        REQUIRE(p.count[dev] == n);
        CHECK(p.value.view(dev).data() == p.value[dev]);
        CHECK(p.grad.view(dev).extent(0) == n);
        nn::detail::for_each_global_run(p, dev, 0, n, [&](std::size_t, std::size_t g, std::size_t len) {
          for (std::size_t j = 0; j < len; ++j) ++hits.at(g + j);
        });
      }
      for (std::size_t g = 0; g < total; ++g) REQUIRE(hits[g] == copies);
    }
    // One Adam step from zero state: m = (1 - b1) g and v = (1 - b2) g^2 for every element, so the
    // slots a device holds pair up element by element: m^2 (1 - b2) = v (1 - b1)^2.
    (void)nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch, 0, batch);
    const std::size_t dp = m.axes_size(state_t::data_axes);
    for (std::size_t dev = 0; dev < m.size(); ++dev) {
      std::size_t flat = 0, held = 0, nonzero = 0;
      for (const auto& p : state.params) flat += p.count[dev];
      state.for_each_state_run(dev, [&](std::size_t i, std::size_t off, std::size_t len, std::span<float* const> slot) {
        REQUIRE(slot.size() == 2);
        if (!zero) CHECK((off == 0 && len == state.params[i].count[dev]));
        for (std::size_t k = 0; k < len; ++k) {
          const double mk = slot[0][k], vk = slot[1][k];
          REQUIRE(std::abs(mk * mk * (1 - b2) - vk * (1 - b1) * (1 - b1)) <= 1e-6 * std::abs(vk) + 1e-30);
          nonzero += vk > 0 ? 1 : 0;
        }
        held += len;
      });
      const std::size_t slice = (flat + dp - 1) / dp, begin = m.group_rank(dev, state_t::data_axes) * slice;
      CHECK(held == (zero ? std::min(flat, begin + slice) - std::min(flat, begin) : flat));
      CHECK(nonzero > 0);
      CHECK(state.optimizer_state_size(dev) == 2 * (zero ? slice : flat));
      CHECK(state.optimizer_state(dev).size() == state.optimizer_state_size(dev));
    }
  }
}

TEST_CASE("k micro-batches of b rows equal one step of k*b rows", "[nn][training][accumulation]") {
  const auto opt = nn::adam(nn::constant(1e-2f));
  const auto ref = run(mesh_t{2, 2}, opt, {.accumulation = 1});
  require_close(run(mesh_t{2, 2}, opt, {.accumulation = 4}), ref, 1e-5);
  require_close(run(mesh_t{1, 1}, opt, {.accumulation = 2}), ref, 1e-5);
}

TEST_CASE("gradient buckets: the bucket size sets the number of collectives, not the result", "[nn][training][buckets]") {
  const auto opt = nn::adam(nn::constant(1e-2f));
  const auto ref = run(mesh_t{4, 2}, opt, {}, 2, nn::data_parallel<"data">{.bucket_elements = 0});
  require_close(run(mesh_t{4, 2}, opt, {}, 2, nn::data_parallel<"data">{.bucket_elements = 100}), ref, 1e-6);
  const mesh_t m{4, 1};
  nn::train_state state(m, make_net(m), opt, nn::data_parallel<"data">{.bucket_elements = 100});
  const auto ds = synthetic(batch);
  nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch, 0, batch);
  // fc1 12x16+16, fc2 16x16+16, fc3 16x4+4 gradient elements per device. The weights of at least
  // half a bucket (192, 256, 64) are reduced in place in pieces of <= 100: 2 + 3 + 1 collectives;
  // the three biases (16 + 16 + 4) are packed into one bucket: 1.
  CHECK(state.sync().collectives(0) == 7);
}

TEST_CASE("gradients reduced in bfloat16 on the wire stay close to float", "[nn][training][precision]") {
  const auto opt = nn::adam(nn::constant(1e-2f));
  const auto ref = run(mesh_t{4, 1}, opt, {}, 3);
  const mesh_t m{4, 1};
  nn::train_state<mesh_t, decltype(make_net(m)), "data", meshlib::bfloat16> state(m, make_net(m), opt, {});
  const auto ds = synthetic(batch * 3);
  std::vector<double> got;
  for (std::size_t s = 0; s < 3; ++s)
    got.push_back(nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                 std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch)
                      .loss);
  CHECK(got[0] == ref[0]);  // the first loss comes before any update
  require_close(got, ref, 2e-2);
}

TEST_CASE("a batch the data axis cannot split is refused before any device runs", "[nn][training][errors]") {
  const mesh_t m{4, 2};
  nn::train_state state(m, make_net(m), nn::adam(nn::constant(1e-3f)), {.accumulation = 2});
  const auto ds = synthetic(12);
  const auto msg = meshlib_test::message_of<meshlib::sharding_error>([&] {
    nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), 12, 0, 12);
  });
  CHECK(msg ==
        "meshlib::nn: train_step: the global batch of 12 rows does not split evenly over the 4 devices of the data "
        "axis x 2 accumulation steps; choose a batch size that is a multiple of 8");
  CHECK(state.step == 0);
}

TEST_CASE("a runner that runs other devices than the state holds is refused, naming both", "[nn][training][errors]") {
  // A state of this process's two devices of four (as under mpirun with 2 processes), run on the
  // default runner of a single process, which runs all four.
  const mesh_t m{4, 1};
  const std::vector<std::size_t> mine{2, 3};
  const nn::rng_key key{11};
  nn::sequential net(nn::dense<float, mesh_t>(m, "fc1", features, hidden, key, mine), nn::relu<float>(m),
                     nn::dense<float, mesh_t>(m, "fc2", hidden, classes, key, mine));
  nn::train_state state(m, std::move(net), nn::adam(nn::constant(1e-3f)), {}, key, mine);
  const auto ds = synthetic(batch);
  const std::string expected =
      ": the runner runs devices {0, 1, 2, 3} in this process, but the train state holds devices {2, 3}; pass the "
      "runner the state was made for, or make the state with the runner's devices (train_state(..., "
      "runner.local_devices(mesh.size())))";
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] {
          nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch / 2, batch / 2,
                         batch);
        }) == "meshlib::nn: train_step" + expected);
  CHECK(meshlib_test::message_of<meshlib::sharding_error>([&] { nn::evaluate(state, ds, batch); }) ==
        "meshlib::nn: evaluate" + expected);
  CHECK(state.step == 0);
}

TEST_CASE("a label outside the classes names the row and the device", "[nn][training][errors]") {
  const mesh_t m{2, 1};
  nn::train_state state(m, make_net(m), nn::adam(nn::constant(1e-3f)), {});
  auto ds = synthetic(batch);
  ds.y[20] = 9;
  const auto msg = meshlib_test::message_of<meshlib::device_error>([&] {
    nn::train_step(state, std::span<const float>(ds.x), std::span<const std::int32_t>(ds.y), batch, 0, batch);
  });
  CHECK(msg.find("label 9 of row 4 on device 1 is not in [0, 4)") != std::string::npos);
}

namespace {
/// Parameter `p`'s global row-major values, read from the devices that hold its blocks.
std::vector<float> global_values(const nn::param_ref<float>& p, std::size_t devices) {
  std::size_t total = 1;
  for (auto e : p.shape) total *= e;
  std::vector<float> out(total);
  for (std::size_t dev = 0; dev < devices; ++dev)
    for (std::size_t i = 0; i < p.count[dev]; ++i) {
      std::size_t rem = i, flat = 0;
      std::vector<std::size_t> idx(p.shape.size());
      for (std::size_t d = p.shape.size(); d-- > 0;) {
        idx[d] = rem % p.extent[dev][d] + p.offset[dev][d];
        rem /= p.extent[dev][d];
      }
      for (std::size_t d = 0; d < p.shape.size(); ++d) flat = flat * p.shape[d] + idx[d];
      out[flat] = p.value[dev][i];
    }
  return out;
}
}  // namespace

TEST_CASE("every train_step applies its own batch's gradient: SGD gives theta - lr g, step after step",
          "[nn][training][accumulation]") {
  // The reference: one device, gradients zeroed before each backward by the test itself, theta -= lr g.
  // train_step instead lets the first backward of a step overwrite last step's gradients: a
  // gradient left over from an earlier step or micro-batch would show here.
  constexpr std::size_t steps = 3;
  constexpr float lr = 0.5f;
  const auto ds = synthetic(batch * steps);
  const mesh_t one{1, 1};
  auto ref = make_net(one);
  std::vector<nn::param_ref<float>> rp;
  ref.collect(rp);
  nn::softmax_cross_entropy<float> ce(one);
  for (std::size_t s = 0; s < steps; ++s) {
    const std::vector<float> rows(ds.x.begin() + static_cast<std::ptrdiff_t>(s * batch * features),
                                  ds.x.begin() + static_cast<std::ptrdiff_t>((s + 1) * batch * features));
    const auto xs = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data">>{one},
                                       std::array<std::size_t, 2>{batch, features}, rows);
    meshlib::spmd(one, [&](std::size_t dev) {
      for (const auto& p : rp) std::fill_n(p.grad[dev], p.count[dev], 0.0f);
      auto x = xs.local_value(dev);
      auto logits = ref.forward(x);
      static_cast<void>(ce.forward(logits, std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch));
      ref.template backward<decltype(x)>(ce.backward(logits), true);
      for (const auto& p : rp)
        for (std::size_t i = 0; i < p.count[dev]; ++i) p.value[dev][i] -= lr * p.grad[dev][i];
    });
  }
  for (const auto& [shape, k] : {std::pair{mesh_t{1, 1}, std::size_t{1}}, std::pair{mesh_t{1, 1}, std::size_t{2}},
                                 std::pair{mesh_t{2, 2}, std::size_t{1}}, std::pair{mesh_t{2, 2}, std::size_t{2}}}) {
    INFO(shape << ", " << k << " micro-batch(es)");
    nn::train_state state(shape, make_net(shape), nn::sgd(nn::constant(lr), 0.0f), {.accumulation = k}, nn::rng_key{11});
    for (std::size_t s = 0; s < steps; ++s)
      static_cast<void>(nn::train_step(state, std::span<const float>(ds.x).subspan(s * batch * features, batch * features),
                                       std::span<const std::int32_t>(ds.y).subspan(s * batch, batch), batch, 0, batch));
    for (std::size_t i = 0; i < rp.size(); ++i) {
      const auto want = global_values(rp[i], 1), got = global_values(state.params[i], shape.size());
      for (std::size_t e = 0; e < want.size(); ++e) {
        INFO(rp[i].name << " element " << e);
        REQUIRE(std::abs(got[e] - want[e]) <= 1e-5f * (1.0f + std::abs(want[e])));
      }
    }
  }
}

}  // namespace MESHLIB_TEST_UNIT

namespace MESHLIB_TEST_UNIT {

TEST_CASE("device_put and device_prefetcher hand the loader's batches to train_step unchanged", "[nn][training][device_put]") {
  // On a host space nothing is copied (the rows move in), and the step's losses are the host
  // batch's, bit for bit; on a GPU the same calls copy through pinned memory (scripts/gpu-check.sh).
  const auto ds = synthetic(batch * 4);
  nn::data_loader plain(ds, {.global_batch = batch, .seed = 5});
  nn::data_loader ahead(ds, {.global_batch = batch, .seed = 5});
  nn::device_prefetcher batches(ahead);
  STATIC_REQUIRE_FALSE(nn::device_prefetcher::copies());
  REQUIRE(meshlib_test::message_of<meshlib::data_error>([&] { (void)batches.next(); }) ==
          "meshlib: device_prefetcher: next() called before start_epoch(epoch)");
  const mesh_t m{2, 2};
  nn::train_state a(m, make_net(m), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{11});
  nn::train_state b(m, make_net(m), nn::adam(nn::constant(1e-2f)), {}, nn::rng_key{11});
  for (std::size_t epoch = 0; epoch < 2; ++epoch) {
    plain.start_epoch(epoch);
    batches.start_epoch(epoch);
    std::size_t steps = 0;
    while (auto host = plain.next()) {
      auto dev = batches.next();
      REQUIRE(dev.has_value());
      REQUIRE(dev->rows == host->rows);
      REQUIRE(dev->step == host->step);
      REQUIRE(dev->epoch == epoch);
      REQUIRE(dev->y == host->y);
      REQUIRE(std::equal(host->x.begin(), host->x.end(), dev->x.data()));
      const auto put = nn::device_put(*host);  // a copy: the host batch stays as it was
      REQUIRE(put.x.data() != host->x.data());
      REQUIRE(std::equal(host->x.begin(), host->x.end(), put.x.data()));
      const double la = nn::train_step(a, *host).loss;
      const double lb = nn::train_step(b, *dev).loss;
      REQUIRE(la == lb);
      ++steps;
    }
    REQUIRE_FALSE(batches.next().has_value());
    REQUIRE(steps == 4);
  }
  // On a host space nothing runs ahead: the loader gives no batch until next() asks, so the rows
  // are assembled just before the step reads them, still in the cache.
  nn::data_loader lazy(ds, {.global_batch = batch, .seed = 5});
  nn::device_prefetcher on_demand(lazy);
  on_demand.start_epoch(0);
  REQUIRE(lazy.next()->step == 0);  // not taken by the prefetcher
  REQUIRE(on_demand.next()->step == 1);
  // Moved in: the rows are the batch's own, not a copy.
  plain.start_epoch(0);
  auto host = *plain.next();
  const float* rows = host.x.data();
  const auto moved = nn::device_put(std::move(host));
  REQUIRE(moved.x.data() == rows);
}

TEST_CASE("numbers in names and messages read as a user writes them: shortest text, no padding zeros", "[nn]") {
  CHECK(nn::adamw(nn::constant(1e-3f)).name() == "adamw(weight decay 1e-4)");
  CHECK(nn::adamw(nn::constant(1e-3f), 0.01f).name() == "adamw(weight decay 0.01)");
  CHECK(nn::adamw(nn::constant(1e-3f), 0.0f).name() == "adamw(weight decay 0)");
  CHECK(nn::sgd(nn::constant(1e-2f)).name() == "sgd(momentum 0.9)");
  CHECK(nn::adam(nn::constant(1e-2f)).name() == "adam");
  // Every float reads back as itself; the exponent has neither '+' nor leading zeros.
  using nn::detail::number_text;
  CHECK(number_text(1e-4f) == "1e-4");
  CHECK(number_text(2.5e-7f) == "2.5e-7");
  CHECK(number_text(3e10f) == "3e10");
  CHECK(number_text(0.1f) == "0.1");
  CHECK(number_text(100.0f) == "100");
  CHECK(number_text(-0.25f) == "-0.25");
  CHECK(number_text(1e-4) == "1e-4");
  for (float v : {1e-4f, 0.1f, 0.3f, 1.0f / 3.0f, 6.02e23f, 123456.78f})
    CHECK(std::stof(number_text(v)) == v);
  const mesh_t m{1, 1};
  CHECK(nn::dropout<float>(m, "drop1", 0.1f).to_string() == "drop1 (dropout 0.1)");
}

}  // namespace MESHLIB_TEST_UNIT

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Checkpoints: saved on one mesh, restored on another (and across ZeRO-1), training continues with
// the losses of an uninterrupted run; bad checkpoints are refused with the file and parameter named.
#include <meshlib.hpp>
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace {

using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
namespace fs = std::filesystem;

constexpr std::size_t features = 8, hidden = 16, classes = 4, batch = 16, steps = 6;

auto make_net(const mesh_t& m, std::size_t width = hidden) {
  const nn::rng_key key{21};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, width, key), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", width, classes, key));
}

struct data {
  std::vector<float> x = std::vector<float>(batch * steps * features);
  std::vector<std::int32_t> y = std::vector<std::int32_t>(batch * steps);
  data() {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::cos(0.61 * static_cast<double>(i)));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 7 + i / 3) % classes);
  }
};

template <class State>
double step(State& s, const data& d, std::size_t i) {
  return nn::train_step(s, std::span<const float>(d.x).subspan(i * batch * features, batch * features),
                        std::span<const std::int32_t>(d.y).subspan(i * batch, batch), batch, 0, batch)
      .loss;
}

fs::path scratch(const std::string& name) {
  auto p = fs::temp_directory_path() / ("meshlib_nn_ckpt_" + name + "_" + std::to_string(::getpid()));
  fs::remove_all(p);
  return p;
}

}  // namespace

TEST_CASE("a checkpoint saved on (4, 2) and restored on (2, 4) continues with the same losses", "[nn][checkpoint]") {
  const data d;
  const auto opt = nn::adam(nn::constant(1e-2f));
  for (auto [save_zero, load_zero] : {std::pair{false, false}, std::pair{true, false}, std::pair{false, true}}) {
    INFO("zero on save " << save_zero << ", on restore " << load_zero);
    const mesh_t a{4, 2}, b{2, 4};
    nn::train_state whole(a, make_net(a), opt, {});
    std::vector<double> ref;
    for (std::size_t i = 0; i < steps; ++i) ref.push_back(step(whole, d, i));

    const auto dir = scratch("reshard");
    nn::train_state first(a, make_net(a), opt, {.zero = save_zero});
    for (std::size_t i = 0; i < 3; ++i) CHECK(std::abs(step(first, d, i) - ref[i]) <= 1e-5 * ref[i]);
    nn::save_checkpoint(dir, first);
    CHECK(fs::exists(dir / "index"));
    CHECK(!fs::exists(fs::path(dir.string() + ".tmp")));

    nn::train_state second(b, make_net(b), opt, {.zero = load_zero});
    nn::restore_checkpoint(dir, second);
    CHECK(second.step == 3);
    for (std::size_t i = 3; i < steps; ++i) {
      INFO("step " << i);
      CHECK(std::abs(step(second, d, i) - ref[i]) <= 1e-5 * ref[i]);
    }
    fs::remove_all(dir);
  }
}

TEST_CASE("bad checkpoints are refused naming the file and the parameter", "[nn][checkpoint][errors]") {
  const data d;
  const mesh_t m{2, 2};
  const auto dir = scratch("bad");
  nn::train_state s(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
  step(s, d, 0);
  nn::save_checkpoint(dir, s);
  const std::string idx = (dir / "index").string();

  SECTION("another model") {
    nn::train_state other(m, make_net(m, 8), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + idx +
              "': parameter 'fc1.w' has shape 8x16 in the checkpoint, the model's is 8x8: a checkpoint of another model");
  }
  SECTION("another optimizer") {
    nn::train_state other(m, make_net(m), nn::sgd(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); })
              .find("saved with optimizer kind 1 (2 state slots), but the train state's optimizer is sgd") !=
          std::string::npos);
  }
  SECTION("a truncated file") {
    fs::resize_file(dir / "fc2.w.bin", 10);
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    const double before = other.params[2].value[0][0];
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "fc2.w.bin").string() +
              "' (parameter 'fc2.w') has 10 bytes, expected 256 (64 float32): truncated or not this checkpoint's file");
    CHECK(other.params[2].value[0][0] == before);  // nothing half-restored
  }
  SECTION("a corrupted file") {
    {
      std::fstream f(dir / "fc1.b.bin", std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(5);
      f.put('\x7f');
    }
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir, other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "fc1.b.bin").string() +
              "' (parameter 'fc1.b') does not match its checksum in the index: the file is corrupted");
  }
  SECTION("no checkpoint at all") {
    nn::train_state other(m, make_net(m), nn::adam(nn::constant(1e-2f)), {});
    CHECK(meshlib_test::message_of<nn::checkpoint_error>([&] { nn::restore_checkpoint(dir / "nope", other); }) ==
          "meshlib::nn: restore_checkpoint: '" + (dir / "nope" / "index").string() + "' is missing: not a checkpoint");
  }
  fs::remove_all(dir);
}

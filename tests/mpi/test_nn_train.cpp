// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training over MPI: the same model and batches on a (4, 2) mesh of P processes x 8/P threads
// (hybrid_runner, each process holding only its devices' parameter blocks and its share of every
// batch) gives the per-step losses of the single-process thread run.
#include <meshlib.hpp>
#include <meshlib/exec/mpi_runner.hpp>
#include <meshlib/mpi.hpp>
#include <meshlib/nn.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <string>
#include <unistd.h>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {
using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
namespace nn = meshlib::nn;
constexpr std::size_t features = 10, hidden = 16, classes = 4, batch = 32, steps = 4;

auto make_net(const mesh_t& m, std::span<const std::size_t> local) {
  const nn::rng_key key{31};
  return nn::sequential(nn::column_dense<float, mesh_t>(m, "fc1", features, hidden, key, local), nn::relu<float>(m),
                        nn::row_dense<float, mesh_t>(m, "fc2", hidden, hidden, key, local), nn::relu<float>(m),
                        nn::dense<float, mesh_t>(m, "fc3", hidden, classes, key, local));
}

struct problem {
  std::vector<float> x = std::vector<float>(batch * steps * features);
  std::vector<std::int32_t> y = std::vector<std::int32_t>(batch * steps);
  problem() {
    for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.41 * static_cast<double>(i)));
    for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 5 + i / 7) % classes);
  }
  /// Step `s` on a single-process state (the whole batch).
  template <class State>
  double whole(State& st, std::size_t s) const {
    return nn::train_step(st, std::span<const float>(x).subspan(s * batch * features, batch * features),
                          std::span<const std::int32_t>(y).subspan(s * batch, batch), batch, 0, batch)
        .loss;
  }
  /// Step `s` on a state holding this process's devices, which passes only the rows of their
  /// groups of the data axis (consecutive in every layout here).
  template <class State>
  double share(State& st, std::size_t s, const meshlib::hybrid_runner& backend) const {
    const auto data = mesh_t::mask_of<"data">();
    const std::size_t n = batch / st.mesh.axes_size(data);
    std::size_t lo = batch, hi = 0;
    for (std::size_t dev : st.local_devices()) {
      lo = std::min(lo, st.mesh.group_rank(dev, data) * n);
      hi = std::max(hi, (st.mesh.group_rank(dev, data) + 1) * n);
    }
    const std::size_t r0 = s * batch + lo;
    return nn::train_step(st, std::span<const float>(x).subspan(r0 * features, (hi - lo) * features),
                          std::span<const std::int32_t>(y).subspan(r0, hi - lo), hi - lo, lo, batch, backend)
        .loss;
  }
};

/// This process's devices of an 8-device mesh split over `P` processes.
std::vector<std::size_t> local_devices(std::size_t p, std::size_t P) {
  std::vector<std::size_t> local;
  for (std::size_t d = 0; d < 8 / P; ++d) local.push_back(p * (8 / P) + d);
  return local;
}
}  // namespace

TEST_CASE("training on processes x threads gives the losses of the thread run", "[mpi][nn]") {
  auto world = meshlib::mpi_communicator(MPI_COMM_WORLD);
  const auto P = static_cast<std::size_t>(world.size()), p = static_cast<std::size_t>(world.rank());
  if (8 % P != 0) return;
  const mesh_t m{4, 2};
  std::vector<float> x(batch * steps * features);
  std::vector<std::int32_t> y(batch * steps);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.41 * static_cast<double>(i)));
  for (std::size_t i = 0; i < y.size(); ++i) y[i] = static_cast<std::int32_t>((i * 5 + i / 7) % classes);
  const auto opt = nn::adam(nn::constant(1e-2f));

  nn::train_state threads(m, make_net(m, {}), opt, {});
  const std::size_t t = 8 / P;
  std::vector<std::size_t> local;
  for (std::size_t d = 0; d < t; ++d) local.push_back(p * t + d);
  nn::train_state hybrid(m, make_net(m, local), opt, {}, nn::rng_key{}, local);
  const meshlib::hybrid_runner backend(world, static_cast<int>(t));
  const std::size_t share = batch / P;
  for (std::size_t s = 0; s < steps; ++s) {
    const auto a = nn::train_step(threads, std::span<const float>(x).subspan(s * batch * features, batch * features),
                                  std::span<const std::int32_t>(y).subspan(s * batch, batch), batch, 0, batch);
    // This process passes only its share of the batch: rows [p * B / P, (p + 1) * B / P).
    const std::size_t r0 = s * batch + p * share;
    const auto b = nn::train_step(hybrid, std::span<const float>(x).subspan(r0 * features, share * features),
                                  std::span<const std::int32_t>(y).subspan(r0, share), share, p * share, batch, backend);
    INFO("step " << s << " on process " << p);
    CHECK(b.loss == a.loss);  // the hybrid communicator reduces in rank order: bitwise equal
    CHECK(b.correct == a.correct);
  }
}

TEST_CASE("a checkpoint written by every process restores on another mesh, process count and ZeRO setting",
          "[mpi][nn][checkpoint]") {
  namespace fs = std::filesystem;
  auto world = meshlib::mpi_communicator(MPI_COMM_WORLD);
  meshlib::mpi::exchange ex(world);
  const auto P = static_cast<std::size_t>(world.size()), p = static_cast<std::size_t>(world.rank());
  if (8 % P != 0) return;
  const problem d;
  const auto opt = nn::adam(nn::constant(1e-2f));
  const mesh_t a{4, 2}, b{2, 4};
  nn::train_state whole(a, make_net(a, {}), opt, {});  // the uninterrupted single-process run
  std::vector<double> ref;
  for (std::size_t s = 0; s < steps; ++s) ref.push_back(d.whole(whole, s));
  // One directory for every process: process 0's name.
  const auto dir = fs::path(ex.all_gather((fs::temp_directory_path() /
                                           ("meshlib_mpi_ckpt_" + std::to_string(::getpid()))).string())[0]);
  const auto local = local_devices(p, P);
  const meshlib::hybrid_runner backend(world, static_cast<int>(8 / P));
  for (const bool zero : {false, true}) {
    INFO("ZeRO-1 on save and on the multi-process restore: " << zero << "; process " << p << " of " << P);
    nn::train_state first(a, make_net(a, local), opt, {}, nn::rng_key{}, local, nn::data_parallel<"data">{.zero = zero ? 1 : 0});
    for (std::size_t s = 0; s < 2; ++s) CHECK(std::abs(d.share(first, s, backend) - ref[s]) <= 1e-5 * ref[s]);
    nn::save_checkpoint(dir, first, ex);
    CHECK(fs::exists(dir / "index"));
    CHECK(!fs::exists(fs::path(dir.string() + ".tmp")));

    // Every process on (2, 4), with its own blocks only.
    nn::train_state second(b, make_net(b, local), opt, {}, nn::rng_key{}, local, nn::data_parallel<"data">{.zero = zero ? 1 : 0});
    nn::restore_checkpoint(dir, second, ex);
    CHECK(second.step == 2);
    // One process holding the whole (2, 4) mesh (each process on its own: no exchange needed).
    nn::train_state alone(b, make_net(b, {}), opt, nn::data_parallel<"data">{.zero = zero ? 0 : 1});
    nn::restore_checkpoint(dir, alone);
    for (std::size_t s = 2; s < steps; ++s) {
      INFO("step " << s);
      CHECK(std::abs(d.share(second, s, backend) - ref[s]) <= 1e-5 * ref[s]);
      CHECK(std::abs(d.whole(alone, s) - ref[s]) <= 1e-5 * ref[s]);
    }
    static_cast<void>(ex.all_gather(""));  // every process has read the files before the next save
  }
  if (p == 0) fs::remove_all(dir);
}

TEST_CASE("a multi-process checkpoint that fails on one process fails on every process", "[mpi][nn][checkpoint][errors]") {
  namespace fs = std::filesystem;
  auto world = meshlib::mpi_communicator(MPI_COMM_WORLD);
  meshlib::mpi::exchange ex(world);
  const auto P = static_cast<std::size_t>(world.size()), p = static_cast<std::size_t>(world.rank());
  if (8 % P != 0) return;
  const mesh_t a{4, 2};
  const auto local = local_devices(p, P);
  const auto opt = nn::adam(nn::constant(1e-2f));
  nn::train_state st(a, make_net(a, local), opt, {}, nn::rng_key{}, local);
  const auto dir = fs::path(ex.all_gather((fs::temp_directory_path() /
                                           ("meshlib_mpi_ckpt_bad_" + std::to_string(::getpid()))).string())[0]);
  SECTION("a missing checkpoint: every process names the index") {
    const std::string expected = "meshlib::nn: restore_checkpoint: '" + (dir / "index").string() + "' is missing: not a checkpoint";
    try {
      nn::restore_checkpoint(dir, st, ex);
      FAIL("no error");
    } catch (const nn::checkpoint_error& e) {
      CHECK(std::string(e.what()) == expected);
    }
  }
  SECTION("a checkpoint only process 0 cannot read: the others name process 0 and keep their state") {
    nn::save_checkpoint(dir, st, ex);
    const auto missing = dir / "elsewhere";  // process 0 is given a directory that holds no checkpoint
    const std::string own = "meshlib::nn: restore_checkpoint: '" + (missing / "index").string() + "' is missing: not a checkpoint";
    nn::train_state other(a, make_net(a, local), opt, {}, nn::rng_key{}, local);
    try {
      nn::restore_checkpoint(p == 0 ? missing : dir, other, ex);
      FAIL("no error");
    } catch (const nn::checkpoint_error& e) {
      CHECK(std::string(e.what()) ==
            (p == 0 ? own : "meshlib::nn: restore_checkpoint: process 0 of " + std::to_string(P) + " failed: " + own));
    }
    CHECK(other.step == 0);  // read, checked, but not applied
  }
  SECTION("a train state that holds only some devices needs the other processes") {
    if (P > 1) {
      meshlib::distributed::single_process_exchange one;
      try {
        nn::save_checkpoint(dir, st, one);
        FAIL("no error");
      } catch (const nn::checkpoint_error& e) {
        CHECK(std::string(e.what()) == "meshlib::nn: save_checkpoint: this train state holds " + std::to_string(8 / P) +
                                           " of the mesh's 8 devices, so the other processes take part: pass their "
                                           "process_exchange (meshlib::mpi::exchange) or call distributed::initialize with one");
      }
    }
  }
  static_cast<void>(ex.all_gather(""));
  if (p == 0) fs::remove_all(dir);
}

}  // namespace MESHLIB_TEST_UNIT

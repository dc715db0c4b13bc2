// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Training over MPI: the same model and batches on a (4, 2) mesh of P processes x 8/P threads
// (hybrid_backend, each process holding only its devices' parameter blocks and its share of every
// batch) gives the per-step losses of the single-process thread run.
#include <meshlib.hpp>
#include <meshlib/comm/mpi/mpi_backend.hpp>
#include <meshlib/mpi.hpp>
#include <meshlib/nn.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "meshlib_catch.hpp"

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
  const meshlib::hybrid_backend backend{world, static_cast<int>(t)};
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

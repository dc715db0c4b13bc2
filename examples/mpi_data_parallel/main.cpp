// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// An existing MPI code adopting meshlib: the application owns its communicator (here a split of
// MPI_COMM_WORLD, as a solver that runs beside other components would have), hands it to meshlib,
// and runs one data-parallel SGD step of a linear model y = w . x:
//   1. each process reads only its rows of the global batch (distributed::process_rows),
//   2. computes the mean gradient of the squared error over its rows,
//   3. meshlib averages the gradients over the processes (all_reduce, reduce_op::mean),
//   4. every process applies the same update.
// The example checks its result against the full-batch gradient computed serially on every
// process, and that every process holds the same weights; it exits non-zero when either fails.
//
//   mpirun -np 4 ./mpi_data_parallel
#include <meshlib/mpi.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace dist = meshlib::distributed;

namespace {

constexpr std::size_t features = 4;
constexpr double learning_rate = 0.1;

// The global data set, as a file or a data loader would provide it row by row.
double feature(std::size_t row, std::size_t j) { return std::sin(0.7 * static_cast<double>(row) + 1.3 * static_cast<double>(j)); }
double label(std::size_t row) {
  const double w_true[features] = {0.5, -1.0, 2.0, 0.25};
  double y = 0;
  for (std::size_t j = 0; j < features; ++j) y += w_true[j] * feature(row, j);
  return y;
}

/// Mean gradient of (w.x - y)^2 over `rows`.
std::vector<double> gradient(const std::vector<double>& w, const std::vector<std::size_t>& rows) {
  std::vector<double> g(features, 0.0);
  for (std::size_t r : rows) {
    double err = -label(r);
    for (std::size_t j = 0; j < features; ++j) err += w[j] * feature(r, j);
    for (std::size_t j = 0; j < features; ++j) g[j] += 2.0 * err * feature(r, j);
  }
  for (auto& v : g) v /= static_cast<double>(rows.size());
  return g;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm app_comm = MPI_COMM_NULL;  // the application's own communicator
  MPI_Comm_split(MPI_COMM_WORLD, /*color=*/0, /*key=*/world_rank, &app_comm);

  bool ok = true;
  {
    meshlib::mpi::guard run(app_comm);  // adopts app_comm; meshlib never frees it
    const std::size_t procs = dist::process_count();
    using mesh_t = meshlib::mesh<meshlib::axis<"data">>;
    const auto m = dist::make_global_mesh<meshlib::axis<"data">>(procs);  // checked on every process
    const meshlib::named_sharding<mesh_t, meshlib::P<"data">> batch_sharding{m};
    const std::size_t batch = 16 * procs;
    const meshlib::shard_layout layout{batch_sharding, std::array<std::size_t, 2>{batch, features}};

    // 1. Only this process's rows.
    std::vector<std::size_t> mine;
    for (const auto& r : dist::process_rows(layout))
      for (std::size_t i = r.begin; i < r.end; ++i) mine.push_back(i);

    // 2.-4. One step.
    std::vector<double> w(features, 0.0);
    auto comm = meshlib::mpi::world();
    {
      // If this process throws within the step (a bad row, a failed read), its peers' all_reduce
      // ends within milliseconds with comm_aborted naming this rank, instead of waiting for the
      // whole timeout: the runtime keeps another copy of world(), so nothing else tells them.
      meshlib::fail_guard on_throw(comm);
      auto g = gradient(w, mine);
      comm.all_reduce(std::span(g), meshlib::reduce_op::mean);
      for (std::size_t j = 0; j < features; ++j) w[j] -= learning_rate * g[j];
    }

    // Check against the serial full-batch step.
    std::vector<std::size_t> all(batch);
    for (std::size_t i = 0; i < batch; ++i) all[i] = i;
    const auto full = gradient(std::vector<double>(features, 0.0), all);
    for (std::size_t j = 0; j < features; ++j) ok = ok && std::fabs(w[j] + learning_rate * full[j]) < 1e-12;
    // Every process holds the same weights: max and min over processes agree.
    std::vector<double> hi = w, lo = w;
    comm.all_reduce(std::span(hi), meshlib::reduce_op::max);
    comm.all_reduce(std::span(lo), meshlib::reduce_op::min);
    for (std::size_t j = 0; j < features; ++j) ok = ok && hi[j] == lo[j];
    int good = ok ? 1 : 0;
    comm.all_reduce(std::span(&good, 1), meshlib::reduce_op::min);
    ok = good == 1;
    if (dist::process_index() == 0)
      std::printf("mpi_data_parallel: %zu processes, %zu rows each, w = [%.6f, %.6f, %.6f, %.6f]: %s\n", procs,
                  mine.size(), w[0], w[1], w[2], w[3], ok ? "matches the serial step" : "WRONG");
  }
  MPI_Comm_free(&app_comm);  // still the application's to free
  MPI_Finalize();
  return ok ? 0 : 1;
}

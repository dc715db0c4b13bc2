// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The conformance kit on the MPI communicator (one rank per process, run with 2 and 4 ranks) and
// on the hybrid communicator (the processes x 2 threads).
#include <meshlib/mpi.hpp>

#include <chrono>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "meshlib_catch.hpp"

namespace {

using clk = std::chrono::steady_clock;

/// Runs `row` on a fresh communicator over MPI_COMM_WORLD with the given timeout.
void run_row(const conformance::fault_row<meshlib::mpi_communicator>& row, double timeout_s) {
  meshlib::mpi_comm_options o;
  o.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s));
  conformance::outcome mine;
  int rank = 0, n = 0;
  {
    meshlib::mpi_communicator c(MPI_COMM_WORLD, o);
    rank = c.rank();
    n = c.size();
    const auto t0 = clk::now();
    try {
      row.body(c);
    } catch (const meshlib::comm_error&) {
      mine = conformance::classify(std::current_exception());
    } catch (const std::exception& e) {
      // The rank's own failure (not the communicator's): tell the peers, as a runner does.
      mine = conformance::classify(std::current_exception());
      c.fail(e.what());
    }
    mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
  }
  INFO(row.name << ", MPI rank " << rank << " of " << n);
  CHECK(row.check(rank, n, mine) == "");
  MPI_Barrier(MPI_COMM_WORLD);
}

/// Runs `row` on a fresh hybrid world (the processes x 2 threads) with the given timeout.
void run_hybrid_row(const conformance::fault_row<meshlib::hybrid_communicator>& row, double timeout_s) {
  constexpr int threads = 2;
  meshlib::mpi_comm_options mo;
  mo.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s));
  meshlib::mpi_communicator procs(MPI_COMM_WORLD, mo);
  meshlib::thread_comm_options to;
  to.timeout = mo.timeout;
  std::vector<conformance::outcome> seen(threads);
  std::vector<int> device(threads, -1);
  int n = 0;
  const auto t0 = clk::now();
  try {
    meshlib::run_hybrid(
        procs, threads,
        [&](meshlib::hybrid_communicator& c) {
          const auto t = static_cast<std::size_t>(c.local().rank());
          device[t] = c.rank();
          n = c.size();
          try {
            row.body(c);
          } catch (...) {
            seen[t] = conformance::classify(std::current_exception());
            seen[t].seconds = std::chrono::duration<double>(clk::now() - t0).count();
            throw;
          }
          seen[t].seconds = std::chrono::duration<double>(clk::now() - t0).count();
        },
        to);
  } catch (const meshlib::participant_error&) {
  }
  for (int t = 0; t < threads; ++t) {
    INFO(row.name << ", hybrid device " << device[static_cast<std::size_t>(t)] << " of " << n);
    CHECK(row.check(device[static_cast<std::size_t>(t)], n, seen[static_cast<std::size_t>(t)]) == "");
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

}  // namespace

TEST_CASE("MPI communicator: conformance value rows", "[conformance][mpi]") {
  conformance::findings f;
  meshlib::mpi_communicator c(MPI_COMM_WORLD);
  conformance::check_values(c, f);
  for (const auto& failure : f.failures) FAIL_CHECK(failure);
  CHECK(f.failures.empty());
}

TEST_CASE("MPI communicator: conformance fault rows (mismatch, arguments, timing)", "[conformance][mpi]") {
  using comm = meshlib::mpi_communicator;
  for (const auto& row : conformance::mismatch_rows<comm>()) run_row(row, conformance::fault_timeout_s);
  for (const auto& row : conformance::argument_rows<comm>()) run_row(row, conformance::fault_timeout_s);
  for (const auto& row : conformance::slow_rows<comm>()) run_row(row, conformance::fault_timeout_s);
  for (const auto& row : conformance::timing_rows<comm>(1.0)) run_row(row, 1.0);
}

TEST_CASE("MPI communicator: conformance throw rows (peers released through the abort channel)", "[conformance][mpi]") {
  using comm = meshlib::mpi_communicator;
  // Bound prompt_s (10 s) against a 20 s timeout: the peers are released by the abort channel, not the timeout.
  // A released rank abandons the fingerprint all-reduce it waited in: its buffers and its
  // communicator stay allocated (mpi_comm_state), else MPI later writes into freed memory.
  for (const auto& row : conformance::throw_rows<comm>(conformance::prompt_s, "MPI"))
    run_row(row, conformance::fault_timeout_s);
}

TEST_CASE("hybrid communicator: conformance value rows", "[conformance][hybrid]") {
  conformance::findings f;
  meshlib::mpi_communicator procs(MPI_COMM_WORLD);
  meshlib::run_hybrid(procs, 2, [&](meshlib::hybrid_communicator& c) { conformance::check_values(c, f, {0, 19}); });
  for (const auto& failure : f.failures) FAIL_CHECK(failure);
  CHECK(f.failures.empty());
}

TEST_CASE("hybrid communicator: conformance throw rows (released across processes)", "[conformance][hybrid]") {
  using comm = meshlib::hybrid_communicator;
  // Bound prompt_s (10 s) against a 20 s timeout: every device of every process is released by the abort
  // channel, not by the timeout.
  for (const auto& row : conformance::throw_rows<comm>(conformance::prompt_s, "hybrid"))
    run_hybrid_row(row, conformance::fault_timeout_s);
}

TEST_CASE("hybrid communicator: conformance mismatch rows (every device of every process)", "[conformance][hybrid]") {
  using comm = meshlib::hybrid_communicator;
  // Every device gets collective_mismatch naming both calls within prompt_s (a 20 s timeout).
  for (const auto& row : conformance::mismatch_rows<comm>()) run_hybrid_row(row, conformance::fault_timeout_s);
}

// A device that never arrives: every device of every process gets comm_timeout naming the
// operation the user called and the missing device by its global id (not a local thread or an
// MPI process rank) (the type and message are the verdict: conformance.hpp, timing_rows).
TEST_CASE("hybrid communicator: conformance timing rows (a missing device is named by its global id)", "[conformance][hybrid]") {
  using comm = meshlib::hybrid_communicator;
  for (const auto& row : conformance::slow_rows<comm>()) run_hybrid_row(row, conformance::fault_timeout_s);
  for (const auto& row : conformance::timing_rows<comm>(1.0)) run_hybrid_row(row, 1.0);
}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The conformance kit on the thread communicator: every value row for groups of 1 to 4 threads,
// and every fault row on a fresh world each (timeouts short, so the whole file runs in seconds).
#include <chrono>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "meshlib_catch.hpp"

namespace {

using clk = std::chrono::steady_clock;

/// Runs `row` on a fresh world of n threads and checks every participant's outcome.
void run_row(const conformance::fault_row<meshlib::thread_communicator>& row, int n, double timeout_s) {
  std::vector<conformance::outcome> seen(static_cast<std::size_t>(n));
  meshlib::thread_comm_options o;
  o.timeout = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(timeout_s));
  const auto t0 = clk::now();
  try {
    meshlib::run_on_threads(
        n,
        [&](meshlib::thread_communicator& c) {
          auto& mine = seen[static_cast<std::size_t>(c.rank())];
          try {
            row.body(c);
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
          } catch (...) {
            mine = conformance::classify(std::current_exception());
            mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
            throw;
          }
        },
        o);
  } catch (const meshlib::participant_error&) {
  }
  for (int r = 0; r < n; ++r) {
    INFO(row.name << ", " << n << " threads, rank " << r);
    CHECK(row.check(r, n, seen[static_cast<std::size_t>(r)]) == "");
  }
}

}  // namespace

TEST_CASE("thread communicator: conformance value rows", "[conformance][thread]") {
  for (int n : {1, 2, 3, 4}) {
    conformance::findings f;
    meshlib::run_on_threads(n, [&](meshlib::thread_communicator& c) { conformance::check_values(c, f); });
    INFO(n << " threads");
    for (const auto& failure : f.failures) FAIL_CHECK(failure);
    CHECK(f.failures.empty());
  }
}

TEST_CASE("thread communicator: conformance fault rows", "[conformance][thread]") {
  using comm = meshlib::thread_communicator;
  for (int n : {2, 4}) {
    for (const auto& row : conformance::mismatch_rows<comm>()) run_row(row, n, conformance::fault_timeout_s);
    for (const auto& row : conformance::argument_rows<comm>()) run_row(row, n, conformance::fault_timeout_s);
    for (const auto& row : conformance::throw_rows<comm>(conformance::prompt_s, "thread"))
      run_row(row, n, conformance::fault_timeout_s);
    for (const auto& row : conformance::slow_rows<comm>()) run_row(row, n, conformance::fault_timeout_s);
    for (const auto& row : conformance::timing_rows<comm>(1.0)) run_row(row, n, 1.0);
    for (const auto& row : conformance::departure_rows<comm>(conformance::prompt_s, "thread"))
      run_row(row, n, conformance::fault_timeout_s);
  }
}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The blame rule every runner shares (comm/detail/root_cause.hpp), on facts built by hand: each
// case is one situation a thread, MPI, hybrid or GPU run can end in.
#include <catch2/catch.hpp>

#include <exception>
#include <stdexcept>
#include <string>
#include <vector>

#include "meshlib/comm/detail/root_cause.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace {
using meshlib::comm::detail::find_root_cause;
using meshlib::comm::detail::run_failures;

template <class E>
std::exception_ptr make(const char* what) {
  return std::make_exception_ptr(E(what));
}
const auto own = [](const char* w) { return make<std::runtime_error>(w); };
const auto aborted = [](const char* w) { return make<meshlib::comm_aborted>(w); };
const auto timeout = [](const char* w) { return make<meshlib::comm_timeout>(w); };
const auto mismatch = [](const char* w) { return make<meshlib::collective_mismatch>(w); };
}  // namespace

TEST_CASE("root cause: nobody failed, nobody blamed", "[root_cause]") {
  std::vector<std::exception_ptr> errors(3);
  const auto b = find_root_cause({.errors = errors, .size = 3, .local_root = 1});
  CHECK(b.source == -1);
  CHECK_NOTHROW(meshlib::comm::detail::rethrow_root_cause({.errors = errors, .size = 3}));
}

TEST_CASE("root cause: the world's root cause, with its own exception", "[root_cause]") {
  // Participant 2 threw first; 0 and 1 were released with comm_aborted.
  std::vector<std::exception_ptr> errors{aborted("released"), aborted("released"), own("bad input")};
  const auto b = find_root_cause({.errors = errors, .size = 3, .local_root = 2});
  CHECK(b.participant == 2);
  CHECK(b.source == 2);
  try {
    meshlib::comm::detail::rethrow_root_cause({.errors = errors, .size = 3, .local_root = 2});
    FAIL("no throw");
  } catch (const meshlib::participant_error& e) {
    CHECK(e.rank() == 2);
    CHECK(std::string(e.what()) == "meshlib: participant 2 of 3 failed: bad input");
    CHECK_THROWS_AS(e.rethrow_nested(), std::runtime_error);
  }
}

TEST_CASE("root cause: a participant that never arrived is blamed with a waiter's message", "[root_cause]") {
  // Participant 1 was late (threw nothing); 0 and 2 timed out.
  std::vector<std::exception_ptr> errors{timeout("1 never arrived"), nullptr, timeout("1 never arrived (2)")};
  const auto b = find_root_cause({.errors = errors, .size = 3, .local_root = 1});
  CHECK(b.participant == 1);
  CHECK(b.source == 0);
}

TEST_CASE("root cause: without a recorded root cause, the lowest that threw", "[root_cause]") {
  std::vector<std::exception_ptr> errors{nullptr, own("second"), own("third")};
  const auto b = find_root_cause({.errors = errors, .size = 3});
  CHECK(b.participant == 1);
  CHECK(b.source == 1);
}

TEST_CASE("root cause: a participant's own failure outranks one that was only late", "[root_cause]") {
  std::vector<std::exception_ptr> errors{timeout("late"), nullptr, own("real")};
  const auto b = find_root_cause({.errors = errors, .size = 3, .local_root = 1});
  CHECK(b.participant == 0);  // the lowest that threw: its timeout message is reported
  CHECK(b.source == 0);
}

TEST_CASE("root cause: another process's failure is blamed on its device", "[root_cause]") {
  // Process 1 of a hybrid run (devices 2, 3): both released by device 0's failure elsewhere.
  std::vector<std::exception_ptr> errors{aborted("device 0 failed"), aborted("device 0 failed")};
  const run_failures f{.errors = errors, .first = 2, .size = 4, .remote_root = 0, .noun = "hybrid device"};
  CHECK(find_root_cause(f).participant == 0);
  try {
    meshlib::comm::detail::rethrow_root_cause(f);
    FAIL("no throw");
  } catch (const meshlib::participant_error& e) {
    CHECK(e.rank() == 0);
    CHECK(std::string(e.what()) == "meshlib: hybrid device 0 of 4 failed: device 0 failed");
  }
}

TEST_CASE("root cause: a failure of our own at the same time as a remote one is ours", "[root_cause]") {
  std::vector<std::exception_ptr> errors{aborted("remote"), own("ours")};
  const auto b = find_root_cause({.errors = errors, .first = 2, .size = 4, .remote_root = 0});
  CHECK(b.participant == 3);
  CHECK(b.source == 1);
}

TEST_CASE("root cause: a mismatch is blamed on the device whose call differed, on every process", "[root_cause]") {
  // The process holding devices 0, 1 saw the mismatch first on device 1; the culprit is device 2.
  std::vector<std::exception_ptr> here{aborted("released"), mismatch("dtype differs")};
  const auto b = find_root_cause({.errors = here, .first = 0, .size = 4, .local_root = 1, .mismatch_culprit = 2});
  CHECK(b.participant == 2);
  CHECK(b.source == 1);
  std::vector<std::exception_ptr> there{mismatch("dtype differs"), aborted("released")};
  CHECK(find_root_cause({.errors = there, .first = 2, .size = 4, .local_root = 0, .mismatch_culprit = 2}).participant == 2);
  // Without a culprit (not computed), the usual rule.
  CHECK(find_root_cause({.errors = here, .size = 4, .local_root = 1}).participant == 1);
}

TEST_CASE("root cause: one MPI rank, released by another's failure or failing itself", "[root_cause]") {
  const std::exception_ptr released = aborted("rank 3 failed");
  CHECK(find_root_cause({.errors = {&released, 1}, .first = 1, .size = 4, .remote_root = 3}).participant == 3);
  const std::exception_ptr mine = own("out of range");
  CHECK(find_root_cause({.errors = {&mine, 1}, .first = 1, .size = 4}).participant == 1);
  const std::exception_ptr late = timeout("rank 0 never arrived");
  CHECK(find_root_cause({.errors = {&late, 1}, .first = 1, .size = 4}).participant == 1);
}

TEST_CASE("root cause: a custom name, as run_on_gpus gives it", "[root_cause]") {
  std::vector<std::exception_ptr> errors{nullptr, own("cuda")};
  try {
    meshlib::comm::detail::rethrow_root_cause({.errors = errors, .size = 2, .local_root = 1},
                                        [](int r) { return "participant " + std::to_string(r) + " of 2 (GPU 5)"; });
    FAIL("no throw");
  } catch (const meshlib::participant_error& e) {
    CHECK(std::string(e.what()) == "meshlib: participant 1 of 2 (GPU 5) failed: cuda");
  }
}

}  // namespace MESHLIB_TEST_UNIT

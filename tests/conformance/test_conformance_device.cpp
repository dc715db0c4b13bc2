// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The conformance kit on the device communicators, with device buffers (cuda_buffers.hpp): every
// value row on the NCCL communicator with one rank (GPU 0), and on 2 and 4 mesh devices sharing
// GPU 0 (shared_gpu_communicator); the argument rows on both. Skipped (exit 77, see
// tests/device/device_main.cpp) where no CUDA device is.
//
// The mismatch, throw (sticky included) and departure rows run on the shared-GPU devices, with
// device buffers and the shared-GPU words (conformance::words_table); the same rows, with the
// slow and missing-device rows, run on every machine over a fake CUDA runtime
// (test_conformance_fake_cuda.cpp), which leaves out only the GPU itself. Left out here: the
// missing-device row (seconds of waiting per run, and the same host logic as on the fake), and
// every fault row on NCCL: one rank cannot mismatch or wait for a peer (a mismatch between NCCL
// ranks needs two GPUs; the NCCL check runs on a fake NCCL in test_conformance_fake_cuda.cpp).
#include <cuda_runtime_api.h>

#include <meshlib/nccl.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <vector>

#include "conformance.hpp"
#include "cuda_buffers.hpp"
#include "meshlib_catch.hpp"

namespace {

using clk = std::chrono::steady_clock;
constexpr int gpu0[] = {0};

void report(conformance::findings& f) {
  for (const auto& failure : f.failures) FAIL_CHECK(failure);
  CHECK(f.failures.empty());
}

/// Runs `body` on every participant through `launch` and records what each one saw.
template <class Comm, class Launch>
std::vector<conformance::outcome> run_participants(int n, const std::function<void(Comm&)>& body, Launch&& launch) {
  std::vector<conformance::outcome> seen(static_cast<std::size_t>(n));
  const auto t0 = clk::now();
  try {
    launch([&](Comm& c) {
      auto& mine = seen[static_cast<std::size_t>(c.rank())];
      try {
        body(c);
        mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
      } catch (...) {
        mine = conformance::classify(std::current_exception());
        mine.seconds = std::chrono::duration<double>(clk::now() - t0).count();
        throw;
      }
    });
  } catch (const meshlib::participant_error&) {
  }
  return seen;
}

template <class Comm>
void check_row(const conformance::fault_row<Comm>& row, int n, const std::vector<conformance::outcome>& seen,
               const char* where) {
  for (int r = 0; r < n; ++r) {
    INFO(row.name << ", " << where << ", participant " << r);
    CHECK(row.check(r, n, seen[static_cast<std::size_t>(r)]) == "");
  }
}

}  // namespace

TEST_CASE("nccl communicator: conformance value rows on device buffers, one rank", "[conformance][nccl]") {
  conformance::findings f;
  meshlib::run_on_gpus(gpu0, [&](meshlib::nccl_communicator& c) { conformance::check_values<conformance::cuda_buffers>(c, f); });
  report(f);
}

TEST_CASE("shared GPU: conformance value rows on device buffers, 2 and 4 devices of GPU 0", "[conformance][shared_gpu]") {
  for (int n : {2, 4}) {
    INFO(n << " devices");
    conformance::findings f;
    meshlib::run_on_shared_gpu(
        n, [&](meshlib::shared_gpu_communicator& c) { conformance::check_values<conformance::cuda_buffers>(c, f); },
        {.device = 0});
    report(f);
  }
}

// The argument rows pass host vectors: the front end rejects the arguments before the device
// backends look at the pointers (a host pointer would be an argument error of its own).
TEST_CASE("nccl communicator: conformance argument rows, one rank", "[conformance][nccl]") {
  using comm = meshlib::nccl_communicator;
  for (const auto& row : conformance::argument_rows<comm>()) {
    const auto seen = run_participants<comm>(1, row.body, [](auto&& fn) { meshlib::run_on_gpus(gpu0, fn); });
    check_row(row, 1, seen, "1 NCCL rank");
  }
}

TEST_CASE("shared GPU: conformance argument rows, 2 and 4 devices of GPU 0", "[conformance][shared_gpu]") {
  using comm = meshlib::shared_gpu_communicator;
  for (int n : {2, 4})
    for (const auto& row : conformance::argument_rows<comm>()) {
      const auto seen =
          run_participants<comm>(n, row.body, [n](auto&& fn) { meshlib::run_on_shared_gpu(n, fn, {.device = 0}); });
      check_row(row, n, seen, n == 2 ? "2 shared-GPU devices" : "4 shared-GPU devices");
    }
}

TEST_CASE("shared GPU: conformance mismatch rows on device buffers, 2 and 4 devices of GPU 0", "[conformance][shared_gpu]") {
  using comm = meshlib::shared_gpu_communicator;
  for (int n : {2, 4})
    for (const auto& row : conformance::mismatch_rows<comm, conformance::cuda_buffers>()) {
      const auto seen =
          run_participants<comm>(n, row.body, [n](auto&& fn) { meshlib::run_on_shared_gpu(n, fn, {.device = 0}); });
      check_row(row, n, seen, n == 2 ? "2 shared-GPU devices" : "4 shared-GPU devices");
    }
}

// Issue 40 §1: a device that throws or leaves releases the others with comm_aborted naming it,
// and the group refuses every later call (the kit's bounds: prompt_s against a 20 s timeout).
TEST_CASE("shared GPU: conformance throw and departure rows on device buffers, 2 and 4 devices of GPU 0",
          "[conformance][shared_gpu]") {
  using comm = meshlib::shared_gpu_communicator;
  using buffers = conformance::cuda_buffers;
  for (int n : {2, 4}) {
    auto rows = conformance::throw_rows<comm, buffers>(conformance::prompt_s, "shared-GPU");
    for (auto&& r : conformance::departure_rows<comm, buffers>(conformance::prompt_s, "shared-GPU")) rows.push_back(std::move(r));
    for (const auto& row : rows) {
      const auto seen = run_participants<comm>(n, row.body, [n](auto&& fn) {
        meshlib::nccl_comm_options o;
        o.device = 0;
        o.timeout = std::chrono::seconds(20);
        meshlib::run_on_shared_gpu(n, fn, o, {.timeout = std::chrono::seconds(20)});
      });
      check_row(row, n, seen, n == 2 ? "2 shared-GPU devices" : "4 shared-GPU devices");
    }
  }
}

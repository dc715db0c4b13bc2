// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The parked threads that run the hybrid worlds' abort-channel watchers
// (comm/mpi/detail/watcher_threads.hpp): a job after a joined one runs on the same thread (none is
// started per call), a job never waits for a busy thread, and join() returns only after the job.
#include "meshlib/comm/mpi/detail/watcher_threads.hpp"

#include <atomic>
#include <chrono>
#include <future>
#include <thread>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using meshlib::comm::detail::watcher_threads;

TEST_CASE("watcher_threads: jobs one after another run on the same parked thread", "[comm][watcher]") {
  auto& pool = watcher_threads::get();
  std::thread::id first, second;
  auto a = pool.run([&] { first = std::this_thread::get_id(); });
  REQUIRE(a.joinable());
  a.join();
  CHECK_FALSE(a.joinable());
  auto b = pool.run([&] { second = std::this_thread::get_id(); });
  b.join();
  CHECK(first != std::this_thread::get_id());
  CHECK(first == second);
}

TEST_CASE("watcher_threads: a job never waits for a busy thread; join waits for its job", "[comm][watcher]") {
  auto& pool = watcher_threads::get();
  std::promise<void> release;
  auto released = release.get_future().share();
  std::atomic<bool> a_done{false};
  std::thread::id a_id, b_id;
  auto a = pool.run([&] {
    a_id = std::this_thread::get_id();
    released.wait();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    a_done = true;
  });
  // While a holds its thread, b gets another one and finishes.
  auto b = pool.run([&] { b_id = std::this_thread::get_id(); });
  b.join();
  CHECK_FALSE(a_done.load());
  release.set_value();
  a.join();  // returns only once a has returned
  CHECK(a_done.load());
  CHECK(a_id != b_id);
}

}  // namespace MESHLIB_TEST_UNIT

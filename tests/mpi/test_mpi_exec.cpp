// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// spmd and shard_map on the MPI backends: the same SPMD program (typed collectives over each axis
// of a 2-D mesh) runs on thread_runner (every device a thread of this process), mpi_runner (one
// device per rank) and hybrid_runner (2 threads per rank); every device this process runs must
// see the same bits as on threads. Values are small integers, so float results are exact too.
#include <meshlib/collectives.hpp>
#include <meshlib/exec.hpp>
#include <meshlib/exec/mpi_runner.hpp>
#include <meshlib/mpi.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;

// The MPI backends are runners (exec/runner.hpp), as the thread runners are.
static_assert(runner<mpi_runner>);
static_assert(runner<hybrid_runner>);

namespace {

using mesh2 = mesh<axis<"data">, axis<"model">>;
constexpr axis_mask D = mesh2::mask_of<"data">();
constexpr axis_mask M = mesh2::mask_of<"model">();

template <class T>
T value(std::size_t dev, std::size_t i) {
  return static_cast<T>(static_cast<long long>(dev) * 100 + static_cast<long long>(i) * 3 - 7);
}

template <class L>
L fill_block(const mesh2& m, typename L::shape_type shape) {
  const std::size_t dev = device_index();
  L x(shape, m, dev);
  for (std::size_t i = 0; i < x.size(); ++i) x.data()[i] = value<typename L::value_type>(dev, i);
  return x;
}

template <class L>
void append(std::vector<double>& out, const L& x) {
  for (std::size_t d = 0; d < L::rank; ++d) out.push_back(static_cast<double>(x.extent(d)));
  for (std::size_t i = 0; i < x.size(); ++i) out.push_back(static_cast<double>(x.data()[i]));
}

/// Every typed collective, over each axis: what each device saw, flattened.
template <class T>
std::vector<double> program(const mesh2& m) {
  const std::size_t a = m.axis_size<"data">(), b = m.axis_size<"model">();
  using rows_t = local_tensor<T, 2, mesh2, D | M, 0, dim_masks<D, M>>;
  using full_t = local_tensor<T, 2, mesh2, D | M>;
  std::vector<double> out;
  auto x = fill_block<rows_t>(m, {2, 3});
  append(out, psum<"data">(x));
  append(out, psum<"model">(x));
  append(out, psum<"data", "model">(x));
  append(out, pmax<"model">(x));
  append(out, pmin<"data">(x));
  append(out, all_gather<"model", 1>(x));
  append(out, all_gather<"data", 0>(x));
  append(out, all_gather<"data", 1>(x, untiled));
  append(out, broadcast<"model">(x, b - 1));
  std::vector<std::pair<std::size_t, std::size_t>> ring;
  for (std::size_t i = 0; i < a; ++i) ring.emplace_back(i, (i + 1) % a);
  append(out, ppermute<"data">(x, ring));
  auto y = fill_block<full_t>(m, {2 * b, 2 * a});
  append(out, psum_scatter<"model", 0>(y));
  append(out, all_to_all<"data", 1, 0>(y));
  out.push_back(static_cast<double>(axis_index<"data">()));
  out.push_back(static_cast<double>(axis_index<"model">()));
  return out;
}

template <class T, class Backend>
void check_backend(const mesh2& m, const Backend& backend) {
  INFO("type " << datatype_of<T> << ", mesh " << m);
  const auto reference = spmd(m, [&] { return program<T>(m); });
  const auto got = spmd(m, [&] { return program<T>(m); }, backend);
  REQUIRE(got.size() == m.size());
  for (std::size_t dev : backend.local_devices(m.size())) {
    INFO("device " << dev);
    REQUIRE(!got[dev].empty());
    REQUIRE(got[dev].size() == reference[dev].size());
    CHECK(std::memcmp(got[dev].data(), reference[dev].data(), got[dev].size() * sizeof(double)) == 0);
  }
}

}  // namespace

TEST_CASE("spmd on mpi_runner and hybrid_runner equals the thread runner", "[mpi][exec]") {
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const auto n = static_cast<std::size_t>(world.size());
  // One device per rank: mesh (n/2) x 2.
  const mpi_runner per_rank{world};
  check_backend<std::int32_t>(mesh2{n / 2, 2}, per_rank);
  check_backend<std::int64_t>(mesh2{n / 2, 2}, per_rank);
  check_backend<float>(mesh2{n / 2, 2}, per_rank);
  check_backend<double>(mesh2{n / 2, 2}, per_rank);
  // Two threads per rank: meshes n x 2 (model inside a process) and 2 x n (model across processes).
  const hybrid_runner hybrid(world, 2);
  check_backend<std::int32_t>(mesh2{n, 2}, hybrid);
  check_backend<float>(mesh2{n, 2}, hybrid);
  check_backend<std::int64_t>(mesh2{2, n}, hybrid);
  check_backend<double>(mesh2{2, n}, hybrid);
}

TEST_CASE("mpi_runner: a mesh of the wrong size is rejected with the fix", "[mpi][exec]") {
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const mpi_runner per_rank{world};
  mesh2 m{static_cast<std::size_t>(world.size()), 3};
  try {
    spmd(m, [] {}, per_rank);
    FAIL("must throw");
  } catch (const comm_argument_error& e) {
    CHECK(std::string(e.what()).find("hybrid_runner for several devices (threads) per rank") != std::string::npos);
  }
}

TEST_CASE("spmd on MPI: a device that throws is reported with its id on its process", "[mpi][exec]") {
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const hybrid_runner hybrid(world, 2);
  mesh2 m{static_cast<std::size_t>(world.size()), 2};
  try {
    // Thread 1 of every process throws before any collective; thread 0 waits for it in the local
    // part of a psum over "model" (inside the process) and is released by the abort.
    spmd(
        m,
        [&] {
          if (axis_index<"model">() == 1) throw std::runtime_error("device failed on purpose");
          auto x = fill_block<local_tensor<float, 1, mesh2, D | M>>(m, {2});
          (void)psum<"model">(x);
        },
        hybrid);
    FAIL("must throw device_error");
  } catch (const device_error& e) {
    CHECK(e.device() == static_cast<std::size_t>(world.rank()) * 2 + 1);
    CHECK(std::string(e.what()).find("device failed on purpose") != std::string::npos);
  }
}

// Blame across processes (issue 10): the last device never arrives at a psum over every device.
// Every device of every process gets comm_timeout (not comm_aborted) naming that device by its
// global id, and device_error::device() is that device on every process, not a waiter.
TEST_CASE("spmd on hybrid_runner: a device that never arrives is blamed on every process", "[mpi][exec][faults]") {
  mpi_comm_options o;
  o.timeout = std::chrono::seconds(1);
  auto world = mpi_communicator(MPI_COMM_WORLD, o);
  const hybrid_runner hybrid(world, 2, {.timeout = std::chrono::seconds(1)});
  const std::size_t n = static_cast<std::size_t>(world.size()) * 2;
  const int last = world.size() - 1;
  mesh2 m{static_cast<std::size_t>(world.size()), 2};
  // The absent device stays away until every other process has been released (each sends it a
  // note), so the test checks the order of events, not the clock: a loaded machine that runs the
  // processes slowly cannot make it fail, only take longer (a 60 s bound ends a broken run).
  MPI_Comm released = MPI_COMM_NULL;
  MPI_Comm_dup(MPI_COMM_WORLD, &released);
  bool all_released = false;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spmd(
        m,
        [&] {
          if (device_index() == n - 1) {
            int notes = 0;
            const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
            while (notes < last && std::chrono::steady_clock::now() < give_up) {
              int found = 0;
              MPI_Iprobe(MPI_ANY_SOURCE, 0, released, &found, MPI_STATUS_IGNORE);
              if (found) {
                int note = 0;
                MPI_Recv(&note, 1, MPI_INT, MPI_ANY_SOURCE, 0, released, MPI_STATUS_IGNORE);
                ++notes;
              } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(5));
              }
            }
            all_released = notes == last;
            return;
          }
          auto x = fill_block<local_tensor<float, 1, mesh2, D | M>>(m, {2});
          (void)psum<"data", "model">(x);
        },
        hybrid);
    FAIL("must throw device_error");
  } catch (const device_error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (world.rank() != last) {
      int note = 1;
      MPI_Send(&note, 1, MPI_INT, last, 0, released);
    }
    const std::string w = e.what();
    INFO(w);
    CHECK(e.device() == n - 1);
    CHECK_THROWS_AS(e.rethrow_cause(), comm_timeout);
    CHECK(w.find("hybrid device(s) " + std::to_string(n - 1) + " never arrived") != std::string::npos);
    CHECK(w.find("all_reduce timed out") != std::string::npos);
    CHECK(w.find("(step") == std::string::npos);  // never an internal step
    // Released by the 1 s timeouts (generous bound: not the default 20 s).
    if (world.rank() != last) CHECK(s < 15.0);
  }
  // Every other process was released while the absent device was still away.
  if (world.rank() == last) CHECK(all_released);
  MPI_Barrier(MPI_COMM_WORLD);
  MPI_Comm_free(&released);
}

// Fault propagation with one rank per process (issue 10): the last rank throws before a psum
// that every other rank waits in; the others must be released by the abort channel well before
// the 20 s timeout, with device_error naming the failed rank and its message, not themselves.
TEST_CASE("spmd on mpi_runner: a rank that throws releases every other rank at once, naming it", "[mpi][exec][faults]") {
  using mesh1 = mesh<axis<"x">>;
  mpi_comm_options o;
  o.timeout = std::chrono::seconds(20);
  auto c = mpi_communicator(MPI_COMM_WORLD, o);
  const int n = c.size();
  const mpi_runner backend{c};
  const mesh1 m{static_cast<std::size_t>(n)};
  const auto t0 = std::chrono::steady_clock::now();
  try {
    spmd(
        m,
        [&] {
          if (device_index() == static_cast<std::size_t>(n - 1)) throw std::runtime_error("rank gives up on purpose");
          local_tensor<float, 1, mesh1, mesh1::all_axes> x({4}, m, device_index());
          (void)psum<"x">(x);
        },
        backend);
    FAIL("must throw device_error");
  } catch (const device_error& e) {
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const std::string w = e.what();
    INFO(w);
    CHECK(e.device() == static_cast<std::size_t>(n - 1));
    CHECK(w.find("rank gives up on purpose") != std::string::npos);
    if (c.rank() != n - 1) {
      CHECK(w.find("MPI rank " + std::to_string(n - 1) + " of " + std::to_string(n) + " failed") != std::string::npos);
      CHECK_THROWS_AS(e.rethrow_cause(), comm_aborted);
      CHECK(s < 10.0);  // released by the channel, not by the 20 s timeout
    }
  }
  CHECK(c.root_cause_rank() == n - 1);
  // Sticky on every rank (a released rank left its fingerprint exchange pending on it): refused.
  float y = 1.0f;
  try {
    c.all_reduce(std::span(&y, 1), reduce_op::sum);
    FAIL("a failed communicator must refuse");
  } catch (const comm_aborted& e) {
    CHECK(std::string(e.what()).find("rank gives up on purpose") != std::string::npos);
    CHECK(std::string(e.what()).find("refused all_reduce") != std::string::npos);
  }
  // A new communicator over the same ranks works.
  auto d = mpi_communicator(MPI_COMM_WORLD, o);
  d.all_reduce(std::span(&y, 1), reduce_op::sum);
  CHECK(y == static_cast<float>(n));
}

// A split of a failed communicator names the failed rank in its own numbering (or -1 when the
// failed rank is not a member).
TEST_CASE("mpi_communicator::fail: splits share the failure and name the rank in their numbering", "[mpi][faults]") {
  mpi_comm_options o;
  o.timeout = std::chrono::seconds(20);
  auto c = mpi_communicator(MPI_COMM_WORLD, o);
  const int n = c.size();
  // Reversed order: world rank r is rank n-1-r of the split.
  auto rev = c.split(0, n - 1 - c.rank());
  auto odd = c.split(c.rank() % 2, c.rank());
  CHECK(c.root_cause_rank() == -1);
  const auto t0 = std::chrono::steady_clock::now();
  if (c.rank() == 1) {
    c.fail("rank 1 fails on purpose");
  } else {
    float x = 1.0f;
    try {
      rev.all_reduce(std::span(&x, 1), reduce_op::sum);  // rank 1 never arrives
      FAIL("must be released");
    } catch (const comm_aborted& e) {
      CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < 10.0);
      CHECK(std::string(e.what()).find("MPI rank 1 of " + std::to_string(n) + " failed: rank 1 fails on purpose") !=
            std::string::npos);
    }
  }
  CHECK(c.root_cause_rank() == 1);
  CHECK(rev.root_cause_rank() == n - 2);
  CHECK(odd.root_cause_rank() == (c.rank() % 2 == 1 ? 0 : -1));
  CHECK_THROWS_AS(odd.barrier(), comm_aborted);
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST_CASE("shard_map on mpi_runner and hybrid_runner: each process's output blocks equal the thread run", "[mpi][exec]") {
  using mesh1 = mesh<axis<"x">>;
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const auto n = static_cast<std::size_t>(world.size());
  auto check = [&](std::size_t devices, const auto& backend) {
    const mesh1 m{devices};
    std::vector<float> host(4 * devices);
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i % 13) - 4.0f;
    auto x = from_host(named_sharding<mesh1, P<"x">>{m}, std::array<std::size_t, 1>{4 * devices}, host);
    auto fn = [](auto b) {
      auto total = psum<"x">(b);  // replicated (4,): the sum of every device's block
      return std::make_tuple(total, all_gather<"x", 0>(b));
    };
    auto [ref_sum, ref_all] = shard_map(fn, m, P<"x">{}, specs<P<>, P<>>{})(x);
    auto [sum, all] = shard_map(fn, m, P<"x">{}, specs<P<>, P<>>{}, backend)(x);
    for (std::size_t dev : backend.local_devices(devices)) {
      INFO("device " << dev);
      REQUIRE(sum.is_local(dev));
      REQUIRE(all.is_local(dev));
      for (std::size_t i = 0; i < 4; ++i) {
        float expect = 0;
        for (std::size_t d = 0; d < devices; ++d) expect += host[d * 4 + i];
        CHECK(sum.local(dev)(i) == expect);
        CHECK(sum.local(dev)(i) == ref_sum.local(dev)(i));
      }
      for (std::size_t i = 0; i < 4 * devices; ++i) CHECK(all.local(dev)(i) == ref_all.local(dev)(i));
    }
  };
  check(n, mpi_runner{world});
  check(2 * n, hybrid_runner(world, 2));
}

// Persistent hybrid threads (exec/mpi_runner.hpp): every call of a hybrid_runner runs local
// thread t on the same thread (0 on the caller), and the process-wide hybrid threads (the default
// runner's, and the deprecated hybrid_backend's) persist too; the psum across processes gives the
// sum over every device of every process.
TEST_CASE("hybrid_runner, own or on the process-wide threads, runs every call on the same device threads", "[mpi][exec][runner]") {
  using mesh1 = mesh<axis<"x">>;
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const auto P = static_cast<std::size_t>(world.size());
  constexpr int T = 2;
  const mesh1 m{P * T};
  const double n = static_cast<double>(m.size());
  auto probe = [&](const auto& runner) {
    std::vector<std::thread::id> ids(m.size());
    const auto sums = spmd(
        m,
        [&] {
          ids[device_index()] = std::this_thread::get_id();
          local_tensor<double, 1, mesh1, mesh1::all_axes> x({1}, m, device_index());
          x.data()[0] = static_cast<double>(device_index() + 1);
          return psum<"x">(x).data()[0];
        },
        runner);
    for (std::size_t d : runner.local_devices(m.size())) CHECK(sums[d] == n * (n + 1) / 2);
    return ids;
  };
  const std::size_t first = static_cast<std::size_t>(world.rank()) * T;
  for (int which = 0; which < 2; ++which) {
    INFO((which == 0 ? "own threads" : "process-wide threads"));
    const hybrid_runner runner =
        which == 0 ? hybrid_runner(world, T) : hybrid_runner(meshlib::exec::detail::process_wide_threads, world, T);
    CHECK((runner.workers == nullptr) == (which == 1));
    const auto a = probe(runner), b = probe(runner), c = probe(runner);
    CHECK(a[first] == std::this_thread::get_id());  // local thread 0 is the caller
    for (std::size_t d = first; d < first + T; ++d) {
      CHECK(a[d] == b[d]);
      CHECK(a[d] == c[d]);
    }
    CHECK(a[first + 1] != a[first]);
  }
}

// The default runner (exec/default_runner.hpp): once mpi::initialize has started P > 1
// processes, spmd and shard_map without a runner run n / P devices in each process.
TEST_CASE("after mpi::initialize the default runner spreads a mesh over the processes", "[mpi][exec][runner]") {
  using mesh1 = mesh<axis<"x">>;
  int r = 0, p = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &r);
  MPI_Comm_size(MPI_COMM_WORLD, &p);
  const auto rank = static_cast<std::size_t>(r), procs = static_cast<std::size_t>(p);
  const mesh1 m{2 * procs};
  const double n = static_cast<double>(m.size());
  auto program = [&] {
    local_tensor<double, 1, mesh1, mesh1::all_axes> x({1}, m, device_index());
    x.data()[0] = static_cast<double>(device_index() + 1);
    return std::pair{device_index(), psum<"x">(x).data()[0]};
  };
  // Before: every device in this process.
  CHECK(default_runner{}.local_devices(m.size()) == thread_runner{}.local_devices(m.size()));
  {
    meshlib::mpi::options o;
    o.runtime.local_device_count = 2;
    meshlib::mpi::guard run(MPI_COMM_WORLD, o);
    const std::vector<std::size_t> mine{2 * rank, 2 * rank + 1};
    CHECK(default_runner{}.local_devices(m.size()) == mine);
    const auto got = spmd(m, program);
    REQUIRE(got.size() == m.size());
    for (std::size_t d = 0; d < m.size(); ++d) {
      INFO("device " << d);
      if (d / 2 == rank) {
        CHECK(got[d].first == d);
        CHECK(got[d].second == n * (n + 1) / 2);  // every process's devices took part
      } else {
        CHECK(got[d].first == 0);  // run by another process: value-initialised here
        CHECK(got[d].second == 0.0);
      }
    }
    // shard_map: this process holds its own blocks of the replicated sum.
    std::vector<float> host(2 * m.size());
    for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<float>(i);
    auto x = from_host(named_sharding<mesh1, P<"x">>{m}, std::array<std::size_t, 1>{host.size()}, host);
    auto total = shard_map([](auto b) { return psum<"x">(b); }, m, P<"x">{}, P<>{})(x);
    for (std::size_t d = 0; d < m.size(); ++d) CHECK(total.is_local(d) == (d / 2 == rank));
    for (std::size_t d : mine)
      for (std::size_t i = 0; i < 2; ++i) {
        float expect = 0;
        for (std::size_t e = 0; e < m.size(); ++e) expect += host[2 * e + i];
        CHECK(total.local(d)(i) == expect);
      }
    // reshard without a runner runs on the default runner too: each process runs the devices whose
    // blocks it holds, and the blocks it lacks come from the other processes. P<"x"> -> P<> gathers
    // the whole array into every device; P<> -> P<"x"> keeps each device's own slice.
    auto full = reshard<P<>>(x);
    for (std::size_t d = 0; d < m.size(); ++d) CHECK(full.is_local(d) == (d / 2 == rank));
    for (std::size_t d : mine) {
      INFO("device " << d);
      CHECK(std::vector<float>(full.local(d).data(), full.local(d).data() + host.size()) == host);
    }
    auto back = reshard(full, named_sharding<mesh1, P<"x">>{m});
    for (std::size_t d : mine) {
      INFO("device " << d);
      CHECK(back.local(d)(0) == host[2 * d]);
      CHECK(back.local(d)(1) == host[2 * d + 1]);
    }
    // A nested spmd inside a device runs on this process's threads: the other processes do not make it.
    const auto nested = spmd(m, [] { return spmd(mesh1{3}, [] { return device_index(); }); });
    for (std::size_t d : mine) CHECK(nested[d] == std::vector<std::size_t>{0, 1, 2});
    // A mesh that does not split evenly over the processes is refused, with the fix.
    const mesh1 odd{2 * procs + 1};
    try {
      spmd(odd, [] {});
      FAIL("must throw");
    } catch (const mesh_error& e) {
      CHECK(std::string(e.what()) == "meshlib: spmd / shard_map on the default runner: the run has " + std::to_string(procs) +
                                         " processes (communicator), which run a mesh's devices in equal shares, but "
                                         "the mesh has " + std::to_string(2 * procs + 1) + " devices; use a multiple of " +
                                         std::to_string(procs) + " (distributed::device_count() is " +
                                         std::to_string(2 * procs) +
                                         "), or pass a runner explicitly (thread_runner{} runs every device in this "
                                         "process)");
    }
    // An explicit thread runner still runs every device here.
    const auto local = spmd(m, [] { return device_index(); }, thread_runner{});
    for (std::size_t d = 0; d < m.size(); ++d) CHECK(local[d] == d);
  }
  // After: threads again.
  const auto after = spmd(m, [] { return device_index(); });
  for (std::size_t d = 0; d < m.size(); ++d) CHECK(after[d] == d);
}

// The deprecated names (one release): mpi_backend is mpi_runner; hybrid_backend a hybrid_runner on
// the process-wide hybrid threads, as before the rename.
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
static_assert(std::is_same_v<mpi_backend, mpi_runner>);
static_assert(std::is_base_of_v<hybrid_runner, hybrid_backend>);
TEST_CASE("the deprecated hybrid_backend runs on the process-wide hybrid threads", "[mpi][exec][runner]") {
  auto world = mpi_communicator(MPI_COMM_WORLD);
  const hybrid_backend old{world, 2};
  CHECK(old.workers == nullptr);
  CHECK(old.threads == 2);
  const auto P = static_cast<std::size_t>(world.size());
  const mesh<axis<"x">> m{P * 2};
  const auto ids = spmd(m, [] { return device_index(); }, old);
  for (std::size_t d : old.local_devices(m.size())) CHECK(ids[d] == d);
}
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

}  // namespace MESHLIB_TEST_UNIT

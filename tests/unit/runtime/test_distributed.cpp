// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// distributed::initialize / shutdown / guard, the process queries and global device order, the
// Kokkos ownership rule, and the start-up consistency checks over a scripted transport that plays
// the other processes.
#include <meshlib/runtime.hpp>

#include <functional>
#include <string>
#include <vector>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

namespace dist = meshlib::distributed;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

/// A transport whose other processes answer what `others(call, mine, rank)` says.
class scripted_exchange final : public dist::process_exchange {
 public:
  using script = std::function<std::string(int call, std::string_view mine, std::size_t rank)>;
  scripted_exchange(std::size_t rank, std::size_t size, script s) : rank_(rank), size_(size), script_(std::move(s)) {}
  std::size_t rank() const override { return rank_; }
  std::size_t size() const override { return size_; }
  std::vector<std::string> all_gather(std::string_view mine) override {
    std::vector<std::string> out;
    for (std::size_t r = 0; r < size_; ++r) out.push_back(r == rank_ ? std::string(mine) : script_(calls_, mine, r));
    ++calls_;
    return out;
  }
  [[noreturn]] void abort(int, std::string_view) override { throw std::logic_error("abort called"); }
  int calls() const { return calls_; }

 private:
  std::size_t rank_, size_;
  script script_;
  int calls_ = 0;
};

/// Every other process agrees: the same value, except for the process-index exchange (call 1).
dist::options agreeing(std::size_t rank, std::size_t size) {
  dist::options o;
  o.env = dist::map_env({});
  o.exchange = std::make_shared<scripted_exchange>(rank, size, [](int call, std::string_view mine, std::size_t r) {
    return call == 1 ? std::to_string(r) : std::string(mine);
  });
  return o;
}

/// Options that read an empty environment (the test's own may hold launcher variables).
dist::options empty_env() {
  dist::options o;
  o.env = dist::map_env({});
  return o;
}
dist::options no_kokkos() {
  auto o = empty_env();
  o.initialize_kokkos = false;
  return o;
}

struct reset_after {
  ~reset_after() { dist::shutdown(); }
};

}  // namespace

TEST_CASE("before initialize the queries answer for one process", "[runtime][distributed]") {
  dist::shutdown();
  CHECK(!dist::is_initialized());
  CHECK(dist::process_index() == 0);
  CHECK(dist::process_count() == 1);
  CHECK(dist::local_device_count() == 1);
  CHECK(dist::devices() == std::vector<std::size_t>{0});
  CHECK(dist::local_devices() == std::vector<std::size_t>{0});
}

TEST_CASE("explicit arguments set the process and the process-major device order", "[runtime][distributed]") {
  reset_after reset;
  for (std::size_t p : {1u, 2u, 3u}) {
    for (std::size_t t : {1u, 2u, 4u}) {
      for (std::size_t i = 0; i < p; ++i) {
        dist::shutdown();
        dist::options o;
        o.process_id = i;
        o.num_processes = p;
        o.local_device_count = t;
        o.env = dist::map_env({});
        dist::initialize(o);
        CHECK(dist::is_initialized());
        CHECK(dist::process_index() == i);
        CHECK(dist::process_count() == p);
        CHECK(dist::device_count() == p * t);
        CHECK(dist::devices().size() == p * t);
        std::vector<std::size_t> expected;
        for (std::size_t k = 0; k < t; ++k) expected.push_back(i * t + k);
        CHECK(dist::local_devices() == expected);
        for (std::size_t d = 0; d < p * t; ++d) {
          CHECK(dist::process_of(d) == d / t);
          CHECK(dist::is_local(d) == (d / t == i));
        }
      }
    }
  }
}

TEST_CASE("the local device count comes from the environment when not given", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  dist::options o;
  o.env = dist::map_env({{"MESHLIB_LOCAL_DEVICE_COUNT", "4"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}});
  dist::initialize(o);
  CHECK(dist::launch().source == dist::launcher::torchrun);
  CHECK(dist::local_devices() == std::vector<std::size_t>{4, 5, 6, 7});
  dist::shutdown();
  o.local_device_count = 0;
  REQUIRE_THROWS_AS(dist::initialize(o), meshlib::distributed_error);
  CHECK(!dist::is_initialized());
}

TEST_CASE("initialize is idempotent and refuses other arguments", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  dist::options o;
  o.process_id = 1;
  o.num_processes = 2;
  o.local_device_count = 2;
  o.env = dist::map_env({});
  dist::initialize(o);
  dist::initialize(o);  // same values: nothing happens
  CHECK(dist::process_index() == 1);
  o.process_id = 0;
  try {
    dist::initialize(o);
    FAIL("a second initialize with another process id must throw");
  } catch (const meshlib::distributed_error& e) {
    CHECK(has(e.what(), "already called as process 1 of 2"));
    CHECK(has(e.what(), "now called as process 0 of 2"));
  }
  CHECK(dist::process_index() == 1);  // unchanged
  dist::shutdown();
  dist::shutdown();  // a second shutdown does nothing
  CHECK(!dist::is_initialized());
  dist::initialize(o);  // after shutdown, new values are fine
  CHECK(dist::process_index() == 0);
}

TEST_CASE("the guard shuts down only what it initialised", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  {
    dist::options o;
    o.env = dist::map_env({{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "3"}});
    dist::guard g(o);
    CHECK(dist::process_index() == 2);
    {
      dist::guard inner(o);  // already initialised: the inner guard owns nothing
    }
    CHECK(dist::is_initialized());
  }
  CHECK(!dist::is_initialized());
}

TEST_CASE("Kokkos is initialised only when it is not, and finalised only by its initialiser", "[runtime][kokkos]") {
  reset_after reset;
  dist::shutdown();
  // The Catch2 main owns Kokkos: initialize must leave it alone.
  REQUIRE(Kokkos::is_initialized());
  {
    dist::guard g(empty_env());
    CHECK(Kokkos::is_initialized());
  }
  CHECK(Kokkos::is_initialized());

  // Fake hooks show the rule without touching the real Kokkos (which cannot start twice).
  auto& h = dist::detail::hooks();
  const auto saved = h;
  static int starts = 0, stops = 0;
  static bool already = false;
  starts = stops = 0;
  h.start_kokkos = [] {
    ++starts;
    return !already;
  };
  h.stop_kokkos = [] { ++stops; };
  already = true;
  dist::initialize(empty_env());
  dist::shutdown();
  CHECK(starts == 1);
  CHECK(stops == 0);  // someone else's Kokkos
  already = false;
  dist::initialize(empty_env());
  dist::shutdown();
  CHECK(starts == 2);
  CHECK(stops == 1);  // ours
  // Kokkos 3.x cannot start again after finalize: a clear error instead.
  try {
    dist::initialize(empty_env());
    FAIL("initialise after finalize must throw");
  } catch (const meshlib::distributed_error& e) {
    CHECK(has(e.what(), "cannot be initialised twice"));
  }
  // Opting out of Kokkos still works.
  dist::initialize(no_kokkos());
  CHECK(dist::is_initialized());
  dist::shutdown();
  CHECK(starts == 2);
  h = saved;
  dist::detail::state().finalized_kokkos = false;
}

TEST_CASE("a transport decides the process and the start-up checks pass when all agree", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  auto o = agreeing(2, 4);
  o.local_device_count = 2;
  dist::initialize(o);
  CHECK(dist::launch().source == dist::launcher::communicator);
  CHECK(dist::process_index() == 2);
  CHECK(dist::process_count() == 4);
  CHECK(static_cast<scripted_exchange&>(*o.exchange).calls() == 2);

  using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
  const auto m = dist::make_global_mesh<meshlib::axis<"data">, meshlib::axis<"model">>(4, 2);
  CHECK(m == mesh_t{4, 2});
  const auto coords = dist::local_coords(m);
  REQUIRE(coords.size() == 2);
  CHECK(coords[0] == mesh_t::coord_type{2, 0});  // devices 4 and 5
  CHECK(coords[1] == mesh_t::coord_type{2, 1});
  REQUIRE_THROWS_AS(dist::check_mesh(mesh_t{2, 2}), meshlib::mesh_error);
}

TEST_CASE("processes that disagree are reported with both values", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  // Process 3 of 4 was started with another local device count.
  dist::options o;
  o.env = dist::map_env({});
  o.local_device_count = 2;
  o.exchange = std::make_shared<scripted_exchange>(0, 4, [](int, std::string_view mine, std::size_t r) {
    return r == 3 ? std::string("4 processes x 1 local devices") : std::string(mine);
  });
  try {
    dist::initialize(o);
    FAIL("must throw process_mismatch");
  } catch (const meshlib::process_mismatch& e) {
    CHECK(has(e.what(), "processes 0,1,2 have 4 processes x 2 local devices"));
    CHECK(has(e.what(), "process 3 has 4 processes x 1 local devices"));
  }
  CHECK(!dist::is_initialized());

  // Two processes claim the same index.
  o.exchange = std::make_shared<scripted_exchange>(1, 3, [](int call, std::string_view mine, std::size_t r) {
    return call == 1 ? std::to_string(r == 2 ? 1 : r) : std::string(mine);
  });
  try {
    dist::initialize(o);
    FAIL("must throw process_mismatch");
  } catch (const meshlib::process_mismatch& e) {
    CHECK(has(e.what(), "ranks 1 and 2 both claim process index 1"));
  }

  // A mesh built differently on one process (another axis name).
  o = agreeing(1, 2);
  o.local_device_count = 2;
  o.exchange = std::make_shared<scripted_exchange>(1, 2, [](int call, std::string_view mine, std::size_t r) {
    if (call == 1) return std::to_string(r);
    if (call == 2) return std::string("mesh{'batch': 2, 'model': 2}");
    return std::string(mine);
  });
  dist::initialize(o);
  try {
    (void)dist::make_global_mesh<meshlib::axis<"data">, meshlib::axis<"model">>(2, 2);
    FAIL("must throw process_mismatch");
  } catch (const meshlib::process_mismatch& e) {
    CHECK(has(e.what(), "disagree about the mesh"));
    CHECK(has(e.what(), "process 0 has mesh{'batch': 2, 'model': 2}"));
    CHECK(has(e.what(), "process 1 has mesh{'data': 2, 'model': 2}"));
  }
}

TEST_CASE("a transport given after an environment initialisation is adopted and checked", "[runtime][distributed]") {
  reset_after reset;
  dist::shutdown();
  dist::options env_only;
  env_only.env = dist::map_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"}});
  dist::initialize(env_only);
  CHECK(dist::launch().source == dist::launcher::openmpi);
  // The same process, now with a transport whose other process disagrees on the device count.
  auto o = env_only;
  o.exchange = std::make_shared<scripted_exchange>(1, 2, [](int, std::string_view, std::size_t) {
    return std::string("2 processes x 4 local devices");
  });
  REQUIRE_THROWS_AS(dist::initialize(o), meshlib::process_mismatch);
  // A transport that agrees is kept: mesh checks now reach the other process.
  auto good = agreeing(1, 2);
  good.env = env_only.env;
  dist::initialize(good);
  CHECK(dist::launch().source == dist::launcher::openmpi);  // the first initialisation stands
  CHECK(dist::exchange() == good.exchange);
}

}  // namespace MESHLIB_TEST_UNIT

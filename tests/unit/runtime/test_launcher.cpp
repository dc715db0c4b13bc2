// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Launcher detection: each launcher's variables, agreement and contradiction between sources, and
// malformed values. The environment is a map, so nothing here depends on how the test was run.
#include <meshlib/runtime/launcher.hpp>

#include <sstream>
#include <string>

#include "meshlib_catch.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib::distributed;

namespace {

// what() of the distributed_error `f` throws, or "" when it throws nothing.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const meshlib::distributed_error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace

TEST_CASE("no launcher and no arguments is one process", "[runtime][launcher]") {
  const auto l = detect_launch(map_env({}));
  CHECK(l.process_index == 0);
  CHECK(l.process_count == 1);
  CHECK(!l.local_rank);
  CHECK(l.source == launcher::none);
}

TEST_CASE("each launcher's variables are read", "[runtime][launcher]") {
  struct row {
    launcher source;
    const char *idx, *cnt, *loc;
  };
  const row rows[] = {
      {launcher::meshlib_env, "MESHLIB_PROCESS_ID", "MESHLIB_PROCESS_COUNT", "MESHLIB_LOCAL_RANK"},
      {launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
      {launcher::mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
      {launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
      {launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
  };
  for (const auto& r : rows) {
    for (std::size_t count : {1u, 2u, 5u, 64u}) {
      for (std::size_t idx = 0; idx < count; idx += (count > 8 ? 13 : 1)) {
        const auto l = detect_launch(map_env({{r.idx, std::to_string(idx)}, {r.cnt, std::to_string(count)},
                                              {r.loc, std::to_string(idx % 4)}}));
        CHECK(l.source == r.source);
        CHECK(l.process_index == idx);
        CHECK(l.process_count == count);
        REQUIRE(l.local_rank);
        CHECK(*l.local_rank == idx % 4);
      }
    }
    // Without the local-rank variable there is no local rank.
    CHECK(!detect_launch(map_env({{r.idx, "1"}, {r.cnt, "2"}})).local_rank);
  }
}

TEST_CASE("explicit arguments win and must agree with a launcher", "[runtime][launcher]") {
  auto l = detect_launch(map_env({}), {2, 3});
  CHECK(l.source == launcher::explicit_arguments);
  CHECK(l.process_index == 2);
  CHECK(l.process_count == 3);

  l = detect_launch(map_env({{"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "3"},
                             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}}),
                    {2, 3});
  CHECK(l.source == launcher::explicit_arguments);
  REQUIRE(l.local_rank);  // the launcher still supplies the local rank
  CHECK(*l.local_rank == 0);

  const auto e = error_of([] {
    (void)detect_launch(map_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "3"}}), {2, 3});
  });
  CHECK(has(e, "meshlib: contradictory launch information"));
  CHECK(has(e, "process_id=2"));
  CHECK(has(e, "OMPI_COMM_WORLD_RANK=1"));

  CHECK(has(error_of([] { (void)detect_launch(map_env({}), {std::size_t{1}, std::nullopt}); }), "only one of"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({}), {3, 3}); }), "outside its world"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({}), {0, 0}); }), "outside its world"));
}

TEST_CASE("launchers that agree are accepted, the first in priority order decides", "[runtime][launcher]") {
  // srun --mpi=pmi2 of an MPICH program: PMI and Slurm both describe the process.
  auto l = detect_launch(map_env({{"PMI_RANK", "3"}, {"PMI_SIZE", "4"}, {"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"},
                                  {"SLURM_LOCALID", "1"}}));
  CHECK(l.source == launcher::mpich);
  CHECK(l.process_index == 3);
  REQUIRE(l.local_rank);
  CHECK(*l.local_rank == 1);  // from Slurm, which covers the same processes
  // OpenMPI and torchrun variables that agree.
  l = detect_launch(map_env({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_RANK", "1"},
                             {"OMPI_COMM_WORLD_SIZE", "2"}}));
  CHECK(l.source == launcher::openmpi);
}

TEST_CASE("contradictory launchers are an error naming both", "[runtime][launcher]") {
  auto e = error_of([] {
    (void)detect_launch(
        map_env({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "4"}, {"RANK", "2"}, {"WORLD_SIZE", "4"}}));
  });
  CHECK(has(e, "contradictory"));
  CHECK(has(e, "OpenMPI (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4): process 1 of 4"));
  CHECK(has(e, "torchrun (RANK=2, WORLD_SIZE=4): process 2 of 4"));

  e = error_of([] {
    (void)detect_launch(map_env({{"PMI_RANK", "0"}, {"PMI_SIZE", "2"}, {"MESHLIB_PROCESS_ID", "0"},
                                 {"MESHLIB_PROCESS_COUNT", "3"}}));
  });
  CHECK(has(e, "MESHLIB_PROCESS_COUNT=3"));
  CHECK(has(e, "PMI_SIZE=2"));

  // Slurm with as many tasks as processes must agree on the index ...
  e = error_of([] {
    (void)detect_launch(
        map_env({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "4"}, {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"}}));
  });
  CHECK(has(e, "SLURM_PROCID=0"));
  CHECK(has(e, "OMPI_COMM_WORLD_RANK=2"));
  // ... and can never have more tasks than there are processes.
  CHECK(has(error_of([] {
              (void)detect_launch(map_env(
                  {{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"RANK", "1"}, {"WORLD_SIZE", "4"}}));
            }),
            "never fewer processes than tasks"));
}

TEST_CASE("an outer Slurm step may start several processes per task", "[runtime][launcher]") {
  // mpirun inside an sbatch allocation: Slurm's task is the node, OpenMPI's rank is the process.
  const auto l = detect_launch(map_env({{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "2"}, {"SLURM_LOCALID", "0"},
                                        {"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}));
  CHECK(l.source == launcher::openmpi);
  CHECK(l.process_index == 5);
  CHECK(l.process_count == 8);
  CHECK(*l.local_rank == 1);
}

TEST_CASE("malformed launcher variables are errors naming the variable", "[runtime][launcher]") {
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"PMI_RANK", "1"}})); }), "PMI_SIZE is not set"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"RANK", "one"}, {"WORLD_SIZE", "2"}})); }),
            "RANK='one' is not a non-negative decimal number"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"RANK", "-1"}, {"WORLD_SIZE", "2"}})); }), "RANK='-1'"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"RANK", "1"}, {"WORLD_SIZE", "2x"}})); }), "WORLD_SIZE='2x'"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}})); }),
            "outside its world"));
  CHECK(has(error_of([] { (void)detect_launch(map_env({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"LOCAL_RANK", ""}})); }),
            "LOCAL_RANK=''"));
  // Surrounding blanks (as some job scripts leave them) are accepted.
  CHECK(detect_launch(map_env({{"RANK", " 1\n"}, {"WORLD_SIZE", "2 "}})).process_index == 1);
}

TEST_CASE("an adopted communicator decides the index and count", "[runtime][launcher]") {
  // A sub-communicator's ranks differ from the launcher's world: not a contradiction.
  auto l = detect_launch(map_env({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}}),
                         {}, std::pair<std::size_t, std::size_t>{1, 2});
  CHECK(l.source == launcher::communicator);
  CHECK(l.process_index == 1);
  CHECK(l.process_count == 2);
  CHECK(*l.local_rank == 1);
  // Explicit arguments must still agree with it.
  CHECK(has(error_of([] {
              (void)detect_launch(map_env({}), {0, 2}, std::pair<std::size_t, std::size_t>{1, 2});
            }),
            "the adopted communicator (rank 1, size 2)"));
}

TEST_CASE("launch_info prints its source", "[runtime][launcher]") {
  std::ostringstream os;
  os << launch_info{1, 4, 1, launcher::openmpi};
  CHECK(os.str() == "process 1 of 4 (OpenMPI, local rank 1)");
}

}  // namespace MESHLIB_TEST_UNIT

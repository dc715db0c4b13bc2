// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief One process per GPU without MPI: `nccl::connect_from_environment()` reads the process
/// index and count from the launcher's environment (`detect_launch`: meshlib's variables, OpenMPI,
/// MPICH/PMI, torchrun's `RANK`/`WORLD_SIZE`, Slurm), picks the GPU of the local rank, and lets
/// NCCL's own bootstrap connect the processes: every process derives the same unique id from
/// `NCCL_COMM_ID=host:port` (process 0 listens there). Where `NCCL_COMM_ID` is unset, it is taken
/// from torchrun-style `MASTER_ADDR` and `MASTER_PORT` as `MASTER_ADDR:(MASTER_PORT + 1)` (the
/// launcher's own store holds `MASTER_PORT`). No meshlib network layer is involved.
///
/// @code
/// // torchrun --nproc-per-node 8 ./train   (or srun, or mpirun without linking MPI)
/// meshlib::nccl_communicator world = meshlib::nccl::connect_from_environment();
/// @endcode

#if MESHLIB_ENABLE_NCCL

#include <cstdlib>
#include <string>

#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/runtime/errors.hpp"
#include "meshlib/runtime/launcher.hpp"

namespace meshlib::nccl {

using distributed::env_source;
using distributed::launch_info;

/// @brief The `host:port` NCCL's bootstrap uses, from `NCCL_COMM_ID`, else from `MASTER_ADDR` and
/// `MASTER_PORT`; empty for a single process with neither.
/// @throws distributed_error when several processes have neither, or `MASTER_PORT` is not a port.
[[nodiscard]] inline std::string bootstrap_address(const env_source& env, const launch_info& info) {
  if (auto id = env("NCCL_COMM_ID"); id && !id->empty()) return *id;
  const auto addr = env("MASTER_ADDR");
  const auto port = env("MASTER_PORT");
  if (addr && port && !addr->empty()) {
    const std::size_t p = distributed::detail::parse_count("MASTER_PORT", *port);
    if (p == 0 || p >= 65535)
      throw distributed_error("meshlib: MASTER_PORT='" + *port + "' is not a port in [1, 65534]");
    return *addr + ":" + std::to_string(p + 1);
  }
  if (info.process_count > 1)
    throw distributed_error("meshlib: nccl::connect_from_environment: " + std::to_string(info.process_count) +
                            " processes need a rendezvous address for NCCL; set NCCL_COMM_ID=host:port (process 0's "
                            "host, a free port) or MASTER_ADDR and MASTER_PORT, or create the communicator through MPI "
                            "(nccl_communicator_from_mpi)");
  return {};
}

/// @brief This process's NCCL communicator over every process of the run (see the file comment).
/// The GPU is `options.device` if set, else the local rank modulo the GPUs visible.
/// @throws distributed_error for a malformed or contradictory environment; as `nccl_communicator`.
[[nodiscard]] inline nccl_communicator connect_from_environment(nccl_comm_options options = {},
                                                                const env_source& env = distributed::process_env()) {
  const launch_info info = distributed::detect_launch(env);
  const std::string address = bootstrap_address(env, info);
  if (options.device < 0) {
    int count = 0;
    meshlib::experimental::check_cuda(cudaGetDeviceCount(&count), "nccl::connect_from_environment", "cudaGetDeviceCount");
    options.device = static_cast<int>(info.local_rank.value_or(info.process_index % static_cast<std::size_t>(count)) %
                                      static_cast<std::size_t>(count));
  }
  // NCCL reads NCCL_COMM_ID in ncclGetUniqueId and, on rank 0, in ncclCommInitRank.
  if (!address.empty()) ::setenv("NCCL_COMM_ID", address.c_str(), 1);  // NOLINT(concurrency-mt-unsafe): start-up
  const ncclUniqueId id = nccl_communicator::new_unique_id();
  return nccl_communicator(id, static_cast<int>(info.process_count), static_cast<int>(info.process_index), options);
}

}  // namespace meshlib::nccl

#endif

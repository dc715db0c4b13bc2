// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief One process per GPU, launched by MPI: `nccl_communicator_from_mpi(comm)` makes the NCCL
/// communicator of the processes of an `MPI_Comm` (rank 0 makes the unique id, `MPI_Bcast` gives
/// it to all; NCCL rank = MPI rank). Each process takes the GPU of its node-local rank unless
/// `options.device` says otherwise. Needs both `meshlib::mpi` and `meshlib::nccl`.
///
/// @code
/// MPI_Init(&argc, &argv);
/// { auto comm = meshlib::nccl_communicator_from_mpi(MPI_COMM_WORLD); ... }
/// MPI_Finalize();
/// @endcode

#if MESHLIB_ENABLE_NCCL && MESHLIB_ENABLE_MPI

#include <mpi.h>

#include "meshlib/comm/nccl/nccl_communicator.hpp"

namespace meshlib {

/// @brief The NCCL communicator over the processes of `comm` (collective over `comm`).
/// @throws comm_error when MPI is not initialised or an MPI call fails; as `nccl_communicator`.
[[nodiscard]] inline nccl_communicator nccl_communicator_from_mpi(MPI_Comm comm, nccl_comm_options options = {}) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) throw comm_error("meshlib: nccl_communicator_from_mpi needs MPI to be initialised first (MPI_Init)");
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (options.device < 0) {
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS)
      throw comm_error("meshlib: nccl_communicator_from_mpi: MPI_Comm_split_type failed");
    int local = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    int count = 0;
    comm::detail::check_cuda(cudaGetDeviceCount(&count), "nccl_communicator_from_mpi", "cudaGetDeviceCount");
    options.device = local % count;  // count >= 1 here: cudaGetDeviceCount fails without a device
  }
  ncclUniqueId id{};
  if (rank == 0) id = nccl_communicator::new_unique_id();
  if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm) != MPI_SUCCESS)
    throw comm_error("meshlib: nccl_communicator_from_mpi: MPI_Bcast of the NCCL unique id failed");
  return nccl_communicator(id, size, rank, options);
}

}  // namespace meshlib

#endif

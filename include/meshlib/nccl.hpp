// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib on GPUs over NCCL: the NCCL communicator (one GPU per participant, collectives
/// on device buffers ordered on CUDA streams), one process driving several GPUs (`run_on_gpus`),
/// several mesh devices sharing one GPU (`shared_gpu_communicator`, `run_on_shared_gpu`),
/// one process per GPU through MPI (`nccl_communicator_from_mpi`, when `meshlib::mpi` is linked
/// too) or through the launcher's environment (`nccl::connect_from_environment`). Needs the
/// `meshlib::nccl` CMake target, which defines `MESHLIB_ENABLE_NCCL` and links NCCL and CUDA's
/// runtime. See docs/gpu.md.

#if !MESHLIB_ENABLE_NCCL
#error "meshlib: <meshlib/nccl.hpp> needs CUDA and NCCL; link the meshlib::nccl CMake target (it defines MESHLIB_ENABLE_NCCL=1), or configure with CUDA and NCCL found"
#else

#include "meshlib/core.hpp"
#include "meshlib/comm.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/nccl/stream_request.hpp"
#include "meshlib/comm/nccl/detail/stream_state.hpp"
#include "meshlib/comm/nccl/nccl_version.hpp"
#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/comm/nccl/run_on_gpus.hpp"
#include "meshlib/comm/nccl/shared_gpu_communicator.hpp"
#include "meshlib/comm/nccl/mpi_bootstrap.hpp"
#include "meshlib/runtime/nccl_runtime.hpp"

#endif

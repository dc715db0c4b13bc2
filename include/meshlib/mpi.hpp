// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib over MPI: the MPI communicator, hybrid process x thread meshes, and the runtime
/// over MPI (`meshlib::mpi::initialize`). Needs the `meshlib::mpi` CMake target, which defines
/// `MESHLIB_ENABLE_MPI` and links MPI.

#if !MESHLIB_ENABLE_MPI
#error "meshlib: <meshlib/mpi.hpp> needs MPI; link the meshlib::mpi CMake target (it defines MESHLIB_ENABLE_MPI=1), or configure with MPI found"
#else

#include "meshlib/core.hpp"
#include "meshlib/comm.hpp"
#include "meshlib/runtime.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/comm/mpi/fail_guard.hpp"
#include "meshlib/comm/mpi/hybrid_communicator.hpp"
#include "meshlib/exec/mpi_runner.hpp"
#include "meshlib/runtime/mpi_runtime.hpp"

#endif

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The runtime layer: the processes of a run (`distributed::initialize`, launcher
/// detection, process index and count, local devices, global mesh checks), per-process data
/// loading, and Kokkos initialisation. Depends on core and comm; the MPI transport comes in through
/// <meshlib/mpi.hpp>.

#include "meshlib/runtime/errors.hpp"
#include "meshlib/runtime/launcher.hpp"
#include "meshlib/runtime/process_exchange.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/process_data.hpp"
#include "meshlib/runtime/kokkos_runtime.hpp"

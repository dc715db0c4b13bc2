// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib: JAX-style SPMD sharding for C++. Everything that needs no optional dependency.
/// The MPI and NCCL backends come in through <meshlib/mpi.hpp> and <meshlib/nccl.hpp>.

#include "meshlib/version.hpp"
#include "meshlib/config.hpp"
#include "meshlib/core.hpp"
#include "meshlib/comm.hpp"
#include "meshlib/tensor.hpp"
#include "meshlib/collectives.hpp"
#include "meshlib/exec.hpp"
#include "meshlib/runtime.hpp"
#include "meshlib/debug.hpp"
#include "meshlib/separate_compilation.hpp"

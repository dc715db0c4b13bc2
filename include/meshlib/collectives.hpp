// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The collectives layer: the device context (`axis_index`, `axis_size`), backends, typed
/// collectives (`psum`, `pmean`, `pmax`, `pmin`, `all_gather`, `psum_scatter`, `all_to_all`,
/// `ppermute`, `broadcast`, `pvary`), the local relabelling steps (`forget_dims`, `reshape`,
/// `axis_index(x)`) and `reshard`. Depends on core, comm and tensor.

#include "meshlib/collectives/errors.hpp"
#include "meshlib/collectives/workspace.hpp"
#include "meshlib/collectives/comm_stream.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/collective_request.hpp"
#include "meshlib/collectives/axis_group.hpp"
#include "meshlib/collectives/type_rules.hpp"
#include "meshlib/collectives/block_ops.hpp"
#include "meshlib/collectives/reductions.hpp"
#include "meshlib/collectives/gathers.hpp"
#include "meshlib/collectives/permutes.hpp"
#include "meshlib/collectives/relabel.hpp"
#include "meshlib/collectives/reshard_plan.hpp"
#include "meshlib/collectives/reshard.hpp"

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The comm layer: the communicator concept, reduce ops, datatypes, errors, and the
/// always-built thread communicator. Depends on core only.

#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/reduce_op.hpp"
#include "meshlib/comm/request.hpp"
#include "meshlib/comm/communicator.hpp"
#include "meshlib/comm/frontend.hpp"
#include "meshlib/comm/timeout.hpp"
#include "meshlib/comm/thread/options.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"
#include "meshlib/comm/thread/run_on_threads.hpp"
#include "meshlib/comm/axis_communicators.hpp"

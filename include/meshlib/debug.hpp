// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The debug layer: traces (Chrome trace JSON, Kokkos profiling regions, a summary),
/// launch counts, per-device printing, sharding pictures and descriptions, and debug mode's checks (replicas,
/// NaN/Inf, late devices). See docs/debugging.md.

#include "meshlib/debug/errors.hpp"
#include "meshlib/debug/trace.hpp"
#include "meshlib/debug/observe.hpp"
#include "meshlib/debug/trace_region.hpp"
#include "meshlib/debug/launch_counter.hpp"
#include "meshlib/debug/debug_print.hpp"
#include "meshlib/debug/check_replicated.hpp"
#include "meshlib/debug/visualize_sharding.hpp"
#include "meshlib/debug/describe.hpp"

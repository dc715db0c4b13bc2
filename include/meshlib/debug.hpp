// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The debug layer: sharding visualisation (and, later, traces and consistency checks).

#include "meshlib/debug/visualize_sharding.hpp"

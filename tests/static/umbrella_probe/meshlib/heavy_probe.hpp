// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
// For the self-test of check_umbrella_includes.cmake only: a meshlib-like header (its path has
// /meshlib/ in it) that includes two headers the umbrella must not pull in.
#include <fstream>
#include <regex>  // not <iomanip>: Kokkos 4 includes that itself, so it would not be listed here

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The one Catch2 include of meshlib's tests: the same test sources build with Debian's Catch2 2.13
// and with Catch2 v3.
#pragma once
#if defined(MESHLIB_CATCH2_MAJOR) && MESHLIB_CATCH2_MAJOR >= 3
#include <catch2/catch_all.hpp>
#else
#include <catch2/catch.hpp>
#endif

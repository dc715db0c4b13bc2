// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib's mesh-independent runtime, compiled: include this in exactly one `.cpp` of a
/// program whose translation units define `MESHLIB_SEPARATE_COMPILATION` (Boost.Asio's
/// `<boost/asio/impl/src.hpp>`; `<meshlib/separate_compilation.hpp>` says what it holds and why).
///
/// It defines (explicitly instantiates) what the other translation units declare `extern
/// template`: the thread communicator's reduce kernels, step protocol and per-device handle, the
/// trace recorder, the debug observer, the collectives' workspace, the launcher detection. Compile
/// it with the same configuration macros and Kokkos as the rest of the program.
/// `meshlib_enable_fast_build(target RUNTIME)` builds it as the static library `meshlib_runtime`
/// (docs/fast-builds.md). Without
/// `MESHLIB_SEPARATE_COMPILATION` it still compiles (the definitions are then weak duplicates of
/// what every translation unit instantiates), so a program is never short of a definition.
///
/// Example:
/// @code
/// // meshlib_runtime.cpp, compiled with -DMESHLIB_SEPARATE_COMPILATION like the rest of the program
/// #include <meshlib/src.hpp>
/// @endcode

#include "meshlib.hpp"
#include "meshlib/separate_compilation.hpp"

MESHLIB_RUNTIME_INSTANTIATIONS_(template)

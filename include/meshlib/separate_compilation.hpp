// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief With `MESHLIB_SEPARATE_COMPILATION`, the parts of meshlib's runtime that do not depend on
/// a program's meshes are compiled once, in `<meshlib/src.hpp>`, instead of in every translation unit.
///
/// meshlib is header-only, and each program generates code again for its thread communicator
/// (the reduce kernels of every operation and element type, its step protocol, the type-erased
/// per-device handle), the trace recorder, the debug observer, the collectives' workspace and the
/// launcher detection: the same code for every program, two thirds of the object code of a small
/// `shard_map` program (docs/fast-builds.md). Boost.Asio's `BOOST_ASIO_SEPARATE_COMPILATION` is the model:
///   - define `MESHLIB_SEPARATE_COMPILATION` for every translation unit of the program (and the
///     precompiled header), so that this header declares those instantiations `extern template`:
///     the compiler inlines what it wants from them but emits none;
///   - compile `<meshlib/src.hpp>` in exactly one translation unit of the program (a `.cpp` that
///     includes it), which defines them.
/// `meshlib_enable_fast_build(target RUNTIME)` does both (a static library `meshlib_runtime`,
/// compiled once per build tree; docs/fast-builds.md). Without the macro this header declares
/// nothing and meshlib stays header-only, as before.
///
/// Both sides must be compiled with the same configuration macros (`MESHLIB_ENABLE_*`,
/// `MESHLIB_DEBUG_HOOKS`) and the same Kokkos, as for any library. What is listed is only what is
/// fixed for every program: mesh-, sharding- and layer-dependent templates stay in the program.
///
/// Example (one `.cpp` of the program, compiled with `-DMESHLIB_SEPARATE_COMPILATION` as the others):
/// @code
/// #include <meshlib/src.hpp>   // meshlib's runtime, compiled once
/// @endcode

#include <cstddef>
#include <cstdint>
#include <optional>
#include <utility>

#include "meshlib/config.hpp"
#include "meshlib/comm/thread/detail/reduce_kernels.hpp"
#include "meshlib/comm/thread/thread_communicator.hpp"
#include "meshlib/runtime/launcher.hpp"
#include "meshlib/collectives/device_context.hpp"
#include "meshlib/collectives/observer.hpp"
#include "meshlib/collectives/workspace.hpp"
#include "meshlib/debug/trace.hpp"
#include "meshlib/debug/observe.hpp"

/// @brief `KW void reduce_into_op<reduce_op::Op, T>(...);`: one of the thread communicator's reduce
/// kernels. Internal to this header and `<meshlib/src.hpp>`.
#define MESHLIB_REDUCE_KERNEL_(KW, Op, T)                                                                     \
  KW void meshlib::comm::detail::reduce_into_op<meshlib::reduce_op::Op, T>(const T* const*, int, T* const*, \
                                                                          int, std::size_t, bool);

/// @brief `MESHLIB_REDUCE_KERNEL_` for every reduce op, for element type `T`. Internal to this header
/// and `<meshlib/src.hpp>`.
#define MESHLIB_REDUCE_KERNELS_(KW, T)                                                                        \
  MESHLIB_REDUCE_KERNEL_(KW, sum, T)                                                                          \
  MESHLIB_REDUCE_KERNEL_(KW, prod, T)                                                                         \
  MESHLIB_REDUCE_KERNEL_(KW, min, T)                                                                          \
  MESHLIB_REDUCE_KERNEL_(KW, max, T)                                                                          \
  MESHLIB_REDUCE_KERNEL_(KW, mean, T)

/// @brief The runtime's fixed instantiations, each preceded by `KW`: `extern template` here (with
/// `MESHLIB_SEPARATE_COMPILATION`), `template` in `<meshlib/src.hpp>`. One list, so that what is
/// declared and what is defined cannot drift. Internal to this header and `<meshlib/src.hpp>`.
#define MESHLIB_RUNTIME_INSTANTIATIONS_(KW)                                                                   \
  MESHLIB_REDUCE_KERNELS_(KW, float)                                                                          \
  MESHLIB_REDUCE_KERNELS_(KW, double)                                                                         \
  MESHLIB_REDUCE_KERNELS_(KW, std::int32_t)                                                                   \
  MESHLIB_REDUCE_KERNELS_(KW, std::int64_t)                                                                   \
  MESHLIB_REDUCE_KERNELS_(KW, meshlib::bfloat16)                                                              \
  KW class meshlib::comm::detail::basic_step_protocol<void>;                                                  \
  KW class meshlib::communicator_frontend<meshlib::thread_communicator>;                                      \
  KW class meshlib::collectives::detail::device_comm_for<meshlib::thread_communicator>;                       \
  KW class meshlib::collectives::detail::observed_comm<meshlib::collectives::detail::device_comm>;            \
  KW class meshlib::collectives::detail::basic_collective_workspace<void>;                                    \
  KW meshlib::distributed::launch_info meshlib::distributed::detect_launch<void>(                             \
      const meshlib::distributed::env_source&, const meshlib::distributed::explicit_launch&,                  \
      std::optional<std::pair<std::size_t, std::size_t>>);                                                    \
  KW class meshlib::debug::detail::basic_trace_recorder<void>;                                                \
  KW class meshlib::debug::detail::basic_run_observer<void>;

#if MESHLIB_CONFIG_SEPARATE_COMPILATION_
MESHLIB_RUNTIME_INSTANTIATIONS_(extern template)
#endif

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `trace_region`: a named span of the program, as `jax.profiler.TraceAnnotation`. It shows
/// on the running device's track of the trace (or the host track outside `shard_map` / `spmd`),
/// and Kokkos tools see it as a profiling region (`Kokkos::Profiling::pushRegion`/`popRegion`)
/// next to the kernels. `scoped_region` is another name for it.
/// @code
/// meshlib::spmd(m, [&] {
///   meshlib::trace_region r("forward");
///   auto h = meshlib::psum<"model">(matmul(x, w));
/// });
/// @endcode

#include <cstddef>
#include <string>
#include <utility>

#include "meshlib/collectives/device_context.hpp"
#include "meshlib/debug/observe.hpp"
#include "meshlib/debug/trace.hpp"

namespace meshlib {

/// @brief Marks its scope as a region named `name` (see the file comment). Costs one check of a
/// flag when neither tracing nor a Kokkos tool is on. Used as `trace_region` (a template only so
/// that the recorder's code is compiled where it is used: see `detail::basic_trace_recorder`).
template <class Tag = void>
class basic_trace_region {
  using recorder = debug::detail::basic_trace_recorder<Tag>;

 public:
  /// Opens the region `name`; it closes when the object is destroyed.
  explicit basic_trace_region(std::string name) {
    auto& rec = recorder::get();
#if MESHLIB_DEBUG_HAS_KOKKOS
    kokkos_ = Kokkos::Profiling::profileLibraryLoaded();
    if (kokkos_) Kokkos::Profiling::pushRegion(name);
#endif
    if (!rec.on()) return;
    const experimental::device_context* ctx = experimental::current_device_slot();
    track_ = &rec.track_of(ctx ? ctx->device() : debug::detail::host_track);
    name_ = std::move(name);
    start_ = rec.now_ns();
  }
  ~basic_trace_region() {
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::popRegion();
#endif
    if (track_ == nullptr) return;
    auto& rec = recorder::get();
    debug::detail::trace_event e;
    e.name = std::move(name_);
    e.start_ns = start_;
    e.end_ns = rec.now_ns();
    try {
      rec.record(*track_, std::move(e));
    } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory while tracing: lose the event, not the program
    }
  }
  basic_trace_region(const basic_trace_region&) = delete;
  basic_trace_region& operator=(const basic_trace_region&) = delete;

 private:
  typename recorder::track* track_ = nullptr;
  std::string name_;
  std::int64_t start_ = 0;
  bool kokkos_ = false;
};

/// @brief A named span of the program (see `basic_trace_region`).
using trace_region = basic_trace_region<>;

/// @brief Another name for `trace_region`.
using scoped_region = trace_region;

}  // namespace meshlib

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// <meshlib.hpp> compiles the code that only tracing, running devices or starting processes needs
// where it is used, not in every translation unit (docs/benchmarks.md, "Include cost"; the pattern
// is in core/deferred.hpp). An explicit specialization declared after a member was instantiated is
// an error on GCC and Clang ("specialization after instantiation"), so this file, compiled with
// -fsyntax-only by check_umbrella_deferred.cmake, fails when a header makes ordinary inline code
// use one of these again, or turns one back into an ordinary class or function.
// MESHLIB_DEFERRED_PROBE (the self-test) makes such a use, and must fail.
#include <meshlib.hpp>

#ifdef MESHLIB_DEFERRED_PROBE
inline void meshlib_deferred_probe() { (void)meshlib::debug::detail::trace_recorder::get().stop(); }
#endif

// The trace recorder's writer and summary, and the debug observer of a run.
template <>
meshlib::trace_summary meshlib::debug::detail::basic_trace_recorder<void>::stop();
template <>
meshlib::debug::detail::basic_trace_recorder<void>::~basic_trace_recorder();
template <>
meshlib::debug::detail::basic_run_observer<void>::~basic_run_observer();
// The collectives' buffer cache.
template <>
void meshlib::collectives::detail::basic_collective_workspace<void>::release_held();
// Launcher detection and start-up.
template <>
meshlib::distributed::launch_info meshlib::distributed::detect_launch<void>(
    const meshlib::distributed::env_source&, const meshlib::distributed::explicit_launch&,
    std::optional<std::pair<std::size_t, std::size_t>>);
template <>
void meshlib::distributed::initialize<void>(const meshlib::distributed::options&);

int main() {}

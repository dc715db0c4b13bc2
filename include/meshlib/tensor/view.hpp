// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The Kokkos side of the tensor layer: the view type of a block, allocation that is safe
/// from many device threads, and the one way meshlib launches a kernel.
///
/// Why this file exists: with the thread communicator every device is a thread, and Debian's
/// Kokkos 3.4.1 is not safe to launch from several threads at once. Its Serial backend keeps one
/// process-wide scratch buffer (`serial_resize_thread_team_data`) that every team-policy kernel,
/// scan and reduction resizes and writes, so concurrent launches of those race (wrong results,
/// aborts). What is safe in 3.4.1 Serial (read in Kokkos_Serial.hpp, Kokkos_Parallel.hpp,
/// impl/Kokkos_SharedAlloc.hpp):
/// - `parallel_for` over a `RangePolicy`: `ParallelFor<..., RangePolicy, Serial>` is a plain loop
///   over the functor copy; the launch only flips the *thread-local* `t_tracking_enabled` flag and
///   calls the profiling hooks, which read one global and do nothing when no tool is loaded.
/// - Without `KOKKOS_ENABLE_DEBUG` (Debian's build) no global list of allocation records exists.
/// What is NOT safe, and ThreadSanitizer cannot show it (it is inside the uninstrumented
/// libkokkoscore): a Serial-only Kokkos compiles its atomics as plain operations, so
/// `SharedAllocationRecord::increment` / `decrement`, the reference count of a managed View, is a
/// plain read-modify-write (disassembled: `mov; lea 1; mov`, no `lock`). Two threads copying or
/// destroying handles of the *same* allocation at once can lose a count (a leak, or a double free).
/// So meshlib:
/// - launches *only* RangePolicy `parallel_for`, with plain functors over raw pointers
///   (`detail::launch`): no View is copied into a kernel;
/// - computes every reduction and scan itself with deterministic per-element loops;
/// - serialises View allocation (`detail::allocate`) behind one mutex: it runs in the
///   uninstrumented library (HostSpace::allocate, record construction, the label) and is cheap
///   next to the kernels (measured in bench/matmul_bench.cpp), so the lock costs no speedup;
/// - keeps one allocation per device block (a replicated tensor still has one block per device),
///   so that a device thread copies and drops only handles of its own blocks.
/// The rule for code running on device threads (shard_map bodies, collectives): copy or destroy
/// `Kokkos::View` handles only of your own device's blocks; to read another device's block, use its
/// `data()` or `detail::unmanaged(view)` (an unmanaged view touches no reference count).

#include <array>
#include <cstddef>
#include <mutex>
#include <string>
#include <type_traits>

#include <Kokkos_Core.hpp>

namespace meshlib {

/// @brief The memory space meshlib puts blocks in unless told otherwise.
using default_memory_space = Kokkos::DefaultExecutionSpace::memory_space;

namespace detail {

/// `T*...*` with `N` stars: the Kokkos data type of a rank-`N` view.
template <class T, std::size_t N>
struct add_pointers {
  using type = typename add_pointers<T, N - 1>::type*;
};
template <class T>
struct add_pointers<T, 0> {
  using type = T;
};

/// The view type of a rank-`Rank` block: row-major, as NumPy and JAX lay arrays out.
template <class T, std::size_t Rank, class Space>
using block_view_t = Kokkos::View<typename add_pointers<T, Rank>::type, Kokkos::LayoutRight, Space>;

/// The unmanaged form of a block view: same data, no reference counting (safe to copy between
/// device threads; the owner must outlive it).
template <class T, std::size_t Rank, class Space>
using unmanaged_view_t =
    Kokkos::View<typename add_pointers<T, Rank>::type, Kokkos::LayoutRight, Space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// `v` as an unmanaged view (see `unmanaged_view_t`).
template <class View>
auto unmanaged(const View& v) {
  return unmanaged_view_t<typename View::value_type, View::rank, typename View::memory_space>(v);
}

/// The execution space that runs kernels on memory of `Space`.
template <class Space>
using exec_space_for_t = std::conditional_t<
    Kokkos::Impl::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Space>::accessible, Kokkos::DefaultExecutionSpace,
    Kokkos::DefaultHostExecutionSpace>;

template <class Space>
inline constexpr bool host_accessible_v = Kokkos::Impl::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible;

/// The one lock around Kokkos global state (see the file comment).
inline std::mutex& kokkos_state_mutex() {
  static std::mutex m;
  return m;
}

/// A rank-`Rank` view of `extent`, zero-filled by meshlib (not by Kokkos' initialising kernel), with
/// the allocation itself under `kokkos_state_mutex()`.
template <class T, std::size_t Rank, class Space = default_memory_space>
block_view_t<T, Rank, Space> allocate(const std::array<std::size_t, Rank>& extent, const char* label = "meshlib::block",
                                      bool zero = true) {
  using view_t = block_view_t<T, Rank, Space>;
  static_assert(Rank <= 8, "meshlib: Kokkos views have at most 8 dimensions");
  view_t v;
  {
    std::lock_guard<std::mutex> lock(kokkos_state_mutex());
    v = [&]<std::size_t... I>(std::index_sequence<I...>) {
      return view_t(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), extent[I]...);
    }(std::make_index_sequence<Rank>{});
  }
  if (zero) {
    T* p = v.data();
    const std::size_t n = v.span();
    if constexpr (host_accessible_v<Space>) {
      for (std::size_t i = 0; i < n; ++i) p[i] = T{};
    } else {
      Kokkos::parallel_for(Kokkos::RangePolicy<exec_space_for_t<Space>>(0, n), KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
      Kokkos::fence();
    }
  }
  return v;
}

/// The extents of a view as an array.
template <class View>
std::array<std::size_t, View::rank> extents_of(const View& v) {
  std::array<std::size_t, View::rank> e{};
  for (std::size_t d = 0; d < View::rank; ++d) e[d] = v.extent(d);
  return e;
}

/// Runs `f(i)` for `i` in `[0, n)` as a RangePolicy `parallel_for`: the only launch meshlib makes,
/// because it is the only one safe from concurrent device threads on Kokkos 3.4.1 Serial.
template <class Space, class F>
void launch(std::size_t n, const F& f) {
  if (n == 0) return;
  Kokkos::parallel_for(Kokkos::RangePolicy<exec_space_for_t<Space>, Kokkos::IndexType<std::size_t>>(0, n), f);
}

}  // namespace detail
}  // namespace meshlib

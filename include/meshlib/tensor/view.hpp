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

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

#include "meshlib/runtime/kokkos_runtime.hpp"

namespace meshlib {

/// @brief The memory space meshlib puts blocks in unless told otherwise.
using default_memory_space = Kokkos::DefaultExecutionSpace::memory_space;

namespace tensor::detail {

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
    Kokkos::SpaceAccessibility<Kokkos::DefaultExecutionSpace, Space>::accessible, Kokkos::DefaultExecutionSpace,
    Kokkos::DefaultHostExecutionSpace>;

template <class Space>
inline constexpr bool host_accessible_v = Kokkos::SpaceAccessibility<Kokkos::HostSpace, Space>::accessible;

/// The one lock around Kokkos global state (see the file comment). Taken on Kokkos 3.x only:
/// Kokkos 4 counts View references atomically in every build and allocates thread-safely.
inline std::mutex& kokkos_state_mutex() {
  static std::mutex m;
  return m;
}

/// Whether device threads may each compute on their own execution-space instance: Kokkos 4 makes
/// independent instances (`partition_space`; a Serial instance has its own scratch buffer, an
/// OpenMP instance its own thread pool and lock). Kokkos 3.4.1 Serial has one instance, and
/// meshlib's RangePolicy-only kernels are safe on it from several threads (the file comment).
inline constexpr bool kokkos_has_instances_v = KOKKOS_VERSION >= 40000;

/// Whether a device may compute on a team of `threads` Kokkos threads: on the OpenMP backend of
/// Kokkos 4, an instance has a thread pool of its own size; any other host or device space has one
/// thread (or one stream) per instance.
template <class Exec>
inline constexpr bool has_thread_teams_v =
#if defined(KOKKOS_ENABLE_OPENMP) && KOKKOS_VERSION >= 40000
    std::is_same_v<Exec, Kokkos::OpenMP>;
#else
    false;
#endif

/// `n` execution-space instances of `Exec`, one per device, each with `threads` threads where the
/// space has thread teams (`has_thread_teams_v`; 1 elsewhere, checked by the runner).
template <class Exec>
std::vector<Exec> make_device_instances(std::size_t n, [[maybe_unused]] std::size_t threads = 1) {
  if constexpr (kokkos_has_instances_v) {
#if defined(KOKKOS_ENABLE_OPENMP) && KOKKOS_VERSION >= 40000
    if constexpr (std::is_same_v<Exec, Kokkos::OpenMP>) {
      // An instance of its own pool size per device, not `partition_space` of the process's pool:
      // a partition is the pool divided by the number of devices (all of a 16-core pool for a
      // one-device mesh, 1/n of it for each device of an MPI rank that runs one device of n),
      // where a device should get what its runner asks for, one thread by default.
      std::vector<Exec> v;
      v.reserve(n);
      for (std::size_t i = 0; i < n; ++i) v.emplace_back(static_cast<int>(threads));
      return v;
    }
#endif
#if KOKKOS_VERSION >= 40000
    return Kokkos::Experimental::partition_space(Exec(), std::vector<int>(n, 1));
#endif
  }
  return std::vector<Exec>(n, Exec());
}

/// The instances of every mesh size (and team size) in use, made on first use and released by a
/// Kokkos finalize hook (an instance must not outlive Kokkos).
template <class Exec>
class device_instance_cache {
 public:
  static Exec get(std::size_t device, std::size_t n, std::size_t threads) {
    static device_instance_cache cache;
    std::lock_guard lock(cache.m_);
    for (auto& s : cache.sets_)
      if (s.n == n && s.threads == threads) return s.instances[device];
    if (!cache.hooked_) {
      cache.hooked_ = true;
      experimental::push_finalize_hook([] {
        std::lock_guard l(cache.m_);
        cache.sets_.clear();
        cache.hooked_ = false;
      });
    }
    cache.sets_.push_back({n, threads, make_device_instances<Exec>(n, threads)});
    return cache.sets_.back().instances[device];
  }

 private:
  struct set {
    std::size_t n;
    std::size_t threads;
    std::vector<Exec> instances;
  };
  std::mutex m_;
  bool hooked_ = false;
  std::vector<set> sets_;
};

/// The execution-space instance local device `device` of `n` local devices computes on, for
/// memory `Space`, with `threads` threads (a team of cores where the space has teams).
template <class Space>
exec_space_for_t<Space> device_instance(std::size_t device, std::size_t n, std::size_t threads = 1) {
  return device_instance_cache<exec_space_for_t<Space>>::get(device, n, threads);
}

/// This thread's current instance of `Exec` (null: none installed; kernels use the default).
template <class Exec>
const Exec*& current_exec_slot() noexcept {
  thread_local const Exec* current = nullptr;
  return current;
}

/// Installs `instance` as this thread's instance for kernels on memory `Space`, for its lifetime.
template <class Space>
class scoped_exec_space {
 public:
  using exec_type = exec_space_for_t<Space>;
  explicit scoped_exec_space(exec_type instance) noexcept
      : instance_(std::move(instance)), previous_(current_exec_slot<exec_type>()) {
    current_exec_slot<exec_type>() = &instance_;
  }
  ~scoped_exec_space() { current_exec_slot<exec_type>() = previous_; }
  scoped_exec_space(const scoped_exec_space&) = delete;
  scoped_exec_space& operator=(const scoped_exec_space&) = delete;

 private:
  exec_type instance_;
  const exec_type* previous_;
};

/// Set by a runner that installed the device's instance itself (`gpu_runner`: a Kokkos CUDA
/// instance on its communicator's stream) just before it calls the device body; the exec layer
/// (exec/detail/run_devices.hpp) reads and clears it, and then installs no instance of its own.
inline bool& runner_installed_exec() noexcept {
  thread_local bool installed = false;
  return installed;
}

/// The instance kernels on memory `Space` run on in this thread: the running device's, else the default.
template <class Space>
exec_space_for_t<Space> current_exec() {
  using exec_type = exec_space_for_t<Space>;
  if (const exec_type* e = current_exec_slot<exec_type>()) return *e;
  return exec_type();
}

/// The GPU the running device's kernels on memory `Space` run on (`current_exec`), or -1 where
/// `Space` is not a CUDA space (host memory has no device number).
template <class Space>
int current_device_id() {
#if defined(KOKKOS_ENABLE_CUDA)
  if constexpr (std::is_same_v<exec_space_for_t<Space>, Kokkos::Cuda>) return current_exec<Space>().cuda_device();
#endif
  return -1;
}

/// A rank-`Rank` view of `extent`, zero-filled by meshlib (not by Kokkos' initialising kernel), with
/// the allocation itself under `kokkos_state_mutex()`.
template <class T, std::size_t Rank, class Space = default_memory_space>
block_view_t<T, Rank, Space> allocate(const std::array<std::size_t, Rank>& extent, const char* label = "meshlib::block",
                                      bool zero = true) {
  using view_t = block_view_t<T, Rank, Space>;
  static_assert(Rank <= 8, "meshlib: Kokkos views have at most 8 dimensions");
  experimental::require_kokkos(label);
  view_t v;
  {
    std::unique_lock<std::mutex> lock(kokkos_state_mutex(), std::defer_lock);
    if constexpr (!kokkos_has_instances_v) lock.lock();
    v = [&]<std::size_t... I>(std::index_sequence<I...>) {
#if defined(KOKKOS_ENABLE_CUDA)
      if constexpr (std::is_same_v<Space, Kokkos::CudaSpace>) {
        // On the running device's GPU (gpu_runner: one process may drive several), which the
        // allocation record keeps for the deallocation; the default CudaSpace is Kokkos' device.
        const auto exec = current_exec<Space>();
        return view_t(Kokkos::view_alloc(Kokkos::CudaSpace::impl_create(exec.cuda_device(), exec.cuda_stream()),
                                         Kokkos::WithoutInitializing, std::string(label)),
                      extent[I]...);
      }
#endif
      return view_t(Kokkos::view_alloc(Kokkos::WithoutInitializing, std::string(label)), extent[I]...);
    }(std::make_index_sequence<Rank>{});
  }
  if (zero) {
    T* p = v.data();
    const std::size_t n = v.span();
    if constexpr (host_accessible_v<Space>) {
      for (std::size_t i = 0; i < n; ++i) p[i] = T{};
    } else {
      const auto exec = current_exec<Space>();
      Kokkos::parallel_for(Kokkos::RangePolicy<exec_space_for_t<Space>>(exec, 0, n), KOKKOS_LAMBDA(std::size_t i) { p[i] = T{}; });
      exec.fence();
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

/// Whether kernels on a GPU's instance are left to run when their launch returns
/// (`MESHLIB_ASYNC_KERNELS=1`, read once; experimental, off by default). Off, every launch waits
/// for its kernel, the GPU path that has run; on, the host goes on while the instance's stream
/// orders the kernels, products and collectives of a device, and only what must wait does: a copy
/// to or from the host (`copy_across`), the end of a device's call (`run_devices`), and each
/// collective of the shared-GPU communicator through its events. Issue 38: a fence per kernel is a
/// host round trip per kernel, which bounds a GPU's training step by the host.
inline bool async_device_kernels() {
  static const bool on = [] {
    const char* v = std::getenv("MESHLIB_ASYNC_KERNELS");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

/// Waits for what was launched on `exec` where meshlib's contract says a launch has finished when it
/// returns: always on a host backend (Kokkos 4's instances; 3.4.1's fence is a process-wide call,
/// and meshlib runs only host backends there), on a GPU unless `async_device_kernels()`.
template <class Exec>
void finish_launch(const Exec& exec) {
  if constexpr (kokkos_has_instances_v) {
    if constexpr (!host_accessible_v<typename Exec::memory_space>)
      if (async_device_kernels()) return;
    exec.fence();
  }
}

/// `launch` on the instance `exec` instead of the running device's: a caller that was handed an
/// instance (`matmul_into(exec, ...)`).
template <class Exec, class F>
void launch_on(const Exec& exec, std::size_t n, const F& f) {
  if (n == 0) return;
  Kokkos::parallel_for(Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, n), f);
  finish_launch(exec);
}

/// Runs `f(i)` for `i` in `[0, n)` as a RangePolicy `parallel_for` on the running device's
/// instance (`current_exec`), and waits for it: the only launch meshlib makes, because it is the
/// only one safe from concurrent device threads on Kokkos 3.4.1 Serial.
template <class Space, class F>
void launch(std::size_t n, const F& f) {
  launch_on(current_exec<Space>(), n, f);
}

/// Copies `n` values at `src` (memory `From`) to `dst` (memory `To`), one side the host's, on the
/// running device's instance of `Space` (the other side), and waits. A plain copy where the host can
/// read `Space`.
template <class Space, class To, class From, class T>
void copy_across(T* dst, const T* src, std::size_t n) {
  if (n == 0) return;
  if constexpr (host_accessible_v<Space>) {
    std::copy_n(src, n, dst);
  } else {
    using unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
    const auto exec = current_exec<Space>();
    Kokkos::deep_copy(exec, Kokkos::View<T*, To, unmanaged>(dst, n), Kokkos::View<const T*, From, unmanaged>(src, n));
    exec.fence();
  }
}

/// Copies `n` values at `src`, in memory `Space`, to the host's `dst`: what a host decision (an
/// error to throw, a loss to print) needs from a kernel's result.
template <class Space, class T>
void copy_to_host(T* dst, const T* src, std::size_t n) {
  copy_across<Space, Kokkos::HostSpace, Space>(dst, src, n);
}

/// Copies `n` host values at `src` into `dst`, in memory `Space`: caller data (labels, targets)
/// that kernels in `Space` read.
template <class Space, class T>
void copy_from_host(T* dst, const T* src, std::size_t n) {
  copy_across<Space, Space, Kokkos::HostSpace>(dst, src, n);
}

/// `n` values at `p`, in memory `Space`, readable on the host: `p` itself where the host can read
/// `Space`, else a copy in `stage` (file I/O and read-back of whole blocks).
template <class Space, class T>
const T* host_readable(const T* p, std::size_t n, std::vector<T>& stage) {
  if constexpr (host_accessible_v<Space>) {
    return p;
  } else {
    stage.resize(n);
    copy_to_host<Space>(stage.data(), p, n);
    return stage.data();
  }
}

/// Lets host code `edit(T* q)` the `n` values at `p`, in memory `Space`: in place where the host can
/// write `Space`, else on a host copy in `stage` that is copied back after `edit` returns.
template <class Space, class T, class Edit>
void edit_on_host(T* p, std::size_t n, std::vector<T>& stage, Edit&& edit) {
  if constexpr (host_accessible_v<Space>) {
    edit(p);
  } else {
    stage.resize(n);
    copy_to_host<Space>(stage.data(), p, n);
    edit(stage.data());
    copy_from_host<Space>(p, stage.data(), n);
  }
}

/// The value at `p`, in memory `Space`, on the host (one `copy_to_host`).
template <class Space, class T>
T read_back(const T* p) {
  T v{};
  copy_to_host<Space>(&v, p, 1);
  return v;
}

}  // namespace tensor::detail

namespace experimental {
/// The extents of a view as a `std::array`.
using tensor::detail::extents_of;

/// Whether a CPU device may be a team of cores in this Kokkos build.
using tensor::detail::has_thread_teams_v;

/// The execution-space instance of device `d` of the process.
using tensor::detail::device_instance;

/// The execution-space instance of the running device (its stream on a GPU).
using tensor::detail::current_exec;

/// Whether a runner installed an execution-space instance on this thread.
using tensor::detail::runner_installed_exec;

/// Installs an execution-space instance as the calling device thread's for a scope (runners use it).
using tensor::detail::scoped_exec_space;

/// The Kokkos execution space that runs kernels on memory space `Space`.
using tensor::detail::exec_space_for_t;
}  // namespace experimental
}  // namespace meshlib

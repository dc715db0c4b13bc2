// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `gpu_runner`: the runner (exec/runner.hpp) whose mesh devices are GPUs. Each device
/// computes on a Kokkos CUDA execution-space instance made on the stream of its communicator, so
/// its kernels and its collectives (NCCL, or the shared-GPU communicator) are ordered on one
/// stream: a typed `psum` on a block in `CudaSpace` is enqueued there and returns without waiting
/// for the GPU (collectives/device_context.hpp), and the next kernel sees its result.
///
/// Three layouts, chosen from the mesh size, the GPUs visible and the launch (`gpu_plan`):
/// | layout | when | communicator |
/// | --- | --- | --- |
/// | `process_per_gpu` | a run of P > 1 processes (`distributed::launch()`: mpirun, srun, torchrun); the mesh has P devices | one NCCL rank per process on GPU `local_rank % gpus` (ids exchanged through MPI when it is initialised, else NCCL's bootstrap from `NCCL_COMM_ID` / `MASTER_ADDR`) |
/// | `gpu_per_device` | one process, a mesh of at most as many devices as GPUs | one NCCL rank per GPU, one thread each (`run_on_gpus`) |
/// | `devices_share_gpu` | one process, more devices than GPUs, one GPU used | the shared-GPU communicator, one stream per device on that GPU |
///
/// `default_runner` picks a `gpu_runner` when meshlib is built with Kokkos CUDA and NCCL
/// (`MESHLIB_HAS_GPU_RUNNER`) and a GPU is visible. The layout logic (`detail::plan_gpu_mesh`) is
/// host code, compiled and tested in every build; the runner itself only with CUDA and NCCL.
/// @code
/// meshlib::mesh<meshlib::axis<"data">> m{4};
/// meshlib::gpu_runner gpus;                              // 4 GPUs: one NCCL rank each; 1 GPU: 4 streams on it
/// auto f = meshlib::shard_map(step, m, meshlib::P<"data">{}, meshlib::P<>{}, gpus);
/// @endcode

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "meshlib/core/errors.hpp"
#include "meshlib/exec/runner.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/launcher.hpp"

#if defined(MESHLIB_ENABLE_NCCL) && MESHLIB_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
#define MESHLIB_HAS_GPU_RUNNER 1
#include <Kokkos_Core.hpp>
#include <cuda_runtime.h>

#include <exception>
#include <memory>
#include <optional>
#include <type_traits>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/nccl_communicator.hpp"
#include "meshlib/comm/nccl/run_on_gpus.hpp"
#include "meshlib/comm/nccl/shared_gpu_communicator.hpp"
#include "meshlib/runtime/nccl_runtime.hpp"
#include "meshlib/tensor/view.hpp"
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
#include "meshlib/comm/nccl/mpi_bootstrap.hpp"
#endif
#else
/// 1 when `gpu_runner` is available: meshlib built with NCCL (`MESHLIB_ENABLE_NCCL`) and Kokkos CUDA.
#define MESHLIB_HAS_GPU_RUNNER 0
#endif

namespace meshlib {

/// @brief How a `gpu_runner` lays a mesh's devices on GPUs (see the file comment's table).
enum class gpu_layout {
  process_per_gpu,    ///< one device per process of the run, one GPU each, NCCL between processes
  gpu_per_device,     ///< one process, one GPU per device, NCCL between the process's threads
  devices_share_gpu,  ///< one process, several devices on one GPU, the shared-GPU communicator
};

/// @brief The layout's name, as messages print it.
[[nodiscard]] constexpr std::string_view to_string(gpu_layout l) noexcept {
  switch (l) {
    case gpu_layout::process_per_gpu: return "one process per GPU";
    case gpu_layout::gpu_per_device: return "one GPU per device";
    case gpu_layout::devices_share_gpu: return "devices sharing one GPU";
  }
  return "?";
}

/// @brief Options of a `gpu_runner`.
struct gpu_runner_options {
  /// The GPUs to use, by CUDA ordinal (empty: every visible GPU, 0 .. count-1). Repeats are refused.
  std::vector<int> gpus{};
};

/// @brief Where a `gpu_runner` runs each of this process's devices of an `n`-device mesh.
struct gpu_plan {
  /// The layout (see `gpu_layout`).
  gpu_layout layout = gpu_layout::gpu_per_device;
  /// The mesh devices this process runs, ascending.
  std::vector<std::size_t> local_devices;
  /// The GPU of each local device (same order as `local_devices`).
  std::vector<int> gpus;
};

namespace exec::detail {

/// The layout of an `n`-device mesh on `visible` GPUs for the launch `launch`, using the GPUs
/// `wanted` (empty: all visible). Host code only: the runner's whole decision, tested without a GPU.
/// @throws error when no GPU is visible, `wanted` names a GPU that does not exist or one twice,
/// mesh_error when the mesh does not fit the layout (each message names the fix).
inline gpu_plan plan_gpu_mesh(std::size_t n, int visible, const distributed::launch_info& launch,
                              std::span<const int> wanted = {}) {
  const std::string who = "meshlib: gpu_runner: ";
  if (visible <= 0)
    throw error(who + "no CUDA device is visible (cudaGetDeviceCount found none; check the driver and "
                      "CUDA_VISIBLE_DEVICES); run on the CPU (thread_runner) instead");
  if (n == 0) throw mesh_error(who + "the mesh has no devices");
  std::vector<int> gpus(wanted.begin(), wanted.end());
  if (gpus.empty())
    for (int g = 0; g < visible; ++g) gpus.push_back(g);
  for (std::size_t i = 0; i < gpus.size(); ++i) {
    if (gpus[i] < 0 || gpus[i] >= visible)
      throw error(who + "GPU " + std::to_string(gpus[i]) + " does not exist: " + std::to_string(visible) +
                  " are visible (0 .. " + std::to_string(visible - 1) + ")");
    for (std::size_t j = 0; j < i; ++j)
      if (gpus[i] == gpus[j])
        throw error(who + "GPU " + std::to_string(gpus[i]) +
                    " is listed twice in gpu_runner_options::gpus; list each GPU once (several mesh devices share a "
                    "GPU when the mesh has more devices than the GPUs listed)");
  }
  gpu_plan plan;
  const std::size_t procs = launch.process_count;
  if (procs > 1) {
    if (n != procs)
      throw mesh_error(who + "the run has " + std::to_string(procs) + " processes (" +
                       std::string(distributed::to_string(launch.source)) + "), one GPU each, but the mesh has " +
                       std::to_string(n) + " devices; use a mesh of " + std::to_string(procs) +
                       " devices (one per process), or start one process per mesh device");
    const std::size_t local = launch.local_rank.value_or(launch.process_index);
    plan.layout = gpu_layout::process_per_gpu;
    plan.local_devices = {launch.process_index};
    plan.gpus = {gpus[local % gpus.size()]};
    return plan;
  }
  for (std::size_t d = 0; d < n; ++d) plan.local_devices.push_back(d);
  if (n <= gpus.size()) {
    plan.layout = gpu_layout::gpu_per_device;
    plan.gpus.assign(gpus.begin(), gpus.begin() + static_cast<std::ptrdiff_t>(n));
    return plan;
  }
  if (gpus.size() > 1)
    throw mesh_error(who + "the mesh has " + std::to_string(n) + " devices but " + std::to_string(gpus.size()) +
                     " GPUs are used; devices share a GPU only when one GPU is used (no communicator spans NCCL "
                     "ranks and shared GPUs): use a mesh of at most " + std::to_string(gpus.size()) +
                     " devices, or gpu_runner_options{.gpus = {0}} to run all " + std::to_string(n) + " on GPU 0");
  constexpr std::size_t most = 32;  // the shared-GPU communicator's limit (comm/nccl/detail/reduce_kernel.hpp)
  if (n > most)
    throw mesh_error(who + "the mesh has " + std::to_string(n) + " devices on one GPU; at most " +
                     std::to_string(most) + " mesh devices share a GPU");
  plan.layout = gpu_layout::devices_share_gpu;
  plan.gpus.assign(n, gpus.front());
  return plan;
}

/// Which runner `default_runner` uses (exec/default_runner.hpp).
enum class default_runner_kind {
  threads,    ///< the process-wide device threads
  processes,  ///< the processes of an MPI run, n / P device threads each (`hybrid_runner`)
  gpus,       ///< `gpu_runner`
};

/// `default_runner`'s choice: a GPU build (`MESHLIB_HAS_GPU_RUNNER`) with a visible GPU, outside a
/// running device (a nested `spmd` runs on threads of its process), runs on the GPUs; otherwise
/// several processes run as processes, and one as threads. Host code, tested without a GPU.
constexpr default_runner_kind choose_default_runner(bool gpu_build, int visible_gpus, bool nested,
                                                    std::size_t process_count) noexcept {
  if (nested) return default_runner_kind::threads;
  if (gpu_build && visible_gpus > 0) return default_runner_kind::gpus;
  return process_count > 1 ? default_runner_kind::processes : default_runner_kind::threads;
}

}  // namespace exec::detail

#if MESHLIB_HAS_GPU_RUNNER

/// @brief The number of CUDA devices visible to this process (0 when none, or no driver).
[[nodiscard]] inline int visible_gpu_count() noexcept {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  return n;
}

/// @brief Mesh devices on GPUs (see the file comment): each device computes on its own Kokkos CUDA
/// instance, made on the stream of its communicator (NCCL or shared-GPU), installed for the
/// device's kernels. Calls on one runner run one at a time; the communicators are made for each
/// call (NCCL's initialisation costs milliseconds: a training loop runs its steps inside one call,
/// as `train` does).
struct gpu_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The runner installs each device's execution-space instance (exec/detail/run_devices.hpp).
  using installs_exec_instances = void;

  /// The GPUs to use.
  gpu_runner_options options{};
  /// Options of the communicators (timeout, pointer checks); `device` and `stream` are the runner's.
  nccl_comm_options comm_options{};

  /// A runner on `options.gpus` (default: every visible GPU).
  explicit gpu_runner(gpu_runner_options options = {}, nccl_comm_options comm = {})
      : options(std::move(options)), comm_options(std::move(comm)) {}

  /// The layout of an `n`-device mesh on this process's GPUs.
  /// @throws as `detail::plan_gpu_mesh`.
  [[nodiscard]] gpu_plan plan(std::size_t n) const {
    return exec::detail::plan_gpu_mesh(n, visible_gpu_count(), distributed::launch(), options.gpus);
  }

  /// The devices this process runs of an `n`-device mesh.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const { return plan(n).local_devices; }

  /// @brief Runs `body(device, communicator)` for this process's devices of an `n`-device mesh,
  /// each on the thread that drives its GPU, with its Kokkos CUDA instance installed.
  /// @throws participant_error naming the root-cause device (exec/runner.hpp).
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    const gpu_plan p = plan(n);
    switch (p.layout) {
      case gpu_layout::process_per_gpu: {
        nccl_comm_options o = comm_options;
        o.device = p.gpus.front();
        o.stream = {};
        meshlib::experimental::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
        std::vector<nccl_communicator>& kept = keep(p, [&] {
          std::vector<nccl_communicator> v;
          v.push_back(connect(o));
          return v;
        });
        nccl_communicator& world = kept.front();
        const auto rank = static_cast<std::size_t>(world.rank());
        try {
          on_instance(world, [&] { body(rank, world); });
        } catch (...) {
          const std::exception_ptr e = std::current_exception();
          const std::string why = "meshlib: process " + std::to_string(rank) + " of " + std::to_string(n) + " (GPU " +
                                  std::to_string(o.device) + ") failed: " + meshlib::experimental::what_of(e);
          world.abort(why);
          kept_->drop();
          throw participant_error(static_cast<int>(rank), why);  // nests the exception (in a handler)
        }
        return;
      }
      case gpu_layout::gpu_per_device: {
        nccl_comm_options o = comm_options;
        o.stream = {};
        std::vector<nccl_communicator>& kept = keep(p, [&] { return nccl_communicators(p.gpus, o); });
        try {
          run_on_communicators(std::span<nccl_communicator>(kept), [&](nccl_communicator& c) {
            const auto rank = static_cast<std::size_t>(c.rank());
            on_instance(c, [&] { body(rank, c); });
          });
        } catch (...) {
          kept_->drop();  // aborted: the next call makes new ones
          throw;
        }
        return;
      }
      case gpu_layout::devices_share_gpu: {
        nccl_comm_options o = comm_options;
        o.device = p.gpus.front();
        o.stream = {};
        meshlib::experimental::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
        run_on_shared_gpu(
            static_cast<int>(n),
            [&](shared_gpu_communicator& c) {
              meshlib::experimental::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
              const auto rank = static_cast<std::size_t>(c.rank());
              on_instance(c, [&] { body(rank, c); });
            },
            o);
        return;
      }
    }
  }

 private:
  /// The NCCL communicators of the last call, kept for the next one with the same plan: NCCL's
  /// initialisation costs far more than a training step, and a training loop calls the runner every
  /// step. Shared by the runner's copies; destroyed with the last one, all GPUs at once
  /// (`destroy_communicators`: finalizing one GPU's communicator waits for its peers). A failed
  /// call drops them (they were aborted). The shared-GPU communicator is made per call: it holds
  /// no NCCL communicator, and its host group is the call's threads.
  struct kept_communicators {
    std::vector<int> gpus;
    gpu_layout layout = gpu_layout::gpu_per_device;
    std::vector<nccl_communicator> comms;
    void drop() noexcept {
      try {
        destroy_communicators(comms);
      } catch (...) {
        comms.clear();
      }
      gpus.clear();
    }
    kept_communicators() = default;
    kept_communicators(const kept_communicators&) = delete;
    kept_communicators& operator=(const kept_communicators&) = delete;
    ~kept_communicators() { drop(); }
  };
  std::shared_ptr<kept_communicators> kept_ = std::make_shared<kept_communicators>();

  /// The kept communicators for plan `p`, made by `make()` unless the last call's fit and are usable.
  template <class Make>
  std::vector<nccl_communicator>& keep(const gpu_plan& p, Make&& make) const {
    kept_communicators& k = *kept_;
    bool usable = !k.comms.empty() && k.gpus == p.gpus && k.layout == p.layout;
    for (const auto& c : k.comms) usable = usable && c.valid() && !c.failed();
    if (!usable) {
      k.drop();
      k.comms = make();
      k.gpus = p.gpus;
      k.layout = p.layout;
    }
    return k.comms;
  }

  /// Runs `f` with a Kokkos CUDA instance on `c`'s stream installed as this thread's instance for
  /// `CudaSpace` kernels; the instance goes (after a fence) before the communicator's stream does.
  template <class C, class F>
  static void on_instance(C& c, F&& f) {
    Kokkos::Cuda exec(c.stream(), Kokkos::Impl::ManageStream::no);
    struct fence_at_end {
      Kokkos::Cuda& e;
      ~fence_at_end() {
        try {
          e.fence("meshlib::gpu_runner: end of the device's call");
        } catch (...) {  // a failed stream is reported by the communicator's request
        }
      }
    } fence{exec};
    static_assert(std::is_same_v<meshlib::experimental::exec_space_for_t<default_memory_space>, Kokkos::Cuda>,
                  "meshlib: gpu_runner needs Kokkos::Cuda as the default execution space (Kokkos_ENABLE_CUDA)");
    meshlib::experimental::scoped_exec_space<default_memory_space> on(exec);
    meshlib::experimental::runner_installed_exec() = true;  // read and cleared by run_devices
    f();
  }

  /// This process's NCCL communicator over the run's processes: through MPI when it is initialised,
  /// else NCCL's bootstrap from the launcher's environment (`nccl::connect_from_environment`).
  static nccl_communicator connect(const nccl_comm_options& o) {
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
    int mpi_up = 0;
    MPI_Initialized(&mpi_up);
    if (mpi_up) return nccl_communicator_from_mpi(MPI_COMM_WORLD, o);
#endif
    return nccl::connect_from_environment(o);
  }
};

static_assert(runner<gpu_runner>);

#endif  // MESHLIB_HAS_GPU_RUNNER

}  // namespace meshlib

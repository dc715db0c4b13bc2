// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `meshlib::distributed`: the processes of one run, modelled on `jax.distributed`.
///
/// @code
/// meshlib::distributed::guard run;                 // detects mpirun / srun / torchrun / nothing
/// auto m = meshlib::distributed::make_global_mesh<meshlib::axis<"data">>(meshlib::distributed::device_count());
/// for (std::size_t d : meshlib::distributed::local_devices()) { /* this process's devices */ }
/// @endcode
///
/// Devices. Each process owns `local_device_count()` devices (threads on a CPU, GPUs with NCCL;
/// the same count on every process, checked at start-up). The global devices are numbered
/// process-major: process `p` owns devices `[p*T, (p+1)*T)` with `T = local_device_count()`. A
/// mesh numbers its devices row-major (the last axis varies fastest), so in
/// `mesh<axis<"process">, axis<"thread">>{P, T}` the last axis is the one inside a process and the
/// first one spans processes; more generally, the trailing axes whose sizes multiply to `T` stay
/// inside a process.
///
/// Before `initialize` (and after `shutdown`) every query answers for the embedded default: one
/// process, index 0, one local device, as JAX does.
///
/// This header needs neither Kokkos nor MPI. Kokkos is initialised by `initialize` only when
/// `<meshlib/runtime/kokkos_runtime.hpp>` is included (it is by `<meshlib/runtime.hpp>`), and a
/// transport to check and abort other processes comes from `<meshlib/mpi.hpp>`.

#include <cstddef>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/core/deferred.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/core/mesh.hpp"
#include "meshlib/runtime/errors.hpp"
#include "meshlib/runtime/launcher.hpp"
#include "meshlib/runtime/process_exchange.hpp"

namespace meshlib::distributed {

/// @brief The arguments of `initialize`, all optional (`jax.distributed.initialize`'s).
struct options {
  /// This process's index; with `num_processes`, overrides detection (and must agree with any
  /// launcher or communicator that is present).
  std::optional<std::size_t> process_id;
  /// The number of processes; with `process_id`, overrides detection.
  std::optional<std::size_t> num_processes;
  /// Devices this process owns; default `MESHLIB_LOCAL_DEVICE_COUNT` from the environment, else 1.
  std::optional<std::size_t> local_device_count;
  /// Initialise Kokkos when the program has not (and finalise it in `shutdown`). Needs
  /// `<meshlib/runtime/kokkos_runtime.hpp>`; without it this flag does nothing.
  bool initialize_kokkos = true;
  /// A transport to the other processes (`meshlib::mpi::exchange`): its rank and size decide the
  /// process index and count, and the start-up consistency checks run over it.
  std::shared_ptr<process_exchange> exchange;
  /// Where launcher variables are read; default the process environment.
  env_source env;
};

namespace detail {

/// Filled by optional headers (Kokkos) so that this one depends on neither.
struct runtime_hooks {
  /// Initialises Kokkos when it is not; returns whether it did.
  bool (*start_kokkos)() = nullptr;
  void (*stop_kokkos)() = nullptr;
};
inline runtime_hooks& hooks() {
  static runtime_hooks h;
  return h;
}

struct runtime_state {
  bool initialized = false;
  launch_info launch;
  std::size_t local_devices = 1;
  std::shared_ptr<process_exchange> exchange;
  bool owns_kokkos = false;
  /// Kokkos 3.x cannot be initialised again in a process once finalised.
  bool finalized_kokkos = false;
};
inline runtime_state& state() {
  static runtime_state s;
  return s;
}
inline std::recursive_mutex& state_mutex() {
  static std::recursive_mutex m;
  return m;
}

template <class Tag = void>
std::string describe(const launch_info& l, std::size_t local) {
  std::ostringstream os;
  os << l << " with " << local << " local device" << (local == 1 ? "" : "s");
  return os.str();
}

/// Throws `process_mismatch` on every process unless every element of `all` equals the first.
/// (This function, `initialize`, `guard` and `check_same_on_all_processes` are templates only so
/// that their bodies are compiled where they are called, not in every translation unit that
/// includes meshlib: docs/benchmarks.md, "Include cost". Call them as plain functions.)
template <class Tag = void>
void require_equal(std::string_view what, const std::vector<std::string>& all) {
  bool same = true;
  for (const auto& v : all) same = same && v == all.front();
  if (same) return;
  // Group processes by value so a 1024-process run prints each distinct value once.
  meshlib::experimental::deferred_t<std::map<std::string, std::vector<std::size_t>>, Tag> by_value;
  for (std::size_t p = 0; p < all.size(); ++p) by_value[all[p]].push_back(p);
  std::ostringstream os;
  os << "meshlib: the processes disagree about " << what << ": ";
  bool first = true;
  for (const auto& [value, procs] : by_value) {
    os << (first ? "" : "; ") << (procs.size() == 1 ? "process " : "processes ");
    for (std::size_t i = 0; i < procs.size() && i < 8; ++i) os << (i ? "," : "") << procs[i];
    if (procs.size() > 8) os << ",... (" << procs.size() << " in all)";
    os << (procs.size() == 1 ? " has " : " have ") << value;
    first = false;
  }
  os << "; every process must pass the same value";
  throw process_mismatch(os.str());
}

}  // namespace detail

/// @brief Whether `initialize` has run (and `shutdown` has not since).
[[nodiscard]] inline bool is_initialized() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().initialized;
}

/// @brief Starts this process's part of a run: detects the process index and count (see
/// launcher.hpp for the rules), sets the local device count, initialises Kokkos when asked and
/// the program has not, and, with a transport, checks that every process agrees on the process
/// count and local device count and that no two claim the same index.
///
/// Idempotent: a second call with arguments that resolve to the same values does nothing; one that
/// resolves to other values throws `distributed_error` (call `shutdown` first).
/// @throws distributed_error on a contradictory launch; process_mismatch (on every process) when
/// processes disagree.
template <class Tag = void>
void initialize(const options& opt = {}) {
  std::lock_guard lock(detail::state_mutex());
  auto& st = detail::state();
  const env_source env = opt.env ? opt.env : process_env<Tag>();

  std::optional<std::pair<std::size_t, std::size_t>> comm;
  if (opt.exchange) comm = std::pair{opt.exchange->rank(), opt.exchange->size()};
  const launch_info launch = detect_launch<Tag>(env, {opt.process_id, opt.num_processes}, comm);

  std::size_t local = 1;
  if (opt.local_device_count) {
    local = *opt.local_device_count;
  } else if (const auto v = env("MESHLIB_LOCAL_DEVICE_COUNT")) {
    local = detail::parse_count<Tag>("MESHLIB_LOCAL_DEVICE_COUNT", *v);
  }
  if (local == 0) throw distributed_error("meshlib: a process needs at least one local device; local_device_count is 0");

  const bool adds_exchange = st.initialized && !st.exchange && opt.exchange;
  if (st.initialized) {
    if (st.launch.process_index == launch.process_index && st.launch.process_count == launch.process_count &&
        st.local_devices == local) {
      if (!adds_exchange) return;
      // Initialised from the environment first, now given a transport (mpi::initialize): keep
      // everything, run the start-up checks over it and keep it.
    } else {
      throw distributed_error("meshlib: distributed::initialize was already called as " +
                              detail::describe<Tag>(st.launch, st.local_devices) + " and is now called as " +
                              detail::describe<Tag>(launch, local) + "; call distributed::shutdown() first");
    }
  }
  if (opt.exchange && launch.process_count > 1) {
    // Every process must see the same world and the same number of devices per process, and the
    // indices must be a permutation: two processes with one index would hang the first collective.
    detail::require_equal<Tag>("the process count and local device count",
                          opt.exchange->all_gather(std::to_string(launch.process_count) + " processes x " +
                                                   std::to_string(local) + " local devices"));
    const auto indices = opt.exchange->all_gather(std::to_string(launch.process_index));
    meshlib::experimental::deferred_t<std::map<std::string, std::vector<std::size_t>>, Tag> seen;
    for (std::size_t r = 0; r < indices.size(); ++r) seen[indices[r]].push_back(r);
    for (const auto& [idx, ranks] : seen)
      if (ranks.size() > 1)
        throw process_mismatch("meshlib: transport ranks " + std::to_string(ranks[0]) + " and " +
                               std::to_string(ranks[1]) + " both claim process index " + idx +
                               "; every process needs its own index");
  }

  if (adds_exchange) {
    st.exchange = opt.exchange;
    return;
  }

  bool owns_kokkos = false;
  if (opt.initialize_kokkos && detail::hooks().start_kokkos) {
    if (st.finalized_kokkos)
      throw distributed_error(
          "meshlib: distributed::initialize would initialise Kokkos again, but meshlib finalised it in an earlier "
          "shutdown() and Kokkos 3.x cannot be initialised twice in one process; initialise Kokkos in main() "
          "instead (Kokkos::ScopeGuard), or pass initialize_kokkos = false");
    owns_kokkos = detail::hooks().start_kokkos();
  }

  st.initialized = true;
  st.launch = launch;
  st.local_devices = local;
  st.exchange = opt.exchange;
  st.owns_kokkos = owns_kokkos;
}

/// @brief Ends this process's part of the run: finalises Kokkos if `initialize` initialised it,
/// and releases the transport (the MPI exchange never frees a communicator it did not create).
/// Does nothing when not initialised.
inline void shutdown() {
  std::lock_guard lock(detail::state_mutex());
  auto& st = detail::state();
  if (!st.initialized) return;
  if (st.owns_kokkos && detail::hooks().stop_kokkos) {
    detail::hooks().stop_kokkos();
    st.finalized_kokkos = true;
  }
  const bool finalized = st.finalized_kokkos;
  st = detail::runtime_state{};
  st.finalized_kokkos = finalized;
}

/// @brief Initialises in its constructor and shuts down in its destructor, but only when it was
/// the one that initialised: a guard inside an already initialised program changes nothing. Used
/// as `guard` (a template only so that `initialize` is compiled where it is used).
template <class Tag = void>
class basic_guard {
 public:
  /// Calls `initialize(opt)`; the guard shuts down at its end only when this call was the one that initialised.
  explicit basic_guard(const options& opt = {}) : owner_(!is_initialized()) { initialize<Tag>(opt); }
  basic_guard(const basic_guard&) = delete;
  basic_guard& operator=(const basic_guard&) = delete;
  ~basic_guard() {
    if (owner_) shutdown();
  }

 private:
  bool owner_;
};

/// @brief Initialises for its scope (see `basic_guard`).
using guard = basic_guard<>;

/// @brief How this process was launched (the embedded default before `initialize`).
[[nodiscard]] inline launch_info launch() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().launch;
}
/// @brief This process's index, `0 <= process_index() < process_count()` (`jax.process_index`).
[[nodiscard]] inline std::size_t process_index() { return launch().process_index; }
/// @brief Number of processes in the run (`jax.process_count`).
[[nodiscard]] inline std::size_t process_count() { return launch().process_count; }
/// @brief Devices each process owns (`jax.local_device_count`).
[[nodiscard]] inline std::size_t local_device_count() {
  std::lock_guard lock(detail::state_mutex());
  return detail::state().local_devices;
}
/// @brief Devices in the run: `process_count() * local_device_count()` (`jax.device_count`).
[[nodiscard]] inline std::size_t device_count() { return process_count() * local_device_count(); }
/// @brief Every device of the run, in global order `0 .. device_count()-1` (`jax.devices`).
[[nodiscard]] inline std::vector<std::size_t> devices() {
  std::vector<std::size_t> out(device_count());
  for (std::size_t d = 0; d < out.size(); ++d) out[d] = d;
  return out;
}
/// @brief The process that owns global device `device`.
[[nodiscard]] inline std::size_t process_of(std::size_t device) { return device / local_device_count(); }
/// @brief This process's devices, in global order: `[i*T, (i+1)*T)` (`jax.local_devices`).
[[nodiscard]] inline std::vector<std::size_t> local_devices() {
  const std::size_t t = local_device_count();
  const std::size_t first = process_index() * t;
  std::vector<std::size_t> out(t);
  for (std::size_t i = 0; i < t; ++i) out[i] = first + i;
  return out;
}
/// @brief Whether global device `device` belongs to this process.
[[nodiscard]] inline bool is_local(std::size_t device) { return process_of(device) == process_index(); }

/// @brief The transport given to `initialize`, or a single-process one.
[[nodiscard]] inline std::shared_ptr<process_exchange> exchange() {
  std::lock_guard lock(detail::state_mutex());
  if (detail::state().exchange) return detail::state().exchange;
  static const auto single = std::make_shared<single_process_exchange>();
  return single;
}

/// @brief Ends the whole run because of `reason`: prints
/// `meshlib: process i of N aborts the run: <reason>` on this process's stderr, then aborts every
/// process through the transport (`MPI_Abort` under MPI; `std::abort` for one process).
[[noreturn]] inline void abort(std::string_view reason, int exit_code = 1) {
  const auto l = launch();
  meshlib::experimental::write_stderr_line("meshlib: process " + std::to_string(l.process_index) + " of " +
                            std::to_string(l.process_count) + " aborts the run: " + std::string(reason));
  exchange()->abort(exit_code, reason);
}

/// @brief Checks that every process passes the same `value` for `what`: a collective over the
/// transport that throws `process_mismatch` on every process, naming each process's value, so a
/// disagreement fails at start-up instead of hanging the first collective. Does nothing for one
/// process or without a transport.
template <class Tag = void>
void check_same_on_all_processes(std::string_view what, std::string_view value) {
  std::shared_ptr<process_exchange> ex;
  {
    std::lock_guard lock(detail::state_mutex());
    ex = detail::state().exchange;
  }
  if (!ex || ex->size() <= 1) return;
  detail::require_equal<Tag>(what, ex->all_gather(value));
}

/// @brief Checks that `m` covers every device of the run and that every process built the same
/// mesh (axis names and sizes).
/// @throws mesh_error when the mesh has another number of devices; process_mismatch (on every
/// process) when processes built different meshes.
template <mesh_type Mesh>
void check_mesh(const Mesh& m) {
  const std::size_t n = device_count();
  if (m.size() != n) {
    std::ostringstream os;
    os << "meshlib: mesh " << m << " has " << m.size() << " devices but the run has " << n << " (" << process_count()
       << " processes x " << local_device_count() << " local devices); choose axis sizes whose product is " << n;
    throw mesh_error(os.str());
  }
  check_same_on_all_processes("the mesh", m.to_string());
}

/// @brief Builds a mesh over every device of the run and checks it on every process, as
/// `jax.make_mesh` over `jax.devices()`.
template <mesh_axis... Axes, class... Sizes>
mesh<Axes...> make_global_mesh(Sizes... sizes) {
  mesh<Axes...> m(sizes...);
  check_mesh(m);
  return m;
}

/// @brief The mesh coordinates of this process's devices, in `local_devices()` order.
template <mesh_type Mesh>
std::vector<typename Mesh::coord_type> local_coords(const Mesh& m) {
  std::vector<typename Mesh::coord_type> out;
  for (std::size_t d : local_devices()) out.push_back(m.coords(d));
  return out;
}

}  // namespace meshlib::distributed

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Launcher detection: which process this is, out of how many, read from explicit arguments
/// or from the environment a launcher sets, as `jax.distributed.initialize` does. Pure: the
/// environment comes in through an `env_source`, so every launcher is testable in one process.
///
/// Sources, and the variables each reads:
///
/// | source        | process index         | process count        | local rank                    |
/// | ------------- | --------------------- | -------------------- | ----------------------------- |
/// | meshlib       | `MESHLIB_PROCESS_ID`  | `MESHLIB_PROCESS_COUNT` | `MESHLIB_LOCAL_RANK`       |
/// | OpenMPI       | `OMPI_COMM_WORLD_RANK`| `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
/// | MPICH / PMI   | `PMI_RANK`            | `PMI_SIZE`           | `MPI_LOCALRANKID`             |
/// | torchrun      | `RANK`                | `WORLD_SIZE`         | `LOCAL_RANK`                  |
/// | Slurm         | `SLURM_PROCID`        | `SLURM_NTASKS`       | `SLURM_LOCALID`               |
///
/// Rules (the same in `docs/multi-process.md`):
/// - A source counts as present when its process-index variable is set; its count must then be set
///   too, both must be decimal numbers, and index < count, else `distributed_error`.
/// - Explicit arguments, meshlib's variables, OpenMPI, MPICH/PMI and torchrun each describe the
///   process itself: every one that is present must agree on (index, count), else
///   `distributed_error` naming both sources and values. The first present in that order wins.
/// - Slurm describes the task `srun` started, which may itself start several processes (`mpirun`
///   or `torchrun` inside an allocation). So when another source is present, Slurm is checked
///   against it only when it claims at least as many processes: the same count must give the same
///   index, and more tasks than processes is a contradiction.
/// - No source at all: one process (index 0 of 1), the embedded default.

#include <charconv>
#include <cstddef>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include "meshlib/core/deferred.hpp"
#include "meshlib/runtime/errors.hpp"

namespace meshlib::distributed {

/// @brief Where the process index and count came from.
enum class launcher {
  none,                ///< nothing set: one process
  explicit_arguments,  ///< `initialize(options{.process_id = ..., .num_processes = ...})`
  communicator,        ///< an adopted communicator (an `MPI_Comm` handed to meshlib)
  meshlib_env,         ///< `MESHLIB_PROCESS_ID` / `MESHLIB_PROCESS_COUNT`
  openmpi,             ///< `OMPI_COMM_WORLD_RANK` / `OMPI_COMM_WORLD_SIZE` (`mpirun` of OpenMPI)
  mpich,               ///< `PMI_RANK` / `PMI_SIZE` (MPICH's Hydra, Intel MPI, PMI launchers)
  torchrun,            ///< `RANK` / `WORLD_SIZE` (torchrun, torch.distributed.launch)
  slurm,               ///< `SLURM_PROCID` / `SLURM_NTASKS` (`srun`)
};

/// @brief The launcher's name ("mpirun", "slurm", ...), as printed in diagnostics.
[[nodiscard]] constexpr std::string_view to_string(launcher l) noexcept {
  switch (l) {
    case launcher::none: return "none";
    case launcher::explicit_arguments: return "explicit arguments";
    case launcher::communicator: return "communicator";
    case launcher::meshlib_env: return "meshlib environment";
    case launcher::openmpi: return "OpenMPI";
    case launcher::mpich: return "MPICH/PMI";
    case launcher::torchrun: return "torchrun";
    case launcher::slurm: return "Slurm";
  }
  return "unknown";
}
/// @brief Prints the launcher's name (`to_string`).
inline std::ostream& operator<<(std::ostream& os, launcher l) { return os << to_string(l); }

/// @brief What detection found: this process's index, the process count, the local rank on its
/// node when the launcher says, and which source decided.
struct launch_info {
  /// This process's index, from 0.
  std::size_t process_index = 0;
  /// The number of processes of the job.
  std::size_t process_count = 1;
  /// The rank on this node, when the launcher says.
  std::optional<std::size_t> local_rank;
  /// Which launcher's environment (or explicit value) decided.
  launcher source = launcher::none;

  /// Equal when every field is.
  friend bool operator==(const launch_info&, const launch_info&) = default;
  /// Prints `process 1 of 4 (OpenMPI, local rank 1)`.
  friend std::ostream& operator<<(std::ostream& os, const launch_info& i) {
    os << "process " << i.process_index << " of " << i.process_count << " (" << i.source;
    if (i.local_rank) os << ", local rank " << *i.local_rank;
    return os << ')';
  }
};

/// @brief Looks up an environment variable: its value, or nothing when unset.
using env_source = std::function<std::optional<std::string>(std::string_view)>;

/// @brief The process's own environment (`std::getenv`).
/// (The functions of this file are templates only so that their bodies are compiled where they
/// are called, not in every translation unit that includes meshlib: docs/benchmarks.md, "Include
/// cost". Call them as plain functions.)
template <class Tag = void>
env_source process_env() {
  return [](std::string_view name) -> std::optional<std::string> {
    const char* v = std::getenv(std::string(name).c_str());
    if (!v) return std::nullopt;
    return std::string(v);
  };
}

/// @brief An environment given as a map, for tests and for programs that read their configuration
/// elsewhere.
template <class Tag = void>
env_source map_env(std::map<std::string, std::string, std::less<>> vars) {
  return [vars = std::move(vars)](std::string_view name) -> std::optional<std::string> {
    auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

/// @brief Values given to `initialize` that override or must agree with the environment.
struct explicit_launch {
  /// The process index given to `initialize`, if any.
  std::optional<std::size_t> process_id;
  /// The process count given to `initialize`, if any.
  std::optional<std::size_t> num_processes;
};

namespace detail {

struct launcher_vars {
  launcher source;
  std::string_view index, count, local;
};

inline constexpr launcher_vars launcher_table[] = {
    {launcher::meshlib_env, "MESHLIB_PROCESS_ID", "MESHLIB_PROCESS_COUNT", "MESHLIB_LOCAL_RANK"},
    {launcher::openmpi, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"},
    {launcher::mpich, "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"},
    {launcher::torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK"},
    {launcher::slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"},
};

/// A decimal number of the whole (trimmed) string, or `distributed_error` naming the variable.
template <class Tag = void>
std::size_t parse_count(std::string_view var, const std::string& raw) {
  std::string_view s = raw;
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\n')) s.remove_suffix(1);
  std::size_t v = 0;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc{} || ptr != s.data() + s.size())
    throw distributed_error("meshlib: environment variable " + std::string(var) + "='" + raw +
                            "' is not a non-negative decimal number");
  return v;
}

/// One source's claim, with the text that names it in errors.
struct claim {
  launch_info info;
  std::string what;  // "OpenMPI (OMPI_COMM_WORLD_RANK=1, OMPI_COMM_WORLD_SIZE=4)"
};

template <class Tag = void>
std::optional<claim> read_launcher(const launcher_vars& v, const env_source& env) {
  const auto idx = env(v.index);
  if (!idx) return std::nullopt;
  const auto cnt = env(v.count);
  if (!cnt)
    throw distributed_error("meshlib: " + std::string(to_string(v.source)) + " launch detected (" +
                            std::string(v.index) + "=" + *idx + ") but " + std::string(v.count) +
                            " is not set; set both or neither");
  claim c;
  c.info.source = v.source;
  c.info.process_index = parse_count<Tag>(v.index, *idx);
  c.info.process_count = parse_count<Tag>(v.count, *cnt);
  c.what = std::string(to_string(v.source)) + " (" + std::string(v.index) + "=" + *idx + ", " + std::string(v.count) +
           "=" + *cnt + ")";
  if (c.info.process_count == 0 || c.info.process_index >= c.info.process_count)
    throw distributed_error("meshlib: " + c.what + " names a process outside its world: the index must be less than "
                            "the count, and the count at least 1");
  if (const auto loc = env(v.local)) c.info.local_rank = parse_count<Tag>(v.local, *loc);
  return c;
}

template <class Tag = void>
std::string describe_claim(const claim& c) {
  return c.what + ": process " + std::to_string(c.info.process_index) + " of " + std::to_string(c.info.process_count);
}

}  // namespace detail

/// @brief Detects this process's index and the process count from explicit values, an adopted
/// communicator's rank and size (`comm`, index then count), and the environment, by the rules in
/// this file's comment.
/// @throws distributed_error on contradictory or malformed sources, naming every one involved.
template <class Tag = void>
launch_info detect_launch(const env_source& env, const explicit_launch& given = {},
                          std::optional<std::pair<std::size_t, std::size_t>> comm = std::nullopt) {
  using claim = meshlib::experimental::deferred_t<detail::claim, Tag>;  // compiled at the first call
  std::vector<claim> direct;
  if (given.process_id || given.num_processes) {
    if (!given.process_id || !given.num_processes)
      throw distributed_error(
          "meshlib: initialize was given only one of process_id and num_processes; give both or neither");
    claim c;
    c.info = {*given.process_id, *given.num_processes, std::nullopt, launcher::explicit_arguments};
    c.what = "explicit arguments (process_id=" + std::to_string(*given.process_id) +
             ", num_processes=" + std::to_string(*given.num_processes) + ")";
    if (c.info.process_count == 0 || c.info.process_index >= c.info.process_count)
      throw distributed_error("meshlib: " + c.what + " name a process outside its world: process_id must be less "
                              "than num_processes, and num_processes at least 1");
    direct.push_back(std::move(c));
  }
  if (comm) {
    claim c;
    c.info = {comm->first, comm->second, std::nullopt, launcher::communicator};
    c.what = "the adopted communicator (rank " + std::to_string(comm->first) + ", size " +
             std::to_string(comm->second) + ")";
    direct.push_back(std::move(c));
  }
  std::optional<claim> slurm;
  std::vector<claim> env_claims;
  for (const auto& v : detail::launcher_table) {
    auto c = detail::read_launcher<Tag>(v, env);
    if (!c) continue;
    if (v.source == launcher::slurm)
      slurm = std::move(c);
    else
      env_claims.push_back(std::move(*c));
  }
  // An adopted communicator is authoritative for the index and count: an application may hand
  // meshlib a sub-communicator whose ranks differ from the launcher's world, so the environment is
  // only consulted for the local rank then.
  const bool have_comm = comm.has_value();
  if (!have_comm) direct.insert(direct.end(), env_claims.begin(), env_claims.end());

  for (std::size_t i = 1; i < direct.size(); ++i) {
    const auto& a = direct[0].info;
    const auto& b = direct[i].info;
    if (a.process_index != b.process_index || a.process_count != b.process_count)
      throw distributed_error("meshlib: contradictory launch information: " + detail::describe_claim<Tag>(direct[0]) +
                              ", but " + detail::describe_claim<Tag>(direct[i]) +
                              "; unset the stale variables or fix the arguments");
  }

  launch_info out;
  if (!direct.empty()) {
    out = direct[0].info;
    if (slurm && !have_comm) {
      const auto& s = slurm->info;
      const bool contradicts = s.process_count > out.process_count ||
                               (s.process_count == out.process_count && s.process_index != out.process_index);
      if (contradicts)
        throw distributed_error("meshlib: contradictory launch information: " + detail::describe_claim<Tag>(direct[0]) +
                                ", but " + detail::describe_claim<Tag>(*slurm) +
                                "; a Slurm step may start several processes per task but never fewer processes "
                                "than tasks");
    }
  } else if (slurm) {
    out = slurm->info;
  }
  // The local rank: from the winning source, else from any other that sets one.
  if (!out.local_rank) {
    for (const auto& c : direct)
      if (c.info.local_rank) {
        out.local_rank = c.info.local_rank;
        break;
      }
    if (!out.local_rank)
      for (const auto& c : env_claims)
        if (c.info.local_rank) {
          out.local_rank = c.info.local_rank;
          break;
        }
    if (!out.local_rank && slurm && slurm->info.process_count == out.process_count) out.local_rank = slurm->info.local_rank;
  }
  return out;
}

}  // namespace meshlib::distributed

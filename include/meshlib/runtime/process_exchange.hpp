// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief `process_exchange`: the one thing the runtime needs from a transport between processes,
/// to check at start-up that every process was given the same arguments, and to abort them all
/// with a reason. The MPI backend provides one over an `MPI_Comm` (`meshlib::mpi::exchange`); a
/// single process needs none.

#include <cstddef>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

namespace meshlib::distributed {

/// @brief A transport between the processes of one run.
class process_exchange {
 public:
  virtual ~process_exchange() = default;
  /// This process's rank in the transport.
  [[nodiscard]] virtual std::size_t rank() const = 0;
  /// Number of processes in the transport.
  [[nodiscard]] virtual std::size_t size() const = 0;
  /// Every process's `mine`, in rank order. Collective: every process calls it.
  [[nodiscard]] virtual std::vector<std::string> all_gather(std::string_view mine) = 0;
  /// Ends every process of the run with `reason` printed by the caller first (`MPI_Abort`).
  [[noreturn]] virtual void abort(int exit_code, std::string_view reason) = 0;
};

/// @brief The exchange of a run of one process: gathers its own value, aborts with `std::abort`.
class single_process_exchange final : public process_exchange {
 public:
  [[nodiscard]] std::size_t rank() const override { return 0; }
  [[nodiscard]] std::size_t size() const override { return 1; }
  [[nodiscard]] std::vector<std::string> all_gather(std::string_view mine) override { return {std::string(mine)}; }
  [[noreturn]] void abort(int, std::string_view) override { std::abort(); }
};

}  // namespace meshlib::distributed

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The runtime over MPI: `meshlib::mpi::initialize` starts MPI when the program has not,
/// adopts the application's communicator, and runs `distributed::initialize` with an exchange over
/// it (so that the start-up consistency checks and `distributed::abort` reach every process);
/// a terminate handler turns an uncaught exception on one rank into an `MPI_Abort` with a readable
/// reason instead of a silent hang of the others.
///
/// @code
/// int main(int argc, char** argv) {
///   MPI_Init(&argc, &argv);                 // or let meshlib do it
///   {
///     meshlib::mpi::guard run(MPI_COMM_WORLD);
///     auto comm = meshlib::mpi::world();    // an mpi_communicator over the adopted MPI_Comm
///     ...
///   }
///   MPI_Finalize();
/// }
/// @endcode

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <span>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/detail/failure.hpp"
#include "meshlib/comm/mpi/mpi_communicator.hpp"
#include "meshlib/runtime/distributed.hpp"
#include "meshlib/runtime/process_exchange.hpp"

namespace meshlib::mpi {

/// @brief A `process_exchange` over an `mpi_communicator`: its waits have the communicator's
/// timeout, and `abort` is `MPI_Abort`.
class exchange final : public distributed::process_exchange {
 public:
  /// Exchanges over `comm`'s ranks, one process each.
  explicit exchange(mpi_communicator comm) : comm_(std::move(comm)) {}
  [[nodiscard]] std::size_t rank() const override { return static_cast<std::size_t>(comm_.rank()); }
  [[nodiscard]] std::size_t size() const override { return static_cast<std::size_t>(comm_.size()); }

  /// Strings travel as 32-bit words (the communicator moves numbers, not bytes), padded to the
  /// longest: a length exchange, then one all_gather.
  [[nodiscard]] std::vector<std::string> all_gather(std::string_view mine) override {
    const std::size_t n = size();
    std::int64_t len = static_cast<std::int64_t>(mine.size());
    std::vector<std::int64_t> lens(n);
    comm_.all_gather(std::span<const std::int64_t>(&len, 1), std::span(lens));
    std::int64_t longest = 0;
    for (auto l : lens) longest = std::max(longest, l);
    const std::size_t words = (static_cast<std::size_t>(longest) + 3) / 4;
    std::vector<std::int32_t> packed(words, 0), all(words * n, 0);
    if (!mine.empty()) std::memcpy(packed.data(), mine.data(), mine.size());
    comm_.all_gather(std::span<const std::int32_t>(packed), std::span(all));
    std::vector<std::string> out(n);
    for (std::size_t r = 0; r < n; ++r)
      out[r].assign(reinterpret_cast<const char*>(all.data() + r * words), static_cast<std::size_t>(lens[r]));
    return out;
  }

  [[noreturn]] void abort(int exit_code, std::string_view reason) override { comm_.abort(reason, exit_code); }

  /// The communicator the exchange runs over.
  [[nodiscard]] const mpi_communicator& communicator() const noexcept { return comm_; }

 private:
  mpi_communicator comm_;
};

/// @brief Options of `mpi::initialize`, on top of `distributed::options`.
struct options {
  /// The process-level options (`distributed::options`); the process index and count come from MPI.
  distributed::options runtime;
  /// Options of the `mpi_communicator` made over the processes (timeout, large payloads).
  mpi_comm_options comm;
  /// Install a terminate handler that prints the uncaught exception and calls `MPI_Abort`.
  bool abort_on_uncaught_exception = true;
};

namespace detail {

struct mpi_runtime_state {
  bool started_mpi = false;
  std::shared_ptr<exchange> ex;
  std::terminate_handler previous = nullptr;
};
inline mpi_runtime_state& mpi_state() {
  static mpi_runtime_state s;
  return s;
}

/// The terminate handler: an uncaught exception on one rank ends every rank with its reason.
[[noreturn]] inline void abort_on_terminate() {
  std::string reason = "std::terminate was called";
  if (const auto e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      reason = std::string("uncaught exception: ") + x.what();
    } catch (...) {
      reason = "uncaught exception not derived from std::exception";
    }
  }
  int rank = 0, size = 1, init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  if (init && !fin) {
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
  }
  meshlib::experimental::write_stderr_line("meshlib: MPI rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " aborts the run: " + std::string(reason));
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

}  // namespace detail

/// The process's MPI state as `meshlib::mpi::initialize` left it (the default runner reads it).
using detail::mpi_state;

/// @brief Starts the run over MPI. Initialises MPI (`MPI_Init_thread`, asking for
/// `MPI_THREAD_MULTIPLE`, which hybrid meshes need) when the program has not; adopts `comm`
/// (default `MPI_COMM_WORLD`, never freed); calls `distributed::initialize` with an exchange over
/// it, so the process index and count are `comm`'s rank and size and the start-up checks run on
/// every process. Collective over `comm`. Idempotent, as `distributed::initialize`.
/// @throws distributed_error, process_mismatch (see `distributed::initialize`), comm_error.
inline void initialize(MPI_Comm comm = MPI_COMM_WORLD, const options& opt = {}) {
  auto& st = detail::mpi_state();
  int init = 0;
  MPI_Initialized(&init);
  if (!init) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided) != MPI_SUCCESS)
      throw comm_error("meshlib: MPI_Init_thread failed");
    st.started_mpi = true;
  }
  if (distributed::is_initialized() && st.ex) {
    distributed::options again = opt.runtime;
    again.exchange = st.ex;
    distributed::initialize(again);  // no-op when the same, distributed_error otherwise
    return;
  }
  auto ex = std::make_shared<exchange>(mpi_communicator(comm, opt.comm));
  distributed::options o = opt.runtime;
  o.exchange = ex;
  distributed::initialize(o);
  st.ex = std::move(ex);
  if (opt.abort_on_uncaught_exception && !st.previous) st.previous = std::set_terminate(&detail::abort_on_terminate);
}

/// @brief The communicator of the run (over the `MPI_Comm` given to `initialize`).
/// @throws distributed_error before `mpi::initialize`.
[[nodiscard]] inline mpi_communicator world() {
  auto& st = detail::mpi_state();
  if (!st.ex) throw distributed_error("meshlib: mpi::world() called before mpi::initialize()");
  return st.ex->communicator();
}

/// @brief Ends the run over MPI: `distributed::shutdown`, frees meshlib's communicators, restores
/// the terminate handler, and calls `MPI_Finalize` only when `initialize` called `MPI_Init`.
inline void finalize() {
  auto& st = detail::mpi_state();
  distributed::shutdown();
  st.ex.reset();
  if (st.previous) {
    std::set_terminate(st.previous);
    st.previous = nullptr;
  }
  if (st.started_mpi) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (!fin) MPI_Finalize();
    st.started_mpi = false;
  }
}

/// @brief `initialize` in the constructor, `finalize` in the destructor.
/// Only the guard that initialised finalises: a guard in an initialised program changes nothing.
class guard {
 public:
  /// Calls `initialize(comm, opt)`; the guard finalises at its end only when this call was the one that initialised.
  explicit guard(MPI_Comm comm = MPI_COMM_WORLD, const options& opt = {})
      : owner_(!detail::mpi_state().ex) {
    initialize(comm, opt);
  }
  guard(const guard&) = delete;
  guard& operator=(const guard&) = delete;
  ~guard() {
    if (owner_) finalize();
  }

 private:
  bool owner_;
};

}  // namespace meshlib::mpi

#endif  // MESHLIB_ENABLE_MPI

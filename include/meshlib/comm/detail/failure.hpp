// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Who failed and who is missing: the failure kinds every backend records, the error each
/// one rethrows, and the one wording of a timeout. Written once so that a backend built on another
/// (the hybrid communicator on the thread world and MPI) can restate a failure in its own terms
/// (global device ids, the operation the user called) from the same facts, instead of parsing or
/// copying another backend's message.

#include <chrono>
#include <cstdio>
#include <exception>
#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include "meshlib/comm/errors.hpp"

namespace meshlib::comm::detail {

/// How a group failed; decides the error type every participant rethrows. The values travel
/// between processes in abort-channel reports.
enum class failure_kind : std::uint8_t { aborted = 0, timeout = 1, mismatch = 2 };

/// Throws the error of kind `k` with message `m`.
[[noreturn]] inline void throw_failure(failure_kind k, std::string m) {
  switch (k) {
    case failure_kind::timeout: throw comm_timeout(std::move(m));
    case failure_kind::mismatch: throw collective_mismatch(std::move(m));
    case failure_kind::aborted: break;
  }
  throw comm_aborted(std::move(m));
}

/// The facts of a timeout, in the failed group's own numbering: the participant that detected it
/// and those that never arrived (ascending; empty: every one arrived, but not in time).
struct missing_report {
  int waiter = -1;
  std::vector<int> missing;
};

/// "<noun>(s) 1, 3" for the participants `ids` (as `name(id)` writes each one's number).
template <class Name>
std::string list_participants(std::string_view noun, const std::vector<int>& ids, Name&& name) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : std::string(noun) + "(s) ") + name(ids[i]);
  return s;
}

/// The wording of every timeout: "meshlib: <op> timed out on <waiter> of <n> after <s> s: <missing>
/// never arrived; raise the timeout (<knob>) if they are only slow". `missing` empty: every
/// participant arrived, but late.
inline std::string timeout_message(std::string_view op, std::string_view waiter, int n,
                                   std::chrono::nanoseconds timeout, const std::string& missing,
                                   std::string_view knob) {
  std::ostringstream os;
  os << "meshlib: " << op << " timed out on " << waiter << " of " << n << " after "
     << std::chrono::duration<double>(timeout).count() << " s: ";
  os << (missing.empty() ? std::string("every rank arrived late") : missing + " never arrived");
  os << "; raise the timeout (" << knob << ") if they are only slow";
  return os.str();
}

/// The message of exception `e` (what() of a std::exception), for the root-cause messages of
/// every launcher and runner.
inline std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception not derived from std::exception";
  }
}

/// Writes `line` and a newline to stderr in one write. `std::cerr << a << b` writes each piece
/// separately (stderr is unbuffered), and a launcher that forwards stderr in chunks (mpirun) may put
/// another process's output, or its own abort notice, between the pieces: a test that reads the
/// message then fails now and then (seen once in 150 `mpi_abort_on_throw` runs).
inline void write_stderr_line(std::string line) {
  line += '\n';
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace meshlib::comm::detail

namespace meshlib::experimental {
/// Writes one whole line to stderr at once, so lines from concurrent device threads do not interleave.
using comm::detail::write_stderr_line;

/// The message of an exception pointer (its `what()`, or a placeholder for a non-standard exception).
using comm::detail::what_of;
}  // namespace meshlib::experimental

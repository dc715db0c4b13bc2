// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief Which NCCL a program runs with: `nccl_version()` (the library loaded at run time, from
/// `ncclGetVersion`), `nccl_header_version()` (the `nccl.h` meshlib was compiled against) and
/// `nccl_min_version`, the oldest library meshlib accepts. Every NCCL communicator creation checks
/// the library first and refuses an older one with `comm_error`.
///
/// @code
/// std::cout << "NCCL " << meshlib::nccl_version() << " (headers " << meshlib::nccl_header_version() << ")\n";
/// @endcode
///
/// Why a run-time check: NCCL is a shared library, and the one a program loads is often not the one
/// it was compiled against (a Python wheel such as nvidia-nccl-cu13 puts its own `libnccl.so.2`
/// first on the library path). A library newer or older than the headers is fine as long as it has
/// every call meshlib makes: `ncclCommSplit` (NCCL 2.18) is the newest of them
/// (`ncclCommInitRankConfig` and `ncclCommFinalize` with non-blocking communicators: 2.14;
/// `ncclGetLastError`: 2.13; `ncclAvg` and `ncclBfloat16`: 2.10). An older library fails on the
/// first such call, far from the cause; meshlib names it instead.

#if MESHLIB_ENABLE_NCCL

#include <nccl.h>

#include <compare>
#include <ostream>
#include <string>
#include <string_view>

#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"

namespace meshlib {

/// @brief A version of NCCL, as major.minor.patch.
struct nccl_version_number {
  int major = 0;  ///< 2 for every NCCL meshlib supports
  int minor = 0;  ///< the release (28 in 2.28.9)
  int patch = 0;  ///< the fix release (9 in 2.28.9)

  /// @brief From NCCL's integer code (`NCCL_VERSION_CODE`, `ncclGetVersion`): since 2.9 it is
  /// major * 10000 + minor * 100 + patch (22809 is 2.28.9), before that major * 1000 + minor * 100 +
  /// patch (2708 is 2.7.8), as NCCL's `NCCL_VERSION` macro writes them.
  /// @pre code >= 0
  [[nodiscard]] static constexpr nccl_version_number from_code(int code) noexcept {
    if (code >= 10000) return {code / 10000, code % 10000 / 100, code % 100};
    return {code / 1000, code % 1000 / 100, code % 100};
  }
  /// The integer code NCCL uses for this version (the inverse of `from_code`).
  [[nodiscard]] constexpr int code() const noexcept {
    return major <= 2 && minor <= 8 ? major * 1000 + minor * 100 + patch : major * 10000 + minor * 100 + patch;
  }
  /// "2.28.9".
  [[nodiscard]] std::string to_string() const {
    return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
  }
  /// Versions compare as (major, minor, patch).
  friend constexpr auto operator<=>(const nccl_version_number&, const nccl_version_number&) = default;
  /// Writes "2.28.9".
  friend std::ostream& operator<<(std::ostream& os, const nccl_version_number& v) { return os << v.to_string(); }
};

/// @brief The oldest NCCL library meshlib accepts: 2.18.0, the first with `ncclCommSplit` (see the
/// file comment for the other calls and their versions).
inline constexpr nccl_version_number nccl_min_version{2, 18, 0};

/// @brief The version of the `nccl.h` meshlib was compiled against (`NCCL_VERSION_CODE`).
[[nodiscard]] constexpr nccl_version_number nccl_header_version() noexcept {
  return nccl_version_number::from_code(NCCL_VERSION_CODE);
}

/// @brief The version of the NCCL library this process loaded (`ncclGetVersion`).
/// @throws comm_error when `ncclGetVersion` fails.
[[nodiscard]] inline nccl_version_number nccl_version() {
  int code = 0;
  comm::detail::check_nccl(ncclGetVersion(&code), "nccl_version", "ncclGetVersion");
  return nccl_version_number::from_code(code);
}

namespace comm::detail {

/// "NCCL library 2.28.3, headers 2.28.9": what a message about NCCL's version shows.
[[nodiscard]] inline std::string nccl_versions_text(nccl_version_number library,
                                                    nccl_version_number headers = nccl_header_version()) {
  return "NCCL library " + library.to_string() + ", headers " + headers.to_string();
}

/// Why `library` cannot run meshlib's NCCL backend, or empty when it can. Headers newer than the
/// library are fine (NCCL keeps its ABI within a major version) as long as the library has every
/// call meshlib makes.
[[nodiscard]] inline std::string nccl_version_problem(std::string_view what, nccl_version_number library,
                                                      nccl_version_number headers = nccl_header_version()) {
  if (library >= nccl_min_version) return {};
  return "meshlib: " + std::string(what) + ": the NCCL library this process loaded is " + library.to_string() +
         ", older than " + nccl_min_version.to_string() +
         ", the oldest meshlib supports (it calls ncclCommSplit, new in 2.18; meshlib was compiled against NCCL " +
         headers.to_string() +
         " headers); install a newer NCCL (pip install -U nvidia-nccl-cu13, or your CUDA toolkit's NCCL) and make "
         "sure its libnccl.so.2 is the one loaded (LD_LIBRARY_PATH)";
}

/// Refuses an NCCL library older than `nccl_min_version` (the check every communicator creation
/// makes first). @throws comm_error naming the version found, the minimum and the fix.
inline void require_nccl_version(std::string_view what, nccl_version_number library,
                                 nccl_version_number headers = nccl_header_version()) {
  if (std::string m = nccl_version_problem(what, library, headers); !m.empty()) throw comm_error(m);
}
/// The same for the library this process loaded.
inline void require_nccl_version(std::string_view what) { require_nccl_version(what, nccl_version()); }

}  // namespace comm::detail
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL

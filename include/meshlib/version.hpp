// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief meshlib's version, as macros for the preprocessor and as constants for C++.
///
/// The version's one source is the file `VERSION` at the top of the repository; this header,
/// CMake's project version, the Conan, vcpkg and Spack recipes and pkg-config repeat it, and the
/// test `package_versions_agree` fails when any of them differs.
///
/// Example:
/// @code
/// static_assert(MESHLIB_VERSION >= 100, "this program needs meshlib 0.1.0 or newer");
/// std::cout << "meshlib " << meshlib::version_string << '\n';
/// @endcode

#include <string_view>

/// @brief The major version: changes when a release breaks source compatibility.
#define MESHLIB_VERSION_MAJOR 0
/// @brief The minor version: new features, source compatible within the major version.
#define MESHLIB_VERSION_MINOR 1
/// @brief The patch version: fixes only.
#define MESHLIB_VERSION_PATCH 0
/// @brief The version as one comparable number: major * 10000 + minor * 100 + patch.
#define MESHLIB_VERSION (MESHLIB_VERSION_MAJOR * 10000 + MESHLIB_VERSION_MINOR * 100 + MESHLIB_VERSION_PATCH)
/// @brief The version as a string literal, "major.minor.patch".
#define MESHLIB_VERSION_STRING "0.1.0"

namespace meshlib {

/// @brief The version of the meshlib headers in use, "major.minor.patch" (`MESHLIB_VERSION_STRING`).
inline constexpr std::string_view version_string{MESHLIB_VERSION_STRING};

}  // namespace meshlib

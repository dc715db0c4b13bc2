// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// meshlib 0.1.0: JAX-style SPMD sharding for C++ -- single-header distribution.
// Generated from include/ by scripts/amalgamate.py; do not edit by hand:
// change the headers in include/ and run `python3 scripts/amalgamate.py`.
//
// Configuration. Needs C++20, Kokkos (its headers and library) and threads. Optional parts
// are off unless their macro is defined to 1 before this file is included (or with -D); each
// also needs its library at link time, so none is switched on by finding a header:
//   MESHLIB_ENABLE_KOKKOS_KERNELS=1  (meshlib::kokkos_kernels in CMake)
//       matmul through KokkosBlas::gemm (BLAS speed; link Kokkos Kernels and a BLAS) instead of
//       meshlib's own, much slower kernel
//   MESHLIB_ENABLE_MPI=1  (meshlib::mpi in CMake)
//       <meshlib/mpi.hpp>: the MPI and hybrid process x thread communicators,
//       meshlib::mpi::initialize (link MPI)
//   MESHLIB_ENABLE_NCCL=1  (meshlib::nccl in CMake)
//       the NCCL communicator for CUDA devices (link CUDA's runtime and NCCL)
//   MESHLIB_ENABLE_TBB=1  (meshlib::tbb in CMake)
//       the oneTBB-backed parts, e.g. parallel data loading (link oneTBB)
//   MESHLIB_ENABLE_ZLIB=1  (meshlib::zlib in CMake)
//       the IDX reader of the data pipeline reads .gz files (link zlib)
// To see what was chosen: meshlib::config (kokkos_kernels, mpi, nccl, tbb, matmul_kernel) at
// run time or in `if constexpr`, or define MESHLIB_VERBOSE_CONFIG for a one-line compiler note.
// Version: MESHLIB_VERSION_MAJOR/_MINOR/_PATCH, MESHLIB_VERSION_STRING, meshlib::version_string.
#ifndef MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
#define MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP
// begin meshlib.hpp
/// @file
/// @brief meshlib: JAX-style SPMD sharding for C++. Everything that needs no optional dependency.
/// The MPI and NCCL backends come in through <meshlib/mpi.hpp> and <meshlib/nccl.hpp>.

// begin meshlib/version.hpp
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
// end meshlib/version.hpp
// begin meshlib/config.hpp
/// @file
/// @brief Which optional parts this translation unit was compiled with, as `meshlib::config`.
///
/// Each optional part is switched on by one macro, which the matching CMake target defines (and
/// which a user of the single header defines by hand, next to linking the library it needs):
///
/// | macro                               | CMake target             | what it enables                                       |
/// | ----------------------------------- | ------------------------ | ----------------------------------------------------- |
/// | `MESHLIB_ENABLE_KOKKOS_KERNELS=1`   | meshlib::kokkos_kernels  | matmul through `KokkosBlas::gemm` (BLAS speed) instead of meshlib's own kernel |
/// | `MESHLIB_ENABLE_MPI=1`              | meshlib::mpi             | `<meshlib/mpi.hpp>`: MPI and hybrid communicators, `meshlib::mpi::initialize` |
/// | `MESHLIB_ENABLE_NCCL=1`             | meshlib::nccl            | the NCCL communicator (CUDA devices)                  |
/// | `MESHLIB_ENABLE_TBB=1`              | meshlib::tbb             | the oneTBB-backed parts (parallel data loading)       |
///
/// None is switched on by finding a header with `__has_include`: each needs a library at link
/// time too, and a header found without its library would turn into a link error far from the
/// cause. Define `MESHLIB_VERBOSE_CONFIG` to have the compiler print one line saying which parts
/// are on (and which could be, because their headers are on the include path).
///
/// Example:
/// @code
/// std::cout << "matmul kernel: " << meshlib::config::matmul_kernel << '\n';
/// if constexpr (!meshlib::config::mpi) { /* run on threads only */ }
/// @endcode

#include <string_view>


#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
#define MESHLIB_CONFIG_KOKKOS_KERNELS_ 1
#else
#define MESHLIB_CONFIG_KOKKOS_KERNELS_ 0
#endif
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
#define MESHLIB_CONFIG_MPI_ 1
#else
#define MESHLIB_CONFIG_MPI_ 0
#endif
#if defined(MESHLIB_ENABLE_NCCL) && MESHLIB_ENABLE_NCCL
#define MESHLIB_CONFIG_NCCL_ 1
#else
#define MESHLIB_CONFIG_NCCL_ 0
#endif
#if defined(MESHLIB_ENABLE_TBB) && MESHLIB_ENABLE_TBB
#define MESHLIB_CONFIG_TBB_ 1
#else
#define MESHLIB_CONFIG_TBB_ 0
#endif

namespace meshlib {

/// @brief The optional parts compiled into this translation unit (see the table in the file's doc).
struct config {
  /// @brief meshlib's version, "major.minor.patch".
  static constexpr std::string_view version{MESHLIB_VERSION_STRING};
  /// @brief True when matmul calls `KokkosBlas::gemm` (`MESHLIB_ENABLE_KOKKOS_KERNELS`).
  static constexpr bool kokkos_kernels = MESHLIB_CONFIG_KOKKOS_KERNELS_ == 1;
  /// @brief True when the MPI communicators are available (`MESHLIB_ENABLE_MPI`).
  static constexpr bool mpi = MESHLIB_CONFIG_MPI_ == 1;
  /// @brief True when the NCCL communicator is available (`MESHLIB_ENABLE_NCCL`).
  static constexpr bool nccl = MESHLIB_CONFIG_NCCL_ == 1;
  /// @brief True when the oneTBB-backed parts are available (`MESHLIB_ENABLE_TBB`).
  static constexpr bool tbb = MESHLIB_CONFIG_TBB_ == 1;
  /// @brief The kernel local matmuls use: "KokkosBlas::gemm" or "meshlib built-in".
  static constexpr std::string_view matmul_kernel = kokkos_kernels ? "KokkosBlas::gemm" : "meshlib built-in";
};

}  // namespace meshlib

#if defined(MESHLIB_VERBOSE_CONFIG)
#define MESHLIB_CONFIG_STR_(x) #x
#define MESHLIB_CONFIG_PRAGMA_(x) _Pragma(MESHLIB_CONFIG_STR_(x))
#if MESHLIB_CONFIG_KOKKOS_KERNELS_
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=KokkosBlas::gemm"
#elif __has_include(<KokkosBlas3_gemm.hpp>)
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=built-in (Kokkos Kernels found: define MESHLIB_ENABLE_KOKKOS_KERNELS=1 and link it)"
#else
#define MESHLIB_CONFIG_KK_TEXT_ "matmul=built-in"
#endif
#if MESHLIB_CONFIG_MPI_
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=on"
#elif __has_include(<mpi.h>)
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=off (mpi.h found: define MESHLIB_ENABLE_MPI=1 and link MPI)"
#else
#define MESHLIB_CONFIG_MPI_TEXT_ "mpi=off"
#endif
#if MESHLIB_CONFIG_NCCL_
#define MESHLIB_CONFIG_NCCL_TEXT_ "nccl=on"
#else
#define MESHLIB_CONFIG_NCCL_TEXT_ "nccl=off"
#endif
#if MESHLIB_CONFIG_TBB_
#define MESHLIB_CONFIG_TBB_TEXT_ "tbb=on"
#else
#define MESHLIB_CONFIG_TBB_TEXT_ "tbb=off"
#endif
MESHLIB_CONFIG_PRAGMA_(message("meshlib " MESHLIB_VERSION_STRING ": " MESHLIB_CONFIG_KK_TEXT_ ", " MESHLIB_CONFIG_MPI_TEXT_ ", " MESHLIB_CONFIG_NCCL_TEXT_ ", " MESHLIB_CONFIG_TBB_TEXT_))
#endif
// end meshlib/config.hpp
// begin meshlib/core.hpp
/// @file
/// @brief The core layer: axes, meshes, partition specs, shardings and shard layout math.
/// Standard library only.

// begin meshlib/core/fixed_string.hpp
/// @file
/// @brief `fixed_string`: a string usable as a C++20 class-type template parameter, so that mesh
/// axis names (`axis<"data">`) are part of a type and checked by the compiler.

#include <algorithm>
#include <cstddef>
#include <ostream>
#include <string_view>

namespace meshlib {

/// @brief A compile-time string literal: `fixed_string{"data"}`.
/// @tparam N the size of the literal including its terminating zero.
template <std::size_t N>
struct fixed_string {
  /// The characters, with the terminating NUL.
  char chars[N] = {};

  constexpr fixed_string() = default;
  /// Copies a string literal; implicit, so `axis<"data">` works.
  constexpr fixed_string(const char (&s)[N]) noexcept { std::copy_n(s, N, chars); }

  /// The characters without the NUL.
  [[nodiscard]] constexpr std::string_view view() const noexcept { return {chars, N - 1}; }
  /// The number of characters, NUL excluded.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return N - 1; }
  /// True for `""`.
  [[nodiscard]] constexpr bool empty() const noexcept { return N == 1; }
  /// Converts to `view()`, so a name compares with and passes as a `std::string_view`.
  constexpr operator std::string_view() const noexcept { return view(); }

  /// Equal when the characters are equal; strings of different lengths compare unequal.
  template <std::size_t M>
  [[nodiscard]] friend constexpr bool operator==(const fixed_string& a, const fixed_string<M>& b) noexcept {
    return a.view() == b.view();
  }

  /// Prints the characters.
  friend std::ostream& operator<<(std::ostream& os, const fixed_string& s) { return os << s.view(); }
};

/// @brief Deduces the size from the literal: `fixed_string{"data"}` is a `fixed_string<5>`.
template <std::size_t N>
fixed_string(const char (&)[N]) -> fixed_string<N>;

}  // namespace meshlib
// end meshlib/core/fixed_string.hpp
// begin meshlib/core/errors.hpp
/// @file
/// @brief The exception types of meshlib's core: what a run-time fact (a size, a shape, a device
/// count) can get wrong. Each `what()` names what was expected, what was found, and where.

#include <stdexcept>
#include <string>

namespace meshlib {

/// @brief Base of every exception meshlib throws.
class error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// @brief A mesh that cannot exist: a zero-sized axis, sizes that disagree with the static sizes of
/// the mesh type, or sizes whose product is not the number of devices.
class mesh_error : public error {
 public:
  using error::error;
};

/// @brief A sharding that does not fit a shape: wrong rank, a dimension not divisible where the
/// chosen rule requires it, local shapes that do not assemble into a global one.
class sharding_error : public error {
 public:
  using error::error;
};

}  // namespace meshlib
// end meshlib/core/errors.hpp
// begin meshlib/core/hash.hpp
/// @file
/// @brief FNV-1a (64-bit), the one hash meshlib uses: parameter names' random streams, checkpoint
/// checksums and the fingerprints by which communicators compare their participants' calls.
/// FNV-1a is a bijection of its state for each input unit, so any single substitution changes
/// the result (what the checkpoint's damage check relies on); it is not cryptographic.

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace meshlib::detail {

/// @brief A running FNV-1a hash: feed it bytes or whole words, read `value`.
struct fnv1a {
  /// The FNV-1a 64-bit offset basis and prime (Fowler, Noll, Vo).
  static constexpr std::uint64_t offset_basis = 0xcbf29ce484222325ull, prime = 0x100000001b3ull;
  /// The hash so far.
  std::uint64_t value = offset_basis;

  /// Mixes in one unit (a byte, or a whole word where the caller hashes words).
  constexpr fnv1a& add(std::uint64_t unit) noexcept {
    value = (value ^ unit) * prime;
    return *this;
  }
  /// Mixes in each byte of `bytes`, in order.
  constexpr fnv1a& add_bytes(std::string_view bytes) noexcept {
    for (char c : bytes) add(static_cast<unsigned char>(c));
    return *this;
  }
};

/// FNV-1a of a byte string (the standard 64-bit FNV-1a of those bytes).
constexpr std::uint64_t fnv1a_of(std::string_view bytes) noexcept { return fnv1a{}.add_bytes(bytes).value; }

}  // namespace meshlib::detail

namespace meshlib {
/// @brief FNV-1a, for the layers above core (parameter streams, checkpoint checksums) and a user's
/// own checksums: the same entities as `detail::fnv1a` and `detail::fnv1a_of`.
using detail::fnv1a;
using detail::fnv1a_of;
}  // namespace meshlib
// end meshlib/core/hash.hpp
// begin meshlib/core/axis.hpp
/// @file
/// @brief `axis<"name">`: a named mesh axis. The name is part of the type, so collectives and
/// partition specs that name an axis are checked against the mesh at compile time.

#include <cstddef>
#include <ostream>
#include <span>


namespace meshlib {

/// @brief The size of an axis known only at run time (mdspan's convention).
inline constexpr std::size_t dynamic_extent = std::dynamic_extent;

/// @brief A mesh axis named `Name`, of a size given at run time, or fixed at compile time by `Size`.
/// @code
/// using data  = meshlib::axis<"data">;      // size given when the mesh is built
/// using model = meshlib::axis<"model", 2>;  // always 2
/// @endcode
template <fixed_string Name, std::size_t Size = dynamic_extent>
struct axis {
  static_assert(!Name.empty(), "meshlib: a mesh axis needs a non-empty name");
  static_assert(Size != 0, "meshlib: a mesh axis of static size 0 holds no device");
  /// Tag that opts the axis into the `mesh_axis` concept.
  using is_mesh_axis = void;  // opt-in tag of the mesh_axis concept
  /// The axis name, as written in `axis<"data">`.
  static constexpr fixed_string name = Name;
  /// The compile-time size, or `dynamic_extent` when the size is given at run time.
  static constexpr std::size_t static_size = Size;

  /// Prints `axis<"name">`.
  friend std::ostream& operator<<(std::ostream& os, axis) { return os << "axis<\"" << Name.view() << "\">"; }
};

/// @brief A type that names a mesh axis: `axis<...>` or a type that carries the same nested tag.
template <class T>
concept mesh_axis = requires {
  typename T::is_mesh_axis;
  { T::name.view() };
  { T::static_size } -> std::convertible_to<std::size_t>;
};

}  // namespace meshlib
// end meshlib/core/axis.hpp
// begin meshlib/core/mesh.hpp
/// @file
/// @brief `mesh<Axes...>`: an N-dimensional grid of devices with named axes, as JAX's `Mesh`.
///
/// Devices are numbered in row-major order over the axes: the last axis varies fastest, as in
/// `jax.make_mesh`. The group of a device along a set of axes is the device and every device that
/// differs from it only in those axes; groups are what per-axis communicators are built from.

#include <array>
#include <cstddef>
#include <initializer_list>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

// begin meshlib/core/checked_size.hpp
/// @file
/// @brief Products of sizes that cannot wrap: the element count of a shape, the device count of a
/// mesh, a byte count. Each throws a `meshlib::error` subtype naming what overflowed, instead of
/// wrapping to a small number that passes a later size check and writes past a buffer.
/// @code
/// meshlib::detail::checked_mul(a, b, "the byte count");  // throws sharding_error on overflow
/// @endcode

#include <array>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <string_view>


namespace meshlib::detail {

/// A size that came from a negative signed value (e.g. `mesh{-1}`, `size_t(-8)`) reads as a number
/// near 2^64; anything above 2^62 is refused as certainly not a real size.
inline constexpr std::size_t max_sane_size = std::size_t{1} << 62;

/// `a * b`, or throws `sharding_error` saying that `what` overflows.
inline std::size_t checked_mul(std::size_t a, std::size_t b, std::string_view what) {
  std::size_t r = 0;
  if (__builtin_mul_overflow(a, b, &r))
    throw sharding_error("meshlib: " + std::string(what) + " overflows: " + std::to_string(a) + " x " + std::to_string(b) +
                         " does not fit in 64 bits");
  return r;
}

/// The product of `sizes`; throws `sharding_error` naming `what`, the dimension and its value when a
/// size looks negative (above `max_sane_size`) or the product overflows. Builds no string unless it
/// throws: it runs on every size query.
inline std::size_t checked_product(std::span<const std::size_t> sizes, std::string_view what) {
  const auto where = [&] {
    std::string s = "meshlib: " + std::string(what) + " (";
    for (std::size_t d = 0; d < sizes.size(); ++d) s += (d ? ", " : "") + std::to_string(sizes[d]);
    return s + (sizes.size() == 1 ? ",)" : ")");
  };
  std::size_t n = 1;
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > max_sane_size)
      throw sharding_error(where() + ": dimension " + std::to_string(d) + " has size " + std::to_string(sizes[d]) +
                           " (" + std::to_string(static_cast<long long>(sizes[d])) +
                           " as a signed number), larger than 2^62: a negative or overflowed size?");
    if (__builtin_mul_overflow(n, sizes[d], &n))
      throw sharding_error(where() + ": the element count overflows at dimension " + std::to_string(d) + " (size " +
                           std::to_string(sizes[d]) + "): it does not fit in 64 bits");
  }
  return n;
}

/// `checked_product` of a shape array.
template <std::size_t Rank>
std::size_t checked_product(const std::array<std::size_t, Rank>& shape, std::string_view what) {
  return checked_product(std::span<const std::size_t>(shape.data(), Rank), what);
}

/// The byte count of `count` elements of `T`, checked.
template <class T>
std::size_t checked_bytes(std::size_t count, std::string_view what) {
  return checked_mul(count, sizeof(T), what);
}

}  // namespace meshlib::detail
// end meshlib/core/checked_size.hpp
// begin meshlib/core/diagnostics.hpp
/// @file
/// @brief How meshlib's compile-time errors name what is wrong: one `static_assert`, fired as a
/// statement, whose failing condition spells the operation, the axes and the layout as types that
/// GCC and Clang both print readably.
///
/// How names travel: C++20 cannot put an axis name into a `static_assert` message, so it rides in
/// a type the compiler prints next to the message. GCC prints a class-type template argument as the
/// string it holds: there the names are words, `meshlib::diagnostic::axis<meshlib::fixed_string<5>{"data"}>`.
/// Clang 14 prints the same argument as numbers (`{{100, 97, 116, 97, 0}}`) and nvcc's front end is
/// another printer again; both print a `char` pack as characters, so there the names travel as
/// `meshlib::diagnostic::axis<'d', 'a', 't', 'a'>` (`MESHLIB_DIAGNOSTIC_WORDS` says which).
///
/// Why a function and not a struct: a struct whose `static_assert` fails is an invalid type on
/// Clang, and every later use of it (`T::value`) is a second, third, fourth error. A function whose
/// body fails still returns, so the caller carries on quietly with a `false` and the user reads one
/// error (stdexec's diagnose functions).
/// @code
/// template <class Op, class Axis>
/// consteval bool psum_over_invariant_axis() {
///   static_assert(meshlib::detail::always_false<Op, Axis>, "meshlib: psum over an axis ...; pvary first");
///   return false;
/// }
/// // in the check: psum_over_invariant_axis<diag_op_t<"psum">, diag_axis_t<"model">>()
/// @endcode

#include <cstddef>
#include <string_view>
#include <utility>


/// 1 where the compiler prints a `fixed_string` template argument as its text (GCC; not Clang, not
/// nvcc's front end, which compiles both passes of a .cu file with it defined): the diagnostic names
/// are then `fixed_string`s, else `char` packs (see the file comment).
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#define MESHLIB_DIAGNOSTIC_WORDS 1
#else
#define MESHLIB_DIAGNOSTIC_WORDS 0
#endif

/// @brief The types that only appear in compile-time error messages (a layer names itself with `op_t`).
namespace meshlib::diagnostic {

#if MESHLIB_DIAGNOSTIC_WORDS
/// The collective or function at fault: `op<fixed_string<5>{"psum"}>`.
template <fixed_string Name>
struct op {};
/// A mesh axis name: `axis<fixed_string<6>{"model"}>`.
template <fixed_string Name>
struct axis {};
#else
/// The collective or function at fault: `op<'p', 's', 'u', 'm'>`.
template <char... C>
struct op {};
/// A mesh axis name: `axis<'m', 'o', 'd', 'e', 'l'>`.
template <char... C>
struct axis {};
#endif
/// A set of axes (an `axis_mask` spelled out), in mesh order.
template <class... Axes>
struct axes {};
/// The axes a value varies over / is a pending sum over.
template <class Axes>
struct vary {};
template <class Axes>
struct partial {};
/// Per dimension, the axes the dimension is a block of.
template <class... DimAxes>
struct dims {};
/// A dimension number.
template <std::size_t D>
struct dim {};
/// A value's layout: `value<vary<axes<...>>, partial<axes<>>, dims<axes<...>, axes<>>>`.
template <class Vary, class Partial, class Dims>
struct value {};
/// A partition spec, one entry per dimension: `spec<axes<axis<"data">>, axes<>>` (`axis` as above).
template <class... Entries>
struct spec {};
/// The size of a dimension or axis known only at run time.
struct dynamic {};
/// A size known at compile time.
template <std::size_t N>
struct size {};

}  // namespace meshlib::diagnostic

namespace meshlib::detail {

/// False for every argument list, but only once the arguments are known: the condition of every
/// diagnostic, so that the compiler prints the arguments next to the message.
template <class... T>
inline constexpr bool always_false = false;

/// `diagnostic::op` and `diagnostic::axis` for the characters of `Name::value` (a `std::string_view`
/// static member). The name comes in a class, not as a `std::string_view const&` template argument:
/// nvcc's front end (13.0) writes a reference template argument into the host code as a pointer
/// (`&X`), so `S.size()` there does not compile.
template <class Name, class Seq = std::make_index_sequence<Name::value.size()>>
struct diag_name;
template <class Name, std::size_t... I>
struct diag_name<Name, std::index_sequence<I...>> {
#if MESHLIB_DIAGNOSTIC_WORDS
  using op = diagnostic::op<fixed_string<sizeof...(I) + 1>({Name::value[I]..., '\0'})>;
  using axis = diagnostic::axis<fixed_string<sizeof...(I) + 1>({Name::value[I]..., '\0'})>;
#else
  using op = diagnostic::op<Name::value[I]...>;
  using axis = diagnostic::axis<Name::value[I]...>;
#endif
};

// The names are static members of class templates, not variable templates: nvcc (13.0) rejects a
// variable template initialised from a template parameter when it is a reference template argument
// ("declaration is incompatible"), and <meshlib/nccl.hpp> must compile in .cu files too.
/// `Name` as a `std::string_view` with static storage (the name class `diag_name` reads).
template <fixed_string Name>
struct name_view {
  static constexpr std::string_view value = Name.view();
};

/// `diagnostic::axis` for the name `"data"`.
template <fixed_string Name>
using diag_axis_t = typename diag_name<name_view<Name>>::axis;
/// `diagnostic::op` for the name `"psum"`.
template <fixed_string Name>
using diag_op_t = typename diag_name<name_view<Name>>::op;

/// The name of axis `I` of `Mesh`, with static storage (see `name_view`).
template <class Mesh, std::size_t I>
struct mesh_axis_name {
  static constexpr std::string_view value = Mesh::axis_names[I];
};

template <class Mesh, unsigned Mask, class Seq = std::make_index_sequence<Mesh::ndim>>
struct diag_axes_impl;
template <class A, class B>
struct concat_axes;
template <class... A, class... B>
struct concat_axes<diagnostic::axes<A...>, diagnostic::axes<B...>> {
  using type = diagnostic::axes<A..., B...>;
};
template <class Mesh, unsigned Mask, std::size_t I>
using one_axis_t = std::conditional_t<((Mask >> I) & 1u) != 0,
                                      diagnostic::axes<typename diag_name<mesh_axis_name<Mesh, I>>::axis>,
                                      diagnostic::axes<>>;
template <class Mesh, unsigned Mask>
struct diag_axes_impl<Mesh, Mask, std::index_sequence<>> {
  using type = diagnostic::axes<>;
};
template <class Mesh, unsigned Mask, std::size_t I0, std::size_t... I>
struct diag_axes_impl<Mesh, Mask, std::index_sequence<I0, I...>> {
  using type = typename concat_axes<one_axis_t<Mesh, Mask, I0>,
                                    typename diag_axes_impl<Mesh, Mask, std::index_sequence<I...>>::type>::type;
};

/// The axes of `Mesh` in `Mask`, spelled out: `diagnostic::axes<axis<"data">>` (`axis` as above).
template <class Mesh, unsigned Mask>
using diag_axes_t = typename diag_axes_impl<Mesh, Mask>::type;

/// `diagnostic::size<N>`, or `diagnostic::dynamic` for a size known only at run time.
template <std::size_t N>
using diag_size_t = std::conditional_t<N == static_cast<std::size_t>(-1), diagnostic::dynamic, diagnostic::size<N>>;

}  // namespace meshlib::detail

/// What a layer written outside core (nn's, or a user's) spells its own compile-time errors with.
namespace meshlib::diagnostic {
/// False for every argument list, once the arguments are known: a diagnostic's condition.
using detail::always_false;
/// `op` for the name `"conv2d"`: how a layer names itself in errors (its
/// `diagnostic_name`).
template <fixed_string Name>
using op_t = detail::diag_op_t<Name>;
/// The axes of `Mesh` in `Mask`, spelled out: `axes<axis<..."data"...>>`.
template <class Mesh, unsigned Mask>
using axes_t = detail::diag_axes_t<Mesh, Mask>;
}  // namespace meshlib::diagnostic
// end meshlib/core/diagnostics.hpp

namespace meshlib {

namespace detail {

template <class... Axes>
consteval bool axis_names_unique() {
  constexpr std::array<std::string_view, sizeof...(Axes)> names{Axes::name.view()...};
  for (std::size_t i = 0; i < names.size(); ++i)
    for (std::size_t j = i + 1; j < names.size(); ++j)
      if (names[i] == names[j]) return false;
  return true;
}

template <class Axis, class MeshAxes>
consteval bool mesh_has_no_axis() {
  static_assert(always_false<Axis, MeshAxes>,
                "meshlib: the mesh has no axis of this name (the name and the mesh's axes are spelled out in the "
                "condition); name one of the mesh's axes");
  return false;
}

}  // namespace detail

/// @brief A set of mesh axes, given by their positions in the mesh (bit i: axis i).
/// Used for the device groups of collectives over several axes at once.
using axis_mask = unsigned;

/// @brief A device mesh with named axes `Axes...` (each an `axis<"name">` or `axis<"name", size>`).
/// @code
/// meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 4};  // 8 devices
/// m.coords(5);                    // {1, 1}
/// m.group<"model">(5);            // {4, 5, 6, 7}: device 5 and all that differ only in "model"
/// @endcode
template <mesh_axis... Axes>
class mesh {
  static_assert(sizeof...(Axes) > 0, "meshlib: a mesh needs at least one axis");
  static_assert(detail::axis_names_unique<Axes...>(),
                "meshlib: two axes of this mesh have the same name; each axis name must be unique");
  static_assert(sizeof...(Axes) <= 8 * sizeof(axis_mask), "meshlib: too many mesh axes");

 public:
  /// Tag that opts the mesh into the `mesh_type` concept.
  using is_mesh = void;
  /// The number of axes.
  static constexpr std::size_t ndim = sizeof...(Axes);
  /// A device coordinate: one index per axis, in mesh order.
  using coord_type = std::array<std::size_t, ndim>;

  /// The axis names, in mesh order.
  static constexpr std::array<std::string_view, ndim> axis_names{Axes::name.view()...};
  /// The compile-time sizes (`dynamic_extent` where the size is given at run time).
  static constexpr std::array<std::size_t, ndim> static_sizes{Axes::static_size...};
  /// How many axes take their size at run time (the constructor's arguments).
  static constexpr std::size_t num_dynamic = ((Axes::static_size == dynamic_extent ? 1 : 0) + ...);

  /// Position of the axis called `name`, or `ndim` when the mesh has no such axis.
  static constexpr std::size_t find_axis(std::string_view name) noexcept {
    for (std::size_t i = 0; i < ndim; ++i)
      if (axis_names[i] == name) return i;
    return ndim;
  }
  /// True when the mesh has an axis called `Name`; for `if constexpr` and `requires`.
  template <fixed_string Name>
  static constexpr bool has_axis = find_axis(Name.view()) < ndim;
  /// Position of axis `Name` in the mesh; naming an axis the mesh lacks does not compile.
  template <fixed_string Name>
  static constexpr std::size_t axis_position = [] {
    if constexpr (!has_axis<Name>)
      detail::mesh_has_no_axis<detail::diag_axis_t<Name>, detail::diag_axes_t<mesh, (ndim == 8 * sizeof(axis_mask) ? ~axis_mask{0} : (axis_mask{1} << ndim) - 1)>>();
    return find_axis(Name.view());
  }();

  /// A mesh whose every axis has a static size.
  constexpr mesh() requires(num_dynamic == 0) : sizes_{static_sizes} { finish(); }

  /// Sizes for every axis, or only for the axes of dynamic size (mdspan's extents convention).
  template <class... Sizes>
    requires(sizeof...(Sizes) > 0 && (std::convertible_to<Sizes, std::size_t> && ...) &&
             (sizeof...(Sizes) == ndim || sizeof...(Sizes) == num_dynamic))
  constexpr explicit mesh(Sizes... sizes) {
    std::array<std::size_t, sizeof...(Sizes)> given{static_cast<std::size_t>(sizes)...};
    assign(std::span<const std::size_t>(given));
  }

  /// Sizes for every axis, in mesh order.
  constexpr explicit mesh(const coord_type& sizes) { assign(std::span<const std::size_t>(sizes)); }

  /// Number of devices.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return size_; }
  /// The sizes of all axes, in mesh order.
  [[nodiscard]] constexpr const coord_type& shape() const noexcept { return sizes_; }
  /// Size of the axis at position `i`.
  [[nodiscard]] constexpr std::size_t axis_size(std::size_t i) const noexcept { return sizes_[i]; }
  /// Size of the axis called `Name`.
  template <fixed_string Name>
  [[nodiscard]] constexpr std::size_t axis_size() const noexcept { return sizes_[axis_position<Name>]; }
  /// Product of the sizes of the axes in `mask`.
  [[nodiscard]] constexpr std::size_t axes_size(axis_mask mask) const noexcept {
    std::size_t n = 1;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (axis_mask{1} << i)) n *= sizes_[i];
    return n;
  }

  /// Mesh coordinates of `device` (row-major: the last axis varies fastest).
  [[nodiscard]] constexpr coord_type coords(std::size_t device) const noexcept {
    coord_type c{};
    for (std::size_t i = ndim; i-- > 0;) {
      c[i] = device % sizes_[i];
      device /= sizes_[i];
    }
    return c;
  }
  /// Device at mesh coordinates `c`.
  [[nodiscard]] constexpr std::size_t device_at(const coord_type& c) const noexcept {
    std::size_t d = 0;
    for (std::size_t i = 0; i < ndim; ++i) d = d * sizes_[i] + c[i];
    return d;
  }

  /// Mask of the axes named `Names...`.
  template <fixed_string... Names>
  static constexpr axis_mask mask_of() noexcept {
    return ((axis_mask{1} << axis_position<Names>) | ... | axis_mask{0});
  }
  /// Mask of every axis.
  static constexpr axis_mask all_axes = ndim == 8 * sizeof(axis_mask) ? ~axis_mask{0} : (axis_mask{1} << ndim) - 1;

  /// Rank of `device` within its group along `mask`: its row-major index over the axes in `mask`.
  [[nodiscard]] constexpr std::size_t group_rank(std::size_t device, axis_mask mask) const noexcept {
    return linear_over(coords(device), mask);
  }
  /// Which group along `mask` the device belongs to: its row-major index over the other axes.
  /// Equal for exactly the members of one group (the `color` of a communicator split).
  [[nodiscard]] constexpr std::size_t group_color(std::size_t device, axis_mask mask) const noexcept {
    return linear_over(coords(device), all_axes & ~mask);
  }
  /// The group of `device` along the axes in `mask`, in group-rank order.
  [[nodiscard]] std::vector<std::size_t> group(std::size_t device, axis_mask mask) const {
    const coord_type base = coords(device);
    const std::size_t n = axes_size(mask);
    std::vector<std::size_t> out;
    out.reserve(n);
    for (std::size_t r = 0; r < n; ++r) {
      coord_type c = base;
      std::size_t rest = r;
      for (std::size_t i = ndim; i-- > 0;) {
        if (!(mask & (axis_mask{1} << i))) continue;
        c[i] = rest % sizes_[i];
        rest /= sizes_[i];
      }
      out.push_back(device_at(c));
    }
    return out;
  }
  /// The group of `device` along the axes named `Names...`.
  template <fixed_string... Names>
  [[nodiscard]] std::vector<std::size_t> group(std::size_t device) const {
    return group(device, mask_of<Names...>());
  }

  /// Throws `mesh_error` unless the mesh has exactly `device_count` devices.
  void check_device_count(std::size_t device_count) const {
    if (size_ != device_count) {
      std::ostringstream os;
      os << "meshlib: mesh " << *this << " has " << size_ << " devices but " << device_count
         << " devices are available; choose axis sizes whose product is " << device_count;
      throw mesh_error(os.str());
    }
  }

  /// Meshes of one type are equal when their axis sizes are.
  friend constexpr bool operator==(const mesh& a, const mesh& b) noexcept { return a.sizes_ == b.sizes_; }

  /// Prints `mesh{'data': 2, 'model': 4}`, as JAX prints a mesh's shape.
  friend std::ostream& operator<<(std::ostream& os, const mesh& m) {
    os << "mesh{";
    for (std::size_t i = 0; i < ndim; ++i) os << (i ? ", " : "") << '\'' << axis_names[i] << "': " << m.sizes_[i];
    return os << '}';
  }
  /// The mesh as `operator<<` prints it: each axis name with its size, in mesh order.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  constexpr std::size_t linear_over(const coord_type& c, axis_mask mask) const noexcept {
    std::size_t r = 0;
    for (std::size_t i = 0; i < ndim; ++i)
      if (mask & (axis_mask{1} << i)) r = r * sizes_[i] + c[i];
    return r;
  }

  constexpr void assign(std::span<const std::size_t> given) {
    if (given.size() == ndim) {
      for (std::size_t i = 0; i < ndim; ++i) {
        if (static_sizes[i] != dynamic_extent && given[i] != static_sizes[i]) {
          throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has static size " +
                           std::to_string(static_sizes[i]) + " but was given size " + std::to_string(given[i]));
        }
        sizes_[i] = given[i];
      }
    } else {
      std::size_t k = 0;
      for (std::size_t i = 0; i < ndim; ++i) sizes_[i] = static_sizes[i] == dynamic_extent ? given[k++] : static_sizes[i];
    }
    finish();
  }

  constexpr void finish() {
    size_ = 1;
    for (std::size_t i = 0; i < ndim; ++i) {
      if (sizes_[i] == 0)
        throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has size 0; every mesh axis needs at least one device");
      // A negative size converted to std::size_t (mesh{-1}) reads as a number near 2^64.
      if (sizes_[i] > detail::max_sane_size)
        throw mesh_error("meshlib: axis '" + std::string(axis_names[i]) + "' has size " + std::to_string(sizes_[i]) +
                         " (" + std::to_string(static_cast<long long>(sizes_[i])) +
                         " as a signed number); a mesh axis size must be positive");
      if (__builtin_mul_overflow(size_, sizes_[i], &size_))
        throw mesh_error("meshlib: the device count of the mesh overflows at axis '" + std::string(axis_names[i]) +
                         "' (size " + std::to_string(sizes_[i]) + "): the product of the axis sizes does not fit in 64 bits");
    }
  }

  coord_type sizes_{};
  std::size_t size_ = 1;
};

/// @brief A type that is a `mesh<...>`.
template <class T>
concept mesh_type = requires { typename T::is_mesh; };

namespace detail {

/// Throws `mesh_error` unless the devices of `m` can run: every communicator numbers its ranks
/// with an `int` (MPI's, NCCL's, the thread communicator's), so `what` (`spmd`, `shard_map`,
/// `reshard`) refuses a mesh of more than `INT_MAX` devices, naming the axis at which the count
/// passes it, before anything is allocated per device (`spmd` on `mesh{2^32 + 2}` otherwise ends
/// in `std::bad_alloc`). A mesh as a description (layouts, shardings) may be larger.
template <mesh_type Mesh>
void require_runnable(const Mesh& m, std::string_view what) {
  constexpr std::size_t limit = static_cast<std::size_t>(std::numeric_limits<int>::max());
  if (m.size() <= limit) return;
  std::size_t n = 1;
  std::size_t at = 0;
  for (; at < Mesh::ndim; ++at) {
    n *= m.axis_size(at);  // a prefix of the product that the mesh checked fits in 64 bits
    if (n > limit) break;
  }
  throw mesh_error("meshlib: " + std::string(what) + " on " + m.to_string() + ": the mesh has " +
                   std::to_string(m.size()) + " devices, more than the " + std::to_string(limit) +
                   " that a communicator's int ranks can number; axis '" + std::string(Mesh::axis_names[at]) +
                   "' (size " + std::to_string(m.axis_size(at)) + ") takes the device count past it: use a mesh "
                   "of at most " + std::to_string(limit) + " devices");
}

}  // namespace detail

/// @brief Builds a mesh and checks it against the number of devices, as `jax.make_mesh`.
/// @throws mesh_error when the product of `sizes` is not `device_count`.
template <mesh_axis... Axes, class... Sizes>
mesh<Axes...> make_mesh(std::size_t device_count, Sizes... sizes) {
  mesh<Axes...> m(sizes...);
  m.check_device_count(device_count);
  return m;
}

}  // namespace meshlib
// end meshlib/core/mesh.hpp
// begin meshlib/core/partition_spec.hpp
/// @file
/// @brief `partition_spec` / `P<...>`: how each dimension of a tensor is split over mesh axes, as
/// JAX's `PartitionSpec`. One entry per dimension: an axis name (`"data"`), `none` (that dimension
/// is replicated), or several axes at once (`axes("data", "fsdp")`, major to minor). Dimensions past
/// the last entry are replicated, as in JAX.
///
/// @code
/// using batch_sharded = meshlib::P<"data", meshlib::none>;          // rows over 'data'
/// using fsdp          = meshlib::P<meshlib::axes("data", "fsdp")>;  // rows over data x fsdp
/// @endcode

#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

namespace meshlib {

/// @brief The value that marks a replicated dimension in a partition spec (JAX's `None`).
struct none_t {
  /// All `none` values are equal.
  friend constexpr bool operator==(none_t, none_t) noexcept { return true; }
};
/// @brief A replicated dimension in a partition spec: JAX's `None` in `P("data", None)`.
inline constexpr none_t none{};

/// @brief One entry of a partition spec: the mesh axes (0 to `max_axes`) a dimension is split over.
/// A structural type, so specs are template arguments; built implicitly from `"name"` or `none`,
/// and by `axes(...)` for several axes.
struct dim_spec {
  /// The most mesh axes one dimension can be split over.
  static constexpr std::size_t max_axes = 4;
  /// The longest axis name, NUL included, a dim_spec can hold.
  static constexpr std::size_t max_name = 32;

  /// The axis names, in the order given; the first `count` are used.
  char names[max_axes][max_name] = {};
  /// How many axes the dimension is split over (0: replicated).
  std::size_t count = 0;

  constexpr dim_spec() = default;
  /// Member by member. nvcc's front end (13.0) writes a `dim_spec` template argument into the host
  /// code as `{names, count}`, which needs this constructor (the type is not an aggregate).
  constexpr dim_spec(const char (&n)[max_axes][max_name], std::size_t c) noexcept : count(c) {
    for (std::size_t i = 0; i < max_axes; ++i)
      for (std::size_t j = 0; j < max_name; ++j) names[i][j] = n[i][j];
  }
  /// A replicated dimension: `P<none>`.
  constexpr dim_spec(none_t) noexcept {}
  /// A dimension split over one axis: `P<"data">`.
  template <std::size_t N>
  constexpr dim_spec(const char (&name)[N]) {  // NOLINT: implicit on purpose, P<"data">
    push(name);
  }

  /// Appends axis `name`; used by `axes(...)` to split a dimension over several axes.
  template <std::size_t N>
  constexpr void push(const char (&name)[N]) {
    static_assert(N <= max_name, "meshlib: axis names in a partition spec are limited to 31 characters");
    static_assert(N > 1, "meshlib: an empty axis name in a partition spec; use meshlib::none for a replicated dimension");
    if (count == max_axes) throw "meshlib: a dimension can be split over at most 4 mesh axes";
    for (std::size_t i = 0; i < N; ++i) names[count][i] = name[i];
    ++count;
  }

  /// The name of the `i`-th axis (`i < size()`).
  [[nodiscard]] constexpr std::string_view axis(std::size_t i) const noexcept {
    return std::string_view(names[i]);
  }
  /// How many axes the dimension is split over.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return count; }
  /// True when the dimension is not split (`none`).
  [[nodiscard]] constexpr bool replicated() const noexcept { return count == 0; }
  /// True when the dimension is split over axis `name`.
  [[nodiscard]] constexpr bool uses(std::string_view name) const noexcept {
    for (std::size_t i = 0; i < count; ++i)
      if (axis(i) == name) return true;
    return false;
  }

  /// Equal when they name the same axes in the same order.
  friend constexpr bool operator==(const dim_spec& a, const dim_spec& b) noexcept {
    if (a.count != b.count) return false;
    for (std::size_t i = 0; i < a.count; ++i)
      if (a.axis(i) != b.axis(i)) return false;
    return true;
  }

  /// Prints `"data"`, `none`, or `axes("data", "fsdp")`.
  friend std::ostream& operator<<(std::ostream& os, const dim_spec& d) {
    if (d.count == 0) return os << "none";
    if (d.count == 1) return os << '"' << d.axis(0) << '"';
    os << "axes(";
    for (std::size_t i = 0; i < d.count; ++i) os << (i ? ", " : "") << '"' << d.axis(i) << '"';
    return os << ')';
  }
};

/// @brief A dimension split over several mesh axes, the first major: `axes("data", "fsdp")` is JAX's
/// `('data', 'fsdp')` entry.
template <std::size_t... N>
  requires(sizeof...(N) >= 1 && sizeof...(N) <= dim_spec::max_axes)
constexpr dim_spec axes(const char (&... names)[N]) {
  dim_spec d;
  (d.push(names), ...);
  return d;
}

/// @brief A partition spec: entry `i` says how tensor dimension `i` is split. JAX's `P`
/// (`PartitionSpec`); `partition_spec` is the long name.
///
/// `P` is the class and `partition_spec` the alias, not the other way round: nvcc's front end (13.0)
/// loses the values of an alias template's class-type arguments (`P<"data", none>` through an
/// alias reaches the host compiler as `partition_spec<__T2, __T3>`, undeclared names), and `P` is
/// what users write, in CUDA translation units too.
template <dim_spec... Dims>
struct P {
  /// Tag that opts the spec into the `partition_spec_type` concept.
  using is_partition_spec = void;
  /// The number of dimensions the spec describes.
  static constexpr std::size_t size = sizeof...(Dims);
  /// The per-dimension entries, in dimension order.
  static constexpr std::array<dim_spec, sizeof...(Dims)> dims{Dims...};

  /// The entry for dimension `d` (`none` past the end: trailing dimensions are replicated).
  static constexpr dim_spec dim(std::size_t d) noexcept { return d < size ? dims[d] : dim_spec{}; }

  /// True when some dimension is split over `name`.
  static constexpr bool uses(std::string_view name) noexcept {
    for (const auto& d : dims)
      if (d.uses(name)) return true;
    return false;
  }
  /// The dimension split over `name`, or `size` when none is.
  static constexpr std::size_t dim_of(std::string_view name) noexcept {
    for (std::size_t i = 0; i < size; ++i)
      if (dims[i].uses(name)) return i;
    return size;
  }

  /// Prints `P<"data", none>`.
  friend std::ostream& operator<<(std::ostream& os, P) {
    os << "P<";
    for (std::size_t i = 0; i < size; ++i) os << (i ? ", " : "") << dims[i];
    return os << '>';
  }
  /// The spec as `operator<<` prints it, such as `P<"data", none>`.
  static std::string to_string() {
    std::ostringstream os;
    os << P{};
    return os.str();
  }
};

/// @brief The long name of `P`.
template <dim_spec... Dims>
using partition_spec = P<Dims...>;

/// @brief A type that is a `partition_spec<...>`.
template <class T>
concept partition_spec_type = requires { typename T::is_partition_spec; };

}  // namespace meshlib
// end meshlib/core/partition_spec.hpp
// begin meshlib/core/named_sharding.hpp
/// @file
/// @brief `named_sharding<Mesh, Spec>`: a partition spec bound to a mesh, as JAX's `NamedSharding`.
/// The pairing is checked when the type is formed: every axis the spec names must be in the mesh,
/// and no axis may appear twice. A spec longer than a tensor's rank is rejected where the rank is
/// known (`check_rank<Rank>()`, used by the tensor layer).

#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>


namespace meshlib {

/// @brief How a dimension whose size is not a multiple of its number of shards is split.
enum class shard_rule {
  /// Every dimension must divide evenly (the default; JAX's shard_map requires it).
  even,
  /// Blocks of ceil(size / shards) elements; trailing blocks are smaller or empty, as
  /// `torch.chunk` and DTensor's `Shard` do. Never loses or duplicates an element.
  uneven,
};

namespace detail {

/// Position in `Mesh` of the first axis `Spec` names that the mesh lacks, as (dim, axis-in-dim),
/// or {Spec::size, 0} when every axis exists.
template <class Mesh, class Spec>
consteval std::pair<std::size_t, std::size_t> first_unknown_axis() {
  for (std::size_t d = 0; d < Spec::size; ++d)
    for (std::size_t k = 0; k < Spec::dims[d].size(); ++k)
      if (Mesh::find_axis(Spec::dims[d].axis(k)) == Mesh::ndim) return {d, k};
  return {Spec::size, 0};
}

/// Whether some axis appears twice in `Spec` (in one dimension or in two).
template <class Spec>
consteval bool has_repeated_axis() {
  for (std::size_t d = 0; d < Spec::size; ++d)
    for (std::size_t k = 0; k < Spec::dims[d].size(); ++k)
      for (std::size_t e = d; e < Spec::size; ++e)
        for (std::size_t l = (e == d ? k + 1 : 0); l < Spec::dims[e].size(); ++l)
          if (Spec::dims[d].axis(k) == Spec::dims[e].axis(l)) return true;
  return false;
}

/// The name of the `K`-th axis of dimension `D` of `Spec`, as a name class of `diag_name`.
template <class Spec, std::size_t D, std::size_t K>
struct spec_axis_name {
  static constexpr std::string_view value = Spec::dims[D].axis(K);
};

template <class Spec, std::size_t D, class Seq = std::make_index_sequence<Spec::dim(D).size()>>
struct diag_spec_entry;
template <class Spec, std::size_t D, std::size_t... K>
struct diag_spec_entry<Spec, D, std::index_sequence<K...>> {
  using type = diagnostic::axes<typename diag_name<spec_axis_name<Spec, D, K>>::axis...>;
};
template <class Spec, class Seq = std::make_index_sequence<Spec::size>>
struct diag_spec_impl;
template <class Spec, std::size_t... D>
struct diag_spec_impl<Spec, std::index_sequence<D...>> {
  using type = diagnostic::spec<typename diag_spec_entry<Spec, D>::type...>;
};
/// A partition spec spelled out for a diagnostic: `spec<axes<axis<'d','a','t','a'>>, axes<>>`.
template <class Spec>
using diag_spec_t = typename diag_spec_impl<Spec>::type;

/// Marks a check whose diagnostic has already fired inside (core/diagnostics.hpp): always true, so
/// that the `static_assert` around a class-level check never adds a second error.
constexpr bool diagnosed(bool) noexcept { return true; }

// The diagnostics below name the offending axis and spec in their failing condition (see
// core/diagnostics.hpp): one error on GCC and Clang.
template <class Axis, class Spec, class MeshAxes>
consteval bool spec_names_axis_not_in_mesh() {
  static_assert(always_false<Axis, Spec, MeshAxes>,
                "meshlib: named_sharding: the partition spec names an axis that the mesh does not have (the axis, "
                "the spec and the mesh's axes are spelled out in the condition); add the axis to the mesh or fix its "
                "name in the spec");
  return false;
}

template <class Spec>
consteval bool spec_uses_an_axis_twice() {
  static_assert(always_false<Spec>,
                "meshlib: named_sharding: the partition spec uses a mesh axis twice; a mesh axis can split at most "
                "one dimension, once");
  return false;
}

template <class Rank, class Spec>
consteval bool spec_longer_than_rank() {
  static_assert(always_false<Rank, Spec>,
                "meshlib: the partition spec has more entries than the tensor has dimensions; drop the extra entries");
  return false;
}

/// True when `Spec` fits `Mesh`; otherwise fires the one diagnostic and returns false.
template <class Mesh, class Spec>
consteval bool diagnose_sharding() {
  constexpr auto bad = first_unknown_axis<Mesh, Spec>();
  if constexpr (bad.first < Spec::size) {
    return spec_names_axis_not_in_mesh<typename diag_name<spec_axis_name<Spec, bad.first, bad.second>>::axis,
                                       diag_spec_t<Spec>, diag_axes_t<Mesh, Mesh::all_axes>>();
  } else if constexpr (has_repeated_axis<Spec>()) {
    return spec_uses_an_axis_twice<diag_spec_t<Spec>>();
  } else {
    return true;
  }
}

}  // namespace detail

/// @brief A partition spec `Spec` bound to a mesh of type `Mesh`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", none>> s{mesh_t{2, 4}};
/// @endcode
template <mesh_type Mesh, partition_spec_type Spec>
class named_sharding {
  static_assert(detail::diagnosed(detail::diagnose_sharding<Mesh, Spec>()));

 public:
  /// Tag that opts the sharding into the `sharding_type` concept.
  using is_named_sharding = void;
  /// The mesh the sharding places blocks on.
  using mesh_type = Mesh;
  /// The partition spec: which mesh axes each array dimension is split over.
  using spec_type = Spec;

  /// Mesh positions of the axes that split dimension `d`, major to minor.
  static constexpr std::array<std::size_t, dim_spec::max_axes> dim_axes(std::size_t d) noexcept {
    std::array<std::size_t, dim_spec::max_axes> out{};
    const dim_spec ds = Spec::dim(d);
    for (std::size_t k = 0; k < ds.size(); ++k) out[k] = Mesh::find_axis(ds.axis(k));
    return out;
  }
  /// Number of mesh axes that split dimension `d`.
  static constexpr std::size_t dim_axis_count(std::size_t d) noexcept { return Spec::dim(d).size(); }
  /// Mask of the mesh axes that split dimension `d`.
  static constexpr axis_mask dim_mask(std::size_t d) noexcept {
    axis_mask m = 0;
    const auto ax = dim_axes(d);
    for (std::size_t k = 0; k < dim_axis_count(d); ++k) m |= axis_mask{1} << ax[k];
    return m;
  }
  /// Mask of every mesh axis the spec uses: a sharded value varies over exactly these.
  static constexpr axis_mask sharded_axes = [] {
    axis_mask m = 0;
    for (std::size_t d = 0; d < Spec::size; ++d) m |= dim_mask(d);
    return m;
  }();
  /// Mask of the mesh axes the spec does not use: the value is replicated over these.
  static constexpr axis_mask replicated_axes = Mesh::all_axes & ~sharded_axes;

  /// Rejects, at compile time, a spec longer than a tensor of rank `Rank`.
  template <std::size_t Rank>
  static constexpr bool check_rank() noexcept {
    // True either way: a spec that is too long fires its one diagnostic here, and the
    // static_assert(check_rank<R>()) of every caller stays quiet.
    if constexpr (Spec::size <= Rank) return true;
    else return detail::diagnosed(detail::spec_longer_than_rank<diagnostic::size<Rank>, detail::diag_spec_t<Spec>>());
  }

  named_sharding() requires(Mesh::num_dynamic == 0) = default;
  /// @brief The sharding of `Spec` over `mesh`; `rule` says how an extent the axes do not divide is split (see `shard_rule`).
  explicit named_sharding(Mesh mesh, shard_rule rule = shard_rule::even) : mesh_(mesh), rule_(rule) {}

  /// The mesh the blocks lie on.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  /// How an extent that the axis size does not divide is split.
  [[nodiscard]] shard_rule rule() const noexcept { return rule_; }

  /// Number of shards dimension `d` is split into.
  [[nodiscard]] std::size_t num_shards(std::size_t d) const noexcept { return mesh_.axes_size(dim_mask(d)); }
  /// Which shard of dimension `d` device `device` holds: its row-major index over the axes that split
  /// `d`, in spec order (the first axis major, as JAX).
  [[nodiscard]] std::size_t shard_index(std::size_t device, std::size_t d) const noexcept {
    const auto c = mesh_.coords(device);
    const auto ax = dim_axes(d);
    std::size_t i = 0;
    for (std::size_t k = 0; k < dim_axis_count(d); ++k) i = i * mesh_.axis_size(ax[k]) + c[ax[k]];
    return i;
  }

  /// Equal when the meshes and rules are equal (the spec is part of the type).
  friend bool operator==(const named_sharding& a, const named_sharding& b) noexcept {
    return a.mesh_ == b.mesh_ && a.rule_ == b.rule_;
  }
  /// Prints `named_sharding(mesh{'data': 2}, P<"data">)`.
  friend std::ostream& operator<<(std::ostream& os, const named_sharding& s) {
    return os << "named_sharding(" << s.mesh_ << ", " << Spec{} << (s.rule_ == shard_rule::uneven ? ", uneven" : "")
              << ')';
  }
  /// The sharding as printed by `operator<<`: the spec and the mesh.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  Mesh mesh_{};
  shard_rule rule_ = shard_rule::even;
};

/// @brief A type that is a `named_sharding<...>`.
template <class T>
concept sharding_type = requires { typename T::is_named_sharding; };

/// @brief Names the axes in `mask` of mesh type `Mesh`: `{'data', 'model'}`.
template <mesh_type Mesh>
std::string describe_axes(axis_mask mask) {
  std::string s = "{";
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(mask & (axis_mask{1} << i))) continue;
    s += (first ? "'" : ", '") + std::string(Mesh::axis_names[i]) + "'";
    first = false;
  }
  return s + "}";
}

}  // namespace meshlib
// end meshlib/core/named_sharding.hpp
// begin meshlib/core/shard_layout.hpp
/// @file
/// @brief Shard layout math: for a global shape and a sharding, which block of the global array
/// each device holds, which devices hold copies of the same block, and the global shape from local
/// ones.
///
/// The rule for one dimension of size `n` split into `s` shards (shard `i` held by the devices
/// whose coordinates over the dimension's axes, in spec order, give index `i`):
/// - `shard_rule::even`: `n % s == 0` is required; block `i` is `[i*n/s, (i+1)*n/s)`.
/// - `shard_rule::uneven`: `c = ceil(n / s)`; block `i` is `[min(i*c, n), min((i+1)*c, n))`, so the
///   trailing blocks are smaller or empty, as `torch.chunk` / DTensor's `Shard`.
/// @post Under either rule the blocks of one dimension are disjoint and cover `[0, n)`: every
/// element of the global array is held by exactly the devices of one replica group.

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <vector>


namespace meshlib {

/// @brief A rectangular block of a global array: an offset and an extent per dimension.
template <std::size_t Rank>
struct block {
  /// Where the block starts in the global array, per dimension.
  std::array<std::size_t, Rank> offset{};
  /// The block's size per dimension.
  std::array<std::size_t, Rank> extent{};

  /// Number of elements.
  [[nodiscard]] constexpr std::size_t size() const noexcept {
    std::size_t n = 1;
    for (auto e : extent) n *= e;
    return n;
  }
  /// Whether the global coordinate `g` lies in the block.
  [[nodiscard]] constexpr bool contains(const std::array<std::size_t, Rank>& g) const noexcept {
    for (std::size_t d = 0; d < Rank; ++d)
      if (g[d] < offset[d] || g[d] >= offset[d] + extent[d]) return false;
    return true;
  }
  /// The global row-major index, in an array of shape `global_shape`, of element `i` of the block
  /// (the block's own elements counted row-major, as its storage holds them).
  /// @pre `i < size()` and the block lies inside `global_shape`.
  /// @post `contains(g)` for the coordinate `g` of the result, and distinct `i` give distinct results.
  [[nodiscard]] constexpr std::size_t global_index(const std::array<std::size_t, Rank>& global_shape,
                                                   std::size_t i) const noexcept {
    std::array<std::size_t, Rank> g{};
    for (std::size_t d = Rank; d-- > 0;) {
      g[d] = offset[d] + i % extent[d];
      i /= extent[d];
    }
    std::size_t flat = 0;
    for (std::size_t d = 0; d < Rank; ++d) flat = flat * global_shape[d] + g[d];
    return flat;
  }
  /// Calls `f(k, g, n)` for the runs of the block's elements `[first, first + len)` that are
  /// contiguous in the global row-major array of shape `global_shape`: block elements `k` to `k + n`
  /// (exclusive) are global elements `g` to `g + n`. A run never crosses a row of the last dimension, so a copy
  /// between a block and its global array is one `copy_n` per run (checkpoints, gathers).
  /// @pre `first + len <= size()`.
  template <class F>
  constexpr void for_each_global_run(const std::array<std::size_t, Rank>& global_shape, std::size_t first,
                                     std::size_t len, F&& f) const {
    std::size_t row = len;
    if constexpr (Rank > 0) row = extent[Rank - 1];
    for (std::size_t k = first, end = first + len; k < end;) {
      const std::size_t n = std::min(row - k % row, end - k);
      f(k, global_index(global_shape, k), n);
      k += n;
    }
  }
  /// Blocks are equal when offsets and extents are.
  friend constexpr bool operator==(const block&, const block&) = default;

  /// Prints `[0:4, 2:4]` (NumPy slice notation).
  friend std::ostream& operator<<(std::ostream& os, const block& b) {
    os << '[';
    for (std::size_t d = 0; d < Rank; ++d) os << (d ? ", " : "") << b.offset[d] << ':' << b.offset[d] + b.extent[d];
    return os << ']';
  }
};

namespace detail {

/// Offset and extent of shard `i` of `shards` of a dimension of size `n` (see the file comment).
constexpr std::pair<std::size_t, std::size_t> split_dim(std::size_t n, std::size_t shards, std::size_t i,
                                                        shard_rule rule) noexcept {
  const std::size_t chunk = rule == shard_rule::even ? n / shards : (n + shards - 1) / shards;
  const std::size_t lo = std::min(i * chunk, n);
  const std::size_t hi = std::min(lo + chunk, n);
  return {lo, hi - lo};
}

/// "axis 'model' (size 4)" or "axes 'data' x 'fsdp' (sizes 2 x 2)".
template <sharding_type S>
std::string describe_dim_axes(const S& s, std::size_t d) {
  using mesh_t = typename S::mesh_type;
  const auto ax = S::dim_axes(d);
  const std::size_t k = S::dim_axis_count(d);
  std::string names, sizes;
  for (std::size_t j = 0; j < k; ++j) {
    names += (j ? " x '" : "'") + std::string(mesh_t::axis_names[ax[j]]) + "'";
    sizes += (j ? " x " : "") + std::to_string(s.mesh().axis_size(ax[j]));
  }
  return (k == 1 ? "axis " : "axes ") + names + (k == 1 ? " (size " : " (sizes ") + sizes + ")";
}

template <std::size_t Rank>
std::string describe_shape(const std::array<std::size_t, Rank>& shape) {
  std::string s = "(";
  for (std::size_t d = 0; d < Rank; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + (Rank == 1 ? ",)" : ")");
}

/// A list of devices as error messages show it: "{2, 3}".
inline std::string describe_devices(std::span<const std::size_t> devices) {
  std::string s = "{";
  for (std::size_t i = 0; i < devices.size(); ++i) s += (i ? ", " : "") + std::to_string(devices[i]);
  return s + "}";
}

}  // namespace detail

/// @brief A list of devices as meshlib's error messages show it: "{2, 3}" (for the messages of
/// layers above core, and a user's).
using detail::describe_devices;

/// @brief The blocks of a global array of shape `global_shape` laid out by sharding `S`.
/// @code
/// meshlib::shard_layout layout{sharding, std::array<std::size_t, 2>{8, 6}};
/// layout.block_of(3);    // offset and extent of device 3's block
/// layout.replicas(3);    // the devices that hold the same block
/// @endcode
template <sharding_type S, std::size_t Rank>
class shard_layout {
  static_assert(S::template check_rank<Rank>());

 public:
  /// A global or local shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// The mesh of the sharding.
  using mesh_type = typename S::mesh_type;

  /// @throws sharding_error when a size is negative-converted (above 2^62) or the element count
  /// overflows (naming the dimension and its size), and under `shard_rule::even` when a sharded dimension does not divide
  /// evenly; the message names the dimension, its size, the axes and their sizes.
  shard_layout(const S& sharding, const shape_type& global_shape) : sharding_(sharding), global_(global_shape) {
    detail::checked_product(global_, "the global shape");
    for (std::size_t d = 0; d < Rank; ++d) {
      const std::size_t shards = sharding_.num_shards(d);
      if (sharding_.rule() == shard_rule::even && global_[d] % shards != 0) {
        std::ostringstream os;
        os << "meshlib: dimension " << d << " of global shape " << detail::describe_shape(global_) << " has size "
           << global_[d] << ", which is not divisible by the " << shards << " shards of "
           << detail::describe_dim_axes(sharding_, d) << " in " << typename S::spec_type{}
           << "; use a size divisible by " << shards << " or shard_rule::uneven";
        throw sharding_error(os.str());
      }
    }
  }

  /// The sharding the layout was computed for.
  [[nodiscard]] const S& sharding() const noexcept { return sharding_; }
  /// The shape of the whole (global) array.
  [[nodiscard]] const shape_type& global_shape() const noexcept { return global_; }
  /// The number of devices of the mesh, each with one block.
  [[nodiscard]] std::size_t num_devices() const noexcept { return sharding_.mesh().size(); }

  /// The block device `device` holds.
  [[nodiscard]] block<Rank> block_of(std::size_t device) const noexcept {
    block<Rank> b;
    for (std::size_t d = 0; d < Rank; ++d) {
      const auto [off, ext] = detail::split_dim(global_[d], sharding_.num_shards(d), sharding_.shard_index(device, d),
                                                sharding_.rule());
      b.offset[d] = off;
      b.extent[d] = ext;
    }
    return b;
  }
  /// The shape of device `device`'s block.
  [[nodiscard]] shape_type local_shape(std::size_t device) const noexcept { return block_of(device).extent; }
  /// The largest local shape (every device's under the even rule): what a padded buffer needs.
  [[nodiscard]] shape_type max_local_shape() const noexcept {
    shape_type s;
    for (std::size_t d = 0; d < Rank; ++d) s[d] = detail::split_dim(global_[d], sharding_.num_shards(d), 0, sharding_.rule()).second;
    return s;
  }

  /// The devices that hold the same block as `device` (itself included), in mesh order: the group
  /// along every axis the spec does not use.
  [[nodiscard]] std::vector<std::size_t> replicas(std::size_t device) const {
    return sharding_.mesh().group(device, S::replicated_axes);
  }
  /// The devices that hold the element at global coordinate `g`.
  [[nodiscard]] std::vector<std::size_t> owners(const shape_type& g) const {
    std::vector<std::size_t> out;
    for (std::size_t dev = 0; dev < num_devices(); ++dev)
      if (block_of(dev).contains(g)) out.push_back(dev);
    return out;
  }

 private:
  S sharding_;
  shape_type global_;
};

/// @brief Deduces the rank from the global shape: `shard_layout{sharding, std::array<std::size_t, 2>{8, 6}}`.
template <sharding_type S, std::size_t Rank>
shard_layout(const S&, const std::array<std::size_t, Rank>&) -> shard_layout<S, Rank>;

/// @brief The global shape of an evenly sharded array whose every block has shape `local_shape`.
template <sharding_type S, std::size_t Rank>
std::array<std::size_t, Rank> global_shape_from_local(const S& sharding, const std::array<std::size_t, Rank>& local_shape) {
  static_assert(S::template check_rank<Rank>());
  std::array<std::size_t, Rank> g;
  for (std::size_t d = 0; d < Rank; ++d) g[d] = local_shape[d] * sharding.num_shards(d);
  return g;
}

/// @brief The global shape from every device's local shape (`local_shapes[device]`).
/// @throws sharding_error when the local shapes cannot come from one global array under the
/// sharding and its rule: a count other than one per device, replicas of one block that disagree,
/// or blocks of a dimension that do not follow the rule. The message names the dimension, the
/// devices and the sizes.
template <sharding_type S, std::size_t Rank>
std::array<std::size_t, Rank> global_shape_from_locals(const S& sharding,
                                                       std::span<const std::array<std::size_t, Rank>> local_shapes) {
  static_assert(S::template check_rank<Rank>());
  const std::size_t n = sharding.mesh().size();
  if (local_shapes.size() != n)
    throw sharding_error("meshlib: global_shape_from_locals needs one local shape per device: the mesh " +
                         sharding.mesh().to_string() + " has " + std::to_string(n) + " devices, " +
                         std::to_string(local_shapes.size()) + " shapes were given");
  std::array<std::size_t, Rank> g{};
  for (std::size_t d = 0; d < Rank; ++d) {
    const std::size_t shards = sharding.num_shards(d);
    std::vector<std::size_t> extent(shards, 0), holder(shards, n);
    for (std::size_t dev = 0; dev < n; ++dev) {
      const std::size_t i = sharding.shard_index(dev, d);
      if (holder[i] == n) {
        holder[i] = dev;
        extent[i] = local_shapes[dev][d];
      } else if (extent[i] != local_shapes[dev][d]) {
        throw sharding_error("meshlib: devices " + std::to_string(holder[i]) + " and " + std::to_string(dev) +
                             " hold the same block of dimension " + std::to_string(d) + " but report sizes " +
                             std::to_string(extent[i]) + " and " + std::to_string(local_shapes[dev][d]));
      }
    }
    for (auto e : extent) g[d] += e;
    for (std::size_t i = 0; i < shards; ++i) {
      const auto expected = detail::split_dim(g[d], shards, i, sharding.rule()).second;
      const bool divisible = sharding.rule() == shard_rule::uneven || g[d] % shards == 0;
      if (!divisible || expected != extent[i]) {
        throw sharding_error("meshlib: dimension " + std::to_string(d) + " split over " +
                             detail::describe_dim_axes(sharding, d) + ": shard " + std::to_string(i) + " (device " +
                             std::to_string(holder[i]) + ") has size " + std::to_string(extent[i]) +
                             ", but a global size of " + std::to_string(g[d]) + " under the " +
                             (sharding.rule() == shard_rule::even ? "even" : "uneven") + " rule gives " +
                             (divisible ? std::to_string(expected) : std::string("no even split")));
      }
    }
  }
  return g;
}

}  // namespace meshlib
// end meshlib/core/shard_layout.hpp
// end meshlib/core.hpp
// begin meshlib/comm.hpp
/// @file
/// @brief The comm layer: the communicator concept, reduce ops, datatypes, errors, and the
/// always-built thread communicator. Depends on core only.

// begin meshlib/comm/errors.hpp
/// @file
/// @brief The exception types of the comm layer. Every blocking call of every communicator ends in
/// one of these instead of hanging: a peer failed (`comm_aborted`), a peer never came
/// (`comm_timeout`), peers disagreed about the step (`collective_mismatch`), or the caller's own
/// arguments were wrong (`comm_argument_error`, thrown before any data moves).

#include <exception>
#include <string>


namespace meshlib {

/// @brief Base of every communicator failure. Once a communicator has failed it refuses every
/// further operation with an error of the root cause's type, naming the root cause.
class comm_error : public error {
 public:
  using error::error;
};

/// @brief A collective that not every participant reached within the communicator's timeout.
/// `what()` names the operation, the step and the ranks that never arrived.
class comm_timeout : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief The communicator was aborted: a participant threw, its thread ended while peers waited
/// for it, or the communicator was destroyed or aborted explicitly. `what()` names the rank that
/// failed first and why; every participant sees the same root cause.
class comm_aborted : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief Participants called different collectives in the same step (another operation, count,
/// element type, reduce op or root). Thrown on every participant; `what()` lists each rank's call.
class collective_mismatch : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief An invalid argument to a communicator operation (root or peer out of range, a negative or
/// overflowing count, a buffer shorter than its count, a forbidden alias, a ppermute with a
/// duplicate source or destination). Thrown before any data moves.
class comm_argument_error : public comm_error {
 public:
  using comm_error::comm_error;
};

/// @brief Thrown by every runner and launcher (`run_on_threads`, `run_hybrid`, the runners of
/// exec/) when a participant failed: the root cause, with its rank. Here with the other comm errors
/// because every backend's launcher throws it, not only the thread backend's.
/// The participant's own exception is nested (`std::rethrow_if_nested(e)` or `rethrow_nested()`
/// rethrows it with its original type); `what()` is "meshlib: participant R of N failed: <its what()>".
class participant_error : public comm_error, public std::nested_exception {
 public:
  /// Must be constructed while the participant's exception is the current one (in a catch block).
  participant_error(int rank, const std::string& message) : comm_error(message), rank_(rank) {}
  /// Rank (in the world of the run) of the participant whose failure is the root cause.
  [[nodiscard]] int rank() const noexcept { return rank_; }

 private:
  int rank_;
};

}  // namespace meshlib
// end meshlib/comm/errors.hpp
// begin meshlib/comm/datatype.hpp
/// @file
/// @brief Element types a communicator moves and reduces: `float`, `double`, 32- and 64-bit signed
/// integers and `bfloat16`; the run-time tag `datatype` that describes them in descriptors, error
/// messages and backend mappings (`ncclDataType_t`, `MPI_Datatype`).

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <string_view>
#include <type_traits>

namespace meshlib {

/// @brief A 16-bit brain floating-point number: the upper half of an IEEE `float` (8-bit exponent,
/// 7-bit mantissa). Arithmetic goes through `float`; conversion from `float` rounds to nearest
/// even, as NCCL's and PyTorch's `bfloat16` do, and keeps NaNs NaN.
struct bfloat16 {
  /// The raw bits: the upper 16 bits of the IEEE float32 value.
  std::uint16_t bits = 0;

  constexpr bfloat16() noexcept = default;
  /// Rounds `f` to the nearest bfloat16 (ties to even).
  constexpr bfloat16(float f) noexcept : bits(from_float(f)) {}  // NOLINT: implicit, as a float type
  /// Widens exactly to float.
  constexpr operator float() const noexcept {  // NOLINT: implicit, as a float type
    return std::bit_cast<float>(static_cast<std::uint32_t>(bits) << 16);
  }
  /// A bfloat16 with exactly these bits.
  [[nodiscard]] static constexpr bfloat16 from_bits(std::uint16_t b) noexcept {
    bfloat16 r;
    r.bits = b;
    return r;
  }
  /// Bitwise equality (so that determinism tests can compare results bit for bit, NaNs included).
  [[nodiscard]] friend constexpr bool same_bits(bfloat16 a, bfloat16 b) noexcept { return a.bits == b.bits; }
  /// Prints the value as its float.
  friend std::ostream& operator<<(std::ostream& os, bfloat16 b) { return os << static_cast<float>(b); }

 private:
  static constexpr std::uint16_t from_float(float f) noexcept {
    const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x0040u);  // quiet NaN
    const std::uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return static_cast<std::uint16_t>((u + rounding) >> 16);
  }
};
static_assert(sizeof(bfloat16) == 2 && std::is_trivially_copyable_v<bfloat16>);

/// @brief Run-time tag of an element type.
enum class datatype : std::uint8_t { float32, float64, int32, int64, bfloat16 };

/// @brief "float32", "float64", "int32", "int64" or "bfloat16".
[[nodiscard]] constexpr std::string_view to_string(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return "float32";
    case datatype::float64: return "float64";
    case datatype::int32: return "int32";
    case datatype::int64: return "int64";
    case datatype::bfloat16: return "bfloat16";
  }
  return "unknown";
}
/// @brief Prints the datatype's name (`to_string`).
inline std::ostream& operator<<(std::ostream& os, datatype t) { return os << to_string(t); }

/// @brief Size in bytes of one element of type `t`.
[[nodiscard]] constexpr std::size_t size_of(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return 4;
    case datatype::float64: return 8;
    case datatype::int32: return 4;
    case datatype::int64: return 8;
    case datatype::bfloat16: return 2;
  }
  return 0;
}

namespace detail {
template <class T>
consteval int datatype_index() {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return static_cast<int>(datatype::float32);
  else if constexpr (std::is_same_v<U, double>) return static_cast<int>(datatype::float64);
  else if constexpr (std::is_same_v<U, bfloat16>) return static_cast<int>(datatype::bfloat16);
  // Any signed integer of 32 or 64 bits: int, long, long long and the <cstdint> aliases alike.
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 4) return static_cast<int>(datatype::int32);
  else if constexpr (std::is_integral_v<U> && std::is_signed_v<U> && sizeof(U) == 8) return static_cast<int>(datatype::int64);
  else return -1;
}
}  // namespace detail

/// @brief An element type that every communicator can send and reduce.
template <class T>
concept comm_element = (detail::datatype_index<T>() >= 0);

/// @brief The run-time tag of element type `T`.
template <comm_element T>
inline constexpr datatype datatype_of = static_cast<datatype>(detail::datatype_index<T>());

/// @brief Every element type, for loops in tests and benchmarks.
inline constexpr datatype all_datatypes[] = {datatype::float32, datatype::float64, datatype::int32, datatype::int64,
                                             datatype::bfloat16};

}  // namespace meshlib
// end meshlib/comm/datatype.hpp
// begin meshlib/comm/reduce_op.hpp
/// @file
/// @brief `reduce_op`: the reductions every communicator supports (NCCL's `ncclRedOp_t`, MPI's
/// `MPI_Op`), `mean` included because JAX's `pmean` is one collective, not a sum and a division.
/// One name for it across meshlib (`pmean`, `mean<D>`, `reduce_op::mean`); NCCL calls it `ncclAvg`.

#include <cstdint>
#include <ostream>
#include <string_view>

namespace meshlib {

/// @brief A reduction over the participants of a collective.
///
/// Reductions are applied in rank order (`((x0 op x1) op x2) ...`) by every backend that meshlib
/// implements itself, so results are bitwise reproducible. Integer `sum` and `prod` wrap modulo
/// 2^bits; integer `mean` is the wrapped sum divided by the participant count, rounded toward zero.
/// `bfloat16` values are combined in `float` and rounded once at the end.
enum class reduce_op : std::uint8_t {
  sum,   ///< x0 + x1 + ... (JAX `psum`)
  prod,  ///< x0 * x1 * ...
  min,   ///< smallest value (JAX `pmin`)
  max,   ///< largest value (JAX `pmax`)
  mean,  ///< sum divided by the number of participants (JAX `pmean`; NCCL's `ncclAvg`)
};

/// @brief The name of a reduce op, as used in error messages: "sum", "prod", "min", "max", "mean".
[[nodiscard]] constexpr std::string_view to_string(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "sum";
    case reduce_op::prod: return "prod";
    case reduce_op::min: return "min";
    case reduce_op::max: return "max";
    case reduce_op::mean: return "mean";
  }
  return "unknown";
}

/// @brief Prints the reduce op's name (`to_string`).
inline std::ostream& operator<<(std::ostream& os, reduce_op op) { return os << to_string(op); }

/// @brief Every reduce op, for loops in tests and benchmarks.
inline constexpr reduce_op all_reduce_ops[] = {reduce_op::sum, reduce_op::prod, reduce_op::min, reduce_op::max,
                                               reduce_op::mean};

}  // namespace meshlib
// end meshlib/comm/reduce_op.hpp
// begin meshlib/comm/request.hpp
/// @file
/// @brief Completion handles. Every communicator operation returns its backend's `request_type`,
/// so that code written against the `communicator` concept works unchanged with backends that
/// complete later (NCCL enqueues on a CUDA stream, MPI has non-blocking calls), as kokkos-comm's
/// `Req` and c10d's `Work`.

#include <concepts>

namespace meshlib {

/// @brief A completion handle: `wait()` blocks until the operation is complete (its receive
/// buffers hold the result and its send buffers may be reused); `test()` says whether it is,
/// without blocking. Both may throw the communicator's errors.
template <class R>
concept comm_request = requires(R& r) {
  r.wait();
  { r.test() } -> std::convertible_to<bool>;
};

/// @brief The request of a backend that completes every operation before returning (the thread
/// communicator): already complete, `wait()` does nothing.
class ready_request {
 public:
  /// Returns at once: the operation already finished.
  constexpr void wait() const noexcept {}
  /// Always true: the operation already finished.
  [[nodiscard]] constexpr bool test() const noexcept { return true; }
};

static_assert(comm_request<ready_request>);

/// @brief The execution context of a backend that runs on the calling host thread (thread and MPI
/// communicators): nothing to pass. A stream backend has its own context type (NCCL: a CUDA
/// stream), and every operation takes one as an optional last argument.
struct host_context {};

}  // namespace meshlib
// end meshlib/comm/request.hpp
// begin meshlib/comm/communicator.hpp
/// @file
/// @brief The `communicator` concept that every backend (thread, MPI, NCCL) satisfies.
///
/// A communicator is one participant's handle on a group of `size()` participants numbered
/// `0 .. size()-1`. Every collective must be called by every participant of the group, in the same
/// order, with agreeing arguments; the backends check that and throw `collective_mismatch`
/// where it is not so (the thread backend always; see docs/design.md for the others).
///
/// Operations (T is any `comm_element`; every one returns `C::request_type`, and takes an optional
/// last argument of type `C::context_type`: a CUDA stream for NCCL, nothing for host backends):
///
/// | operation | out-of-place | in-place |
/// | --- | --- | --- |
/// | all_reduce | `all_reduce(send, recv, op)`: recv[i] = op over ranks of send[i] | `all_reduce(buf, op)` |
/// | reduce | `reduce(send, recv, op, root)`: only root's recv is written | `reduce(buf, op, root)` |
/// | broadcast | `broadcast(send, recv, root)`: send read on root only | `broadcast(buf, root)` |
/// | all_gather | `all_gather(send, recv)`: recv = [send of rank 0, rank 1, ...] | `all_gather(buf)`: own block at buf[rank*c] |
/// | reduce_scatter | `reduce_scatter(send, recv, op)`: recv = block `rank` of the reduced send | `reduce_scatter(buf, op)`: result at buf[rank*c] (NCCL's convention) |
/// | all_to_all | `all_to_all(send, recv)`: block j of send goes to rank j, lands at block `rank` | `all_to_all(buf)` |
/// | all_to_all_v | `all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs)` | |
/// | ppermute | `ppermute(send, recv, pairs)`: recv gets the send of the rank that sends to it, zeros if none | `ppermute(buf, pairs)` |
/// | send / recv | `send(buf, dest, tag)`, `recv(buf, source, tag)` | |
/// | barrier | `barrier()` | |
/// | split | `split(color, key)` -> a communicator of the same type over the ranks of equal color, ordered by (key, rank) | |
///
/// Counts come from the spans: `all_reduce`, `reduce`, `broadcast` and `all_gather` move
/// `send.size()` elements per rank, `reduce_scatter` `recv.size()` per rank, `all_to_all`
/// `send.size() / size()` per peer. A receive buffer longer than needed is allowed (the rest is left
/// untouched); a shorter one, and an overlap of send and receive buffers, are rejected with
/// `comm_argument_error` before any data moves (pass the in-place form instead).

#include <concepts>
#include <cstdint>
#include <span>
#include <utility>


namespace meshlib {

/// @brief A (source, destination) pair of a `ppermute`, as in `jax.lax.ppermute(x, perm=[(0, 1), ...])`.
struct permute_pair {
  /// The rank that sends.
  int source = 0;
  /// The rank that receives what `source` sends.
  int dest = 0;
  /// Pairs are equal when source and dest both match.
  friend constexpr bool operator==(const permute_pair&, const permute_pair&) = default;
};

namespace detail {
// The element type through which the concept checks the templated operations; a backend must
// provide them for every comm_element, the concept can only spell out one.
using concept_probe_t = float;
}  // namespace detail

/// @brief Types that opted in as communicators (nested `is_communicator` tag), with their handle types.
template <class C>
concept communicator_tagged = requires {
  typename C::is_communicator;
  typename C::request_type;
  typename C::context_type;
} && comm_request<typename C::request_type>;

/// @brief A participant handle of a group: `rank()` in `[0, size())`.
template <class C>
concept communicator_group = requires(const C& c) {
  { c.rank() } -> std::same_as<int>;
  { c.size() } -> std::same_as<int>;
};

/// @brief The reducing collectives, out-of-place and in-place.
template <class C>
concept reducing_communicator = requires(C& c, std::span<const detail::concept_probe_t> s,
                                         std::span<detail::concept_probe_t> r, reduce_op op, int root) {
  { c.all_reduce(s, r, op) } -> std::same_as<typename C::request_type>;
  { c.all_reduce(r, op) } -> std::same_as<typename C::request_type>;
  { c.reduce(s, r, op, root) } -> std::same_as<typename C::request_type>;
  { c.reduce(r, op, root) } -> std::same_as<typename C::request_type>;
  { c.reduce_scatter(s, r, op) } -> std::same_as<typename C::request_type>;
  { c.reduce_scatter(r, op) } -> std::same_as<typename C::request_type>;
};

/// @brief The data-movement collectives, out-of-place and in-place.
template <class C>
concept moving_communicator = requires(C& c, std::span<const detail::concept_probe_t> s,
                                       std::span<detail::concept_probe_t> r, std::span<const std::int64_t> counts,
                                       std::span<const permute_pair> pairs, int root) {
  { c.broadcast(s, r, root) } -> std::same_as<typename C::request_type>;
  { c.broadcast(r, root) } -> std::same_as<typename C::request_type>;
  { c.all_gather(s, r) } -> std::same_as<typename C::request_type>;
  { c.all_gather(r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all(s, r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all(r) } -> std::same_as<typename C::request_type>;
  { c.all_to_all_v(s, counts, counts, r, counts, counts) } -> std::same_as<typename C::request_type>;
  { c.ppermute(s, r, pairs) } -> std::same_as<typename C::request_type>;
  { c.ppermute(r, pairs) } -> std::same_as<typename C::request_type>;
};

/// @brief Point-to-point messages, matched by (source, tag) in send order.
template <class C>
concept point_to_point_communicator = requires(C& c, std::span<const detail::concept_probe_t> s,
                                               std::span<detail::concept_probe_t> r, int peer, int tag) {
  { c.send(s, peer, tag) } -> std::same_as<typename C::request_type>;
  { c.recv(r, peer, tag) } -> std::same_as<typename C::request_type>;
};

/// @brief Synchronisation and sub-communicators.
template <class C>
concept structured_communicator = requires(C& c, int color, int key) {
  { c.barrier() } -> std::same_as<typename C::request_type>;
  { c.split(color, key) } -> std::same_as<C>;
};

/// @brief A communicator: one participant's handle on a group, with every collective meshlib uses.
/// Satisfied by `thread_communicator` (and later the MPI and NCCL communicators).
template <class C>
concept communicator = communicator_tagged<C> && communicator_group<C> && reducing_communicator<C> &&
                       moving_communicator<C> && point_to_point_communicator<C> && structured_communicator<C> &&
                       std::movable<C>;

}  // namespace meshlib
// end meshlib/comm/communicator.hpp
// begin meshlib/comm/frontend.hpp
/// @file
/// @brief `communicator_frontend`: the public operations of every communicator, written once.
///
/// A backend derives from `communicator_frontend<Backend, Request, Context>` and implements only
/// its transport; the front end gives it every overload of the `communicator` concept (in-place and
/// out-of-place), checks every argument before any data moves (buffer sizes, overlap, roots,
/// peers, tags, ppermute pairs, all_to_all_v layouts, element-count overflow) and builds every
/// argument error, so that a wrong call reads the same on every backend.
///
/// @code
/// class my_communicator : public meshlib::communicator_frontend<my_communicator> {
///   friend class meshlib::communicator_frontend<my_communicator>;
///  public:
///   int rank() const noexcept;  int size() const noexcept;
///   my_communicator split(int color, int key);    // (call check_split(color) first)
///  private:
///   void ensure_usable(meshlib::detail::op_kind) const;   // throws on an empty or failed handle
///   std::string label() const;                             // "rank 2", "MPI rank 1", ...
///   template <meshlib::detail::op_kind K, class T>                    // the transport of operation K
///   ready_request transport(const meshlib::detail::operation<T>&, host_context);
/// };
/// @endcode
///
/// Optional hook: `void on_argument_error(op_kind, const std::string& what) const`, called before
/// the front end throws `comm_argument_error` (the thread backend fails its world there, so that
/// peers already waiting for this rank are released at once).
///
/// Asynchronous backends: every operation takes an optional last argument of the backend's
/// `Context` (a CUDA stream for NCCL) and returns its `Request`; the front end passes both through
/// untouched, so a stream-ordered backend plugs in without any change above it.

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

// begin meshlib/comm/detail/buffer_checks.hpp
/// @file
/// @brief The buffer checks every backend runs before any data moves, so that a wrong call reads
/// the same on the thread, MPI and hybrid communicators.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

namespace meshlib::detail {

/// Whether the byte ranges `[a, a + an)` and `[b, b + bn)` share a byte; an empty range overlaps
/// nothing.
inline bool buffers_overlap(const void* a, std::size_t an, const void* b, std::size_t bn) noexcept {
  const auto pa = reinterpret_cast<std::uintptr_t>(a);
  const auto pb = reinterpret_cast<std::uintptr_t>(b);
  return an != 0 && bn != 0 && pa < pb + bn && pb < pa + an;
}

/// What is wrong with the buffers of an out-of-place call that writes `needed` elements to `recv`,
/// or an empty string when nothing is.
template <class T>
std::string out_of_place_problem(std::span<const T> send, std::span<T> recv, std::size_t needed) {
  if (recv.size() < needed)
    return "receive buffer holds " + std::to_string(recv.size()) + " elements but " + std::to_string(needed) +
           " are needed";
  if (buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
    return "the send and receive buffers overlap; use the in-place form (one buffer) instead";
  return {};
}

}  // namespace meshlib::detail
// end meshlib/comm/detail/buffer_checks.hpp
// begin meshlib/comm/detail/operation.hpp
/// @file
/// @brief The description of one communicator operation, as the front end hands it to a backend's
/// transport: what was called (`op_kind`), on which buffers, with which count, reduce op, root,
/// peer or tag. Every backend sees the same normalised description, whatever overload the user
/// called (in-place forms set `in_place` and point `send` and `recv` into the one buffer), and
/// the MPI backends derive their mismatch fingerprint from it.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>


namespace meshlib::detail {

/// The operations of the `communicator` concept (the values are part of the MPI fingerprint).
enum class op_kind : std::uint8_t {
  barrier,
  all_reduce,
  reduce,
  broadcast,
  all_gather,
  reduce_scatter,
  all_to_all,
  all_to_all_v,
  ppermute,
  split,
  send,
  recv,
};

/// The public name of an operation, as error messages show it.
constexpr std::string_view op_name(op_kind k) noexcept {
  switch (k) {
    case op_kind::barrier: return "barrier";
    case op_kind::all_reduce: return "all_reduce";
    case op_kind::reduce: return "reduce";
    case op_kind::broadcast: return "broadcast";
    case op_kind::all_gather: return "all_gather";
    case op_kind::reduce_scatter: return "reduce_scatter";
    case op_kind::all_to_all: return "all_to_all";
    case op_kind::all_to_all_v: return "all_to_all_v";
    case op_kind::ppermute: return "ppermute";
    case op_kind::split: return "split";
    case op_kind::send: return "send";
    case op_kind::recv: return "recv";
  }
  return "unknown";
}

/// Whether the participants of an operation must agree on its element type (all but barrier and
/// split). With `uses_count`, `uses_op` and `uses_root`, this is what every backend compares
/// across participants and what a mismatch message shows (`describe_call`).
constexpr bool uses_dtype(op_kind k) noexcept { return k != op_kind::barrier && k != op_kind::split; }
/// Whether they must agree on the count (all_to_all_v's counts are per peer, checked apart).
constexpr bool uses_count(op_kind k) noexcept { return uses_dtype(k) && k != op_kind::all_to_all_v; }
/// Whether they must agree on the reduce op (the reducing operations).
constexpr bool uses_op(op_kind k) noexcept {
  return k == op_kind::all_reduce || k == op_kind::reduce || k == op_kind::reduce_scatter;
}
/// Whether they must agree on a root (reduce and broadcast).
constexpr bool uses_root(op_kind k) noexcept { return k == op_kind::reduce || k == op_kind::broadcast; }

/// One operation, after the front end's checks. Buffer conventions (n = size(), c = count):
///
/// | kind | send | recv | count |
/// | --- | --- | --- | --- |
/// | all_reduce, reduce | c elements (== recv in place) | c elements (reduce: root only) | c |
/// | reduce_scatter | n*c elements | c elements (in place: block rank() of send) | c |
/// | broadcast | root's c elements (nullptr elsewhere out of place; == recv in place) | c elements | c |
/// | all_gather | c elements (in place: block rank() of recv) | n*c elements | c |
/// | all_to_all | n*c elements (== recv in place) | n*c elements | c (per peer) |
/// | all_to_all_v | the send buffer; counts/displs in `v` | the receive buffer | 0 |
/// | ppermute | c elements (== recv in place) | c elements | c |
/// | send / recv | the message (`peer`, `tag`) | the message | c |
/// | barrier | - | - | 0 |
template <class T>
struct operation {
  op_kind kind = op_kind::barrier;
  const T* send = nullptr;
  T* recv = nullptr;
  std::size_t count = 0;
  reduce_op op = reduce_op::sum;
  int root = 0;  ///< root of reduce and broadcast
  int peer = 0;  ///< destination of send, source of recv
  int tag = 0;
  bool in_place = false;
  std::span<const permute_pair> pairs{};                            ///< ppermute
  const std::int64_t* v[4] = {nullptr, nullptr, nullptr, nullptr};  ///< all_to_all_v: sc, sd, rc, rd (n each)
};

}  // namespace meshlib::detail
// end meshlib/comm/detail/operation.hpp

namespace meshlib {

/// @brief The shared front end of the communicators (see the file comment): `Backend` derives from
/// it and provides the transport.
template <class Backend, class Request = ready_request, class Context = host_context>
class communicator_frontend {
 public:
  /// Tag that opts the communicator into the `communicator_tagged` concept.
  using is_communicator = void;
  /// What the non-blocking calls return (`wait()` / `test()`).
  using request_type = Request;
  /// The backend state the collectives run on.
  using context_type = Context;

  // ---- reducing collectives --------------------------------------------------------------------

  /// @brief recv[i] = op over every rank of send[i], for i < send.size(), on every rank.
  template <comm_element T>
  request_type all_reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                          context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_reduce;
    check_out_of_place(k, send, recv, send.size());
    return start<k>(reducing<T>(k, send.data(), recv.data(), send.size(), op, false), ctx);
  }
  /// @brief In-place all_reduce: buf[i] = op over every rank of buf[i].
  template <comm_element T>
  request_type all_reduce(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_reduce;
    usable(k);
    return start<k>(reducing<T>(k, buf.data(), buf.data(), buf.size(), op, true), ctx);
  }

  /// @brief Like all_reduce, but only `root` receives the result; recv is ignored elsewhere.
  template <comm_element T>
  request_type reduce(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op, int root,
                      context_type ctx = {}) {
    constexpr auto k = detail::op_kind::reduce;
    check_root(k, root);
    if (self().rank() == root) check_out_of_place(k, send, recv, send.size());
    auto o = reducing<T>(k, send.data(), self().rank() == root ? recv.data() : nullptr, send.size(), op, false);
    o.root = root;
    return start<k>(o, ctx);
  }
  /// @brief In-place reduce: root's buf receives the result; the others' buf is only read.
  template <comm_element T>
  request_type reduce(std::span<T> buf, reduce_op op, int root, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::reduce;
    check_root(k, root);
    auto o = reducing<T>(k, buf.data(), buf.data(), buf.size(), op, true);
    o.root = root;
    return start<k>(o, ctx);
  }

  /// @brief recv = block `rank()` of the element-wise reduction of every rank's send, whose
  /// length is `size() * recv.size()`.
  template <comm_element T>
  request_type reduce_scatter(std::span<const std::type_identity_t<T>> send, std::span<T> recv, reduce_op op,
                              context_type ctx = {}) {
    constexpr auto k = detail::op_kind::reduce_scatter;
    const std::size_t count = recv.size();
    const std::size_t total = checked_mul(k, count);
    if (send.size() < total)
      bad_argument(k, "send buffer holds " + std::to_string(send.size()) + " elements but size() * recv.size() = " +
                          std::to_string(total) + " are needed");
    check_out_of_place(k, send.first(total), recv, count);
    return start<k>(reducing<T>(k, send.data(), recv.data(), count, op, false), ctx);
  }
  /// @brief In-place reduce_scatter (NCCL's convention): buf holds `size()` blocks; block `rank()`
  /// receives the reduction of every rank's block `rank()`; the other blocks are left as they were.
  template <comm_element T>
  request_type reduce_scatter(std::span<T> buf, reduce_op op, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::reduce_scatter;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(reducing<T>(k, buf.data(), buf.data() + block(count), count, op, true), ctx);
  }

  // ---- data movement ---------------------------------------------------------------------------

  /// @brief Every rank's recv receives root's send (read on root only); `recv.size()` is the count.
  template <comm_element T>
  request_type broadcast(std::span<const std::type_identity_t<T>> send, std::span<T> recv, int root,
                         context_type ctx = {}) {
    constexpr auto k = detail::op_kind::broadcast;
    check_root(k, root);
    const bool is_root = self().rank() == root;
    if (is_root) {
      check_out_of_place(k, send, recv, recv.size());
      if (send.size() < recv.size())
        bad_argument(k, "root's send buffer holds " + std::to_string(send.size()) + " elements but recv.size() = " +
                            std::to_string(recv.size()) + " are broadcast");
    }
    auto o = moving<T>(k, is_root ? send.data() : nullptr, recv.data(), recv.size(), false);
    o.root = root;
    return start<k>(o, ctx);
  }
  /// @brief In-place broadcast: every rank's buf receives root's buf.
  template <comm_element T>
  request_type broadcast(std::span<T> buf, int root, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::broadcast;
    check_root(k, root);
    auto o = moving<T>(k, buf.data(), buf.data(), buf.size(), true);
    o.root = root;
    return start<k>(o, ctx);
  }

  /// @brief recv = [send of rank 0, send of rank 1, ...]: `size() * send.size()` elements.
  template <comm_element T>
  request_type all_gather(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_gather;
    const std::size_t count = send.size();
    check_out_of_place(k, send, recv, checked_mul(k, count));
    return start<k>(moving<T>(k, send.data(), recv.data(), count, false), ctx);
  }
  /// @brief In-place all_gather: buf holds `size()` blocks, this rank's own already in block `rank()`.
  template <comm_element T>
  request_type all_gather(std::span<T> buf, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_gather;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(moving<T>(k, buf.data() + block(count), buf.data(), count, true), ctx);
  }

  /// @brief send holds `size()` equal blocks; block j goes to rank j, where it lands in block `rank()`.
  template <comm_element T>
  request_type all_to_all(std::span<const std::type_identity_t<T>> send, std::span<T> recv, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_to_all;
    const std::size_t count = blocks_of(k, send.size());
    check_out_of_place(k, send, recv, send.size());
    return start<k>(moving<T>(k, send.data(), recv.data(), count, false), ctx);
  }
  /// @brief In-place all_to_all.
  template <comm_element T>
  request_type all_to_all(std::span<T> buf, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_to_all;
    const std::size_t count = blocks_of(k, buf.size());
    return start<k>(moving<T>(k, buf.data(), buf.data(), count, true), ctx);
  }

  /// @brief all_to_all with a count per peer (MPI_Alltoallv): `send_counts[j]` elements from
  /// `send[send_displs[j]]` go to rank j, which receives them at `recv[recv_displs[rank()]]`; every
  /// rank's `recv_counts[j]` must equal rank j's `send_counts[rank()]` (else `collective_mismatch`).
  template <comm_element T>
  request_type all_to_all_v(std::span<const std::type_identity_t<T>> send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, std::span<T> recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            context_type ctx = {}) {
    constexpr auto k = detail::op_kind::all_to_all_v;
    usable(k);
    check_layout(k, "send", send.size(), send_counts, send_displs);
    check_layout(k, "recv", recv.size(), recv_counts, recv_displs);
    if (detail::buffers_overlap(send.data(), send.size_bytes(), recv.data(), recv.size_bytes()))
      bad_argument(k, "the send and receive buffers overlap; all_to_all_v has no in-place form");
    auto o = moving<T>(k, send.data(), recv.data(), 0, false);
    o.v[0] = send_counts.data();
    o.v[1] = send_displs.data();
    o.v[2] = recv_counts.data();
    o.v[3] = recv_displs.data();
    return start<k>(o, ctx);
  }

  /// @brief Each rank sends its send to the destination of the pairs whose source it is; recv
  /// receives the send of the pair whose destination this rank is, or zeros (as in JAX). Every
  /// rank passes the same pairs; a duplicate source or destination is rejected.
  template <comm_element T>
  request_type ppermute(std::span<const std::type_identity_t<T>> send, std::span<T> recv,
                        std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::ppermute;
    check_pairs(pairs);
    check_out_of_place(k, send, recv, send.size());
    auto o = moving<T>(k, send.data(), recv.data(), send.size(), false);
    o.pairs = pairs;
    return start<k>(o, ctx);
  }
  /// @brief In-place ppermute.
  template <comm_element T>
  request_type ppermute(std::span<T> buf, std::span<const permute_pair> pairs, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::ppermute;
    check_pairs(pairs);
    auto o = moving<T>(k, buf.data(), buf.data(), buf.size(), true);
    o.pairs = pairs;
    return start<k>(o, ctx);
  }

  // ---- point to point --------------------------------------------------------------------------

  /// @brief Sends buf to rank `dest` with `tag` (>= 0). Buffered: returns once buf is copied,
  /// whether or not `dest` has posted its recv (so exchanges written as send-then-recv on every
  /// rank cannot deadlock).
  template <class T>
    requires comm_element<std::remove_cv_t<T>>
  request_type send(std::span<T> buf, int dest, int tag = 0, context_type ctx = {}) {
    using U = std::remove_cv_t<T>;
    constexpr auto k = detail::op_kind::send;
    check_peer(k, dest, "destination");
    check_tag(k, tag);
    auto o = moving<U>(k, buf.data(), nullptr, buf.size(), false);
    o.peer = dest;
    o.tag = tag;
    return start<k>(o, ctx);
  }

  /// @brief Receives into buf the oldest message that rank `source` sent to this rank with `tag`.
  /// Its element type and count must be those of buf (else `collective_mismatch`).
  template <comm_element T>
  request_type recv(std::span<T> buf, int source, int tag = 0, context_type ctx = {}) {
    constexpr auto k = detail::op_kind::recv;
    check_peer(k, source, "source");
    check_tag(k, tag);
    auto o = moving<T>(k, nullptr, buf.data(), buf.size(), false);
    o.peer = source;
    o.tag = tag;
    return start<k>(o, ctx);
  }

  // ---- synchronisation -------------------------------------------------------------------------

  /// @brief Returns once every rank of the group has called barrier.
  request_type barrier(context_type ctx = {}) {
    constexpr auto k = detail::op_kind::barrier;
    usable(k);
    detail::operation<float> o;
    o.kind = k;
    return start<k>(o, ctx);
  }

 protected:
  communicator_frontend() = default;

  /// The default of the optional hook (see the file comment): nothing to release.
  void on_argument_error(detail::op_kind, const std::string&) const {}

  /// For `split`: refuses a negative color (after the usability check).
  void check_split(int color) const {
    constexpr auto k = detail::op_kind::split;
    usable(k);
    if (color < 0) bad_argument(k, "color " + std::to_string(color) + " is negative; colors are >= 0");
  }

  /// "all_reduce on rank 2 of 4": how messages name the call and the caller.
  std::string where(detail::op_kind k) const {
    return std::string(detail::op_name(k)) + " on " + self().label() + " of " + std::to_string(self().size());
  }

  /// Throws `comm_argument_error` ("meshlib: invalid argument to <where>: <what>") after the
  /// backend's `on_argument_error` hook. For the backends' own limits too (MPI's int counts).
  [[noreturn]] void bad_argument(detail::op_kind k, const std::string& what) const {
    self().on_argument_error(k, what);
    throw comm_argument_error("meshlib: invalid argument to " + where(k) + ": " + what);
  }

 private:
  Backend& self() noexcept { return static_cast<Backend&>(*this); }
  const Backend& self() const noexcept { return static_cast<const Backend&>(*this); }

  template <detail::op_kind K, class T>
  request_type start(detail::operation<T> o, context_type ctx) {
    o.kind = K;
    return self().template transport<K, T>(o, ctx);
  }

  template <class T>
  static detail::operation<T> moving(detail::op_kind k, const T* send, T* recv, std::size_t count, bool in_place) {
    detail::operation<T> o;
    o.kind = k;
    o.send = send;
    o.recv = recv;
    o.count = count;
    o.in_place = in_place;
    return o;
  }
  template <class T>
  static detail::operation<T> reducing(detail::op_kind k, const T* send, T* recv, std::size_t count, reduce_op op,
                                       bool in_place) {
    auto o = moving<T>(k, send, recv, count, in_place);
    o.op = op;
    return o;
  }

  std::size_t block(std::size_t count) const noexcept { return static_cast<std::size_t>(self().rank()) * count; }

  void usable(detail::op_kind k) const { self().ensure_usable(k); }

  void check_root(detail::op_kind k, int root) const {
    usable(k);
    if (root < 0 || root >= self().size())
      bad_argument(k, "root " + std::to_string(root) + " is out of range [0, " + std::to_string(self().size()) + ")");
  }

  void check_peer(detail::op_kind k, int peer, const char* what) const {
    usable(k);
    if (peer < 0 || peer >= self().size())
      bad_argument(k, std::string(what) + " rank " + std::to_string(peer) + " is out of range [0, " +
                          std::to_string(self().size()) + ")");
  }

  void check_tag(detail::op_kind k, int tag) const {
    if (tag < 0) bad_argument(k, "tag " + std::to_string(tag) + " is negative; tags are >= 0");
  }

  /// Out-of-place forms: recv must hold `needed` elements and must not overlap send.
  template <class T>
  void check_out_of_place(detail::op_kind k, std::span<const T> send, std::span<T> recv, std::size_t needed) const {
    usable(k);
    if (auto problem = detail::out_of_place_problem(send, recv, needed); !problem.empty()) bad_argument(k, problem);
  }

  /// count * size(), refused when it overflows.
  std::size_t checked_mul(detail::op_kind k, std::size_t count) const {
    usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    if (count > std::numeric_limits<std::size_t>::max() / n)
      bad_argument(k, "count " + std::to_string(count) + " times " + std::to_string(n) + " ranks overflows");
    return count * n;
  }

  /// The block length of a buffer of `size()` equal blocks.
  std::size_t blocks_of(detail::op_kind k, std::size_t total) const {
    usable(k);
    const auto n = static_cast<std::size_t>(self().size());
    if (total % n != 0)
      bad_argument(k, "buffer of " + std::to_string(total) + " elements does not split into " + std::to_string(n) +
                          " equal blocks");
    return total / n;
  }

  /// One side of an all_to_all_v: n counts and displacements, each block inside the buffer. The
  /// end of a block is compared without adding count and displacement first (int64 overflow).
  void check_layout(detail::op_kind k, const char* which, std::size_t buffer, std::span<const std::int64_t> counts,
                    std::span<const std::int64_t> displs) const {
    const auto n = static_cast<std::size_t>(self().size());
    const std::string w(which);
    if (counts.size() != n || displs.size() != n)
      bad_argument(k, w + "_counts and " + w + "_displs need " + std::to_string(n) + " entries each, got " +
                          std::to_string(counts.size()) + " and " + std::to_string(displs.size()));
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t c = counts[j];
      const std::int64_t d = displs[j];
      if (c < 0 || d < 0)
        bad_argument(k, w + "_counts[" + std::to_string(j) + "] = " + std::to_string(c) + " and " + w + "_displs[" +
                            std::to_string(j) + "] = " + std::to_string(d) + ": counts and displacements must be >= 0");
      if (c > std::numeric_limits<std::int64_t>::max() - d || static_cast<std::uint64_t>(c + d) > buffer)
        bad_argument(k, w + " block " + std::to_string(j) + " (displacement " + std::to_string(d) + ", count " +
                            std::to_string(c) + ") overflows or runs past the end of the " + w + " buffer of " +
                            std::to_string(buffer) + " elements");
    }
  }

  void check_pairs(std::span<const permute_pair> pairs) const {
    constexpr auto k = detail::op_kind::ppermute;
    usable(k);
    const int n = self().size();
    std::vector<char> src(static_cast<std::size_t>(n)), dst(static_cast<std::size_t>(n));
    for (const auto& p : pairs) {
      if (p.source < 0 || p.source >= n || p.dest < 0 || p.dest >= n)
        bad_argument(k, "pair (" + std::to_string(p.source) + ", " + std::to_string(p.dest) +
                            ") names a rank out of range [0, " + std::to_string(n) + ")");
      if (src[static_cast<std::size_t>(p.source)]++)
        bad_argument(k, "rank " + std::to_string(p.source) + " is the source of two pairs; each rank sends at most once");
      if (dst[static_cast<std::size_t>(p.dest)]++)
        bad_argument(k, "rank " + std::to_string(p.dest) + " is the destination of two pairs; each rank receives at most once");
    }
  }
};

}  // namespace meshlib
// end meshlib/comm/frontend.hpp
// begin meshlib/comm/timeout.hpp
/// @file
/// @brief The timeout every communicator starts from unless told otherwise: `MESHLIB_COMM_TIMEOUT`
/// or 60 s. Here, in the comm layer and apart from any backend, because every backend's options
/// (thread, MPI, NCCL) and the debug layer's slow-collective warning use the same default; before,
/// they reached into the thread backend's options for it.

#include <chrono>
#include <cstdlib>
#include <string>


namespace meshlib {

/// @brief Timeout of a communicator whose creator gave none and whose environment has no
/// `MESHLIB_COMM_TIMEOUT`: 60 seconds. Long enough for any step of a real program on a loaded
/// machine, short enough that a hung CI job fails with a message instead of being killed.
inline constexpr std::chrono::seconds default_comm_timeout_fallback{60};

/// @brief The timeout communicators use unless told otherwise: `MESHLIB_COMM_TIMEOUT` (seconds, a
/// positive decimal number such as `2` or `0.5`), else `default_comm_timeout_fallback` (60 s).
/// @throws comm_argument_error when the variable is set to something that is not a positive number.
inline std::chrono::nanoseconds default_comm_timeout() {
  const char* env = std::getenv("MESHLIB_COMM_TIMEOUT");  // NOLINT(concurrency-mt-unsafe): read only
  if (env == nullptr || *env == '\0') return default_comm_timeout_fallback;
  char* end = nullptr;
  const double seconds = std::strtod(env, &end);
  if (end == env || *end != '\0' || !(seconds > 0) || seconds > 1e9) {
    throw comm_argument_error(std::string("meshlib: MESHLIB_COMM_TIMEOUT='") + env +
                              "' is not a positive number of seconds; set it to e.g. 30 or 0.5, or unset it for " +
                              std::to_string(default_comm_timeout_fallback.count()) + " s");
  }
  return std::chrono::nanoseconds(static_cast<long long>(seconds * 1e9));
}

}  // namespace meshlib
// end meshlib/comm/timeout.hpp
// begin meshlib/comm/thread/options.hpp
/// @file
/// @brief `thread_comm_options`: the knobs of the thread communicator, with defaults that were
/// measured on a 2-core machine (see docs/benchmarks.md). The timeout default they start from is
/// the comm layer's (comm/timeout.hpp), shared by every backend.

#include <chrono>
#include <cstddef>


namespace meshlib {

/// @brief Options of a `thread_world`.
/// @code
/// meshlib::thread_world world(4, {.timeout = std::chrono::seconds(2)});
/// @endcode
struct thread_comm_options {
  /// How long a participant waits for its peers in one step before `comm_timeout`.
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// The one-shot algorithm (each rank copies its payload into a shared slot; one
  /// synchronisation) runs while the bytes each rank stages are at most this (for all_reduce and
  /// reduce: times the number of ranks, because there each rank then reads every payload whole);
  /// above it the zero-copy algorithm runs (peers read each other's buffers; two
  /// synchronisations). 0: the measured default, 2 KiB when each participant has a core, 64 KiB
  /// when there are more participants than cores (each synchronisation then costs context switches).
  std::size_t one_shot_max_bytes = 0;
  /// Payload of all ranks together (bytes per rank times ranks) from which the zero-copy
  /// algorithms write with non-temporal (streaming) stores, which skip the read-for-ownership of
  /// lines that will not be read again soon and leave the caches to the inputs. 0: the measured
  /// default (64 MiB); SIZE_MAX: never.
  std::size_t streaming_min_bytes = 0;
  /// How long a waiting participant spins, at most, before it blocks. Negative: the measured
  /// default (`detail::spin_window`, 50 us: about what a block and wake-up cost), none when there
  /// are more participants than cores. A participant that spun in vain spins less next time.
  std::chrono::nanoseconds spin = std::chrono::nanoseconds(-1);
  /// How long a waiting participant yields its core before it blocks, where the peer it waits for
  /// needs that core (it last ran on the same CPU, or there are more participants than cores);
  /// instead of spinning in the first case, after it in the second. Negative: default (2 ms).
  std::chrono::nanoseconds yield = std::chrono::nanoseconds(-1);
  /// `run_on_threads` only: pin participant r to the r-th CPU the process may run on (modulo their
  /// number), as OpenMPI binds its ranks to cores; the calling thread's affinity is restored when
  /// it returns. Keeps two communicating participants from sharing a core on a busy machine.
  /// Linux only; ignored elsewhere.
  bool pin_threads = false;
};

}  // namespace meshlib
// end meshlib/comm/thread/options.hpp
// begin meshlib/comm/thread/thread_communicator.hpp
/// @file
/// @brief The thread communicator: N participants that are N threads of one process, talking
/// through shared memory. meshlib's embedded default, and what every test runs on.
///
/// @code
/// meshlib::run_on_threads(4, [](meshlib::thread_communicator& comm) {
///   std::vector<float> x(1024, float(comm.rank()));
///   comm.all_reduce(std::span(x), meshlib::reduce_op::sum);   // in place: every x[i] == 6
/// });
/// @endcode
/// or, by hand: `meshlib::thread_world world(4);` then on thread r `auto comm = world.communicator(r);`.
///
/// Algorithms (docs/design.md has the details and docs/benchmarks.md the measurements):
/// - one-shot, for small payloads (`thread_comm_options::one_shot_max_bytes`): each rank copies
///   its payload into its slot (up to 24 bytes into the very cache line that announces its
///   arrival) and publishes its call; once every peer's call is there, each rank reads what it
///   needs from the peers' slots. One synchronisation per collective.
/// - zero-copy, above that: each rank arrives with the addresses of its buffers; after the release
///   each reads straight from its peers' buffers (all_reduce: rank k reduces slice k of every input
///   and writes it into every output), then all meet once more so no buffer is left while a peer
///   still reads or writes it. No byte is staged or moved twice; big payloads are written with
///   streaming stores.
/// Both reduce each element in rank order, so results are bitwise identical on every rank, in
/// every run, with either algorithm.
///
/// Faults: no wait is unbounded. A failed participant (`thread_world::abort`, or `run_on_threads`
/// seeing it throw), a participant whose handle is destroyed while peers wait for it, a timeout, a
/// mismatched step or an invalid argument fails the whole world (every group split from it), and
/// every participant's pending and later calls throw the root cause's error type
/// (`comm_aborted`, `comm_timeout`, `collective_mismatch`) with the same root-cause message.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/thread/detail/group_state.hpp
/// @file
/// @brief The shared state of the thread communicator: one `world_state` per `thread_world` (the
/// failure record every group of that world shares, and the registry of sub-groups being split),
/// one `group_state` per communicator group (the arrival counter, the release word, a slot per
/// rank with its call descriptor and staging buffers, and the point-to-point mailboxes).
///
/// Synchronisation (details in docs/design.md, "The thread communicator"): every collective is
/// one step. Each rank publishes its call in its flag line for the step (one cache line). One-shot
/// steps wait for every peer's flag line and compare the calls; zero-copy steps also count arrivals
/// on `arrivals`, and the rank that completes the count releases the step by incrementing `word`
/// with a compare-and-swap that fails once the world has failed. Waits spin, then block on a
/// condition variable with a deadline (oversubscribed groups yield in between). A failure sets the high bit of `word` in every group of
/// the world, which ends every wait at once.
///
/// What a rank publishes in a step is in call_desc.hpp; how long it spins, yields and blocks, and
/// which algorithm a step takes, in wait_policy.hpp.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

// begin meshlib/comm/detail/failure.hpp
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


namespace meshlib::detail {

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

}  // namespace meshlib::detail
// end meshlib/comm/detail/failure.hpp
// begin meshlib/comm/detail/spin_then_block.hpp
/// @file
/// @brief How a host thread waits for another: poll for a bounded window (`poll_for`,
/// `spin_window`), then block. One path for every waiter that spins before it sleeps: the thread
/// communicator's steps (comm/thread/detail/step_protocol.hpp) and the persistent device threads
/// (exec/detail/device_workers.hpp).
///
/// Why spin first, and for how long: a futex wake-up of a sleeping thread costs far more than a
/// cache line moving between cores (~0.1 us). Measured on the 2-core reference VM
/// (`comm_bench --wake-latency`, 2026-12-05, docs/benchmarks.md, "Waiting and the large
/// all_reduce"): a blocked thread woken from another CPU runs 25-28 us after the wake-up call
/// (median; p90 35-40 us), 4-6 us when woken on the waker's CPU; an idle vCPU took 27-50 us
/// (2026-12-01). Spinning for as long as a block and wake-up cost is never more than twice as slow
/// as the better of the two (the classic competitive bound), and spinning longer only burns a core
/// that a peer, or the computation an overlapped collective hides, could use. Hence `spin_window`
/// = 50 us, above the p90 of a wake-up across CPUs.
///
/// Why the sleeper pays for the fence: a waiter that goes to sleep announces it (a counter) and
/// then re-checks its condition; the thread that makes the condition true stores, then reads the
/// counter and wakes only if someone sleeps. Without a full fence on both sides each can miss the
/// other's store (store buffering) and the sleeper oversleeps until its next re-check. A fence on
/// the waker's side costs every collective a cache-line round trip on the critical path (0.2 us
/// calls), so the sleeper issues a process-wide barrier instead (`sleeper_fence`: Linux
/// `membarrier`, a few microseconds, paid only by a thread about to block), and the waker only
/// keeps the compiler from reordering (`waker_fence`), the asymmetric Dekker handshake.

#include <atomic>
#include <chrono>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__linux__) && __has_include(<linux/membarrier.h>)
#include <linux/membarrier.h>
#include <sys/syscall.h>
#include <unistd.h>
#define MESHLIB_DETAIL_HAS_MEMBARRIER 1
#else
#define MESHLIB_DETAIL_HAS_MEMBARRIER 0
#endif

namespace meshlib::detail {

/// Tells the core that this is a spin-wait loop (frees resources for the sibling hyper-thread and
/// avoids the memory-order mis-speculation penalty when the awaited line changes).
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  // The builtin behind _mm_pause (GCC and Clang): <immintrin.h> would cost every TU that includes
  // meshlib ~0.6 s of parsing for this one instruction (docs/benchmarks.md, include cost).
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

/// How long a waiter whose peers each have a core polls before it blocks (see the file comment).
inline constexpr std::chrono::nanoseconds spin_window{50'000};

/// Polls `done()` for at most `budget` (the clock is read every 32 polls); true as soon as it
/// holds, false when the budget ran out first.
template <class Done>
bool poll_for(Done&& done, std::chrono::nanoseconds budget) {
  const auto start = std::chrono::steady_clock::now();
  for (unsigned i = 1;; ++i) {
    if (done()) return true;
    cpu_relax();
    if ((i & 31u) == 0 && std::chrono::steady_clock::now() - start > budget) return done();
  }
}

/// The CPU the calling thread runs on, or -1 where that is unknown: a hint for a waiter whose peer
/// shares its core, which spinning cannot help (glibc reads it from rseq: no system call).
inline int current_cpu() noexcept {
#if defined(__linux__)
  return ::sched_getcpu();
#else
  return -1;
#endif
}

/// The waker's half of the handshake (see the file comment): between its store that makes a
/// waiter's condition true and its read of whether anyone sleeps. Free at run time.
inline void waker_fence() noexcept { std::atomic_signal_fence(std::memory_order_seq_cst); }

/// The sleeper's half: between announcing that it sleeps and re-checking its condition. Returns
/// whether it was a process-wide barrier; when not (no `membarrier`), a waker may miss the
/// sleeper, which must then re-check its condition on a short period.
/// No `std::atomic_thread_fence` here: the announcement is a seq_cst read-modify-write and the
/// system call is a full barrier itself (and ThreadSanitizer builds refuse thread fences).
inline bool sleeper_fence() noexcept {
#if MESHLIB_DETAIL_HAS_MEMBARRIER
  static const bool registered =
      ::syscall(SYS_membarrier, MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED, 0, 0) == 0;
  return registered && ::syscall(SYS_membarrier, MEMBARRIER_CMD_PRIVATE_EXPEDITED, 0, 0) == 0;
#else
  return false;
#endif
}

}  // namespace meshlib::detail
// end meshlib/comm/detail/spin_then_block.hpp
// begin meshlib/comm/thread/detail/call_desc.hpp
/// @file
/// @brief What one rank of a thread group called in one step: the full descriptor (`call_desc`),
/// its hot part in the rank's flag line (`flag_line`, one cache line), how two ranks' calls are
/// compared (`same_call`) and what a mismatch message shows of a call (`summary_of`, for the
/// describer every backend shares, call_text.hpp). Apart from the group state because this is the
/// step protocol's vocabulary (what a rank publishes and what its peers check), whereas the group
/// state is where it lives.

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

// begin meshlib/comm/detail/call_text.hpp
/// @file
/// @brief How a `collective_mismatch` message shows one participant's call, for every backend:
/// "all_reduce(float32, count 8, op sum)", "reduce(int64, count 3, op max, root 1)",
/// "ppermute(float32, count 4, pairs [(0, 1), (1, 0)])", "split(color 1, key 0)", "barrier()".
/// Each backend records calls in its own format (the thread group's descriptors, the MPI call
/// record, the NCCL fingerprint, the shared-GPU call); it decodes its record into a `call_summary`
/// and asks `describe_call` for the text (and `describe_counts_disagreement` for an all_to_all_v
/// whose counts disagree). One describer, so that the backends cannot drift apart
/// in how they name the same call (they had: "count 4, op sum" on the host, "4 elements, sum" on
/// the devices), and so that one set of expected words (the conformance kit's) fits them all.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>


namespace meshlib::detail {

/// One participant's call, as far as its backend's record of the call knows it. Which fields are
/// shown follows from `kind` (`uses_dtype`, `uses_count`, `uses_op`, `uses_root`), so a backend
/// may leave the others at any value; the optional parts are shown only where a backend has them.
struct call_summary {
  op_kind kind = op_kind::barrier;
  /// The element type; empty for an element type without a `datatype` (the device backends'
  /// CUDA 16-bit types), shown as "-".
  std::optional<datatype> dtype;
  std::uint64_t count = 0;       ///< elements per participant, as the concept counts them
  reduce_op op = reduce_op::sum;
  int root = 0;
  /// split: the color and key, where the backend records them.
  std::optional<int> color;
  int key = 0;
  /// ppermute: the pairs, where the backend keeps every participant's (the others keep a hash).
  std::optional<std::span<const permute_pair>> pairs;
  /// all_to_all_v: the send and receive counts (one per participant), where the backend may read
  /// them when the message is written.
  std::optional<std::span<const std::int64_t>> send_counts;
  std::optional<std::span<const std::int64_t>> recv_counts;
};

/// "[1, 2, 3]".
inline std::string bracketed_counts(std::span<const std::int64_t> a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}

/// The text every backend's `collective_mismatch` message shows for one call:
/// "<op>(<type>, count <n>, op <reduce op>, root <r>, pairs [...], send_counts [...],
/// recv_counts [...])", with only the parts the operation takes ("split(color 1, key 0)",
/// "barrier()").
inline std::string describe_call(const call_summary& c) {
  std::string s(op_name(c.kind));
  s += '(';
  if (c.kind == op_kind::split) {
    if (c.color) s += "color " + std::to_string(*c.color) + ", key " + std::to_string(c.key);
  } else if (uses_dtype(c.kind)) {
    s += c.dtype ? std::string(to_string(*c.dtype)) : std::string("-");
    if (uses_count(c.kind)) s += ", count " + std::to_string(c.count);
    if (uses_op(c.kind)) s += ", op " + std::string(to_string(c.op));
    if (uses_root(c.kind)) s += ", root " + std::to_string(c.root);
    if (c.kind == op_kind::ppermute && c.pairs) {
      s += ", pairs [";
      for (std::size_t i = 0; i < c.pairs->size(); ++i)
        s += (i ? ", (" : "(") + std::to_string((*c.pairs)[i].source) + ", " + std::to_string((*c.pairs)[i].dest) + ')';
      s += ']';
    }
    if (c.kind == op_kind::all_to_all_v) {
      if (c.send_counts) s += ", send_counts " + bracketed_counts(*c.send_counts);
      if (c.recv_counts) s += ", recv_counts " + bracketed_counts(*c.recv_counts);
    }
  }
  return s + ')';
}

/// "rank 1 sends 3 elements to rank 0, which expects 2": how every backend's
/// `collective_mismatch` message names an all_to_all_v whose counts disagree (the sender's
/// send_counts entry for the receiver against the receiver's recv_counts entry for the sender),
/// with each backend's labels of the participants.
inline std::string describe_counts_disagreement(std::string_view sender, std::string_view receiver,
                                                std::int64_t sent, std::int64_t expected) {
  return std::string(sender) + " sends " + std::to_string(sent) + " elements to " + std::string(receiver) +
         ", which expects " + std::to_string(expected);
}

/// One (sender, receiver) pair of an all_to_all_v whose counts disagree.
struct counts_disagreement {
  std::size_t sender = 0;
  std::size_t receiver = 0;
  std::int64_t sent = 0;      ///< the sender's send_counts entry for the receiver
  std::int64_t expected = 0;  ///< the receiver's recv_counts entry for the sender
};

/// The first pair of `n` participants whose counts disagree, in the one order every backend that
/// sees all the counts checks (senders ascending, then receivers), so that every participant
/// names the same pair; empty when they all agree. `sent(i, j)`: participant i's send_counts
/// entry for j; `expected(j, i)`: participant j's recv_counts entry for i.
template <class Sent, class Expected>
std::optional<counts_disagreement> first_counts_disagreement(std::size_t n, Sent&& sent, Expected&& expected) {
  for (std::size_t i = 0; i < n; ++i)
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t s = sent(i, j), e = expected(j, i);
      if (s != e) return counts_disagreement{i, j, s, e};
    }
  return std::nullopt;
}

}  // namespace meshlib::detail
// end meshlib/comm/detail/call_text.hpp

namespace meshlib::detail {

/// What one rank called in one step: compared across ranks (mismatch detection), and the source
/// of the peers' buffer addresses for the zero-copy algorithms.
struct call_desc {
  op_kind kind = op_kind::barrier;
  datatype dtype = datatype::float32;
  reduce_op op = reduce_op::sum;
  int root = 0;
  std::uint64_t count = 0;
  int color = 0;
  int key = 0;
  const void* src = nullptr;  ///< staged copy (one-shot) or the user's send buffer (zero-copy)
  void* dst = nullptr;        ///< the user's receive buffer (zero-copy algorithms that push)
  std::span<const permute_pair> pairs{};  ///< ppermute: the caller's pairs (the slot keeps a copy)
  const std::int64_t* v[4] = {nullptr, nullptr, nullptr, nullptr};  ///< all_to_all_v: sc, sd, rc, rd
  int nv = 0;                                                       ///< length of each v array
};

/// What a mismatch message shows of a rank's call (`describe_call`). `pairs` is the slot's copy
/// of a ppermute's pairs; the all_to_all_v counts are shown only when `with_arrays` (they live in
/// the caller's memory, which is safe to read only while the caller is blocked).
inline call_summary summary_of(const call_desc& d, const std::vector<permute_pair>& pairs, bool with_arrays) {
  call_summary c;
  c.kind = d.kind;
  c.dtype = d.dtype;
  c.count = d.count;
  c.op = d.op;
  c.root = d.root;
  if (d.kind == op_kind::split) {
    c.color = d.color;
    c.key = d.key;
  }
  if (d.kind == op_kind::ppermute) c.pairs = std::span<const permute_pair>(pairs);
  if (d.kind == op_kind::all_to_all_v && with_arrays) {
    c.send_counts = std::span<const std::int64_t>(d.v[0], static_cast<std::size_t>(d.nv));
    c.recv_counts = std::span<const std::int64_t>(d.v[2], static_cast<std::size_t>(d.nv));
  }
  return c;
}

/// The hot part of a rank's call in one step, in one cache line with its step number, so that a
/// peer learns that the rank arrived, what it called, and (for up to 24 bytes) its payload, from
/// one cache-line transfer.
struct alignas(64) flag_line {
  std::atomic<std::uint64_t> seq{0};  ///< step + 1 once this line holds the rank's call of that step
  op_kind kind = op_kind::barrier;
  datatype dtype = datatype::float32;
  reduce_op op = reduce_op::sum;
  std::int32_t root = 0;
  std::uint64_t count = 0;
  std::int32_t color = 0;
  std::int32_t key = 0;
  const void* src = nullptr;
  alignas(8) std::byte inline_data[24] = {};
};
static_assert(sizeof(flag_line) == 64);
inline constexpr std::size_t inline_capacity = sizeof(flag_line::inline_data);

/// Whether two ranks' calls agree on everything the step depends on (pairs: the slots' copies).
inline bool same_call(const flag_line& a, const flag_line& b, const std::vector<permute_pair>& pa,
                      const std::vector<permute_pair>& pb) {
  if (a.kind != b.kind) return false;
  if (uses_dtype(a.kind) && a.dtype != b.dtype) return false;
  if (uses_count(a.kind) && a.count != b.count) return false;
  if (uses_op(a.kind) && a.op != b.op) return false;
  if (uses_root(a.kind) && a.root != b.root) return false;
  if (a.kind == op_kind::ppermute && pa != pb) return false;
  return true;
}

}  // namespace meshlib::detail
// end meshlib/comm/thread/detail/call_desc.hpp
// begin meshlib/comm/thread/detail/wait_policy.hpp
/// @file
/// @brief How the ranks of a thread group wait for each other and which algorithm a step takes:
/// `wait_policy` (spin, yield, block; the one-shot and streaming thresholds) with its measured
/// defaults. Apart from the group state because these are tuning
/// decisions (docs/benchmarks.md), made once per group from `thread_comm_options` and the core
/// count, not the shared state itself.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <thread>


namespace meshlib::detail {

/// The waiting policy of one group: spin while a peer on another core is about to arrive (a cache
/// line moves between cores in ~60 ns), for at most `spin_window` (comm/detail/spin_then_block.hpp:
/// about what a block and wake-up cost), then block. Yield instead of spinning, for at most
/// `yield`, where the peer needs this core to arrive at all: it last ran on the waiter's CPU, or
/// there are more participants than cores (a context switch to a runnable peer is cheaper than a
/// wake-up). Where each participant has a core, yielding to no one made a late peer's waiter spin
/// through system calls for 2 ms (a core burnt for nothing) and see the peer's arrival only
/// between them.
struct wait_policy {
  std::chrono::nanoseconds spin;
  std::chrono::nanoseconds yield;  ///< yielding, when a peer shares this CPU or oversubscribed, before blocking
  bool oversubscribed;             ///< more participants than cores
  std::chrono::nanoseconds timeout;
  std::size_t one_shot_max;  ///< bytes staged per rank at or below which the one-shot algorithm runs
  int burst;                 ///< spins before the first clock reading
  std::size_t streaming_min; ///< payload bytes of all ranks from which zero-copy paths use streaming stores
};

/// Measured (docs/benchmarks.md): streaming stores pay once the payloads of all ranks no longer
/// fit in the caches: 16 MiB all_reduce 1.3x faster with them on 4 and 8 ranks, 1.35x slower on 2.
inline constexpr std::size_t default_streaming_min_bytes = std::size_t{64} << 20;

/// Measured on the 2-core reference machine (docs/benchmarks.md): below this many staged bytes per
/// rank, one synchronisation plus a copy beats two synchronisations and no copy. Oversubscribed, a
/// synchronisation costs context switches, so the one-shot algorithm pays for much longer.
inline std::size_t default_one_shot_max_bytes(bool oversubscribed) noexcept {
  return oversubscribed ? std::size_t{64} << 10 : std::size_t{2} << 10;
}

/// @brief How long this thread spins, at most `policy.spin`, before it yields: the spin budget
/// adapts to whether spinning has been paying off for it (issue 27).
///
/// Why: spinning only helps while the awaited peer runs on another core. When the peer shares
/// this thread's core (the scheduler put both there: on a loaded machine it happened for whole
/// runs of 2000 calls), it cannot arrive until this thread gives the core up, so every wait spun
/// its full budget first: ~107 us per 8 B all_reduce instead of ~0.5 us, on the raw communicator
/// and the typed collectives alike (docs/benchmarks.md). So a wait whose spinning ran out (a
/// miss) cuts this thread's budget to `floor`, and a wait that ended while spinning after having
/// had to spin at all doubles it back, up to the policy's; a wait that finds its peers already
/// there says nothing either way. Per thread, not per communicator: where a thread runs is a
/// property of the thread, and a `thread_runner` makes a fresh world every call.
class adaptive_spin {
 public:
  /// The budget after a miss: what a context switch costs, so a peer on another core that is a
  /// little late is still caught without a switch.
  static constexpr std::chrono::nanoseconds floor{1'000};

  /// This thread's current budget under a policy allowing `max`.
  static std::chrono::nanoseconds budget(std::chrono::nanoseconds max) noexcept {
    const std::chrono::nanoseconds b = current();
    return b.count() < 0 || b > max ? max : b;
  }
  /// A wait that had to spin ended while spinning: spinning pays here again.
  static void caught(std::chrono::nanoseconds max) noexcept {
    std::chrono::nanoseconds& b = current();
    if (b.count() >= 0) b = std::min(max, std::max(floor, 2 * b));
  }
  /// A wait spun its whole budget in vain.
  static void missed(std::chrono::nanoseconds max) noexcept {
    current() = std::min(max, floor);
    ++misses();
  }
  /// Misses of this thread so far (tests: how often a wait spun its budget in vain).
  static std::uint64_t& misses() noexcept {
    thread_local std::uint64_t n = 0;
    return n;
  }

 private:
  static std::chrono::nanoseconds& current() noexcept {
    thread_local std::chrono::nanoseconds b{-1};  // negative: the policy's budget, nothing learnt yet
    return b;
  }
};

/// `threads`: the world's participants, all of which may be running (a sub-group of 2 in a world of
/// 8 threads on 2 cores must yield, not spin).
inline wait_policy make_wait_policy(const thread_comm_options& o, int threads) {
  // Read once: hardware_concurrency reads /sys on every call (11 us here), and every group (a
  // world per spmd call, a sub-group per axis used) asks.
  static const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const bool oversubscribed = static_cast<unsigned>(threads) > cores;
  wait_policy p{};
  p.spin = o.spin.count() >= 0 ? o.spin
                               : (oversubscribed ? std::chrono::nanoseconds(0) : spin_window);
  p.yield = o.yield.count() >= 0 ? o.yield : std::chrono::nanoseconds(2'000'000);
  p.oversubscribed = oversubscribed;
  p.timeout = o.timeout;
  p.burst = oversubscribed ? 2 : 64;
  p.streaming_min = o.streaming_min_bytes != 0 ? o.streaming_min_bytes : default_streaming_min_bytes;
  p.one_shot_max = o.one_shot_max_bytes != 0 ? o.one_shot_max_bytes : default_one_shot_max_bytes(oversubscribed);
  return p;
}

}  // namespace meshlib::detail
// end meshlib/comm/thread/detail/wait_policy.hpp

namespace meshlib::detail {

using comm_clock = std::chrono::steady_clock;

/// How long a waiter waits, after a peer's handle was destroyed by an exception unwinding its
/// stack, for that peer's runner to report the exception (well inside the 1 s promise).
inline constexpr std::chrono::milliseconds unwind_grace{200};


/// A buffer aligned to a cache line, grown by its owner only.
class staging_buffer {
 public:
  staging_buffer() = default;
  staging_buffer(const staging_buffer&) = delete;
  staging_buffer& operator=(const staging_buffer&) = delete;
  ~staging_buffer() { release(); }
  std::byte* reserve(std::size_t bytes) {
    if (bytes > capacity_) {
      release();
      const std::size_t cap = std::max<std::size_t>(bytes, 256);
      data_ = static_cast<std::byte*>(::operator new(cap, std::align_val_t{64}));
      capacity_ = cap;
    }
    return data_;
  }

 private:
  void release() noexcept {
    if (data_) ::operator delete(data_, std::align_val_t{64});
    data_ = nullptr;
    capacity_ = 0;
  }
  std::byte* data_ = nullptr;
  std::size_t capacity_ = 0;
};

/// One rank's slot. Flag lines, descriptors and staging buffers are double-buffered by the parity of the step:
/// a rank can start step s+1 (and overwrite its parity-(s+1) copies) while slow peers still read
/// its step-s copies, but it cannot start step s+2 before every peer arrived at s+1, that is,
/// before every peer finished reading step s.
struct alignas(64) rank_slot {
  flag_line line[2];
  call_desc desc[2];
  std::vector<permute_pair> pairs[2];     ///< copy of a ppermute's pairs (peers may read it after the caller returned)
  alignas(64) std::atomic<std::uint64_t> arrived{0};  ///< central arrivals of this rank (zero-copy steps)
  alignas(64) std::atomic<std::uint64_t> done{0};     ///< step + 1 of the last zero-copy step it finished copying
  /// The CPU its thread ran on when it last arrived (-1: unknown), written only when it changes: a
  /// waiter whose late peer shares its CPU yields instead of spinning (step_protocol::wait_until).
  std::atomic<int> cpu{-1};
  std::atomic<bool> departed{false};      ///< its handle was destroyed
  /// When the handle was destroyed by stack unwinding (steady-clock ticks; 0: it was not). Its
  /// thread is about to report the exception itself, and that exception is the better root cause
  /// than "it left": waiters give it `unwind_grace` to arrive before they blame the departure.
  std::atomic<std::int64_t> unwound_at{0};
  std::atomic<bool> claimed{false};       ///< its handle was handed out
  staging_buffer staging[2];
};

struct group_state;

/// The failure record and sub-group registry shared by every group of one thread_world.
struct world_state {
  world_state(const thread_comm_options& o, int participants) : options(o), size(participants) {}

  thread_comm_options options;
  const int size;  ///< threads of the world: whether they outnumber the cores decides how groups wait
  std::mutex mutex;
  std::atomic<bool> failed{false};
  failure_kind kind = failure_kind::aborted;  // guarded by mutex
  int failed_rank = -1;                       // world rank of the root cause, -1 if none
  std::string message;                        // guarded by mutex
  missing_report timed_out;                   // a timeout's waiter and missing ranks (world ranks; guarded by mutex)
  std::vector<std::weak_ptr<group_state>> groups;
  struct pending_group {
    std::shared_ptr<group_state> state;
    int claims = 0;
  };
  std::map<std::tuple<std::uint64_t, std::uint64_t, int>, pending_group> pending;
  std::uint64_t next_group_id = 0;

  /// Records the root cause (the first failure wins) and releases every waiter of every group.
  /// @returns whether this call recorded the root cause.
  bool fail(failure_kind k, int world_rank, std::string msg, missing_report report = {});

  /// Throws the error of the recorded root cause, `context` appended.
  [[noreturn]] void rethrow(std::string_view context) {
    failure_kind k;
    std::string m;
    {
      std::lock_guard lk(mutex);
      k = kind;
      m = message;
    }
    if (!context.empty()) {
      m += " [";
      m += context;
      m += ']';
    }
    throw_failure(k, std::move(m));
  }

  /// The facts of the root cause when it is a timeout this world detected (world ranks), so that
  /// an owner can restate it in its own terms; false when it is not.
  bool timeout_facts(missing_report& out) {
    std::lock_guard lk(mutex);
    if (!failed.load(std::memory_order_relaxed) || kind != failure_kind::timeout || timed_out.waiter < 0) return false;
    out = timed_out;
    return true;
  }

  int root_cause_rank() {
    std::lock_guard lk(mutex);
    return failed_rank;
  }
};

/// A point-to-point message in flight: send copies it here, so send never waits for recv.
struct p2p_message {
  int tag = 0;
  datatype dtype = datatype::float32;
  std::size_t count = 0;
  std::vector<std::byte> data;
};

inline constexpr std::uint64_t failed_bit = std::uint64_t{1} << 63;

struct group_state {
  group_state(std::shared_ptr<world_state> w, std::vector<int> members, std::uint64_t gid)
      : world(std::move(w)),
        n(static_cast<int>(members.size())),
        id(gid),
        world_ranks(std::move(members)),
        policy(make_wait_policy(world->options, world->size)),
        slots(new rank_slot[static_cast<std::size_t>(n)]),
        mailboxes(static_cast<std::size_t>(n) * static_cast<std::size_t>(n)) {}

  std::shared_ptr<world_state> world;
  const int n;
  const std::uint64_t id;
  const std::vector<int> world_ranks;  ///< world rank of each group rank
  const wait_policy policy;

  // The arrival counter and the release word share a line: the rank that completes a step
  // already owns the line when it releases the step.
  alignas(64) std::atomic<std::uint64_t> arrivals{0};
  std::atomic<std::uint64_t> word{0};  ///< released steps | failed_bit

  alignas(64) std::atomic<int> sleepers{0};
  std::mutex mutex;
  std::condition_variable cv;

  std::unique_ptr<rank_slot[]> slots;

  std::mutex p2p_mutex;
  std::condition_variable p2p_cv;
  /// [source * n + dest], guarded by p2p_mutex; in send order. Vectors, not deques: a default
  /// deque allocates, and a world (one per spmd call) has n * n mailboxes, nearly always empty.
  std::vector<std::vector<p2p_message>> mailboxes;

  bool is_world() const noexcept { return id == 0; }

  /// "rank 2", or "rank 2 (world rank 5)" in a sub-group.
  std::string rank_label(int r) const {
    std::string s = "rank " + std::to_string(r);
    if (!is_world()) s += " (world rank " + std::to_string(world_ranks[static_cast<std::size_t>(r)]) + ")";
    return s;
  }

  /// Wakes every blocked waiter of this group (after a rank arrived or departed). The check of
  /// `sleepers` is unfenced on purpose: a waiter about to sleep issues the process-wide barrier
  /// instead (`sleeper_fence`, comm/detail/spin_then_block.hpp), so that no wake-up is missed
  /// while every collective's arrival stays one plain store.
  void wake() {
    waker_fence();
    if (sleepers.load(std::memory_order_relaxed) != 0) {
      { std::lock_guard lk(mutex); }
      cv.notify_all();
    }
  }
  void wake_all_unconditionally() {
    { std::lock_guard lk(mutex); }
    cv.notify_all();
    { std::lock_guard lk(p2p_mutex); }
    p2p_cv.notify_all();
  }
};

inline bool world_state::fail(failure_kind k, int world_rank, std::string msg, missing_report report) {
  std::vector<std::shared_ptr<group_state>> live;
  {
    std::lock_guard lk(mutex);
    if (failed.load(std::memory_order_relaxed)) return false;
    kind = k;
    failed_rank = world_rank;
    message = std::move(msg);
    timed_out = std::move(report);
    failed.store(true, std::memory_order_seq_cst);
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(std::move(g));
  }
  for (auto& g : live) {
    g->word.fetch_or(failed_bit, std::memory_order_seq_cst);
    g->wake_all_unconditionally();
  }
  return true;
}

/// Creates a group of `world` and registers it for failure propagation; the caller holds world->mutex.
inline std::shared_ptr<group_state> make_group_locked(const std::shared_ptr<world_state>& world,
                                                      std::vector<int> members) {
  auto g = std::make_shared<group_state>(world, std::move(members), world->next_group_id++);
  std::erase_if(world->groups, [](const std::weak_ptr<group_state>& w) { return w.expired(); });
  world->groups.push_back(g);
  if (world->failed.load(std::memory_order_relaxed)) g->word.fetch_or(failed_bit);
  return g;
}

inline std::shared_ptr<group_state> make_group(const std::shared_ptr<world_state>& world, std::vector<int> members) {
  std::lock_guard lk(world->mutex);
  return make_group_locked(world, std::move(members));
}

/// The sub-group of color `color` made by the split in step `step` of group `parent`: the first
/// member to come creates it, the others find it; the entry goes when every member took it.
inline std::shared_ptr<group_state> claim_split_group(const std::shared_ptr<world_state>& world, std::uint64_t parent,
                                                      std::uint64_t step, int color, const std::vector<int>& members) {
  std::lock_guard lk(world->mutex);
  const auto key = std::make_tuple(parent, step, color);
  auto it = world->pending.find(key);
  if (it == world->pending.end())
    it = world->pending.emplace(key, world_state::pending_group{make_group_locked(world, members), 0}).first;
  std::shared_ptr<group_state> g = it->second.state;
  if (++it->second.claims == static_cast<int>(members.size())) world->pending.erase(it);
  return g;
}

}  // namespace meshlib::detail
// end meshlib/comm/thread/detail/group_state.hpp
// begin meshlib/comm/thread/detail/reduce_kernels.hpp
/// @file
/// @brief The element loops of the thread communicator: a rank-ordered reduction of n inputs into
/// one or more outputs, and plain copies. One code path serves the one-shot and the zero-copy
/// algorithms, so that both give the same bits: every element is combined as
/// `((x0 op x1) op x2) ...` in rank order, whatever the algorithm, the slicing or the thread timing.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>


#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace meshlib::detail {

/// The type in which elements of T are combined: float for bfloat16 (NCCL's and PyTorch's
/// accumulation type), the unsigned twin for integers (so that sum and prod wrap instead of
/// overflowing into undefined behaviour), T itself for float and double.
template <class T>
struct accumulator {
  using type = T;
};
template <>
struct accumulator<bfloat16> {
  using type = float;
};
template <class T>
  requires std::is_integral_v<T>
struct accumulator<T> {
  using type = std::make_unsigned_t<T>;
};
template <class T>
using accumulator_t = typename accumulator<T>::type;

template <class T>
constexpr accumulator_t<T> widen(T x) noexcept {
  return static_cast<accumulator_t<T>>(x);
}

/// Whether the sign bit of a float or double is set (-0.0 included), usable in constexpr code.
template <class F>
constexpr bool sign_bit(F v) noexcept {
  if constexpr (sizeof(F) == 4) return (std::bit_cast<std::uint32_t>(v) >> 31) != 0;
  else return (std::bit_cast<std::uint64_t>(v) >> 63) != 0;
}

/// max of floating-point values as meshlib defines it on every backend: a NaN anywhere gives NaN
/// (the first in rank order: `a` is the running result of the lower ranks), and +0 > -0. So the
/// result does not depend on the order of the participants, and NaN is not lost as with
/// `a < b ? b : a` (which keeps `a` whenever `b` is NaN).
template <class F>
constexpr F float_max(F a, F b) noexcept {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return sign_bit(a) ? b : a;
  return a < b ? b : a;
}

/// min, the mirror of `float_max`: NaN anywhere gives NaN, and -0 < +0.
template <class F>
constexpr F float_min(F a, F b) noexcept {
  if (a != a) return a;
  if (b != b) return b;
  if (a == b) return sign_bit(a) ? a : b;
  return b < a ? b : a;
}

template <reduce_op Op, class T>
constexpr accumulator_t<T> combine(accumulator_t<T> a, T x) noexcept {
  using A = accumulator_t<T>;
  if constexpr (Op == reduce_op::sum || Op == reduce_op::mean) {
    return static_cast<A>(a + widen(x));
  } else if constexpr (Op == reduce_op::prod) {
    return static_cast<A>(a * widen(x));
  } else if constexpr (std::is_integral_v<T>) {
    // Compare as signed values; the accumulator holds them as unsigned bit patterns.
    const T av = static_cast<T>(a);
    if constexpr (Op == reduce_op::min) return x < av ? widen(x) : a;
    else return av < x ? widen(x) : a;
  } else {
    if constexpr (Op == reduce_op::min) return float_min(a, widen(x));
    else return float_max(a, widen(x));
  }
}

template <reduce_op Op, class T>
constexpr T finish(accumulator_t<T> a, int n) noexcept {
  if constexpr (Op == reduce_op::mean) {
    if constexpr (std::is_integral_v<T>) return static_cast<T>(static_cast<T>(a) / static_cast<T>(n));
    else return static_cast<T>(a / static_cast<accumulator_t<T>>(n));
  } else {
    return static_cast<T>(a);
  }
}

/// Elements combined per block: the accumulators of one block stay in L1.
inline constexpr std::size_t reduce_block_elems = 1024;

/// Copies `bytes` with non-temporal (streaming) stores where the target is 16-byte aligned: the
/// written lines bypass the caches, so a copy much larger than the last-level cache neither reads
/// the target lines first (no read-for-ownership) nor evicts the sources. The caller issues
/// `stream_fence()` before it tells peers that the data is there.
inline void stream_bytes(void* dst, const void* src, std::size_t bytes) noexcept {
#if defined(__SSE2__)
  auto* d = static_cast<std::byte*>(dst);
  const auto* s = static_cast<const std::byte*>(src);
  const std::size_t head = (16 - (reinterpret_cast<std::uintptr_t>(d) & 15)) & 15;
  if (head >= bytes) {
    std::memcpy(d, s, bytes);
    return;
  }
  std::memcpy(d, s, head);
  d += head;
  s += head;
  bytes -= head;
  std::size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
    const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
  }
  for (; i + 16 <= bytes; i += 16)
    _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
  std::memcpy(d + i, s + i, bytes - i);
#else
  std::memcpy(dst, src, bytes);
#endif
}

/// Orders the streaming stores before the stores that follow (the release of a step).
inline void stream_fence() noexcept {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

/// out[o][i] = in[0][i] op in[1][i] op ... op in[n-1][i] for i in [0, len), for each of the
/// `nout` outputs. Inputs may alias outputs element for element (in-place collectives): each block
/// is read completely before any of it is written. With `streaming`, outputs are written with
/// non-temporal stores (call stream_fence() before publishing them).
template <reduce_op Op, class T>
void reduce_into_op(const T* const* in, int n, T* const* out, int nout, std::size_t len, bool streaming) {
  using A = accumulator_t<T>;
  // float and double sum/prod/min/max accumulate in T itself: then the first output's block can be
  // the accumulator (one pass for two ranks instead of three), unless it is also a later input
  // (an in-place reduce to a root other than 0), which must be read before anything is written.
  constexpr bool direct_ok = std::is_same_v<A, T> && Op != reduce_op::mean;
  bool direct = direct_ok && !streaming && n >= 2;
  for (int r = 1; r < n && direct; ++r) direct = in[r] != out[0];
  if (direct) {
    for (std::size_t b = 0; b < len; b += reduce_block_elems) {
      const std::size_t m = std::min(reduce_block_elems, len - b);
      T* y = out[0] + b;
      const T* x0 = in[0] + b;
      const T* x1 = in[1] + b;
      for (std::size_t i = 0; i < m; ++i) y[i] = combine<Op, T>(x0[i], x1[i]);
      for (int r = 2; r < n; ++r) {
        const T* x = in[r] + b;
        for (std::size_t i = 0; i < m; ++i) y[i] = combine<Op, T>(y[i], x[i]);
      }
      for (int o = 1; o < nout; ++o) std::memcpy(out[o] + b, y, m * sizeof(T));
    }
    return;
  }
  A acc[reduce_block_elems];
  T res[reduce_block_elems];
  for (std::size_t b = 0; b < len; b += reduce_block_elems) {
    const std::size_t m = std::min(reduce_block_elems, len - b);
    const T* in0 = in[0] + b;
    if (n >= 2) {
      const T* in1 = in[1] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, T>(widen(in0[i]), in1[i]);
    } else {
      for (std::size_t i = 0; i < m; ++i) acc[i] = widen(in0[i]);
    }
    for (int r = 2; r < n; ++r) {
      const T* x = in[r] + b;
      for (std::size_t i = 0; i < m; ++i) acc[i] = combine<Op, T>(acc[i], x[i]);
    }
    if (!streaming) {
      T* y = out[0] + b;
      for (std::size_t i = 0; i < m; ++i) y[i] = finish<Op, T>(acc[i], n);
      for (int o = 1; o < nout; ++o) std::memcpy(out[o] + b, y, m * sizeof(T));
      continue;
    }
    for (std::size_t i = 0; i < m; ++i) res[i] = finish<Op, T>(acc[i], n);
    for (int o = 0; o < nout; ++o) stream_bytes(out[o] + b, res, m * sizeof(T));
  }
}

/// Dispatches `reduce_into_op` on the run-time reduce op.
template <class T>
void reduce_into(reduce_op op, const T* const* in, int n, T* const* out, int nout, std::size_t len,
                 bool streaming = false) {
  switch (op) {
    case reduce_op::sum: return reduce_into_op<reduce_op::sum, T>(in, n, out, nout, len, streaming);
    case reduce_op::prod: return reduce_into_op<reduce_op::prod, T>(in, n, out, nout, len, streaming);
    case reduce_op::min: return reduce_into_op<reduce_op::min, T>(in, n, out, nout, len, streaming);
    case reduce_op::max: return reduce_into_op<reduce_op::max, T>(in, n, out, nout, len, streaming);
    case reduce_op::mean: return reduce_into_op<reduce_op::mean, T>(in, n, out, nout, len, streaming);
  }
}

/// memcpy that accepts empty ranges with null pointers (a span of size 0 may have data() == nullptr).
inline void copy_bytes(void* dst, const void* src, std::size_t bytes) noexcept {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

}  // namespace meshlib::detail
// end meshlib/comm/thread/detail/reduce_kernels.hpp
// begin meshlib/comm/thread/detail/step_protocol.hpp
/// @file
/// @brief One rank's side of the thread communicator's step protocol: publishing its call for a
/// step, waiting for its peers (spin, yield, block, with the timeout and departures), releasing
/// zero-copy steps, the second meeting after the copies, and mismatch detection. Apart from
/// `thread_communicator` because the protocol is the synchronisation, the communicator the
/// algorithms and the API on top of it; the communicator derives from `step_protocol`, which
/// holds the handle's place in its group (group, rank, step counters).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// begin meshlib/comm/detail/blocking_waits.hpp
/// @file
/// @brief `detail::prefer_blocking_waits()`: whether this thread's waits in a host backend block
/// at once instead of spinning and yielding first.
///
/// Why a per-thread hint: a backend spins and yields because the waiting thread wants its answer
/// soon and a context switch costs more than a short spin. A communication worker
/// (collectives/comm_stream.hpp) is the opposite case: nothing waits on it but the device thread,
/// which is busy computing what the collective overlaps, so every spin or `sched_yield` of the
/// worker takes a core from that computation (8 device threads and 8 workers on 2 cores: measured
/// in docs/benchmarks.md, "Overlapped gradient synchronisation"). The worker sets it for its
/// lifetime; the thread backend's waits read it (comm/thread/detail/step_protocol.hpp).

namespace meshlib::detail {

/// This thread's hint (see the file comment); false unless the thread sets it.
inline bool& prefer_blocking_waits() noexcept {
  thread_local bool block = false;
  return block;
}

}  // namespace meshlib::detail
// end meshlib/comm/detail/blocking_waits.hpp

namespace meshlib::detail {

/// Waits of every thread communicator of the process that went on to block, so far (tests: a
/// waiter whose peer is late ends up blocked, not spinning or yielding for ever).
inline std::atomic<std::uint64_t>& blocked_waits() noexcept {
  static std::atomic<std::uint64_t> n{0};
  return n;
}

/// @brief A handle's place in its thread group and the protocol of its steps. The base of
/// `thread_communicator`; moving a handle moves its place (not its `patience_`).
class step_protocol {
 protected:
  step_protocol() = default;
  step_protocol(std::shared_ptr<group_state> s, int rank) : state_(std::move(s)), rank_(rank) {}
  step_protocol(step_protocol&& o) noexcept
      : state_(std::move(o.state_)), rank_(o.rank_), step_(o.step_), central_(o.central_), cpu_(o.cpu_) {}
  step_protocol& operator=(const step_protocol&) = delete;

  /// "all_reduce on rank 2 of 4", as the front end's `where` names the call and the caller.
  std::string step_where(op_kind k) const {
    return std::string(op_name(k)) + " on " + state_->rank_label(rank_) + " of " + std::to_string(state_->n);
  }
  /// Rank of this participant in the world its group was split from.
  int own_world_rank() const noexcept { return state_->world_ranks[static_cast<std::size_t>(rank_)]; }

  /// Whether rank `r` of this group has left for good: its handle is gone, and if an exception
  /// took it, the grace for that exception's report has passed (see `unwind_grace`).
  bool departure_is_final(int r) const noexcept {
    const auto& slot = state_->slots[static_cast<std::size_t>(r)];
    if (!slot.departed.load()) return false;
    const std::int64_t at = slot.unwound_at.load(std::memory_order_relaxed);
    return at == 0 ||
           detail::comm_clock::now().time_since_epoch().count() - at >=
               std::chrono::duration_cast<detail::comm_clock::duration>(detail::unwind_grace).count();
  }

  // ---- synchronisation -------------------------------------------------------------------------
  //
  // Every collective is one step. A rank publishes its call in its flag line for the step (one
  // cache line: step number, call, up to 24 bytes of payload) and:
  // - one-shot steps (payload staged in the slot, nothing of the caller's is read by peers): waits
  //   until every peer's flag line shows the step, checks that the calls agree, and goes on. One
  //   synchronisation; on two cores, one cache-line transfer each way.
  // - zero-copy steps (peers read the caller's own buffers): also arrives at the group's counter;
  //   the rank that arrives last checks the calls and releases the step with a compare-and-swap
  //   that fails once the world has failed, so that a step a rank gave up on (timeout, abort) is
  //   never released and no one reads the buffers of a rank that has left. After the copies all
  //   meet once more (complete()).

  /// The flag line of rank r for step s.
  detail::flag_line& line(int r, std::uint64_t s) const noexcept { return state_->slots[r].line[s & 1]; }

  /// Copies `bytes` of payload where peers will read it in the next step: into the flag line
  /// when it fits, else into this rank's staging buffer.
  const void* stage(const void* data, std::size_t bytes) {
    auto& slot = state_->slots[rank_];
    std::byte* buf = bytes <= detail::inline_capacity ? slot.line[step_ & 1].inline_data
                                                      : slot.staging[step_ & 1].reserve(bytes);
    detail::copy_bytes(buf, data, bytes);
    return buf;
  }

  /// Takes the next step with this rank's call `d` and returns the step number once the step may
  /// proceed (every rank arrived with an agreeing call).
  std::uint64_t arrive(const detail::call_desc& d, bool zero_copy) {
    auto& g = *state_;
    const std::uint64_t s = step_++;
    auto& slot = g.slots[rank_];
    slot.desc[s & 1] = d;
    if (d.kind == op_kind::ppermute) slot.pairs[s & 1].assign(d.pairs.begin(), d.pairs.end());
    auto& ln = slot.line[s & 1];
    ln.kind = d.kind;
    ln.dtype = d.dtype;
    ln.op = d.op;
    ln.root = d.root;
    ln.count = d.count;
    ln.color = d.color;
    ln.key = d.key;
    ln.src = d.src;
    // A release store, not seq_cst: a full fence here would wait for the peers' copies of this
    // line to be invalidated, one cache-line transfer on the critical path. A waiter that is just
    // going to sleep pays for the fence instead (group_state::wake, sleeper_fence).
    ln.seq.store(s + 1, std::memory_order_release);
    g.wake();
    // Where this rank runs, for peers that wait for it later (wait_until); stored only when it
    // changed, so that the line stays in the peers' caches.
    if (const int cpu = detail::current_cpu(); cpu != cpu_) slot.cpu.store(cpu_ = cpu, std::memory_order_relaxed);
    if (g.n == 1) return s;
    if (!zero_copy) {
      wait_flags(s, d.kind);
      check_flags(s);
      return s;
    }
    arrive_central(d.kind, s);
    return s;
  }

  /// Waits until every peer's flag line shows step s.
  void wait_flags(std::uint64_t s, op_kind k) {
    const int n = state_->n;
    int next = 0;  // ranks below `next` have arrived
    auto ready = [&] {
      while (next < n && line(next, s).seq.load(std::memory_order_acquire) > s) ++next;
      return next == n;
    };
    auto arrived = [&](int r) { return line(r, s).seq.load(std::memory_order_acquire) > s; };
    wait_until(ready, arrived, k, s, /*cancellable=*/true);
  }

  /// Mismatch detection of a one-shot step; every rank runs it on the same lines, so every rank
  /// reaches the same verdict.
  void check_flags(std::uint64_t s) const {
    auto& g = *state_;
    const auto& mine = line(rank_, s);
    const auto& my_pairs = g.slots[rank_].pairs[s & 1];
    bool ok = true;
    for (int r = 0; r < g.n && ok; ++r)
      if (r != rank_) ok = detail::same_call(mine, line(r, s), my_pairs, g.slots[r].pairs[s & 1]);
    if (!ok) report_mismatch(s, "", /*with_arrays=*/false);
  }

  [[noreturn]] void report_mismatch(std::uint64_t s, const std::string& extra, bool with_arrays) const {
    auto& g = *state_;
    std::ostringstream os;
    os << "meshlib: collective mismatch in step " << s << " of a communicator of " << g.n
       << " ranks: the ranks called different collectives";
    for (int r = 0; r < g.n; ++r)
      os << (r ? "; " : ": ") << g.rank_label(r) << " called "
         << detail::describe_call(detail::summary_of(g.slots[r].desc[s & 1], g.slots[r].pairs[s & 1], with_arrays));
    os << extra;
    g.world->fail(detail::failure_kind::mismatch, -1, os.str());
    g.world->rethrow("seen by " + step_where(g.slots[rank_].desc[s & 1].kind));
  }

  /// The central arrival of a zero-copy step. The release decides, once for all, whether the step
  /// happens; only then does every rank check the calls (from the flag lines and the slots' copies,
  /// which stay valid while any rank may still read them), so the releaser does not read its peers'
  /// lines one after the other on the critical path. all_to_all_v, whose check reads arrays in the
  /// callers' memory, is checked by the releaser while every other rank is still blocked.
  void arrive_central(op_kind k, std::uint64_t s) {
    auto& g = *state_;
    const std::uint64_t target = ++central_;
    g.slots[rank_].arrived.store(target, std::memory_order_release);
    const std::uint64_t c = g.arrivals.fetch_add(1, std::memory_order_acq_rel) + 1;
    if (c == target * static_cast<std::uint64_t>(g.n)) {
      if (k == op_kind::all_to_all_v) check_step(s);
      std::uint64_t w = g.word.load(std::memory_order_relaxed);
      do {
        if (w & detail::failed_bit) failed_while_waiting(k, s);
      } while (!g.word.compare_exchange_weak(w, w + 1, std::memory_order_seq_cst, std::memory_order_relaxed));
      g.wake();
    } else {
      auto ready = [&] { return (g.word.load(std::memory_order_acquire) & ~detail::failed_bit) >= target; };
      auto arrived = [&](int r) { return g.slots[r].arrived.load(std::memory_order_acquire) >= target; };
      wait_until(ready, arrived, k, s, /*cancellable=*/true);
    }
    if (k != op_kind::all_to_all_v) check_flags(s);
  }

  /// The second meeting of the zero-copy algorithms: every rank has finished reading and writing
  /// its peers' buffers (each rank raises its `done` flag; one cache-line transfer each way).
  /// Cannot fail: every rank is past the release of the step, so every rank gets here after a
  /// bounded amount of copying; giving up here on a failure would let a rank return (and its
  /// caller free its buffers) while a peer still copies them.
  void complete() {
    detail::stream_fence();  // streaming stores are weakly ordered: drain them before telling peers
    auto& g = *state_;
    if (g.n == 1) return;
    const std::uint64_t s = step_ - 1;
    g.slots[rank_].done.store(s + 1, std::memory_order_release);
    g.wake();
    int next = 0;
    auto ready = [&] {
      while (next < g.n && g.slots[next].done.load(std::memory_order_acquire) > s) ++next;
      return next == g.n;
    };
    wait_until(ready, [](int) { return true; }, op_kind::barrier, s, /*cancellable=*/false);
  }

  /// Mismatch detection of a zero-copy step, run by the last rank to arrive while the others are
  /// blocked (so their descriptors, and the arrays they point to, are safe to read).
  void check_step(std::uint64_t s) const {
    auto& g = *state_;
    const auto& l0 = line(0, s);
    const auto& p0 = g.slots[0].pairs[s & 1];
    bool ok = true;
    for (int r = 1; r < g.n && ok; ++r) ok = detail::same_call(l0, line(r, s), p0, g.slots[r].pairs[s & 1]);
    std::string extra;
    if (ok && l0.kind == op_kind::all_to_all_v) {
      const auto bad = detail::first_counts_disagreement(
          static_cast<std::size_t>(g.n), [&](std::size_t i, std::size_t j) { return g.slots[i].desc[s & 1].v[0][j]; },
          [&](std::size_t j, std::size_t i) { return g.slots[j].desc[s & 1].v[2][i]; });
      if (bad) {
        ok = false;
        extra = "; " + detail::describe_counts_disagreement(g.rank_label(static_cast<int>(bad->sender)),
                                                            g.rank_label(static_cast<int>(bad->receiver)), bad->sent,
                                                            bad->expected);
      }
    }
    if (!ok) report_mismatch(s, extra, /*with_arrays=*/true);
  }

  /// Waits until `ready()`: spins (for this thread's adaptive budget, at most the policy's window),
  /// yields (oversubscribed groups only), then blocks with a deadline: the spin-then-block path of
  /// comm/detail/spin_then_block.hpp, which the device threads share. When `cancellable`, throws
  /// once the world fails first, when the timeout passes (naming the ranks for which `arrived(r)`
  /// is false) or when such a rank has left.
  template <class Ready, class Arrived>
  void wait_until(Ready&& ready, Arrived&& arrived, op_kind k, std::uint64_t s, bool cancellable) {
    auto& g = *state_;
    auto failed = [&] { return cancellable && (g.word.load(std::memory_order_acquire) & detail::failed_bit); };
    // A first burst of spinning without reading the clock: most waits of a participant with a
    // core of its own end within it.
    if (ready()) return;  // nothing to learn about spinning from a wait that did not wait
    for (int i = 1; i < g.policy.burst; ++i) {
      detail::cpu_relax();
      if (ready()) return detail::adaptive_spin::caught(g.policy.spin);
    }
    const auto start = detail::comm_clock::now();
    // A thread that prefers blocking (a communication worker: comm/detail/blocking_waits.hpp)
    // neither spins nor yields: its core is better spent on the computation it overlaps.
    if (!detail::prefer_blocking_waits()) {
      // A late peer that last ran on this very CPU cannot arrive while this thread spins: give it
      // the core at once (a yield is a context switch; blocking would add a wake-up). Two unpinned
      // threads that the scheduler put on one core of a busy machine: 8 B all_reduce 10.3 us, 16.8
      // spinning first (docs/benchmarks.md, "Waiting and the large all_reduce"), 14-28 blocking.
      const int here = detail::current_cpu();
      bool beside = false;
      for (int r = 0; r < g.n && !beside && here >= 0; ++r)
        beside = r != rank_ && !arrived(r) && g.slots[r].cpu.load(std::memory_order_relaxed) == here;
      // Otherwise spin, for the thread's budget (wait_policy.hpp, adaptive_spin: cut short while
      // its spinning has been in vain), at most the policy's window.
      if (!beside) {
        if (detail::poll_for([&] { return ready() || failed(); }, detail::adaptive_spin::budget(g.policy.spin))) {
          if (ready()) return detail::adaptive_spin::caught(g.policy.spin);
          failed_while_waiting(k, s);
        }
        detail::adaptive_spin::missed(g.policy.spin);
      }
      // Yield (a bounded time) only where a peer needs this core to arrive at all: it shares this
      // CPU, or there are more participants than cores. A peer on another core that is late will
      // not come sooner for this thread's system calls, and they would take a core from others.
      if (beside || g.policy.oversubscribed) {
        const auto until = detail::comm_clock::now() + g.policy.yield;
        for (;;) {
          if (ready()) return;
          if (failed()) {
            if (ready()) return;
            failed_while_waiting(k, s);
          }
          if (detail::comm_clock::now() >= until) break;
          std::this_thread::yield();
        }
      }
    }
    const auto deadline = start + g.policy.timeout + patience_;
    int departed = -1;
    bool timed_out = false;
    bool done = false;
    {
      detail::blocked_waits().fetch_add(1, std::memory_order_relaxed);
      g.sleepers.fetch_add(1, std::memory_order_seq_cst);
      // With the process-wide barrier no waker can miss this sleeper, and the re-check below is
      // only for departures and the deadline; without it a missed wake-up costs at most the time
      // waited so far (the re-check period grows from the spin window to 1 ms).
      const bool fenced = detail::sleeper_fence();
      auto recheck = [&](detail::comm_clock::time_point now) {
        if (fenced) return std::chrono::duration_cast<detail::comm_clock::duration>(std::chrono::milliseconds(1));
        return std::clamp<detail::comm_clock::duration>(now - start, detail::spin_window, std::chrono::milliseconds(1));
      };
      std::unique_lock lk(g.mutex);
      for (;;) {
        if (ready()) {
          done = true;
          break;
        }
        if (!cancellable) {
          g.cv.wait_for(lk, recheck(detail::comm_clock::now()));
          continue;
        }
        if (failed()) break;
        for (int r = 0; r < g.n && departed < 0; ++r)
          if (departure_is_final(r) && !arrived(r)) departed = r;
        if (departed >= 0) break;
        const auto now = detail::comm_clock::now();
        if (now >= deadline) {
          timed_out = true;
          break;
        }
        g.cv.wait_until(lk, std::min(deadline, now + recheck(now)));
      }
      g.sleepers.fetch_sub(1, std::memory_order_relaxed);
    }
    if (done) return;
    if (departed >= 0) {
      g.world->fail(detail::failure_kind::aborted, g.world_ranks[static_cast<std::size_t>(departed)],
                    "meshlib: communicator aborted: " + g.rank_label(departed) +
                        " left the communicator (its handle was destroyed or its thread ended) while " +
                        g.rank_label(rank_) + " waited for it in " + std::string(detail::op_name(k)) + " (step " +
                        std::to_string(s) + ")");
    } else if (timed_out) {
      detail::missing_report facts;
      facts.waiter = own_world_rank();
      std::vector<int> missing;
      for (int r = 0; r < g.n; ++r)
        if (!arrived(r)) {
          missing.push_back(r);
          facts.missing.push_back(g.world_ranks[static_cast<std::size_t>(r)]);
        }
      const std::string msg = detail::timeout_message(
          std::string(detail::op_name(k)) + " (step " + std::to_string(s) + ")", g.rank_label(rank_), g.n,
          g.policy.timeout,
          detail::list_participants("rank", missing,
                                    [&](int r) { return g.is_world() ? std::to_string(r) : g.rank_label(r); }),
          "thread_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
      // The root cause is the first rank that never arrived, not this waiter (device_error::device()
      // of spmd names it). The facts let an owner (the hybrid communicator) name them its own way.
      const int culprit = missing.empty() ? own_world_rank() : facts.missing.front();
      g.world->fail(detail::failure_kind::timeout, culprit, msg, std::move(facts));
    }
    // The failure bit is set now; a step that became ready meanwhile still counts.
    if (ready()) return;
    failed_while_waiting(k, s);
  }

  [[noreturn]] void failed_while_waiting(op_kind k, std::uint64_t s) const {
    state_->world->rethrow("seen by " + step_where(k) + ", step " + std::to_string(s));
  }

  std::shared_ptr<detail::group_state> state_;
  int rank_ = 0;
  std::uint64_t step_ = 0;     ///< collectives this handle has taken part in
  std::uint64_t central_ = 0;  ///< central arrivals (two per zero-copy collective)
  int cpu_ = -1;               ///< the CPU last published in this rank's slot
  /// Time this handle waits in a collective beyond the group's timeout before it gives up. Zero
  /// but while a hybrid member waits for its leader's exchange between processes: the process
  /// whose device never arrived must time out first, so that its report (naming that device)
  /// reaches every process before a waiter elsewhere blames the innocent leader.
  std::chrono::nanoseconds patience_{0};
};

}  // namespace meshlib::detail
// end meshlib/comm/thread/detail/step_protocol.hpp

namespace meshlib {

class thread_world;

/// @brief One participant's handle on a group of threads. Satisfies `communicator`.
///
/// A handle belongs to one thread at a time (it is movable, not copyable) and every operation
/// blocks that thread until the operation is complete, then returns an already-complete
/// `ready_request`. Destroying a handle tells its peers that this rank has left: a peer that
/// waits for it in a collective gets `comm_aborted` instead of waiting for the timeout.
class thread_communicator : public communicator_frontend<thread_communicator>, private detail::step_protocol {
  friend class communicator_frontend<thread_communicator>;
  friend class hybrid_communicator;  // restates a timeout of its local steps (timeout_facts), sets patience_

 public:

  /// An empty handle (not part of any group); only assignable and destructible.
  thread_communicator() = default;
  thread_communicator(const thread_communicator&) = delete;
  thread_communicator& operator=(const thread_communicator&) = delete;
  /// Movable: the moved-from communicator is no longer valid.
  thread_communicator(thread_communicator&& o) noexcept
      : detail::step_protocol(std::move(o)) {}
  /// Move assignment: the moved-from communicator is no longer valid.
  thread_communicator& operator=(thread_communicator&& o) noexcept {
    if (this != &o) {
      depart();
      state_ = std::move(o.state_);
      rank_ = o.rank_;
      step_ = o.step_;
      central_ = o.central_;
      cpu_ = o.cpu_;
    }
    return *this;
  }
  ~thread_communicator() { depart(); }

  /// Rank of this participant in its group, in `[0, size())`.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// Number of participants of the group (0 for an empty handle).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->n : 0; }
  /// Whether the handle belongs to a group.
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// Rank of this participant in the world the group was split from.
  [[nodiscard]] int world_rank() const noexcept {
    return state_ ? state_->world_ranks[static_cast<std::size_t>(rank_)] : -1;
  }

  /// @brief Fails the whole world with this rank as the root cause; every participant's pending
  /// and later calls throw `comm_aborted` naming this rank and `reason`.
  /// @returns whether this call recorded the root cause (false when the world had already failed).
  bool abort(std::string_view reason) {
    require_valid(detail::op_kind::barrier);
    return state_->world->fail(detail::failure_kind::aborted, world_rank(),
                               "meshlib: communicator aborted: " + state_->rank_label(rank_) + " failed: " +
                                   std::string(reason));
  }

  // The collectives, point to point and barrier: communicator_frontend (argument checks); the
  // transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// @brief Collective: the ranks that pass the same `color` (>= 0) form a new communicator, in
  /// which they are ordered by (`key`, rank in this one), as `MPI_Comm_split`. Sub-groups belong to
  /// the same world: a failure in any of them fails all.
  thread_communicator split(int color, int key) {
    constexpr auto k = detail::op_kind::split;
    check_split(color);
    detail::call_desc d;
    d.kind = k;
    d.color = color;
    d.key = key;
    const std::uint64_t s = arrive(d, false);
    auto& g = *state_;
    std::vector<std::pair<int, int>> keyed;  // (key, rank) of the members
    for (int r = 0; r < g.n; ++r) {
      const auto& lr = line(r, s);
      if (lr.color == color) keyed.emplace_back(lr.key, r);
    }
    std::sort(keyed.begin(), keyed.end());
    std::vector<int> members;
    members.reserve(keyed.size());
    int new_rank = 0;
    for (std::size_t i = 0; i < keyed.size(); ++i) {
      if (keyed[i].second == rank_) new_rank = static_cast<int>(i);
      members.push_back(g.world_ranks[static_cast<std::size_t>(keyed[i].second)]);
    }
    auto sub = detail::claim_split_group(g.world, g.id, s, color, members);
    sub->slots[new_rank].claimed.store(true);
    return thread_communicator(std::move(sub), new_rank);
  }

 private:
  friend class thread_world;
  using op_kind = detail::op_kind;

  thread_communicator(std::shared_ptr<detail::group_state> s, int rank) : detail::step_protocol(std::move(s), rank) {}

  void depart() noexcept {
    if (!state_) return;
    if (std::uncaught_exceptions() > 0)
      state_->slots[rank_].unwound_at.store(detail::comm_clock::now().time_since_epoch().count() | 1,
                                            std::memory_order_relaxed);
    state_->slots[rank_].departed.store(true, std::memory_order_seq_cst);
    state_->wake_all_unconditionally();
    state_.reset();
  }

  std::size_t mailbox(int src, int dst) const noexcept {
    return static_cast<std::size_t>(src) * static_cast<std::size_t>(state_->n) + static_cast<std::size_t>(dst);
  }

  // ---- the front end's hooks: its argument checks all run before this rank arrives, so before
  // any data moves -----------------------------------------------------------------------------

  std::string label() const { return state_->rank_label(rank_); }

  void require_valid(op_kind k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(detail::op_name(k)) +
                       " called on an empty thread_communicator handle (default-constructed or moved from)");
  }

  /// Refuses every call once the world has failed.
  void ensure_usable(op_kind k) const {
    require_valid(k);
    if (state_->word.load(std::memory_order_acquire) & detail::failed_bit)
      state_->world->rethrow("refused " + where(k) + ": the communicator has failed");
  }

  /// Fails the world before the front end throws comm_argument_error, so that peers waiting for
  /// this rank are released at once.
  void on_argument_error(op_kind k, const std::string& what) const {
    require_valid(k);
    state_->world->fail(detail::failure_kind::aborted, world_rank(),
                        "meshlib: communicator aborted: " + state_->rank_label(rank_) + " passed an invalid argument to " +
                            std::string(detail::op_name(k)) + ": " + what);
  }

  /// The transport of operation K (the front end has checked its arguments).
  template <op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type) {
    if constexpr (K == op_kind::all_reduce) return do_all_reduce<T>(o.send, o.recv, o.count, o.op);
    else if constexpr (K == op_kind::reduce) return do_reduce<T>(o.send, o.recv, o.count, o.op, o.root);
    else if constexpr (K == op_kind::reduce_scatter) return do_reduce_scatter<T>(o.send, o.recv, o.count, o.op);
    else if constexpr (K == op_kind::broadcast) return do_broadcast<T>(o.send, o.recv, o.count, o.root);
    else if constexpr (K == op_kind::all_gather) return do_all_gather<T>(o.send, o.recv, o.count);
    else if constexpr (K == op_kind::all_to_all) return do_all_to_all<T>(o.send, o.recv, o.count);
    else if constexpr (K == op_kind::all_to_all_v)
      return do_all_to_all_v<T>(o.send, o.v[0], o.v[1], o.recv, o.v[2], o.v[3]);
    else if constexpr (K == op_kind::ppermute) return do_ppermute<T>(o.send, o.recv, o.count, o.pairs);
    else if constexpr (K == op_kind::send) return post(o.send, o.count, datatype_of<T>, o.peer, o.tag);
    else if constexpr (K == op_kind::recv) {
      receive(o.recv, o.count, datatype_of<T>, o.peer, o.tag);
      return {};
    } else {
      static_assert(K == op_kind::barrier);
      detail::call_desc d;
      d.kind = K;
      arrive(d, false);
      return {};
    }
  }

  /// Buffered send: the message is copied into the mailbox of (this rank, dest).
  request_type post(const void* data, std::size_t count, datatype dt, int dest, int tag) {
    detail::p2p_message m;
    m.tag = tag;
    m.dtype = dt;
    m.count = count;
    m.data.resize(count * size_of(dt));
    detail::copy_bytes(m.data.data(), data, m.data.size());
    auto& g = *state_;
    {
      std::lock_guard lk(g.p2p_mutex);
      g.mailboxes[mailbox(rank_, dest)].push_back(std::move(m));
    }
    g.p2p_cv.notify_all();
    return {};
  }

  // ---- algorithms ------------------------------------------------------------------------------

  bool one_shot(std::size_t staged_bytes) const noexcept { return staged_bytes <= state_->policy.one_shot_max; }
  /// Whether a zero-copy path moving `payload_bytes` per rank writes with streaming stores: when the
  /// payloads of all ranks together reach `streaming_min` (they no longer fit in the caches).
  bool streaming(std::size_t payload_bytes) const noexcept {
    return payload_bytes >= state_->policy.streaming_min / static_cast<std::size_t>(state_->n);
  }

  /// A zero-copy path's copy: streaming stores for big payloads.
  static void move_bytes(void* dst, const void* src, std::size_t bytes, bool stream) noexcept {
    if (bytes == 0 || dst == src) return;
    if (stream) detail::stream_bytes(dst, src, bytes);
    else std::memcpy(dst, src, bytes);
  }

  template <class T>
  const T* src_of(std::uint64_t s, int r) const noexcept {
    return static_cast<const T*>(line(r, s).src);
  }
  template <class T>
  T* dst_of(std::uint64_t s, int r) const noexcept {
    return static_cast<T*>(state_->slots[r].desc[s & 1].dst);
  }

  /// [lo, hi) of the elements this rank reduces in the zero-copy all_reduce: contiguous slices,
  /// cut at cache-line boundaries so that no two ranks write the same line.
  std::pair<std::size_t, std::size_t> slice(std::size_t count, std::size_t elem, int k) const noexcept {
    const std::size_t per_line = std::max<std::size_t>(1, 64 / elem);
    const std::size_t lines = (count + per_line - 1) / per_line;
    const auto n = static_cast<std::size_t>(state_->n);
    const auto kk = static_cast<std::size_t>(k);
    return {std::min(count, lines * kk / n * per_line), std::min(count, lines * (kk + 1) / n * per_line)};
  }

  template <class T>
  detail::call_desc desc(op_kind k, std::size_t count) const noexcept {
    detail::call_desc d;
    d.kind = k;
    d.dtype = datatype_of<T>;
    d.count = count;
    return d;
  }

  template <class T>
  request_type do_all_reduce(const T* send, T* recv, std::size_t count, reduce_op op) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_reduce, count);
    d.op = op;
    ins_.resize(static_cast<std::size_t>(n));
    outs_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    if (one_shot(count * sizeof(T) * static_cast<std::size_t>(n))) {  // each rank reads n payloads
      d.src = stage(send, count * sizeof(T));
      const std::uint64_t s = arrive(d, false);
      for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r);
      detail::reduce_into<T>(op, in, n, &recv, 1, count);
      return {};
    }
    d.src = send;
    d.dst = recv;
    const std::uint64_t s = arrive(d, true);
    const auto [lo, hi] = slice(count, sizeof(T), rank_);
    T** out = reinterpret_cast<T**>(outs_.data());
    for (int r = 0; r < n; ++r) {
      in[r] = src_of<T>(s, r) + lo;
      out[r] = dst_of<T>(s, r) + lo;
    }
    detail::reduce_into<T>(op, in, n, out, n, hi - lo, streaming(count * sizeof(T)));
    complete();
    return {};
  }

  template <class T>
  request_type do_reduce(const T* send, T* recv, std::size_t count, reduce_op op, int root) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::reduce, count);
    d.op = op;
    d.root = root;
    ins_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    if (one_shot(count * sizeof(T) * static_cast<std::size_t>(n))) {  // each rank reads n payloads
      d.src = stage(send, count * sizeof(T));
      const std::uint64_t s = arrive(d, false);
      if (rank_ == root) {
        for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r);
        detail::reduce_into<T>(op, in, n, &recv, 1, count);
      }
      return {};
    }
    d.src = send;
    d.dst = rank_ == root ? recv : nullptr;
    const std::uint64_t s = arrive(d, true);
    const auto [lo, hi] = slice(count, sizeof(T), rank_);
    for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r) + lo;
    T* out = dst_of<T>(s, root) + lo;
    detail::reduce_into<T>(op, in, n, &out, 1, hi - lo, streaming(count * sizeof(T)));
    complete();
    return {};
  }

  template <class T>
  request_type do_reduce_scatter(const T* send, T* recv, std::size_t count, reduce_op op) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::reduce_scatter, count);
    d.op = op;
    ins_.resize(static_cast<std::size_t>(n));
    const T** in = reinterpret_cast<const T**>(ins_.data());
    const std::size_t mine = static_cast<std::size_t>(rank_) * count;
    const std::size_t total_bytes = count * sizeof(T) * static_cast<std::size_t>(n);
    const bool staged = one_shot(total_bytes);
    d.src = staged ? stage(send, total_bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    for (int r = 0; r < n; ++r) in[r] = src_of<T>(s, r) + mine;
    detail::reduce_into<T>(op, in, n, &recv, 1, count, !staged && streaming(total_bytes));
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_broadcast(const T* send, T* recv, std::size_t count, int root) {
    auto d = desc<T>(op_kind::broadcast, count);
    d.root = root;
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    if (rank_ == root) d.src = staged ? stage(send, bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    const bool stream = !staged && streaming(bytes);
    if (rank_ == root) move_bytes(recv, send, bytes, stream);
    else move_bytes(recv, src_of<T>(s, root), bytes, stream);
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_gather(const T* send, T* recv, std::size_t count) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_gather, count);
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    d.src = staged ? stage(send, bytes) : static_cast<const void*>(send);
    const std::uint64_t s = arrive(d, !staged);
    const bool stream = !staged && streaming(bytes * static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      // Own block from the caller's buffer; in place it is already there and move_bytes skips it.
      const T* from = r == rank_ ? send : src_of<T>(s, r);
      move_bytes(recv + static_cast<std::size_t>(r) * count, from, bytes, stream);
    }
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_to_all(const T* send, T* recv, std::size_t count) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_to_all, count);
    const std::size_t bytes = count * sizeof(T);
    const std::size_t total = bytes * static_cast<std::size_t>(n);
    const bool staged = one_shot(total);
    if (staged) {
      d.src = stage(send, total);
    } else if (send == recv) {
      // In place and zero-copy: peers read this rank's blocks while it overwrites them; give them a copy.
      std::byte* copy = scratch_.reserve(total);
      detail::copy_bytes(copy, send, total);
      d.src = copy;
    } else {
      d.src = send;
    }
    const std::uint64_t s = arrive(d, !staged);
    const std::size_t mine = static_cast<std::size_t>(rank_) * count;
    const bool stream = !staged && streaming(total);
    for (int r = 0; r < n; ++r) move_bytes(recv + static_cast<std::size_t>(r) * count, src_of<T>(s, r) + mine, bytes, stream);
    if (!staged) complete();
    return {};
  }

  template <class T>
  request_type do_all_to_all_v(const T* send, const std::int64_t* sc, const std::int64_t* sd, T* recv,
                               const std::int64_t* rc, const std::int64_t* rd) {
    const int n = state_->n;
    auto d = desc<T>(op_kind::all_to_all_v, 0);
    d.src = send;
    d.v[0] = sc;
    d.v[1] = sd;
    d.v[2] = rc;
    d.v[3] = rd;
    d.nv = n;
    const std::uint64_t s = arrive(d, true);
    for (int r = 0; r < n; ++r) {
      const auto& dr = state_->slots[r].desc[s & 1];
      const T* from = static_cast<const T*>(dr.src) + dr.v[1][rank_];
      detail::copy_bytes(recv + rd[r], from, static_cast<std::size_t>(rc[r]) * sizeof(T));
    }
    complete();
    return {};
  }

  template <class T>
  request_type do_ppermute(const T* send, T* recv, std::size_t count, std::span<const permute_pair> pairs) {
    auto d = desc<T>(op_kind::ppermute, count);
    d.pairs = pairs;
    const std::size_t bytes = count * sizeof(T);
    const bool staged = one_shot(bytes);
    if (staged) {
      d.src = stage(send, bytes);
    } else if (send == recv) {
      std::byte* copy = scratch_.reserve(bytes);
      detail::copy_bytes(copy, send, bytes);
      d.src = copy;
    } else {
      d.src = send;
    }
    const std::uint64_t s = arrive(d, !staged);
    int from = -1;
    for (const auto& p : pairs)
      if (p.dest == rank_) from = p.source;
    if (from >= 0) detail::copy_bytes(recv, src_of<T>(s, from), bytes);
    else std::fill_n(recv, count, T{});
    if (!staged) complete();
    return {};
  }

  void receive(void* buf, std::size_t count, datatype dt, int source, int tag) {
    constexpr auto k = op_kind::recv;
    auto& g = *state_;
    auto& box = g.mailboxes[mailbox(source, rank_)];
    const auto deadline = detail::comm_clock::now() + g.policy.timeout;
    std::unique_lock lk(g.p2p_mutex);
    for (;;) {
      auto it = std::find_if(box.begin(), box.end(), [tag](const detail::p2p_message& m) { return m.tag == tag; });
      if (it != box.end()) {
        if (it->dtype != dt || it->count != count) {
          std::ostringstream os;
          os << "meshlib: point-to-point mismatch: " << g.rank_label(source) << " sent " << it->count << " elements of "
             << it->dtype << " with tag " << tag << " but " << g.rank_label(rank_) << " receives " << count
             << " elements of " << dt;
          lk.unlock();
          g.world->fail(detail::failure_kind::mismatch, -1, os.str());
          g.world->rethrow("seen by " + where(k));
        }
        detail::copy_bytes(buf, it->data.data(), it->data.size());
        box.erase(it);
        return;
      }
      if (g.word.load(std::memory_order_acquire) & detail::failed_bit) {
        lk.unlock();
        g.world->rethrow("seen by " + where(k) + " from " + g.rank_label(source));
      }
      const auto now = detail::comm_clock::now();
      if (departure_is_final(source) || now >= deadline) {
        lk.unlock();
        if (now >= deadline)
          g.world->fail(detail::failure_kind::timeout, world_rank(),
                        "meshlib: recv from " + g.rank_label(source) + " with tag " + std::to_string(tag) +
                            " timed out on " + g.rank_label(rank_) + " after " +
                            std::to_string(std::chrono::duration<double>(g.policy.timeout).count()) + " s: " +
                            g.rank_label(source) + " never sent it");
        else
          g.world->fail(detail::failure_kind::aborted, g.world_ranks[static_cast<std::size_t>(source)],
                        "meshlib: communicator aborted: " + g.rank_label(source) +
                            " left the communicator (its handle was destroyed or its thread ended) while " +
                            g.rank_label(rank_) + " waited to receive from it");
        g.world->rethrow("seen by " + where(k));
      }
      g.p2p_cv.wait_until(lk, std::min(deadline, now + std::chrono::milliseconds(100)));
    }
  }

  std::vector<const void*> ins_;  ///< scratch arrays of peer pointers, kept to avoid allocations
  std::vector<void*> outs_;
  detail::staging_buffer scratch_;  ///< copy of an in-place buffer that peers read (zero-copy paths)
};

static_assert(communicator<thread_communicator>);

}  // namespace meshlib

// The world that hands out the handles (after the class: it uses it).
// begin meshlib/comm/thread/thread_world.hpp
/// @file
/// @brief `thread_world`: the shared state of a group of threads and the source of their
/// `thread_communicator` handles (each rank's once), and the way to fail the group from outside
/// a handle (a runner that saw a participant throw, a hybrid world's watcher). Apart from the
/// communicator because it is the group's owner, not a participant's handle;
/// `<meshlib/comm/thread/thread_communicator.hpp>` includes this header, so either gives both.

#include <memory>
#include <numeric>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


namespace meshlib {

/// @brief The shared state of a group of `size` threads, and the source of their handles.
///
/// The world outlives nothing it hands out: handles share ownership of the state, so a handle
/// may outlive its world. Destroying the world while a handle it gave out is still held aborts
/// the world ("the thread_world was destroyed"), which releases every blocked participant.
class thread_world {
 public:
  /// @throws comm_argument_error unless 1 <= size.
  explicit thread_world(int size, thread_comm_options options = {}) {
    if (size < 1)
      throw comm_argument_error("meshlib: a thread_world needs at least 1 participant, got " + std::to_string(size));
    world_ = std::make_shared<detail::world_state>(options, size);
    std::vector<int> ranks(static_cast<std::size_t>(size));
    std::iota(ranks.begin(), ranks.end(), 0);
    group_ = detail::make_group(world_, std::move(ranks));
  }
  thread_world(const thread_world&) = delete;
  thread_world& operator=(const thread_world&) = delete;
  /// Movable: the world's shared state moves with it.
  thread_world(thread_world&&) noexcept = default;
  /// Move assignment: the world's shared state moves with it.
  thread_world& operator=(thread_world&&) noexcept = default;
  ~thread_world() {
    if (!group_) return;
    for (int r = 0; r < group_->n; ++r) {
      const auto& slot = group_->slots[r];
      if (slot.claimed.load() && !slot.departed.load()) {
        world_->fail(detail::failure_kind::aborted, -1,
                     "meshlib: communicator aborted: the thread_world was destroyed while rank " + std::to_string(r) +
                         " still held its handle");
        break;
      }
    }
  }

  /// Number of participants.
  [[nodiscard]] int size() const noexcept { return group_->n; }

  /// @brief The handle of participant `rank`, for the thread that plays it. Each rank's handle is
  /// handed out once.
  /// @throws comm_argument_error when rank is out of range or its handle was already taken.
  [[nodiscard]] thread_communicator communicator(int rank) {
    if (rank < 0 || rank >= group_->n)
      throw comm_argument_error("meshlib: thread_world::communicator: rank " + std::to_string(rank) +
                                " is out of range [0, " + std::to_string(group_->n) + ")");
    if (group_->slots[rank].claimed.exchange(true))
      throw comm_argument_error("meshlib: thread_world::communicator: the handle of rank " + std::to_string(rank) +
                                " was already handed out; each rank has one handle");
    return thread_communicator(group_, rank);
  }

  /// @brief Fails the world with `rank` as the root cause (`comm_aborted` everywhere, naming it).
  /// @returns whether this call recorded the root cause.
  bool abort(int rank, std::string_view reason) {
    return abort(rank, reason, "rank " + std::to_string(rank));
  }
  /// @brief As `abort(rank, reason)`, with the failed participant named `who` in the message
  /// ("meshlib: communicator aborted: <who> failed: <reason>"): a hybrid world names the global
  /// device; rank -1 is a participant outside this world (a device of another process).
  bool abort(int rank, std::string_view reason, std::string_view who) {
    return world_->fail(detail::failure_kind::aborted, rank,
                        "meshlib: communicator aborted: " + std::string(who) + " failed: " + std::string(reason));
  }

  /// @brief Fails the world as a collective mismatch that was detected elsewhere (by another
  /// process of a hybrid world): every participant gets `collective_mismatch` with `message`, no
  /// participant being the root cause. @returns whether this call recorded the root cause.
  bool fail_as_mismatch(std::string_view message) { return fail_as(detail::failure_kind::mismatch, message); }

  /// @brief Fails the world with an error detected elsewhere (by another process of a hybrid
  /// world, or by its leader's exchange between processes): every participant gets the error of
  /// `kind` (`comm_aborted`, `comm_timeout`, `collective_mismatch`) with `message`, no participant
  /// of this world being the root cause. @returns whether this call recorded the root cause.
  bool fail_as(detail::failure_kind kind, std::string_view message) {
    return world_->fail(kind, -1, std::string(message));
  }

  /// Whether the world has failed.
  [[nodiscard]] bool failed() const noexcept { return world_->failed.load(); }
  /// World rank of the root cause of the failure, -1 when none or when no one rank caused it (a mismatch).
  [[nodiscard]] int root_cause_rank() const { return world_->root_cause_rank(); }

 private:
  std::shared_ptr<detail::world_state> world_;
  std::shared_ptr<detail::group_state> group_;
};

}  // namespace meshlib
// end meshlib/comm/thread/thread_world.hpp
// end meshlib/comm/thread/thread_communicator.hpp
// begin meshlib/comm/thread/run_on_threads.hpp
/// @file
/// @brief `run_on_threads(n, fn)`: runs `fn(comm)` once per participant of a fresh `thread_world`
/// of n threads, joins them, and rethrows the root cause of a failure with its rank: the thread
/// backend's own launcher, as `run_hybrid` is the MPI backend's. `spmd` and `shard_map` run on the
/// persistent device threads of exec's `thread_runner` instead (exec/detail/device_workers.hpp)
/// and come here only for a call those cannot take (a nested call); both report failures through
/// `detail::participant_failures`, and pin with `detail::pin_to`, both here because this launcher,
/// below exec, needs them too.

#include <exception>
#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/detail/root_cause.hpp
/// @file
/// @brief Who is blamed when a run fails: the one rule every launcher and runner applies
/// (`run_on_threads` and `thread_runner`, `mpi_runner`, `run_hybrid` and `hybrid_runner`,
/// `run_on_gpus`), so that a failure reads the same whatever runs the devices.
///
/// Each runner gathers the facts its backend knows (which local participant threw what, the
/// world's recorded root cause, what another process reported, the device whose call differed in
/// a mismatch) and `rethrow_root_cause` turns them into one `participant_error`. It lives in comm,
/// not exec, because `run_on_threads`, `run_hybrid` and `run_on_gpus` are comm's own launchers
/// and arrows point down; the exec runners call the same function.

#include <exception>
#include <span>
#include <string>
#include <string_view>


namespace meshlib::detail {

/// @brief What a run's participants on this process left behind (see the file comment). Ids
/// named "global" count every participant of the run, on every process.
struct run_failures {
  /// Per local participant: the exception it left with, or null.
  std::span<const std::exception_ptr> errors;
  /// The global id of local participant 0 (a process's first device; 0 in a one-process run).
  int first = 0;
  /// Participants in all.
  int size = 0;
  /// The local participant the world recorded as the root cause (the first to throw, or one that
  /// never arrived at a collective that timed out), even if it threw nothing itself; -1: none.
  int local_root = -1;
  /// The global id another process reported as the root cause; -1: none.
  int remote_root = -1;
  /// The global id of the participant whose call differed in a collective mismatch, as every
  /// member computed it; -1: none or unknown.
  int mismatch_culprit = -1;
  /// How messages name a participant: "participant", "MPI rank", "hybrid device".
  std::string_view noun = "participant";
};

/// The blamed participant (global id) and the local participant whose exception is reported.
struct blame {
  int participant = -1;
  int source = -1;
};

/// @brief The rule, in order (`source < 0`: nobody failed):
/// 1. A collective mismatch with no failure of a participant's own (an exception that is not a
///    communicator error) is blamed on the participant whose call differed: the same on every
///    process, not whichever saw it first.
/// 2. A failure another process reported, with no root cause here and no failure of our own, is
///    blamed on that process's participant.
/// 3. Otherwise the world's local root cause when it has one and nothing of our own outranks it
///    (a participant that threw an exception of its own is real, one that was late is not
///    necessarily), else the participant whose exception is reported.
/// The reported exception is the root cause's own when it threw, a participant's own failure when
/// another process is blamed meanwhile, else the lowest participant's that threw.
inline blame find_root_cause(const run_failures& f) {
  const int n = static_cast<int>(f.errors.size());
  auto threw = [&](int r) { return r >= 0 && r < n && f.errors[static_cast<std::size_t>(r)] != nullptr; };
  const bool local_root = f.local_root >= 0 && f.local_root < n;
  int root = threw(f.local_root) ? f.local_root : -1;
  for (int r = 0; r < n && root < 0; ++r)
    if (threw(r)) root = r;
  if (root < 0) return {};
  int own = -1, mismatched = -1;  // the lowest participant that failed on its own / with a mismatch
  for (int r = 0; r < n; ++r) {
    if (!threw(r)) continue;
    try {
      std::rethrow_exception(f.errors[static_cast<std::size_t>(r)]);
    } catch (const collective_mismatch&) {
      if (mismatched < 0) mismatched = r;
    } catch (const comm_error&) {
    } catch (...) {
      if (own < 0) own = r;
    }
  }
  if (own < 0 && mismatched >= 0 && f.mismatch_culprit >= 0) return {f.mismatch_culprit, mismatched};
  const int source = f.remote_root >= 0 && own >= 0 ? own : root;
  if (f.remote_root >= 0 && !local_root && own < 0) return {f.remote_root, source};
  return {f.first + (own < 0 && local_root ? f.local_root : source), source};
}

/// Throws `participant_error` for the root cause of `f` (see `find_root_cause`), naming it as
/// `name(global id)` ("participant 3 of 4", "hybrid device 5 of 8", "participant 1 of 2 (GPU 1)") with the
/// reported exception's message; returns when no participant failed.
template <class Name>
void rethrow_root_cause(const run_failures& f, Name&& name) {
  const blame b = find_root_cause(f);
  if (b.source < 0) return;
  const std::exception_ptr& e = f.errors[static_cast<std::size_t>(b.source)];
  try {
    std::rethrow_exception(e);
  } catch (...) {  // inside the handler, so participant_error nests the exception reported
    throw participant_error(b.participant, "meshlib: " + name(b.participant) + " failed: " + what_of(e));
  }
}

/// `rethrow_root_cause` naming participants as "<noun> <id> of <size>".
inline void rethrow_root_cause(const run_failures& f) {
  rethrow_root_cause(f, [&](int id) { return std::string(f.noun) + " " + std::to_string(id) + " of " + std::to_string(f.size); });
}

}  // namespace meshlib::detail
// end meshlib/comm/detail/root_cause.hpp

namespace meshlib {

namespace detail {
/// Pins the calling thread to the `index`-th CPU of `allowed` (modulo their number).
#if defined(__linux__)
inline void pin_to(const cpu_set_t& allowed, int index) {
  const int count = CPU_COUNT(&allowed);
  if (count <= 0) return;
  int want = index % count;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed)) continue;
    if (want-- == 0) {
      cpu_set_t one;
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      pthread_setaffinity_np(pthread_self(), sizeof(one), &one);
      return;
    }
  }
}
#endif

/// @brief The participants' failures in one run on a `thread_world`, and who is blamed for them:
/// shared by `run_on_threads` and the persistent device threads (`thread_runner`), so that both
/// report the same root cause with the same message.
class participant_failures {
 public:
  /// For a world of `n` participants.
  explicit participant_failures(int n) : errors_(static_cast<std::size_t>(n)) {}

  /// Runs `fn(comm)` as participant `r` of `world`; an exception is recorded and aborts the world
  /// with it as the root cause (while `r` still holds its handle, so the abort, not its departure,
  /// is what its peers see).
  template <class F>
  void run(thread_world& world, int r, F& fn) {
    thread_communicator comm = world.communicator(r);
    try {
      fn(comm);
    } catch (...) {
      errors_[static_cast<std::size_t>(r)] = std::current_exception();
      world.abort(r, what_of(errors_[static_cast<std::size_t>(r)]));
    }
  }

  /// Once every participant has ended: throws `participant_error` for the root cause, if any
  /// failed, by the rule every runner shares (`detail::find_root_cause`): the world's root cause
  /// (the first to throw, or the first that never arrived at a collective that timed out), even
  /// when it threw nothing itself (it was only late); the exception reported is its own, else that
  /// of the lowest participant that threw.
  void rethrow(const thread_world& world) const {
    rethrow_root_cause({.errors = errors_,
                        .size = static_cast<int>(errors_.size()),
                        .local_root = world.failed() ? world.root_cause_rank() : -1});
  }

 private:
  std::vector<std::exception_ptr> errors_;
};
}  // namespace detail

/// @brief Runs `fn(thread_communicator&)` on `n` threads, one per participant of a new
/// `thread_world(n, options)` (participant 0 on the calling thread), and returns when all have
/// returned.
///
/// When a participant throws, the world is aborted with it as the root cause, so every peer that
/// waits in (or later enters) a collective gets `comm_aborted` instead of hanging; once every
/// thread has ended, `run_on_threads` throws `participant_error` for the root cause: the first
/// participant to throw, or, when the communicator itself failed (a collective mismatch, a
/// timeout), the lowest rank that threw.
/// @code
/// std::vector<std::vector<float>> out(4, std::vector<float>(4));   // one result per participant
/// meshlib::run_on_threads(4, [&](meshlib::thread_communicator& c) {
///   const float x = float(c.rank());
///   c.all_gather(std::span<const float>(&x, 1), std::span<float>(out[c.rank()]));  // {0, 1, 2, 3}
/// });
/// @endcode
/// @throws participant_error as above; comm_argument_error when n < 1; std::system_error when a
/// thread cannot be started (after the started ones are aborted and joined).
template <class F>
  requires std::is_invocable_v<F&, thread_communicator&>
void run_on_threads(int n, F&& fn, thread_comm_options options = {}) {
  const bool pin = options.pin_threads;
  thread_world world(n, std::move(options));
#if defined(__linux__)
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  // Pin only when every participant gets its own CPU; oversubscribed participants must be free to
  // move to whichever core is idle (OpenMPI does not bind oversubscribed ranks either).
  const bool can_pin = pin && pthread_getaffinity_np(pthread_self(), sizeof(allowed), &allowed) == 0 &&
                       n <= CPU_COUNT(&allowed);
  struct restore_affinity {
    bool active;
    cpu_set_t mask;
    ~restore_affinity() {
      if (active) pthread_setaffinity_np(pthread_self(), sizeof(mask), &mask);
    }
  } restore{can_pin, allowed};
#else
  (void)pin;
#endif
  detail::participant_failures failures(n);
  auto body = [&](int r) {
#if defined(__linux__)
    if (can_pin) detail::pin_to(allowed, r);
#endif
    failures.run(world, r, fn);
  };
  std::vector<std::thread> threads;
  threads.reserve(static_cast<std::size_t>(n > 0 ? n - 1 : 0));
  try {
    for (int r = 1; r < n; ++r) threads.emplace_back(body, r);
  } catch (...) {
    world.abort(0, "run_on_threads could not start a thread");
    for (auto& t : threads) t.join();
    throw;
  }
  body(0);
  for (auto& t : threads) t.join();
  failures.rethrow(world);
}

}  // namespace meshlib
// end meshlib/comm/thread/run_on_threads.hpp
// begin meshlib/comm/axis_communicators.hpp
/// @file
/// @brief `axis_communicators`: for one device of a `mesh`, the communicator of its group along
/// any set of mesh axes, split from the communicator of the whole mesh, with ranks in the group's
/// stable order (`mesh::group`, `mesh::group_rank`). Works with every backend (it only needs
/// `split`) and builds each group's communicator once, on first use.

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <utility>


namespace meshlib {

/// @brief The communicators of one device's groups along the axes of a mesh.
///
/// The device is the rank of `world`, whose size must be the mesh's. `over<"data">()` is the
/// communicator of the devices that differ from this one only in axis "data", ranked by their
/// "data" coordinate; `over<"data", "model">()` (any subset, in any order) that of the group along
/// both axes, ranked row-major over them. Its rank is `mesh.group_rank(device, mask)`.
///
/// The first call for a set of axes is collective over `world` (it splits it): every device must
/// ask for the same sets of axes in the same order, as SPMD code does naturally (a device that
/// asks for another set meets a `collective_mismatch`, not a hang). Later calls return the cached
/// communicator at the cost of a map lookup. The whole mesh (every axis) is `world` itself.
/// @code
/// meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">> m{2, 2};
/// meshlib::run_on_threads(4, [&](meshlib::thread_communicator& world) {
///   meshlib::axis_communicators axes(world, m);
///   auto& model = axes.over<"model">();   // devices {0,1} or {2,3}
///   float x = 1.0f;
///   model.all_reduce(std::span(&x, 1), meshlib::reduce_op::sum);  // x == 2
/// });
/// @endcode
template <communicator Comm, mesh_type Mesh>
class axis_communicators {
 public:
  /// @throws comm_argument_error when world.size() differs from mesh.size().
  axis_communicators(Comm& world, const Mesh& mesh) : world_(&world), mesh_(mesh) {
    if (static_cast<std::size_t>(world.size()) != mesh.size())
      throw comm_argument_error("meshlib: axis_communicators: the communicator has " + std::to_string(world.size()) +
                                " ranks but mesh " + mesh.to_string() + " has " + std::to_string(mesh.size()) +
                                " devices; build it from the communicator of the whole mesh");
  }

  /// The device this object belongs to (its rank in the whole-mesh communicator).
  [[nodiscard]] std::size_t device() const noexcept { return static_cast<std::size_t>(world_->rank()); }
  /// The mesh whose axes the communicators span.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }

  /// @brief The communicator of this device's group along the axes in `mask`.
  Comm& over(axis_mask mask) {
    mask &= Mesh::all_axes;
    // A group that holds every device (the whole mesh, or axes whose complement has size 1) is
    // `world` itself, in the same rank order: no split (an NCCL split costs as much as a new
    // communicator, and a 1-device mesh asks for its data group every step).
    if (mask == Mesh::all_axes || mesh_.axes_size(mask) == mesh_.size()) return *world_;
    auto it = groups_.find(mask);
    if (it == groups_.end()) {
      const std::size_t dev = device();
      Comm sub = world_->split(static_cast<int>(mesh_.group_color(dev, mask)), static_cast<int>(mesh_.group_rank(dev, mask)));
      it = groups_.emplace(mask, std::make_unique<Comm>(std::move(sub))).first;
    }
    return *it->second;
  }

  /// @brief The communicator of this device's group along the axes named `Names...`.
  template <fixed_string... Names>
  Comm& over() {
    return over(Mesh::template mask_of<Names...>());
  }

 private:
  Comm* world_;
  Mesh mesh_;
  std::map<axis_mask, std::unique_ptr<Comm>> groups_;
};

}  // namespace meshlib
// end meshlib/comm/axis_communicators.hpp
// end meshlib/comm.hpp
// begin meshlib/tensor.hpp
/// @file
/// @brief The tensor layer: `sharded_tensor` (global view), `local_tensor` (the value a device sees
/// inside `shard_map` / `spmd`), and local kernels with sharding propagation (elementwise,
/// reductions, transpose, matmul). Needs Kokkos; Kokkos Kernels is used for matmul where found.

// begin meshlib/tensor/view.hpp
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
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <Kokkos_Core.hpp>

// begin meshlib/runtime/kokkos_runtime.hpp
/// @file
/// @brief The Kokkos part of `distributed::initialize`, kept out of distributed.hpp so that launcher
/// detection and the process queries build without Kokkos. Including this header makes
/// `initialize` initialise Kokkos when the program has not (`options::initialize_kokkos`), and
/// `shutdown` finalise it only when `initialize` was the one that initialised it.
///
/// Kokkos 3.x (3.4.1 here) cannot be initialised again in a process after `Kokkos::finalize`: a
/// program that shuts meshlib down and initialises it again must own Kokkos itself
/// (`Kokkos::ScopeGuard` in `main`); `initialize` says so with a `distributed_error` instead of
/// letting Kokkos fail.
///
/// It also holds the Kokkos lifecycle rule every meshlib entry point checks
/// (`detail::require_kokkos`): Kokkos must be initialised before the first tensor is made and
/// before any device thread starts, and stay initialised until the last tensor is gone. Without
/// the check, a forgotten `Kokkos::ScopeGuard` aborts inside a device thread with Kokkos' own
/// "deallocated after Kokkos::finalize" or "terminate called recursively", which names neither
/// the cause nor the fix.

#include <functional>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include <Kokkos_Core.hpp>

// begin meshlib/runtime/distributed.hpp
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

// begin meshlib/core/deferred.hpp
/// @file
/// @brief `detail::deferred_t<T, Tag>`: the type `T`, spelled so that it depends on `Tag`.
///
/// Why: every translation unit that includes <meshlib.hpp> pays for the code of meshlib's ordinary
/// inline functions, and for every template those functions use (a `std::map`'s members, a
/// `std::vector` of a meshlib type), even when it never calls them (docs/benchmarks.md, "Include
/// cost"). Code that only runs devices, traces or starts processes is therefore written as
/// templates (`template <class Tag = void>`, called as plain functions, or a class template behind
/// one alias, as `std::string` is). Inside such a template, a local variable of a type that does
/// not depend on `Tag` is still instantiated where the template is defined; spelling its type
/// `deferred_t<T, Tag>` postpones that to the first call too.
/// @code
/// template <class Tag = void>
/// void report(const std::vector<std::string>& all) {
///   deferred_t<std::map<std::string, std::size_t>, Tag> count;  // compiled only when report is called
///   for (const auto& v : all) ++count[v];
/// }
/// @endcode

namespace meshlib::detail {

/// Holds `T` as `type`; a class template, so that `deferred<T, Tag>::type` depends on `Tag`.
template <class T, class Tag>
struct deferred {
  using type = T;
};

/// `T`, dependent on `Tag` (see the file comment).
template <class T, class Tag>
using deferred_t = typename deferred<T, Tag>::type;

}  // namespace meshlib::detail
// end meshlib/core/deferred.hpp
// begin meshlib/runtime/errors.hpp
/// @file
/// @brief The exception types of the runtime layer: what a launch can get wrong before any data
/// moves. Both are thrown at start-up so that a bad launch fails loudly instead of hanging later.


namespace meshlib {

/// @brief A launch meshlib cannot make sense of: contradictory launcher environments (OpenMPI says
/// rank 1 of 4, torchrun says rank 2 of 4), a rank outside its world, a variable that is not a
/// number, explicit arguments that contradict the launcher, or `initialize` called again with other
/// arguments. `what()` names every variable and value involved.
class distributed_error : public error {
 public:
  using error::error;
};

/// @brief Processes that disagree about something every process must share (the process count,
/// the local device count, a mesh's shape or axis names). Thrown on every process, with each
/// disagreeing process's value, by the start-up checks that exchange a description of the value.
class process_mismatch : public distributed_error {
 public:
  using distributed_error::distributed_error;
};

}  // namespace meshlib
// end meshlib/runtime/errors.hpp
// begin meshlib/runtime/launcher.hpp
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
  using claim = meshlib::detail::deferred_t<detail::claim, Tag>;  // compiled at the first call
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
// end meshlib/runtime/launcher.hpp
// begin meshlib/runtime/process_exchange.hpp
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
// end meshlib/runtime/process_exchange.hpp

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
  meshlib::detail::deferred_t<std::map<std::string, std::vector<std::size_t>>, Tag> by_value;
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
    meshlib::detail::deferred_t<std::map<std::string, std::vector<std::size_t>>, Tag> seen;
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
  meshlib::detail::write_stderr_line("meshlib: process " + std::to_string(l.process_index) + " of " +
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
// end meshlib/runtime/distributed.hpp

namespace meshlib {

/// @brief A meshlib entry point was called while Kokkos is not initialised (never was, or was
/// already finalised). `what()` names the entry point and the fix.
/// @code
/// int main(int argc, char** argv) {
///   Kokkos::ScopeGuard kokkos(argc, argv);  // or meshlib::distributed::guard / meshlib::mpi::guard
///   meshlib::mesh<meshlib::axis<"x">> m{2};
///   meshlib::spmd(m, [] {});                // without the guard: throws kokkos_lifecycle_error
/// }
/// @endcode
class kokkos_lifecycle_error : public error {
 public:
  using error::error;
};

namespace detail {

/// Throws `kokkos_lifecycle_error` unless Kokkos is initialised; `what` names the entry point.
inline void require_kokkos(std::string_view what) {
  if (Kokkos::is_initialized()) [[likely]]
    return;
#if KOKKOS_VERSION >= 40000
  const bool finalized = Kokkos::is_finalized();
#else
  const bool finalized = false;  // Kokkos 3.x cannot tell "finalised" from "never initialised"
#endif
  throw kokkos_lifecycle_error(
      "meshlib: " + std::string(what) + ": Kokkos " + (finalized ? "was already finalised" : "is not initialised") +
      "; hold a Kokkos::ScopeGuard in main() (or meshlib::distributed::guard, or meshlib::mpi::guard with MPI, "
      "which initialise MPI and Kokkos in the right order) before the first meshlib call and before any device "
      "thread starts, and keep it alive until every tensor is destroyed");
}

/// `Kokkos::push_finalize_hook`, serialised: Kokkos keeps its hooks in a plain stack, so two threads
/// that push at once (two user threads making their first meshlib call together) corrupt it. Every
/// hook meshlib pushes goes through here, from the thread that calls into meshlib, never from a
/// device thread.
inline void push_finalize_hook(std::function<void()> hook) {
  static std::mutex m;
  std::lock_guard lock(m);
  Kokkos::push_finalize_hook(std::move(hook));
}

}  // namespace detail
}  // namespace meshlib

namespace meshlib::distributed::detail {

inline bool start_kokkos() {
  if (Kokkos::is_initialized()) return false;
  Kokkos::initialize();
  return true;
}

inline void stop_kokkos() {
  if (Kokkos::is_initialized()) Kokkos::finalize();
}

/// Registers the hooks before `main` (an inline variable is initialised once per program).
inline const bool kokkos_hooks_registered = [] {
  hooks().start_kokkos = &start_kokkos;
  hooks().stop_kokkos = &stop_kokkos;
  return true;
}();

}  // namespace meshlib::distributed::detail
// end meshlib/runtime/kokkos_runtime.hpp

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
      detail::push_finalize_hook([] {
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
  require_kokkos(label);
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

/// `launch` on the instance `exec` instead of the running device's: a caller that was handed an
/// instance (`matmul_into(exec, ...)`).
template <class Exec, class F>
void launch_on(const Exec& exec, std::size_t n, const F& f) {
  if (n == 0) return;
  Kokkos::parallel_for(Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>>(exec, 0, n), f);
  // Host backends finish before returning; a device backend's kernel is asynchronous. (3.4.1's
  // fence is a process-wide call, and meshlib runs only host backends there.)
  if constexpr (kokkos_has_instances_v) exec.fence();
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

}  // namespace detail
}  // namespace meshlib
// end meshlib/tensor/view.hpp
// begin meshlib/tensor/kernel.hpp
/// @file
/// @brief The public kernel face: what a user writing a layer (and meshlib's own nn layer) needs to
/// run a kernel on a device's block and to hold device memory, without reaching into the tensor
/// layer's `detail` namespace:
/// - `launch<Space>(n, f)` runs `f(i)` for `i` in `[0, n)` on the running device's execution-space
///   instance for memory `Space`, and waits: a RangePolicy `parallel_for`, the one kind of launch
///   that is safe from many device threads (tensor/view.hpp says why); `f` captures raw pointers
///   (`block.data()`), never views;
/// - `allocate<T, Rank, Space>(extent, label)` makes a zero-filled block, safe from any device thread;
/// - `block_view<T, Rank, Space>` is the (owning) view of a block, `unmanaged_block_view` one that
///   does not count references (safe to copy between device threads);
/// - `copy_to_host<Space>`, `copy_from_host<Space>`, `read_back<Space>`, `host_readable<Space>` and
///   `edit_on_host<Space>` move a kernel's result to host code and caller data to a kernel;
///   `host_accessible_v<Space>` says whether host code may touch `Space` directly.
/// They are the tensor layer's own functions (the same entities, so a call that finds both by
/// argument-dependent lookup is not ambiguous).
/// @code
/// // y = 2 x on the running device (inside spmd / shard_map)
/// float* y = out.data();
/// const float* x = in.data();
/// meshlib::launch<meshlib::default_memory_space>(n, KOKKOS_LAMBDA(std::size_t i) { y[i] = 2 * x[i]; });
/// auto scratch = meshlib::allocate<float, 1>({n}, "my_layer::scratch");   // zero-filled
/// @endcode

#include <cstddef>


namespace meshlib {

/// @brief The view of a rank-`Rank` block of `T` in memory `Space`: row-major, as NumPy and JAX lay
/// arrays out; owns its memory (reference-counted: copy or drop it only on its device's thread).
template <class T, std::size_t Rank, class Space = default_memory_space>
using block_view = detail::block_view_t<T, Rank, Space>;

/// @brief A `block_view` that does not own its memory (no reference count: safe to copy between
/// device threads; the owner must outlive it).
template <class T, std::size_t Rank, class Space = default_memory_space>
using unmanaged_block_view = detail::unmanaged_view_t<T, Rank, Space>;

using detail::allocate;
using detail::copy_from_host;
using detail::copy_to_host;
using detail::edit_on_host;
using detail::host_accessible_v;
using detail::host_readable;
using detail::launch;
using detail::read_back;

}  // namespace meshlib
// end meshlib/tensor/kernel.hpp
// begin meshlib/tensor/spec_algebra.hpp
/// @file
/// @brief Building the partition spec of a kernel's result from its operands' specs (the global
/// view's sharding propagation). Result specs drop trailing `none`s, so that the type a kernel
/// returns is the one a user writes: the row sum of a `P<"data", none>` tensor is `P<"data">`.

#include <array>
#include <cstddef>
#include <utility>


namespace meshlib::detail {

template <std::size_t N>
constexpr std::size_t trimmed_length(const std::array<dim_spec, N>& dims) {
  std::size_t n = 0;
  for (std::size_t i = 0; i < N; ++i)
    if (!dims[i].replicated()) n = i + 1;
  return n;
}

template <auto Dims, class Seq = std::make_index_sequence<trimmed_length(Dims)>>
struct spec_from_array;
template <auto Dims, std::size_t... I>
struct spec_from_array<Dims, std::index_sequence<I...>> {
  using type = P<Dims[I]...>;
};

/// The partition spec whose entries are `Dims` (a `std::array<dim_spec, N>`), trailing `none`s dropped.
template <auto Dims>
using spec_from_array_t = typename spec_from_array<Dims>::type;

/// The entries of `Spec` for a rank-`Rank` array, trailing ones filled with `none`.
template <class Spec, std::size_t Rank>
constexpr std::array<dim_spec, Rank> spec_entries() {
  std::array<dim_spec, Rank> out{};
  for (std::size_t i = 0; i < Rank; ++i) out[i] = Spec::dim(i);
  return out;
}

/// Length of `'data', 'model'` (or `none` for an empty mask) for the axes of `Mesh` in `Mask`.
template <class Mesh, axis_mask Mask>
consteval std::size_t axes_names_length() {
  std::size_t n = 0;
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(Mask & (axis_mask{1} << i))) continue;
    n += Mesh::axis_names[i].size() + 2 + (first ? 0 : 2);
    first = false;
  }
  return first ? 4 : n;
}

/// `'data', 'model'` as a `fixed_string`, so that compile-time diagnostics can name axes in the
/// template arguments the compiler prints; `none` for an empty mask.
template <class Mesh, axis_mask Mask>
inline constexpr auto axes_names_v = [] {
  fixed_string<axes_names_length<Mesh, Mask>() + 1> s;
  std::size_t k = 0;
  auto put = [&](std::string_view v) {
    for (char c : v) s.chars[k++] = c;
  };
  bool first = true;
  for (std::size_t i = 0; i < Mesh::ndim; ++i) {
    if (!(Mask & (axis_mask{1} << i))) continue;
    if (!first) put(", ");
    put("'");
    put(Mesh::axis_names[i]);
    put("'");
    first = false;
  }
  if (first) put("none");
  return s;
}();

}  // namespace meshlib::detail
// end meshlib/tensor/spec_algebra.hpp
// begin meshlib/tensor/local_tensor.hpp
/// @file
/// @brief `local_tensor`: the value one device sees inside `shard_map` / `spmd`, its block of a
/// sharded array, with the layout facts the type system tracks, as JAX's `vma` (varying manual axes)
/// plus a pending-sum set.
///
/// Three compile-time facts ride in the type:
/// - `Vary`: the mesh axes the value may differ over. Invariant over an axis means every device of
///   that axis group holds the same value (JAX: not in `vma`).
/// - `Partial`: the mesh axes over which the value is a pending sum: the true value is the sum of
///   the blocks over that axis group (what `psum` completes). Disjoint from `Vary`.
/// - `Dims`: for each dimension, the mesh axes of which that dimension is a block (its entry in the
///   partition spec the value came in with). Kernels use it to propagate sharding (GSPMD's rules):
///   reducing a dimension sharded over `a` makes the result partial over `a`; a matmul whose
///   contraction dimension is sharded over `a` on both sides is partial over `a`.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// // a block of a P<"data", none> array, entering shard_map:
/// using x_t = meshlib::entry_local_t<float, 2, meshlib::named_sharding<mesh_t, meshlib::P<"data">>>;
/// static_assert(x_t::vary == mesh_t::mask_of<"data">() && x_t::partial == 0);
/// @endcode

#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib {

/// @brief For each dimension of a local block, the mask of mesh axes that dimension is a block of.
template <axis_mask... M>
struct dim_masks {
  /// Tag by which `local_tensor` checks that its `Dims` is a `dim_masks`.
  using is_dim_masks = void;
  /// The rank: one mask per dimension.
  static constexpr std::size_t size = sizeof...(M);
  /// The masks, in dimension order.
  static constexpr std::array<axis_mask, sizeof...(M)> values{M...};
  /// Every axis some dimension is sharded over.
  static constexpr axis_mask all = (axis_mask{0} | ... | M);
  /// The mask of dimension `d`; 0 (not sharded) for `d` past the rank.
  static constexpr axis_mask at(std::size_t d) noexcept { return d < size ? values[d] : axis_mask{0}; }
};

namespace detail {

template <class T>
concept dim_masks_type = requires { typename T::is_dim_masks; };

template <std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct replicated_dims_impl;
template <std::size_t Rank, std::size_t... I>
struct replicated_dims_impl<Rank, std::index_sequence<I...>> {
  using type = dim_masks<(static_cast<void>(I), axis_mask{0})...>;
};

template <class S, std::size_t Rank, class Seq = std::make_index_sequence<Rank>>
struct dims_of_impl;
template <class S, std::size_t Rank, std::size_t... I>
struct dims_of_impl<S, Rank, std::index_sequence<I...>> {
  using type = dim_masks<S::dim_mask(I)...>;
};

/// `Dims` without dimension `D`.
template <class Dims, std::size_t D, class Seq = std::make_index_sequence<Dims::size - 1>>
struct remove_dim_impl;
template <class Dims, std::size_t D, std::size_t... I>
struct remove_dim_impl<Dims, D, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(I < D ? I : I + 1)...>;
};

/// `Dims` permuted: entry `i` of the result is entry `Perm[i]` of `Dims`.
template <class Dims, auto Perm, class Seq = std::make_index_sequence<Dims::size>>
struct permute_dims_impl;
template <class Dims, auto Perm, std::size_t... I>
struct permute_dims_impl<Dims, Perm, std::index_sequence<I...>> {
  using type = dim_masks<Dims::at(Perm[I])...>;
};

}  // namespace detail

/// @brief `dim_masks` of rank `Rank` with no sharded dimension.
template <std::size_t Rank>
using replicated_dims = typename detail::replicated_dims_impl<Rank>::type;

/// @brief The `dim_masks` of a rank-`Rank` array laid out by sharding `S`.
template <sharding_type S, std::size_t Rank>
using dims_of_t = typename detail::dims_of_impl<S, Rank>::type;

/// @brief The value of type `T` one device holds inside `shard_map` / `spmd`.
/// @tparam Vary    mesh axes the value varies over (see the file comment).
/// @tparam Partial mesh axes over which the value is a pending sum; disjoint from `Vary`.
/// @tparam Dims    `dim_masks<...>`: per dimension, the axes it is a block of; each within `Vary | Partial`.
/// @tparam Space   the Kokkos memory space of the block.
/// A `local_tensor` is a handle: copies share the block, as `Kokkos::View` copies do.
template <class T, std::size_t Rank, mesh_type Mesh, axis_mask Vary = 0, axis_mask Partial = 0,
          class Dims = replicated_dims<Rank>, class Space = default_memory_space>
class local_tensor {
  static_assert(detail::dim_masks_type<Dims> && Dims::size == Rank,
                "meshlib: local_tensor: Dims must be a dim_masks<...> with one mask per dimension");
  static_assert((Vary & Partial) == 0,
                "meshlib: local_tensor: a value cannot both vary over an axis and be a pending sum over it");
  static_assert((Vary & ~Mesh::all_axes) == 0 && (Partial & ~Mesh::all_axes) == 0,
                "meshlib: local_tensor: Vary / Partial name axes the mesh does not have");

 public:
  /// Tag that opts the type into the `local_tensor_type` concept.
  using is_local_tensor = void;
  /// The element type.
  using value_type = T;
  /// The mesh the block belongs to.
  using mesh_type = Mesh;
  /// Per dimension, the mesh axes it is a block of (`dim_masks`).
  using dims_type = Dims;
  /// The Kokkos memory space the block lives in.
  using memory_space = Space;
  /// The block's storage: a row-major `Kokkos::View` in `Space`.
  using view_type = detail::block_view_t<T, Rank, Space>;
  /// A shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// The number of dimensions.
  static constexpr std::size_t rank = Rank;
  /// The mesh axes over which the value differs from device to device.
  static constexpr axis_mask vary = Vary;
  /// The mesh axes over which the value is a pending sum (a `psum` is still due).
  static constexpr axis_mask partial = Partial;

  local_tensor() = default;
  /// Wraps `view`, device `device`'s block on `mesh` (no copy).
  local_tensor(view_type view, const Mesh& mesh, std::size_t device) : view_(std::move(view)), mesh_(mesh), device_(device) {}
  /// A zero block of `shape` on `device`. Throws `sharding_error` naming the dimension and its size
  /// when the element or byte count overflows (a wrapped count would allocate a small block).
  local_tensor(const shape_type& shape, const Mesh& mesh, std::size_t device)
      : view_(detail::allocate<T, Rank, Space>(checked_shape(shape), "meshlib::local_tensor")), mesh_(mesh),
        device_(device) {}

  /// The block's storage (shared, not copied).
  [[nodiscard]] const view_type& view() const noexcept { return view_; }
  /// The mesh the block belongs to.
  [[nodiscard]] const Mesh& mesh() const noexcept { return mesh_; }
  /// The device whose block this is.
  [[nodiscard]] std::size_t device() const noexcept { return device_; }
  /// The block's shape.
  [[nodiscard]] shape_type shape() const { return detail::extents_of(view_); }
  /// The block's extent in dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return view_.extent(d); }
  /// The number of elements of the block.
  [[nodiscard]] std::size_t size() const noexcept { return view_.size(); }
  /// The first element; the block is contiguous, row-major.
  [[nodiscard]] T* data() const noexcept { return view_.data(); }
  /// Size of dimension `d` of the global array this block belongs to (even rule: every block of a
  /// dimension has the same size, as `shard_map` requires).
  [[nodiscard]] std::size_t global_extent(std::size_t d) const noexcept {
    return view_.extent(d) * mesh_.axes_size(Dims::at(d));
  }

  /// Element access (host-accessible spaces).
  template <class... I>
    requires(sizeof...(I) == Rank)
  [[nodiscard]] T& operator()(I... i) const {
    return view_(i...);
  }

  /// Prints `local_tensor<(4, 6) on device 3, vary {'data'}, partial {}>`.
  friend std::ostream& operator<<(std::ostream& os, const local_tensor& t) {
    return os << "local_tensor<" << detail::describe_shape(t.shape()) << " on device " << t.device_
              << ", vary " << describe_axes<Mesh>(Vary) << ", partial " << describe_axes<Mesh>(Partial) << '>';
  }
  /// The block as `operator<<` prints it.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  static const shape_type& checked_shape(const shape_type& shape) {
    (void)detail::checked_bytes<T>(detail::checked_product(shape, "the local_tensor block shape"),
                                   "the byte count of the local_tensor block");
    return shape;
  }

  view_type view_{};
  Mesh mesh_{[] {
    if constexpr (Mesh::num_dynamic == 0) return Mesh{};
    else return Mesh{typename Mesh::coord_type{[] {
      typename Mesh::coord_type c{};
      for (auto& x : c) x = 1;
      return c;
    }()}};
  }()};
  std::size_t device_ = 0;
};

/// @brief A type that is a `local_tensor<...>`.
template <class T>
concept local_tensor_type = requires { typename std::remove_cvref_t<T>::is_local_tensor; };

/// @brief True for `local_tensor` types (the `local_tensor_type` concept as a value).
template <class T>
inline constexpr bool is_local_tensor_v = local_tensor_type<T>;

/// @brief A device's block read back into host memory, row-major (a copy on the running device's
/// instance where the block is device memory; a plain copy on a host space): for host code that
/// needs a kernel's result, such as sampling the next token from a model's logits.
template <local_tensor_type L>
[[nodiscard]] std::vector<std::remove_const_t<typename L::value_type>> to_host(const L& x) {
  std::vector<std::remove_const_t<typename L::value_type>> out(x.size());
  detail::copy_to_host<typename L::memory_space>(out.data(), x.data(), x.size());
  return out;
}

namespace detail {
/// The layout of local value `L`, spelled out for a diagnostic (core/diagnostics.hpp).
template <class L, class Seq = std::make_index_sequence<L::rank>>
struct diag_value_impl;
template <class L, std::size_t... I>
struct diag_value_impl<L, std::index_sequence<I...>> {
  using mesh_t = typename L::mesh_type;
  using type = diagnostic::value<diagnostic::vary<diag_axes_t<mesh_t, L::vary>>,
                                 diagnostic::partial<diag_axes_t<mesh_t, L::partial>>,
                                 diagnostic::dims<diag_axes_t<mesh_t, L::dims_type::at(I)>...>>;
};
/// `diagnostic::value<vary<...>, partial<...>, dims<...>>` of a local value `L`.
template <class L>
using diag_value_t = typename diag_value_impl<L>::type;
}  // namespace detail

namespace diagnostic {
/// The layout of local value `L` spelled out for a compile-time error: `value<vary<...>, partial<...>, dims<...>>`.
template <class L>
using value_t = detail::diag_value_t<L>;
}  // namespace diagnostic

namespace detail {
template <class L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
struct rebind_local;
template <class T, std::size_t Rank, class M, axis_mask V0, axis_mask P0, class D0, class S, class U, std::size_t R,
          axis_mask V, axis_mask P, class D>
struct rebind_local<local_tensor<T, Rank, M, V0, P0, D0, S>, U, R, V, P, D> {
  using type = local_tensor<U, R, M, V, P, D, S>;
};
}  // namespace detail

/// @brief `L` with every field but the named ones kept: the result types collectives and kernels compute.
template <local_tensor_type L, axis_mask NewVary>
using with_vary_t = typename detail::rebind_local<L, typename L::value_type, L::rank, NewVary, L::partial,
                                                  typename L::dims_type>::type;
/// @brief `L` with its partial axes replaced.
template <local_tensor_type L, axis_mask NewPartial>
using with_partial_t = typename detail::rebind_local<L, typename L::value_type, L::rank, L::vary, NewPartial,
                                                     typename L::dims_type>::type;
/// @brief `L` with vary and partial both replaced (collectives move axes from one to the other).
template <local_tensor_type L, axis_mask NewVary, axis_mask NewPartial>
using with_vary_partial_t =
    typename detail::rebind_local<L, typename L::value_type, L::rank, NewVary, NewPartial, typename L::dims_type>::type;
/// @brief `L` with its per-dimension sharding masks replaced.
template <local_tensor_type L, class NewDims>
using with_dims_t =
    typename detail::rebind_local<L, typename L::value_type, NewDims::size, L::vary, L::partial, NewDims>::type;
/// @brief `L` with element type `U`.
template <local_tensor_type L, class U>
using with_value_t = typename detail::rebind_local<L, U, L::rank, L::vary, L::partial, typename L::dims_type>::type;
/// @brief The general form: element type, rank, vary, partial and dims all given.
template <local_tensor_type L, class U, std::size_t R, axis_mask V, axis_mask P, class D>
using rebind_local_t = typename detail::rebind_local<L, U, R, V, P, D>::type;

/// @brief `Dims` without dimension `D`, and `Dims` permuted (`Perm[i]`: the source of entry `i`).
template <class Dims, std::size_t D>
using remove_dim_t = typename detail::remove_dim_impl<Dims, D>::type;
/// @brief `Dims` permuted: entry `i` is `Dims`' entry `Perm[i]`.
template <class Dims, auto Perm>
using permute_dims_t = typename detail::permute_dims_impl<Dims, Perm>::type;

/// @brief The local type of a block of a rank-`Rank` array laid out by `S`, entering `shard_map`:
/// varying over every axis the spec uses, partial over none.
template <class T, std::size_t Rank, sharding_type S, class Space = default_memory_space>
using entry_local_t = local_tensor<T, Rank, typename S::mesh_type, S::sharded_axes, 0, dims_of_t<S, Rank>, Space>;

}  // namespace meshlib
// end meshlib/tensor/local_tensor.hpp
// begin meshlib/tensor/sharded_tensor.hpp
/// @file
/// @brief `sharded_tensor`: one logical array of a global shape laid out over a mesh, each device
/// holding its block in a `Kokkos::View` (row-major), as a `jax.Array` with a `NamedSharding`.
///
/// Blocks are indexed by device id. A process holds the blocks of its *local* devices only: with
/// the thread communicator that is every device; with one process per rank (MPI) it is that rank's
/// devices, and the other entries stay empty. Operations that need another device's block
/// (`to_host`) throw `sharding_error` when it is not local.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"data">, meshlib::axis<"model">>;
/// meshlib::named_sharding<mesh_t, meshlib::P<"data", "model">> s{mesh_t{2, 2}};
/// std::vector<float> host(8 * 6);                       // row-major 8 x 6
/// auto x = meshlib::from_host(s, std::array<std::size_t, 2>{8, 6}, std::span<const float>(host));
/// x.local(3);        // device 3's 4 x 3 block, a Kokkos::View
/// x.block_of(3);     // its offsets and extents: [4:8, 3:6]
/// auto back = x.to_host();                              // == host
/// @endcode

#include <algorithm>
#include <array>
#include <concepts>
#include <cstddef>
#include <functional>
#include <numeric>
#include <ostream>
#include <span>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib {

namespace detail {

/// Calls `f(local_index, global_index)` for every element of block `b`, row-major.
template <std::size_t Rank, class F>
void for_each_in_block(const block<Rank>& b, F&& f) {
  if (b.size() == 0) return;
  std::array<std::size_t, Rank> g = b.offset;
  const std::size_t n = b.size();
  for (std::size_t i = 0; i < n; ++i) {
    f(i, static_cast<const std::array<std::size_t, Rank>&>(g));
    for (std::size_t d = Rank; d-- > 0;) {
      if (++g[d] < b.offset[d] + b.extent[d]) break;
      g[d] = b.offset[d];
    }
  }
}

/// Row-major flat index of `g` in an array of `shape`.
template <std::size_t Rank>
constexpr std::size_t flat_index(const std::array<std::size_t, Rank>& shape, const std::array<std::size_t, Rank>& g) {
  std::size_t k = 0;
  for (std::size_t d = 0; d < Rank; ++d) k = k * shape[d] + g[d];
  return k;
}

template <std::size_t Rank>
std::size_t shape_size(const std::array<std::size_t, Rank>& s) {
  return checked_product(s, "the global shape");  // throws, never wraps (core/checked_size.hpp)
}

}  // namespace detail

/// @brief A global array of `T` of rank `Rank`, laid out by `Sharding` (a `named_sharding`), each
/// local device's block in a row-major `Kokkos::View` in `Space`.
/// A `sharded_tensor` is a handle: copies share the blocks (as `Kokkos::View` and `jax.Array`).
template <class T, std::size_t Rank, sharding_type Sharding, class Space = default_memory_space>
class sharded_tensor {
  static_assert(Sharding::template check_rank<Rank>());

 public:
  /// Tag that opts the type into the `sharded_tensor_type` concept.
  using is_sharded_tensor = void;
  /// The element type.
  using value_type = T;
  /// How the array is split over the mesh.
  using sharding_type = Sharding;
  /// The mesh of the sharding.
  using mesh_type = typename Sharding::mesh_type;
  /// The partition spec of the sharding.
  using spec_type = typename Sharding::spec_type;
  /// The Kokkos memory space the blocks live in.
  using memory_space = Space;
  /// A block's storage: a row-major `Kokkos::View` in `Space`.
  using view_type = detail::block_view_t<T, Rank, Space>;
  /// A shape: one extent per dimension.
  using shape_type = std::array<std::size_t, Rank>;
  /// Which block of the global array each device holds.
  using layout_type = shard_layout<Sharding, Rank>;
  /// The type of a block inside `shard_map`: varying over the spec's axes.
  using local_type = entry_local_t<T, Rank, Sharding, Space>;
  /// The number of dimensions.
  static constexpr std::size_t rank = Rank;

  /// Zero blocks for every device of the mesh (the thread-communicator case).
  /// @throws sharding_error when the shape does not fit the sharding (see `shard_layout`).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape)
      : sharded_tensor(sharding, global_shape, all_devices(sharding)) {}

  /// Zero blocks for the devices in `local_devices` only (one process of a multi-process run).
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::span<const std::size_t> local_devices)
      : layout_(sharding, global_shape), blocks_(sharding.mesh().size()), local_(sharding.mesh().size(), false) {
    detail::checked_bytes<T>(size(), "the byte count of the global shape");
    for (std::size_t dev : local_devices) {
      if (dev >= blocks_.size())
        throw sharding_error("meshlib: sharded_tensor: local device " + std::to_string(dev) + " is not in mesh " +
                             sharding.mesh().to_string());
      blocks_[dev] = detail::allocate<T, Rank, Space>(layout_.local_shape(dev), "meshlib::sharded_tensor");
      local_[dev] = true;
    }
  }

  /// Wraps existing blocks: `blocks[dev]` is device `dev`'s block (or an empty view where not local).
  /// @throws sharding_error when a local block's shape is not the one the layout gives.
  sharded_tensor(const Sharding& sharding, const shape_type& global_shape, std::vector<view_type> blocks,
                 std::vector<bool> local)
      : layout_(sharding, global_shape), blocks_(std::move(blocks)), local_(std::move(local)) {
    if (blocks_.size() != sharding.mesh().size() || local_.size() != blocks_.size())
      throw sharding_error("meshlib: sharded_tensor needs one block entry per device of " + sharding.mesh().to_string());
    for (std::size_t dev = 0; dev < blocks_.size(); ++dev)
      if (local_[dev] && detail::extents_of(blocks_[dev]) != layout_.local_shape(dev))
        throw sharding_error("meshlib: sharded_tensor: device " + std::to_string(dev) + "'s block has shape " +
                             detail::describe_shape(detail::extents_of(blocks_[dev])) + " but " + sharding.to_string() +
                             " on global shape " + detail::describe_shape(global_shape) + " gives it shape " +
                             detail::describe_shape(layout_.local_shape(dev)));
  }

  /// How the array is split over the mesh.
  [[nodiscard]] const Sharding& sharding() const noexcept { return layout_.sharding(); }
  /// The mesh the blocks lie on.
  [[nodiscard]] const mesh_type& mesh() const noexcept { return layout_.sharding().mesh(); }
  /// Which block each device holds.
  [[nodiscard]] const layout_type& layout() const noexcept { return layout_; }
  /// The shape of the whole (global) array.
  [[nodiscard]] const shape_type& global_shape() const noexcept { return layout_.global_shape(); }
  /// The global extent of dimension `d`.
  [[nodiscard]] std::size_t extent(std::size_t d) const noexcept { return layout_.global_shape()[d]; }
  /// Number of elements of the global array.
  [[nodiscard]] std::size_t size() const noexcept { return detail::shape_size(global_shape()); }
  /// The number of devices of the mesh, local or not.
  [[nodiscard]] std::size_t num_devices() const noexcept { return blocks_.size(); }

  /// Whether this process holds device `dev`'s block.
  [[nodiscard]] bool is_local(std::size_t dev) const noexcept { return dev < local_.size() && local_[dev]; }
  /// The devices whose blocks this process holds, ascending.
  [[nodiscard]] std::vector<std::size_t> local_devices() const {
    std::vector<std::size_t> out;
    for (std::size_t d = 0; d < local_.size(); ++d)
      if (local_[d]) out.push_back(d);
    return out;
  }
  /// Whether this process holds every block.
  [[nodiscard]] bool fully_local() const noexcept { return std::all_of(local_.begin(), local_.end(), [](bool b) { return b; }); }

  /// Device `dev`'s block. @throws sharding_error when it is not local.
  [[nodiscard]] const view_type& local(std::size_t dev) const {
    check_local(dev, "local");
    return blocks_[dev];
  }
  /// Device `dev`'s block as the value `shard_map` hands the device (shares memory).
  [[nodiscard]] local_type local_value(std::size_t dev) const { return local_type(local(dev), mesh(), dev); }
  /// Offsets and extents of device `dev`'s block in the global array.
  [[nodiscard]] block<Rank> block_of(std::size_t dev) const noexcept { return layout_.block_of(dev); }
  /// Where device `dev`'s block starts in the global array.
  [[nodiscard]] shape_type offsets(std::size_t dev) const noexcept { return layout_.block_of(dev).offset; }
  /// The shape of device `dev`'s block.
  [[nodiscard]] shape_type local_shape(std::size_t dev) const noexcept { return layout_.local_shape(dev); }

  /// The global array, row-major, each element read from the first local device holding it.
  /// @throws sharding_error when some element has no local holder.
  [[nodiscard]] std::vector<T> to_host() const {
    std::vector<T> out(size());
    const std::size_t n = num_devices();
    // Walk replica groups: the first local member of each group supplies the block.
    std::vector<bool> covered(n, false);
    for (std::size_t dev = 0; dev < n; ++dev) {
      if (covered[dev]) continue;
      const auto reps = layout_.replicas(dev);
      std::size_t src = n;
      for (auto r : reps) {
        covered[r] = true;
        if (src == n && local_[r]) src = r;
      }
      const block<Rank> b = layout_.block_of(dev);
      if (b.size() == 0) continue;
      if (src == n)
        throw sharding_error("meshlib: to_host: block " + block_string(b) + " is held by devices " +
                             detail::describe_devices(reps) + ", none of them local to this process");
      copy_block_out(src, b, out.data());
    }
    return out;
  }

  /// Prints `sharded_tensor<(8, 6), named_sharding(mesh{'data': 2}, P<"data">)>`.
  friend std::ostream& operator<<(std::ostream& os, const sharded_tensor& t) {
    return os << "sharded_tensor<" << detail::describe_shape(t.global_shape()) << ", " << t.sharding() << '>';
  }
  /// The array as `operator<<` prints it: global shape and sharding.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  static std::vector<std::size_t> all_devices(const Sharding& s) {
    std::vector<std::size_t> d(s.mesh().size());
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
  static std::string block_string(const block<Rank>& b) {
    std::ostringstream os;
    os << b;
    return os.str();
  }
  void check_local(std::size_t dev, const char* what) const {
    if (dev >= local_.size() || !local_[dev])
      throw sharding_error(std::string("meshlib: sharded_tensor::") + what + ": device " + std::to_string(dev) +
                           (dev >= local_.size() ? " is not in mesh " + mesh().to_string()
                                                 : std::string(" is not local to this process")));
  }

  void copy_block_out(std::size_t dev, const block<Rank>& b, T* out) const {
    auto host = Kokkos::create_mirror_view(blocks_[dev]);
    if constexpr (!detail::host_accessible_v<Space>) Kokkos::deep_copy(host, blocks_[dev]);
    const T* src = host.data();
    detail::for_each_in_block(b, [&](std::size_t i, const shape_type& g) { out[detail::flat_index(global_shape(), g)] = src[i]; });
  }

  layout_type layout_;
  std::vector<view_type> blocks_;
  std::vector<bool> local_;
};

/// @brief A type that is a `sharded_tensor<...>`.
template <class T>
concept sharded_tensor_type = requires { typename std::remove_cvref_t<T>::is_sharded_tensor; };
/// @brief True for `sharded_tensor` types (the `sharded_tensor_type` concept as a value).
template <class T>
inline constexpr bool is_sharded_tensor_v = sharded_tensor_type<T>;

namespace detail {

/// Builds a tensor whose local blocks `fill(dev, block, T* host_data)` writes, row-major.
template <class T, std::size_t Rank, sharding_type S, class Space, class F>
sharded_tensor<T, Rank, S, Space> fill_blocks(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                              std::span<const std::size_t> local_devices, F&& fill) {
  sharded_tensor<T, Rank, S, Space> t(sharding, shape, local_devices);
  for (std::size_t dev : local_devices) {
    const auto& v = t.local(dev);
    auto host = Kokkos::create_mirror_view(v);
    fill(dev, t.block_of(dev), host.data());
    if constexpr (!host_accessible_v<Space>) Kokkos::deep_copy(v, host);
  }
  return t;
}

template <class S>
std::vector<std::size_t> every_device(const S& s) {
  std::vector<std::size_t> d(s.mesh().size());
  std::iota(d.begin(), d.end(), std::size_t{0});
  return d;
}

}  // namespace detail

/// @brief Scatters a global row-major host array into blocks (`jax.device_put(x, sharding)`).
/// @throws sharding_error when `data.size()` is not the product of `shape`, or the shape does not fit.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<std::remove_const_t<T>, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                                                 std::span<T> data,
                                                                 std::span<const std::size_t> local_devices = {}) {
  using U = std::remove_const_t<T>;
  if (data.size() != detail::shape_size(shape))
    throw sharding_error("meshlib: from_host: global shape " + detail::describe_shape(shape) + " has " +
                         std::to_string(detail::shape_size(shape)) + " elements but the host array has " +
                         std::to_string(data.size()));
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return detail::fill_blocks<U, Rank, S, Space>(sharding, shape, local_devices,
                                                [&](std::size_t, const block<Rank>& b, U* out) {
                                                  detail::for_each_in_block(b, [&](std::size_t i, const auto& g) {
                                                    out[i] = data[detail::flat_index(shape, g)];
                                                  });
                                                });
}

/// @brief `from_host` for a `std::vector`.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> from_host(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                            const std::vector<T>& data, std::span<const std::size_t> local_devices = {}) {
  return from_host<Space>(sharding, shape, std::span<const T>(data), local_devices);
}

/// @brief Builds each local block by a callback, as `jax.make_array_from_callback(shape, sharding, cb)`.
/// `cb` is called either per block as `cb(device, block<Rank> b, Kokkos::View host_block)` (fill the
/// view: `b.offset` / `b.extent` say where it lies in the global array), or per element as
/// `cb(std::array<std::size_t, Rank> global_index) -> T`.
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S, class F>
sharded_tensor<T, Rank, S, Space> make_array_from_callback(const std::array<std::size_t, Rank>& shape, const S& sharding,
                                                           F&& cb, std::span<const std::size_t> local_devices = {}) {
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  using view_t = detail::block_view_t<T, Rank, Space>;
  using host_t = typename view_t::HostMirror;
  if constexpr (std::invocable<F&, const std::array<std::size_t, Rank>&>) {
    return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
      detail::for_each_in_block(b, [&](std::size_t i, const auto& g) { out[i] = static_cast<T>(cb(g)); });
    });
  } else {
    static_assert(std::invocable<F&, std::size_t, const block<Rank>&, const host_t&>,
                  "meshlib: make_array_from_callback: the callback must be invocable as cb(global_index) -> T or as "
                  "cb(device, block, host_view)");
    return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t dev, const block<Rank>& b, T* out) {
      host_t v = [&]<std::size_t... I>(std::index_sequence<I...>) {
        return host_t(out, b.extent[I]...);
      }(std::make_index_sequence<Rank>{});
      cb(dev, b, static_cast<const host_t&>(v));
    });
  }
}

/// @brief A tensor whose every element is `value` (`jnp.full` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> full(const S& sharding, const std::array<std::size_t, Rank>& shape, const T& value,
                                       std::span<const std::size_t> local_devices = {}) {
  const auto all = detail::every_device(sharding);
  if (local_devices.empty()) local_devices = all;
  return detail::fill_blocks<T, Rank, S, Space>(sharding, shape, local_devices, [&](std::size_t, const block<Rank>& b, T* out) {
    std::fill(out, out + b.size(), value);
  });
}

/// @brief A tensor of zeros (`jnp.zeros` with a sharding).
template <class T, class Space = default_memory_space, std::size_t Rank, sharding_type S>
sharded_tensor<T, Rank, S, Space> zeros(const S& sharding, const std::array<std::size_t, Rank>& shape,
                                        std::span<const std::size_t> local_devices = {}) {
  if (local_devices.empty()) return sharded_tensor<T, Rank, S, Space>(sharding, shape);
  return sharded_tensor<T, Rank, S, Space>(sharding, shape, local_devices);
}

/// @brief The global array as a row-major host vector (`jax.device_get` / `np.asarray`).
template <sharded_tensor_type X>
auto to_host(const X& x) {
  return x.to_host();
}

}  // namespace meshlib
// end meshlib/tensor/sharded_tensor.hpp
// begin meshlib/tensor/elementwise.hpp
/// @file
/// @brief Elementwise kernels: `map`, `zip`, and the arithmetic operators, on local values (inside
/// `shard_map` / `spmd`) and on global `sharded_tensor`s.
///
/// Sharding propagation: an elementwise result has its operands' layout. Both operands of a binary
/// operation must have the *same* layout (same sharding in the global view; same vary, partial and
/// dims in the local view): meshlib does not move data implicitly, so a mismatch does not compile
/// and the message points to `reshard`.
///
/// Pending sums (`Partial`): only linear operations keep a value partial. `a + b`, `a - b`, `-a`,
/// `a * s`, `s * a`, `a / s` are allowed on partial values (the sum of the parts is still the right
/// answer); `map`, `zip`, `a * b`, `a + s` are not (`psum` first), because e.g. adding 1 to each of
/// n parts adds n to their sum.
/// @code
/// auto y = x * 2.0f + 1.0f;                           // pmap-style x * 2 + 1
/// auto z = meshlib::zip([](float a, float b) { return a > b ? a : b; }, x, y);
/// @endcode

#include <concepts>
#include <cstddef>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/tensor/for_each_device.hpp
/// @file
/// @brief `detail::for_each_device`: how a global-view operation (elementwise, reductions, matmul,
/// transpose on `sharded_tensor`s) runs its devices' kernels, each on its execution-space
/// instance; and `detail::device_dispatcher`, the hook that runs them at once.
///
/// Why a hook: the threads that run devices at once belong to the exec layer (its device thread
/// pool, exec/detail/device_workers.hpp), above this one; a layer must not include the layers
/// above it. So this layer declares a dispatcher and the exec header installs its pool there when
/// a program includes it (`<meshlib.hpp>`, `<meshlib/exec.hpp>` and every runner do). Without it,
/// or below `parallel_work_threshold`, the calling thread runs the devices one after another:
/// the same results (a global-view operation's devices do not talk to each other), only slower.

#include <atomic>
#include <cstddef>
#include <span>


namespace meshlib::detail {

/// Runs `call(ctx, i)` for every `i` in `[0, count)` at once and returns when all have returned;
/// rethrows the exception of the lowest `i` that threw.
using device_dispatch_fn = void (*)(std::size_t count, void* ctx, void (*call)(void*, std::size_t));

/// The installed dispatcher (see the file comment); null: the devices run one after another.
inline constinit std::atomic<device_dispatch_fn> device_dispatcher{nullptr};

/// Below this many element operations in all, waking workers costs more than it saves (a wake is
/// a few microseconds; a host kernel does about a thousand element operations per microsecond).
inline constexpr std::size_t parallel_work_threshold = std::size_t{1} << 15;

/// Runs `f(d)` for every device `d` in `devices` at once (see the file comment), each on its
/// execution-space instance for memory space `Space` among `num_devices` devices. `work`: the
/// element operations of all devices together; below `parallel_work_threshold` the calling thread
/// runs the devices one after another (still each on its instance).
template <class Space, class F>
void for_each_device(std::span<const std::size_t> devices, std::size_t num_devices, std::size_t work, F&& f) {
  if (devices.empty()) return;
  (void)device_instance<Space>(0, num_devices);  // made here, not in the workers
  auto task = [&](std::size_t i) {
    const std::size_t d = devices[i];
    scoped_exec_space<Space> on(device_instance<Space>(d, num_devices));
    f(d);
  };
  const device_dispatch_fn dispatch = device_dispatcher.load(std::memory_order_acquire);
  if (work < parallel_work_threshold || dispatch == nullptr) {
    for (std::size_t i = 0; i < devices.size(); ++i) task(i);
    return;
  }
  dispatch(devices.size(), &task, [](void* t, std::size_t i) { (*static_cast<decltype(task)*>(t))(i); });
}

}  // namespace meshlib::detail
// end meshlib/tensor/for_each_device.hpp
// begin meshlib/tensor/pointer_check.hpp
/// @file
/// @brief Where a raw pointer's memory is, asked at run time, so that a host pointer never reaches a
/// device kernel silently (a `cudaErrorIllegalAddress` at some later fence, or worse, nothing).
///
/// A view's memory space is part of its type, and the public entries that launch kernels check at
/// compile time that the kernel's execution space can read every view they are given
/// (`meshlib::require_accessible`). What the type cannot tell is whether the pointer *inside* a
/// view of `Kokkos::CudaSpace` really is device memory: an unmanaged view wrapped around
/// `std::vector::data()`, or a batch handed over as a `std::span`, says CudaSpace and holds a host
/// address. For those, `pointer_query<Space>` asks the device runtime (`cudaPointerGetAttributes`
/// for CUDA); `check_device_readable` throws `memory_space_error` naming the entry, the argument and
/// the fix, and `is_device_readable` lets the training step stage a host batch instead.
///
/// `pointer_query` is a customisation point: a memory space without a specialisation is not asked
/// (its pointers are trusted, as the host's are). The tests specialise it for a fake device space
/// to check the run-time half on a machine without a GPU.
/// @code
/// meshlib::check_device_readable<Kokkos::CudaSpace>(x.data(), "my_layer::forward", "x");
/// // throws: "meshlib: my_layer::forward: argument 'x' is host memory, but its kernel runs on Cuda
/// //          (CudaSpace); copy it to the device first (meshlib::nn::device_put for a batch, ...)"
/// @endcode

#include <string>
#include <string_view>
#include <type_traits>

#include <Kokkos_Core.hpp>


#if defined(KOKKOS_ENABLE_CUDA)
#include <cuda_runtime.h>
#endif

namespace meshlib {

/// @brief A pointer handed to a kernel that cannot read it: host memory where the kernel runs on a
/// device, or another device's memory. Thrown before the kernel is launched.
class memory_space_error : public error {
 public:
  using error::error;
};

/// @brief What the device runtime says of an address.
enum class pointer_location {
  host,     ///< host memory (pageable or pinned): a device kernel must not read it
  device,   ///< device memory of GPU `pointer_info::device`
  managed,  ///< managed (unified) memory: readable everywhere
};

/// @brief The answer of a `pointer_query`.
struct pointer_info {
  pointer_location location = pointer_location::host;  ///< host, device or managed memory
  int device = -1;  ///< the GPU of device memory (-1 otherwise)
};

/// @brief How meshlib asks where a pointer's memory is, for memory space `Space`. The primary
/// template asks nothing (`asks == false`): host spaces, and device spaces meshlib has no query
/// for. Specialise it for a space of your own with `static constexpr bool asks = true;` and
/// `static pointer_info of(const void*)`.
template <class Space>
struct pointer_query {
  /// Whether meshlib asks at all: false, every pointer is trusted (as the host's are).
  static constexpr bool asks = false;
  /// Not asked: "readable everywhere".
  static pointer_info of(const void*) noexcept { return {pointer_location::managed, -1}; }
};

#if defined(KOKKOS_ENABLE_CUDA)
/// `cudaPointerGetAttributes`: unregistered host memory is `cudaMemoryTypeUnregistered` (CUDA 11+),
/// pinned host memory `cudaMemoryTypeHost`; both are host memory to a kernel here.
template <>
struct pointer_query<Kokkos::CudaSpace> {
  static constexpr bool asks = true;
  static pointer_info of(const void* p) noexcept {
    cudaPointerAttributes a{};
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
      (void)cudaGetLastError();  // an unknown address: host memory CUDA never saw
      return {pointer_location::host, -1};
    }
    if (a.type == cudaMemoryTypeDevice) return {pointer_location::device, a.device};
    if (a.type == cudaMemoryTypeManaged) return {pointer_location::managed, a.device};
    return {pointer_location::host, -1};
  }
};
#endif

/// @brief Whether a kernel in memory space `Space`'s execution space on GPU `device` (-1: any) can
/// read `p`: always where `Space` is not asked (`pointer_query<Space>::asks`), else device memory
/// of that GPU or managed memory. A null pointer is readable (an empty block).
template <class Space>
[[nodiscard]] bool is_device_readable(const void* p, int device = -1) noexcept {
  if constexpr (!pointer_query<Space>::asks) {
    return true;
  } else {
    if (p == nullptr) return true;
    const pointer_info i = pointer_query<Space>::of(p);
    if (i.location == pointer_location::managed) return true;
    return i.location == pointer_location::device && (device < 0 || i.device == device);
  }
}

/// @brief Whether the running device's kernels on memory `Space` (inside `spmd` / `shard_map`: its
/// execution-space instance, on its GPU) can read `p`: `is_device_readable` for that device's GPU.
template <class Space>
[[nodiscard]] bool is_readable_by_running_device(const void* p) {
  if constexpr (!pointer_query<Space>::asks) {
    (void)p;
    return true;
  } else {
    return is_device_readable<Space>(p, detail::current_device_id<Space>());
  }
}

/// @brief Throws `memory_space_error` unless a kernel on memory `Space` can read `p`
/// (`is_device_readable`): the message names `entry` (the public call), `argument` and the fix.
template <class Space>
void check_device_readable(const void* p, std::string_view entry, std::string_view argument, int device = -1) {
  if constexpr (pointer_query<Space>::asks) {
    if (is_device_readable<Space>(p, device)) return;
    const pointer_info i = pointer_query<Space>::of(p);
    const std::string where = std::string(Space::execution_space::name()) + " (" + Space::name() + ")";
    if (i.location == pointer_location::device)
      throw memory_space_error("meshlib: " + std::string(entry) + ": argument '" + std::string(argument) +
                               "' is memory of GPU " + std::to_string(i.device) + ", but its kernel runs on GPU " +
                               std::to_string(device) + "; copy it to that GPU first (Kokkos::deep_copy)");
    throw memory_space_error("meshlib: " + std::string(entry) + ": argument '" + std::string(argument) +
                             "' is host memory, but its kernel runs on " + where +
                             "; copy it to the device first (meshlib::nn::device_put for a batch, "
                             "meshlib::device_put for an array, Kokkos::deep_copy for a view)");
  } else {
    (void)p, (void)entry, (void)argument, (void)device;
  }
}

namespace detail {
/// The diagnostic of `require_accessible` (core/diagnostics.hpp: a function, so one error).
template <class Entry, class Argument, class Exec, class Space>
consteval bool argument_memory_is_not_accessible_from_kernel_space() {
  static_assert(always_false<Entry, Argument, Exec, Space>,
                "meshlib: an argument's memory space cannot be read by the execution space its kernel runs on "
                "(the note names the call, the argument, the execution space and the memory space); copy it there "
                "first with meshlib::nn::device_put (a batch), meshlib::device_put (an array) or Kokkos::deep_copy");
  return false;
}
}  // namespace detail

/// @brief Compile-time half of the check: `true` when execution space `Exec` can access memory
/// space `Space`; otherwise one compile error that spells the call `Entry` and the `Argument`
/// (`diag_op_t<"matmul_into">`, `diag_op_t<"A">`).
template <class Entry, class Argument, class Exec, class Space>
consteval bool require_accessible() {
  if constexpr (Kokkos::SpaceAccessibility<Exec, Space>::accessible) return true;
  else return detail::argument_memory_is_not_accessible_from_kernel_space<Entry, Argument, Exec, Space>();
}

/// @brief The compile-time check of a public entry whose kernels run on the running device's
/// instance of memory space `KernelSpace` (`nn`'s layers and losses: `default_memory_space`, where
/// their buffers live; an elementwise op: its first operand's space): `true` when those kernels can
/// read the memory of `L` (a `local_tensor` or `Kokkos::View` type), else the one diagnostic of
/// `require_accessible`, naming `Entry` and `Argument`. A layer of your own calls it first thing:
/// @code
/// template <meshlib::local_tensor_type X>
/// X forward(const X& x) {
///   static_cast<void>(meshlib::require_kernel_can_read<"my_layer.forward", "x", X>());
///   ...
/// @endcode
template <fixed_string Entry, fixed_string Argument, class L, class KernelSpace = default_memory_space>
consteval bool require_kernel_can_read() {
  return require_accessible<detail::diag_op_t<Entry>, detail::diag_op_t<Argument>,
                            typename KernelSpace::execution_space, typename L::memory_space>();
}

}  // namespace meshlib
// end meshlib/tensor/pointer_check.hpp

namespace meshlib {

namespace detail {

// ---- diagnostics ------------------------------------------------------------------------------
// Each is a function whose one static_assert names, in its failing condition, the operands' specs
// or layouts spelled out with axis names (core/diagnostics.hpp): one error on GCC and Clang.

template <class Op, class LhsSpec, class RhsSpec>
consteval bool zip_needs_same_sharding() {
  static_assert(always_false<Op, LhsSpec, RhsSpec>,
                "meshlib: zip / elementwise operator: the operands have different shardings (the two specs are "
                "spelled out in the condition); meshlib moves no data implicitly: reshard one operand with "
                "meshlib::reshard<Spec>(x) so both have the same spec");
  return false;
}

template <class Op, class LhsValue, class RhsValue>
consteval bool zip_needs_same_local_layout() {
  static_assert(always_false<Op, LhsValue, RhsValue>,
                "meshlib: zip / elementwise operator on local values: the operands vary over, are partial over, or are "
                "sharded over different mesh axes (the two layouts are spelled out in the condition); make them "
                "agree first: psum / all_gather the one, pbroadcast the other, or reshard the inputs of shard_map");
  return false;
}

template <class Op, class LhsRank, class RhsRank>
consteval bool zip_of_different_ranks() {
  static_assert(always_false<Op, LhsRank, RhsRank>, "meshlib: zip / elementwise operator on operands of different ranks");
  return false;
}

template <class Op, class LhsMesh, class RhsMesh>
consteval bool zip_of_different_meshes() {
  static_assert(always_false<Op, LhsMesh, RhsMesh>,
                "meshlib: zip / elementwise operator on operands over different mesh types");
  return false;
}

template <class PartialAxes, class Value>
consteval bool operation_is_not_linear_on_partial() {
  static_assert(always_false<PartialAxes, Value>,
                "meshlib: this operation is not linear, but the operand is a pending sum over the axes spelled out in "
                "the condition; complete the sum with psum over those axes first (only +, -, negation, and scaling "
                "by a scalar keep a value partial)");
  return false;
}

/// True when `L` is not partial; otherwise fires `operation_is_not_linear_on_partial`.
template <class L>
consteval bool check_not_partial() {
  if constexpr (L::partial != 0)
    return operation_is_not_linear_on_partial<diag_axes_t<typename L::mesh_type, L::partial>, diag_value_t<L>>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_zip_local() {
  using op_t = diag_op_t<"zip">;
  if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return zip_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (A::rank != B::rank)
    return zip_of_different_ranks<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<diag_value_t<A>, diag_value_t<B>>)
    return zip_needs_same_local_layout<op_t, diag_value_t<A>, diag_value_t<B>>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_zip_global() {
  using op_t = diag_op_t<"zip">;
  if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return zip_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (A::rank != B::rank)
    return zip_of_different_ranks<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<typename A::spec_type, typename B::spec_type>)
    return zip_needs_same_sharding<op_t, diag_spec_t<typename A::spec_type>, diag_spec_t<typename B::spec_type>>();
  else return true;
}

// ---- kernels on views -------------------------------------------------------------------------

template <class F, class T, class U>
struct map_functor {
  F f;
  const T* in;
  U* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = f(in[i]); }
};

template <class F, class T1, class T2, class U>
struct zip_functor {
  F f;
  const T1* a;
  const T2* b;
  U* out;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const { out[i] = f(a[i], b[i]); }
};

/// out = f(in), elementwise, into a fresh view of the same shape.
template <class U, class Space, class View, class F>
auto map_view(const View& in, const F& f) {
  constexpr std::size_t rank = View::rank;
  auto out = allocate<U, rank, Space>(extents_of(in), "meshlib::map", false);
  launch<Space>(in.span(), map_functor<F, typename View::value_type, U>{f, in.data(), out.data()});
  return out;
}

template <class U, class Space, class VA, class VB, class F>
auto zip_view(const VA& a, const VB& b, const F& f) {
  // The kernel runs where the first operand lives; the second must be readable there (a host block
  // zipped with a device block would hand a host address to a GPU kernel).
  static_cast<void>(require_kernel_can_read<"zip", "b", VB, Space>());
  constexpr std::size_t rank = VA::rank;
  if (extents_of(a) != extents_of(b))
    throw sharding_error("meshlib: zip: the local blocks have shapes " + describe_shape(extents_of(a)) + " and " +
                         describe_shape(extents_of(b)) + "; elementwise operands need equal shapes");
  auto out = allocate<U, rank, Space>(extents_of(a), "meshlib::zip", false);
  launch<Space>(a.span(), zip_functor<F, typename VA::value_type, typename VB::value_type, U>{f, a.data(), b.data(),
                                                                                                out.data()});
  return out;
}

template <class X, class U, class Views>
auto rewrap_global(const X& x, Views&& blocks) {
  using out_t = sharded_tensor<U, X::rank, typename X::sharding_type, typename X::memory_space>;
  std::vector<bool> local(x.num_devices());
  for (std::size_t d = 0; d < local.size(); ++d) local[d] = x.is_local(d);
  return out_t(x.sharding(), x.global_shape(), std::forward<Views>(blocks), std::move(local));
}

template <class X, class Y>
void check_same_global(const X& x, const Y& y, const char* op) {
  if (!(x.sharding() == y.sharding()) || x.global_shape() != y.global_shape())
    throw sharding_error(std::string("meshlib: ") + op + ": operands " + x.to_string() + " and " + y.to_string() +
                         " differ in mesh sizes, shard rule or global shape");
  for (std::size_t d = 0; d < x.num_devices(); ++d)
    if (x.is_local(d) != y.is_local(d))
      throw sharding_error(std::string("meshlib: ") + op + ": device " + std::to_string(d) +
                           " is local to one operand and not the other");
}

}  // namespace detail

// ---- local view ---------------------------------------------------------------------------------

/// @brief `f` applied to every element of a local value; same layout, element type `f`'s result.
/// @pre `x` is not partial (map is not linear in general).
template <class F, local_tensor_type L>
auto map(F f, const L& x) {
  if constexpr (!detail::check_not_partial<L>()) {
    return x;  // the diagnostic above has fired
  } else {
    using T = typename L::value_type;
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
    using out_t = with_value_t<L, U>;
    return out_t(detail::map_view<U, typename L::memory_space>(x.view(), f), x.mesh(), x.device());
  }
}

/// @brief `f(a[i], b[i])` for every element; both operands must have the same layout.
template <class F, local_tensor_type A, local_tensor_type B>
auto zip(F f, const A& a, const B& b) {
  if constexpr (!detail::diagnose_zip_local<A, B>()) {
    return a;  // the diagnostic above has fired
  } else if constexpr (!detail::check_not_partial<A>()) {
    return a;  // the diagnostic above has fired
  } else {
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using out_t = with_value_t<A, U>;
    return out_t(detail::zip_view<U, typename A::memory_space>(a.view(), b.view(), f), a.mesh(), a.device());
  }
}

namespace detail {
/// Zip allowed on partial operands (for the linear operators +, -).
template <class F, local_tensor_type A, local_tensor_type B>
auto zip_linear(F f, const A& a, const B& b) {
  if constexpr (!diagnose_zip_local<A, B>()) {
    return a;  // the diagnostic above has fired
  } else {
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using out_t = with_value_t<A, U>;
    return out_t(zip_view<U, typename A::memory_space>(a.view(), b.view(), f), a.mesh(), a.device());
  }
}
template <class F, local_tensor_type L>
auto map_linear(F f, const L& x) {
  using T = typename L::value_type;
  using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
  return with_value_t<L, U>(map_view<U, typename L::memory_space>(x.view(), f), x.mesh(), x.device());
}

struct plus_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a + b; }
};
struct minus_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a - b; }
};
struct times_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a * b; }
};
struct divide_fn {
  template <class A, class B>
  KOKKOS_INLINE_FUNCTION auto operator()(const A& a, const B& b) const { return a / b; }
};
template <class S, class Op, bool ScalarLeft>
struct scalar_fn {
  S s;
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(const T& x) const {
    if constexpr (ScalarLeft) return static_cast<T>(Op{}(static_cast<T>(s), x));
    else return static_cast<T>(Op{}(x, static_cast<T>(s)));
  }
};
struct negate_fn {
  template <class T>
  KOKKOS_INLINE_FUNCTION T operator()(const T& x) const { return static_cast<T>(-x); }
};

template <class S, class T>
concept scalar_for = std::is_arithmetic_v<S> && std::is_arithmetic_v<T>;
}  // namespace detail

/// @brief Elementwise sum and difference: linear, so allowed on partial values of the same layout.
template <local_tensor_type A, local_tensor_type B>
auto operator+(const A& a, const B& b) {
  return detail::zip_linear(detail::plus_fn{}, a, b);
}
/// @brief Elementwise difference: linear, so allowed on partial values of the same layout.
template <local_tensor_type A, local_tensor_type B>
auto operator-(const A& a, const B& b) {
  return detail::zip_linear(detail::minus_fn{}, a, b);
}
/// @brief Elementwise product and quotient: not linear in the pair, so not on partial values.
template <local_tensor_type A, local_tensor_type B>
auto operator*(const A& a, const B& b) {
  return zip(detail::times_fn{}, a, b);
}
/// @brief Elementwise quotient: not linear in the pair, so not on partial values.
template <local_tensor_type A, local_tensor_type B>
auto operator/(const A& a, const B& b) {
  return zip(detail::divide_fn{}, a, b);
}
/// @brief Negation: linear, allowed on partial values.
template <local_tensor_type L>
L operator-(const L& x) {
  return detail::map_linear(detail::negate_fn{}, x);
}

/// @brief Scaling by a scalar: linear, allowed on partial values. The result keeps `x`'s element type.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator*(const L& x, S s) {
  return detail::map_linear(detail::scalar_fn<S, detail::times_fn, false>{s}, x);
}
/// @brief Scaling by a scalar on the left: linear, allowed on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator*(S s, const L& x) {
  return detail::map_linear(detail::scalar_fn<S, detail::times_fn, true>{s}, x);
}
/// @brief Division by a scalar: linear, allowed on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator/(const L& x, S s) {
  return detail::map_linear(detail::scalar_fn<S, detail::divide_fn, false>{s}, x);
}
/// @brief Adding a scalar: not linear (it would be added once per part), so not on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator+(const L& x, S s) {
  return map(detail::scalar_fn<S, detail::plus_fn, false>{s}, x);
}
/// @brief Adding a scalar on the left: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator+(S s, const L& x) {
  return map(detail::scalar_fn<S, detail::plus_fn, true>{s}, x);
}
/// @brief Subtracting a scalar: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator-(const L& x, S s) {
  return map(detail::scalar_fn<S, detail::minus_fn, false>{s}, x);
}
/// @brief Subtracting from a scalar: not linear, so not on partial values.
template <local_tensor_type L, class S>
  requires detail::scalar_for<S, typename L::value_type>
L operator-(S s, const L& x) {
  return map(detail::scalar_fn<S, detail::minus_fn, true>{s}, x);
}

// ---- global view --------------------------------------------------------------------------------

/// @brief `f` applied to every element of every local block; the result has `x`'s sharding.
template <class F, sharded_tensor_type X>
auto map(F f, const X& x) {
  using T = typename X::value_type;
  using U = std::remove_cvref_t<std::invoke_result_t<F&, const T&>>;
  using view_u = detail::block_view_t<U, X::rank, typename X::memory_space>;
  std::vector<view_u> out(x.num_devices());
  detail::for_each_device<typename X::memory_space>(x.local_devices(), x.num_devices(), x.size(), [&](std::size_t d) {
    out[d] = detail::map_view<U, typename X::memory_space>(x.local(d), f);
  });
  return detail::rewrap_global<X, U>(x, std::move(out));
}

/// @brief `f(a[i], b[i])` for every element; both tensors must have the same sharding.
template <class F, sharded_tensor_type A, sharded_tensor_type B>
auto zip(F f, const A& a, const B& b) {
  constexpr bool ok = detail::diagnose_zip_global<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
    detail::check_same_global(a, b, "zip");
    using U = std::remove_cvref_t<std::invoke_result_t<F&, const typename A::value_type&, const typename B::value_type&>>;
    using view_u = detail::block_view_t<U, A::rank, typename A::memory_space>;
    std::vector<view_u> out(a.num_devices());
    detail::for_each_device<typename A::memory_space>(a.local_devices(), a.num_devices(), a.size(), [&](std::size_t d) {
      out[d] = detail::zip_view<U, typename A::memory_space>(a.local(d), b.local(d), f);
    });
    return detail::rewrap_global<A, U>(a, std::move(out));
  }
}

template <sharded_tensor_type A, sharded_tensor_type B>
auto operator+(const A& a, const B& b) {
  return zip(detail::plus_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator-(const A& a, const B& b) {
  return zip(detail::minus_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator*(const A& a, const B& b) {
  return zip(detail::times_fn{}, a, b);
}
template <sharded_tensor_type A, sharded_tensor_type B>
auto operator/(const A& a, const B& b) {
  return zip(detail::divide_fn{}, a, b);
}
/// @brief Negation of every element of a sharded tensor.
template <sharded_tensor_type X>
X operator-(const X& x) {
  return map(detail::negate_fn{}, x);
}

#define MESHLIB_DETAIL_GLOBAL_SCALAR_OP(op, fn)                                                     \
  template <sharded_tensor_type X, class S>                                                        \
    requires detail::scalar_for<S, typename X::value_type>                                         \
  X operator op(const X& x, S s) {                                                                 \
    return map(detail::scalar_fn<S, detail::fn, false>{s}, x);                                     \
  }                                                                                                \
  template <sharded_tensor_type X, class S>                                                        \
    requires detail::scalar_for<S, typename X::value_type>                                         \
  X operator op(S s, const X& x) {                                                                 \
    return map(detail::scalar_fn<S, detail::fn, true>{s}, x);                                      \
  }
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(+, plus_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(-, minus_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(*, times_fn)
MESHLIB_DETAIL_GLOBAL_SCALAR_OP(/, divide_fn)
#undef MESHLIB_DETAIL_GLOBAL_SCALAR_OP

}  // namespace meshlib
// end meshlib/tensor/elementwise.hpp
// begin meshlib/tensor/reduce.hpp
/// @file
/// @brief Reductions along one dimension: `sum<D>`, `mean<D>`, `max<D>`, on local values and on
/// global `sharded_tensor`s. The result has rank `Rank - 1`.
///
/// Sharding propagation, local view (inside `shard_map` / `spmd`), when dimension `D` is a block of
/// the axes `a` (its `dims` entry), following what JAX's shard_map gives for the same program:
/// | reduction | local result | to complete it |
/// | --- | --- | --- |
/// | `sum<D>`  | partial over `a` (no longer varying over `a`) | `psum` over `a` |
/// | `mean<D>` | partial over `a`: the local sum divided by the *global* extent of `D`, so that the sum of the parts is the global mean | `psum` over `a` |
/// | `max<D>`  | still varying over `a`: the max of this block only (a max is no sum) | `pmax` over `a` |
/// A dimension not sharded (`a` empty) reduces completely on each device. `sum` and `mean` are
/// linear, so they also accept partial inputs; `max` does not.
/// `mean` of an integer tensor returns `double` (as `jnp.mean` returns a float).
///
/// Global view: the reduction is complete (an "automatic psum"): the result's spec is the input's
/// with dimension `D` removed, so the axes that split `D` now replicate the result. It needs every
/// block of each reduced group in this process (the thread communicator case); otherwise it
/// throws `sharding_error` (use the local view and a collective).
///
/// All loops are meshlib's own (one output element per RangePolicy iteration, the reduced
/// dimension summed in index order): deterministic, and safe from concurrent device threads on
/// Kokkos 3.4.1, whose parallel_reduce is not (see view.hpp).

#include <array>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>


namespace meshlib {

/// The reductions of the local kernels (named apart from the comm layer's `reduce_op`, which
/// `<meshlib.hpp>` also includes).
enum class reduce_kind { sum, max, mean };

namespace detail {

/// `Spec` of a rank-`Rank` array without entry `D`.
template <class Spec, std::size_t Rank, std::size_t D>
constexpr std::array<dim_spec, Rank - 1> remove_spec_entry() {
  std::array<dim_spec, Rank - 1> out{};
  for (std::size_t i = 0; i + 1 < Rank; ++i) out[i] = Spec::dim(i < D ? i : i + 1);
  return out;
}

template <class Dim, class Rank>
consteval bool reduction_over_missing_dim() {
  static_assert(always_false<Dim, Rank>,
                "meshlib: reduction over a dimension the tensor does not have (the dimension and the rank are spelled "
                "out in the condition)");
  return false;
}

template <class Op, class PartialAxes, class Value>
consteval bool max_of_partial_value() {
  static_assert(always_false<Op, PartialAxes, Value>,
                "meshlib: max over a value that is a pending sum over the axes spelled out in the condition: the max "
                "of the parts is not the max of the sum; psum over those axes first");
  return false;
}

/// True when dimension `D` exists; otherwise fires `reduction_over_missing_dim`.
template <std::size_t D, std::size_t Rank>
consteval bool check_reduce_dim() {
  if constexpr (D < Rank) return true;
  else return reduction_over_missing_dim<diagnostic::dim<D>, diagnostic::size<Rank>>();
}

template <class T>
using mean_result_t = std::conditional_t<std::is_floating_point_v<T>, T, double>;

template <reduce_kind Op, class T>
using reduce_result_t = std::conditional_t<Op == reduce_kind::mean, mean_result_t<T>, T>;

template <class T>
KOKKOS_INLINE_FUNCTION constexpr T lowest_of() {
  if constexpr (std::numeric_limits<T>::has_infinity) return -std::numeric_limits<T>::infinity();
  else return std::numeric_limits<T>::lowest();
}

/// One output element per iteration: out[o * inner + j] = reduce over k of in[(o * n + k) * inner + j].
template <reduce_kind Op, class T, class U>
struct reduce_functor {
  const T* in;
  U* out;
  std::size_t n, inner;
  U scale;  // mean: 1 / global extent
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t idx) const {
    const std::size_t o = idx / inner, j = idx % inner;
    const T* p = in + o * n * inner + j;
    if constexpr (Op == reduce_kind::max) {
      T acc = lowest_of<T>();
      for (std::size_t k = 0; k < n; ++k) acc = p[k * inner] > acc ? p[k * inner] : acc;
      out[idx] = acc;
    } else {
      U acc = U{};
      for (std::size_t k = 0; k < n; ++k) acc += static_cast<U>(p[k * inner]);
      out[idx] = Op == reduce_kind::mean ? static_cast<U>(acc * scale) : acc;
    }
  }
};

/// Reduces dimension `D` of `in`; `mean_extent` is the extent `mean` divides by.
template <reduce_kind Op, std::size_t D, class Space, class U = void, class View>
auto reduce_view(const View& in, std::size_t mean_extent) {
  constexpr std::size_t rank = View::rank;
  using T = typename View::value_type;
  using R = std::conditional_t<std::is_void_v<U>, reduce_result_t<Op, T>, U>;
  std::array<std::size_t, rank - 1> shape{};
  std::size_t outer = 1, inner = 1;
  for (std::size_t d = 0; d < rank; ++d) {
    if (d < D) outer *= in.extent(d);
    if (d > D) inner *= in.extent(d);
    if (d != D) shape[d < D ? d : d - 1] = in.extent(d);
  }
  auto out = allocate<R, rank - 1, Space>(shape, "meshlib::reduce", false);
  const R scale = mean_extent == 0 ? R{} : static_cast<R>(R{1} / static_cast<R>(mean_extent));
  launch<Space>(outer * inner, reduce_functor<Op, T, R>{in.data(), out.data(), in.extent(D), inner, scale});
  return out;
}

/// True when reducing dimension `D` of local value `L` with `Op` is allowed; otherwise fires the
/// one diagnostic that says why.
template <reduce_kind Op, std::size_t D, class L>
consteval bool check_reduce_local() {
  if constexpr (!check_reduce_dim<D, L::rank>()) return false;
  else if constexpr (Op == reduce_kind::max && L::partial != 0)
    return max_of_partial_value<diag_op_t<"max">, diag_axes_t<typename L::mesh_type, L::partial>, diag_value_t<L>>();
  else return true;
}

template <reduce_kind Op, std::size_t D, local_tensor_type L>
auto reduce_local(const L& x) {
  if constexpr (!check_reduce_local<Op, D, L>()) {
    return x;  // the diagnostic above has fired
  } else {
  using T = typename L::value_type;
  using U = reduce_result_t<Op, T>;
  constexpr axis_mask a = L::dims_type::at(D);
  constexpr axis_mask vary = Op == reduce_kind::max ? L::vary : (L::vary & ~a);
  constexpr axis_mask partial = Op == reduce_kind::max ? L::partial : (L::partial | a);
  using out_t = rebind_local_t<L, U, L::rank - 1, vary, partial, remove_dim_t<typename L::dims_type, D>>;
  return out_t(reduce_view<Op, D, typename L::memory_space>(x.view(), x.global_extent(D)), x.mesh(), x.device());
  }
}

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global_checked(const X& x);

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global(const X& x) {
  if constexpr (!check_reduce_dim<D, X::rank>()) return x;  // the diagnostic has fired
  else return reduce_global_checked<Op, D>(x);
}

template <reduce_kind Op, std::size_t D, sharded_tensor_type X>
auto reduce_global_checked(const X& x) {
  using S = typename X::sharding_type;
  using mesh_t = typename X::mesh_type;
  using T = typename X::value_type;
  using U = reduce_result_t<Op, T>;
  using out_spec = spec_from_array_t<remove_spec_entry<typename X::spec_type, X::rank, D>()>;
  using out_sharding = named_sharding<mesh_t, out_spec>;
  using space = typename X::memory_space;
  using out_t = sharded_tensor<U, X::rank - 1, out_sharding, space>;
  constexpr axis_mask a = S::dim_mask(D);
  const auto& m = x.mesh();
  const std::size_t n = x.num_devices();
  // Partial results per local device, over its own block.
  using view_u = block_view_t<U, X::rank - 1, space>;
  std::vector<view_u> part(n);
  for_each_device<space>(x.local_devices(), n, x.size(), [&](std::size_t dev) {
    part[dev] = reduce_view<Op == reduce_kind::max ? reduce_kind::max : reduce_kind::sum, D, space, U>(x.local(dev), 0);
  });
  if constexpr (a == 0) {
    if constexpr (Op == reduce_kind::mean) {
      std::vector<view_u> out(n);
      const U scale = x.extent(D) == 0 ? U{} : static_cast<U>(U{1} / static_cast<U>(x.extent(D)));
      for (std::size_t dev : x.local_devices()) {
        out[dev] = part[dev];
        U* p = out[dev].data();
        for (std::size_t i = 0; i < out[dev].span(); ++i) p[i] = static_cast<U>(p[i] * scale);
      }
      part = std::move(out);
    }
    std::vector<bool> local(n);
    for (std::size_t d = 0; d < n; ++d) local[d] = x.is_local(d);
    std::array<std::size_t, X::rank - 1> shape{};
    for (std::size_t d = 0, k = 0; d < X::rank; ++d)
      if (d != D) shape[k++] = x.extent(d);
    return out_t(out_sharding(m, x.sharding().rule()), shape, std::move(part), std::move(local));
  } else {
    // Complete the reduction over each group along `a`, in group-rank order (deterministic).
    std::array<std::size_t, X::rank - 1> shape{};
    for (std::size_t d = 0, k = 0; d < X::rank; ++d)
      if (d != D) shape[k++] = x.extent(d);
    out_t out(out_sharding(m, x.sharding().rule()), shape, std::span<const std::size_t>(x.local_devices()));
    const U scale = x.extent(D) == 0 ? U{} : static_cast<U>(U{1} / static_cast<U>(x.extent(D)));
    for (std::size_t dev : x.local_devices()) {
      U* dst = out.local(dev).data();
      const std::size_t len = out.local(dev).span();
      const auto group = m.group(dev, a);
      bool first = true;
      for (std::size_t g : group) {
        if (!x.is_local(g))
          throw sharding_error("meshlib: global " + std::string(Op == reduce_kind::max ? "max" : Op == reduce_kind::sum ? "sum" : "mean") +
                               " over dimension " + std::to_string(D) + " of " + x.to_string() + " needs device " +
                               std::to_string(g) + "'s block, which is not local; reduce in the local view and complete with a collective");
        const U* src = part[g].data();
        if (x.local_shape(g)[D] == 0) continue;  // an empty block (uneven rule) contributes nothing
        for (std::size_t i = 0; i < len; ++i) {
          if (first) dst[i] = src[i];
          else if constexpr (Op == reduce_kind::max) dst[i] = src[i] > dst[i] ? src[i] : dst[i];
          else dst[i] += src[i];
        }
        first = false;
      }
      if (first && Op == reduce_kind::max)
        for (std::size_t i = 0; i < len; ++i) dst[i] = lowest_of<U>();
      if constexpr (Op == reduce_kind::mean)
        for (std::size_t i = 0; i < len; ++i) dst[i] = static_cast<U>(dst[i] * scale);
    }
    return out;
  }
}

}  // namespace detail

/// @brief Sum over dimension `D` (local view: partial over `D`'s axes; global view: complete).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto sum(const X& x) {
  if constexpr (local_tensor_type<X>) return detail::reduce_local<reduce_kind::sum, D>(x);
  else return detail::reduce_global<reduce_kind::sum, D>(x);
}

/// @brief Mean over dimension `D` (local view: partial over `D`'s axes, scaled by the global extent).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto mean(const X& x) {
  if constexpr (local_tensor_type<X>) return detail::reduce_local<reduce_kind::mean, D>(x);
  else return detail::reduce_global<reduce_kind::mean, D>(x);
}

/// @brief Max over dimension `D` (local view: the block's max, still varying over `D`'s axes: pmax completes it).
template <std::size_t D, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto max(const X& x) {
  if constexpr (local_tensor_type<X>) return detail::reduce_local<reduce_kind::max, D>(x);
  else return detail::reduce_global<reduce_kind::max, D>(x);
}

}  // namespace meshlib
// end meshlib/tensor/reduce.hpp
// begin meshlib/tensor/transpose.hpp
/// @file
/// @brief `transpose`: `transpose(x)` swaps the two dimensions of a rank-2 tensor;
/// `transpose<P0, P1, ...>(x)` permutes the dimensions of any rank as `np.transpose(x, axes)`
/// (result dimension `i` is input dimension `Pi`). Sharding propagation: dimensions carry their
/// sharding with them (local view: `dims` permuted, vary and partial unchanged; global view: the
/// spec entries permuted, `P<"data", none>` becomes `P<none, "data">`). No data moves between devices.

#include <array>
#include <cstddef>
#include <vector>


namespace meshlib {

namespace detail {

template <class T>
struct transpose_functor {
  const T* in;
  T* out;
  std::size_t rows, cols;  // of `in`
  static constexpr std::size_t tile = 32;
  // One iteration per tile of `in`, so reads and writes both stay in cache.
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t t) const {
    const std::size_t tiles_c = (cols + tile - 1) / tile;
    const std::size_t r0 = (t / tiles_c) * tile, c0 = (t % tiles_c) * tile;
    const std::size_t r1 = r0 + tile < rows ? r0 + tile : rows, c1 = c0 + tile < cols ? c0 + tile : cols;
    for (std::size_t r = r0; r < r1; ++r)
      for (std::size_t c = c0; c < c1; ++c) out[c * rows + r] = in[r * cols + c];
  }
};

template <class Space, class View>
auto transpose_view(const View& in) {
  using T = typename View::value_type;
  const std::size_t rows = in.extent(0), cols = in.extent(1);
  auto out = allocate<T, 2, Space>({cols, rows}, "meshlib::transpose", false);
  constexpr std::size_t tile = transpose_functor<T>::tile;
  launch<Space>(((rows + tile - 1) / tile) * ((cols + tile - 1) / tile), transpose_functor<T>{in.data(), out.data(), rows, cols});
  return out;
}

template <class Op, class Rank>
consteval bool transpose_needs_rank_2() {
  static_assert(always_false<Op, Rank>,
                "meshlib: transpose(x) without indices swaps the two dimensions of a rank-2 tensor; for other ranks "
                "name the permutation: transpose<1, 0, 2>(x) (the rank is spelled out in the condition)");
  return false;
}

/// Result element `i` (row-major over the output) reads input offset sum_d idx_d * stride[d], where
/// `stride[d]` is the input stride of the input dimension that output dimension `d` comes from.
template <class T, std::size_t R>
struct permute_functor {
  const T* in;
  T* out;
  std::array<std::size_t, R> out_extent;
  std::array<std::size_t, R> stride;
  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    std::size_t rem = i, off = 0;
    for (std::size_t d = R; d-- > 0;) {
      off += (rem % out_extent[d]) * stride[d];
      rem /= out_extent[d];
    }
    out[i] = in[off];
  }
};

template <auto Perm>
consteval bool is_permutation() {
  for (std::size_t i = 0; i < Perm.size(); ++i) {
    if (Perm[i] >= Perm.size()) return false;
    for (std::size_t j = i + 1; j < Perm.size(); ++j)
      if (Perm[i] == Perm[j]) return false;
  }
  return true;
}

template <class Op, class Rank, class... Indices>
consteval bool transpose_needs_a_permutation() {
  static_assert(always_false<Op, Rank, Indices...>,
                "meshlib: transpose<P...>: the indices must be a permutation of 0 .. rank-1, one per dimension (the "
                "rank and the indices are spelled out in the condition)");
  return false;
}

template <class Space, std::size_t... Perm, class View>
auto permute_view(const View& in) {
  using T = typename View::non_const_value_type;
  constexpr std::size_t R = View::rank;
  constexpr std::array<std::size_t, R> perm{Perm...};
  std::array<std::size_t, R> in_stride{}, out_extent{}, stride{};
  std::size_t st = 1;
  for (std::size_t d = R; d-- > 0;) {
    in_stride[d] = st;
    st *= in.extent(d);
  }
  for (std::size_t d = 0; d < R; ++d) {
    out_extent[d] = in.extent(perm[d]);
    stride[d] = in_stride[perm[d]];
  }
  auto out = allocate<T, R, Space>(out_extent, "meshlib::transpose", false);
  launch<Space>(in.span(), permute_functor<T, R>{in.data(), out.data(), out_extent, stride});
  return out;
}

}  // namespace detail

/// @brief `x` with its dimensions permuted (`transpose<1, 0, 2>(x)`), or, with no indices, the
/// transpose of a rank-2 `x`. Local values and sharded tensors alike.
template <std::size_t... Perm, class X>
  requires(local_tensor_type<X> || sharded_tensor_type<X>)
auto transpose(const X& x) {
  if constexpr (sizeof...(Perm) == 0) {
    if constexpr (X::rank != 2) return detail::transpose_needs_rank_2<detail::diag_op_t<"transpose">, diagnostic::size<X::rank>>(), x;
    else return transpose<1, 0>(x);
  } else if constexpr (sizeof...(Perm) != X::rank ||
                       !detail::is_permutation<std::array<std::size_t, sizeof...(Perm)>{Perm...}>()) {
    // the diagnostic fires; x is returned so that the caller sees one error only
    return detail::transpose_needs_a_permutation<detail::diag_op_t<"transpose">, diagnostic::size<X::rank>,
                                                 diagnostic::dim<Perm>...>(),
           x;
  } else {
    constexpr std::array<std::size_t, X::rank> perm{Perm...};
    using space = typename X::memory_space;
    auto kernel = [](const auto& v) {
      if constexpr (X::rank == 2 && std::array<std::size_t, X::rank>{Perm...}[0] == 1) return detail::transpose_view<space>(v);  // cache-tiled
      else return detail::permute_view<space, Perm...>(v);
    };
    if constexpr (local_tensor_type<X>) {
      using out_t = with_dims_t<X, permute_dims_t<typename X::dims_type, perm>>;
      return out_t(kernel(x.view()), x.mesh(), x.device());
    } else {
      using spec = typename X::spec_type;
      using out_spec = detail::spec_from_array_t<std::array<dim_spec, X::rank>{spec::dim(Perm)...}>;
      using out_sharding = named_sharding<typename X::mesh_type, out_spec>;
      using out_t = sharded_tensor<typename X::value_type, X::rank, out_sharding, space>;
      std::vector<typename out_t::view_type> blocks(x.num_devices());
      std::vector<bool> local(x.num_devices());
      detail::for_each_device<space>(x.local_devices(), x.num_devices(), x.size(), [&](std::size_t d) { blocks[d] = kernel(x.local(d)); });
      for (std::size_t d : x.local_devices()) local[d] = true;
      typename out_t::shape_type shape{};
      for (std::size_t d = 0; d < X::rank; ++d) shape[d] = x.extent(perm[d]);
      return out_t(out_sharding(x.mesh(), x.sharding().rule()), shape, std::move(blocks), std::move(local));
    }
  }
}

}  // namespace meshlib
// end meshlib/tensor/transpose.hpp
// begin meshlib/tensor/matmul_into.hpp
/// @file
/// @brief `matmul_into`: `C = alpha * op(A) * op(B) + beta * C` on rank-2 Kokkos views that the
/// caller owns, the product kernel under `matmul` and the training layer.
///
/// Why a product into a caller's buffer: a training step multiplies the same shapes every
/// iteration, so it keeps its output blocks instead of allocating one per product (as `matmul`
/// does), accumulates gradients with `beta = 1`, and gets the backward pass's `x^T dy` and `dy W^T`
/// from the transpose flags without materialising a transpose (BLAS reads the operand transposed).
///
/// Kernel: `KokkosBlas::gemm` when meshlib has Kokkos Kernels for the element type and memory
/// space (`use_blas_v`: `float` / `double` in host-accessible memory; Debian's build calls the BLAS
/// TPL, OpenBLAS) and the three views share a LayoutRight or LayoutLeft layout; otherwise meshlib's
/// own Kokkos kernel, a RangePolicy `parallel_for` on the given execution-space instance: over the
/// rows of `C` on a host (`matmul_into_functor`), over its elements on a GPU
/// (`matmul_into_element_functor`: coalesced, every thread busy). RangePolicy only, over raw pointers: safe from concurrent device
/// threads on Kokkos 3.4.1 (tensor/view.hpp), where Kokkos Kernels' own team-policy fallback is not.
///
/// The edge cases are BLAS's, decided here so both kernels agree: `beta == 0` overwrites `C`
/// without reading it (garbage or NaN in `C` is ignored); `k == 0` or `alpha == 0` gives
/// `beta * C` without reading `A` or `B` (Kokkos Kernels 3.4.1 returns early on `k == 0`, leaving
/// `C` unscaled, so that case never reaches it); an empty `C` does nothing.
///
/// BLAS threads: with one thread per device, a multi-threaded BLAS inside every device would
/// oversubscribe the cores. The first BLAS product therefore sets OpenBLAS to one thread per call
/// (`openblas_set_num_threads`, looked up with `dlsym`, so nothing is required at link time), unless
/// `set_blas_threads_per_device(n)` was called first or `MESHLIB_BLAS_THREADS=n` is set.
/// @code
/// // the backward of y = x W: dW = x^T dy (accumulated), dx = dy W^T
/// meshlib::matmul_into(dw, x, dy, {.transpose_a = true, .beta = 1});
/// meshlib::matmul_into(dx, dy, w, {.transpose_b = true});
/// @endcode

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <mutex>
#include <string>
#include <type_traits>

#include <dlfcn.h>

#include <Kokkos_Core.hpp>


#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
#include <KokkosBlas3_gemm.hpp>
#endif

namespace meshlib {

/// @brief The name of the Kokkos profiling region around each matrix product that the BLAS makes
/// (`matmul_into`, and so `matmul` and the nn layers): Kokkos tools see no kernel launch for it,
/// since the BLAS is not Kokkos. A product that runs as meshlib's own kernel is a Kokkos
/// `parallel_for` instead, and has no such region. `launch_counter` counts the regions.
inline constexpr const char* blas_product_region = "meshlib::matmul_into[BLAS]";

namespace detail {

inline std::atomic<bool>& blas_threads_chosen() {
  static std::atomic<bool> chosen{false};
  return chosen;
}

/// OpenBLAS's `openblas_set_num_threads`, when an OpenBLAS is loaded in the process.
inline void (*openblas_setter())(int) {
  static void (*fn)(int) = reinterpret_cast<void (*)(int)>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  return fn;
}

}  // namespace detail

/// @brief Sets how many threads the BLAS uses inside one device's `matmul` (process-wide: OpenBLAS
/// has one setting). Call it before the device threads start.
/// @returns whether an OpenBLAS was found to apply it to.
inline bool set_blas_threads_per_device(int threads) {
  detail::blas_threads_chosen() = true;
  if (auto fn = detail::openblas_setter()) {
    fn(threads < 1 ? 1 : threads);
    return true;
  }
  return false;
}

namespace detail {

/// Applies the default of one BLAS thread per device once, unless the user chose.
inline void ensure_blas_threads() {
  static std::once_flag once;
  std::call_once(once, [] {
    if (blas_threads_chosen()) return;
    int n = 1;
    if (const char* env = std::getenv("MESHLIB_BLAS_THREADS")) n = std::atoi(env);
    set_blas_threads_per_device(n);
  });
}

/// Whether the BLAS may be used at all: not when `MESHLIB_NO_BLAS=1` is set, which makes every
/// product on a host run meshlib's own kernel (the same bits on every machine, and a GPU built with
/// `--fmad=false`'s: the reference runs of scripts/gpu-check.sh). Read once.
inline bool blas_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("MESHLIB_NO_BLAS");
    return v == nullptr || std::string(v) != "1";
  }();
  return allowed;
}

/// Shows a product that a library outside Kokkos makes (the BLAS) to Kokkos tools as the profiling
/// region `blas_product_region` for as long as it lives, because Kokkos tools see only Kokkos' own
/// launches: `launch_counter` (debug/launch_counter.hpp) counts the products by it, a timeline tool
/// shows their time. One check of a flag when no tool is loaded.
class blas_product_scope {
 public:
  blas_product_scope() : on_(Kokkos::Profiling::profileLibraryLoaded()) {
    if (on_) Kokkos::Profiling::pushRegion(blas_product_region);
  }
  ~blas_product_scope() {
    if (on_) Kokkos::Profiling::popRegion();
  }
  blas_product_scope(const blas_product_scope&) = delete;
  blas_product_scope& operator=(const blas_product_scope&) = delete;

 private:
  bool on_;
};

/// Whether products of `T` in memory `Space` go to `KokkosBlas::gemm` (see the file comment).
template <class T, class Space>
inline constexpr bool use_blas_v =
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
    (std::is_same_v<T, float> || std::is_same_v<T, double>) && host_accessible_v<Space>;
#else
    false;
#endif

/// meshlib's product kernel: one row `i` of `C` per iteration. Every operand is a pointer and two
/// strides, so a transpose is only a swap of strides: `op(A)(i, p) = a[i * a_i + p * a_p]`,
/// `op(B)(p, j) = b[p * b_p + j * b_j]`, `C(i, j) = c[i * c_i + j * c_j]`.
/// Two loop orders: when `op(B)` and `C` rows are unit-stride (no transpose of B, row-major), the
/// i-p-j order (an axpy per `p`, vectorisable); otherwise (`op(B) = B^T`) a dot product per `(i, j)`,
/// unit-stride along `p` on both sides for row-major `A` and `B`.
template <class T>
struct matmul_into_functor {
  const T* a;
  const T* b;
  T* c;
  std::size_t a_i, a_p, b_p, b_j, c_i, c_j;
  std::size_t n, k;  // k == 0: only C = beta * C
  T alpha, beta;

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t i) const {
    T* ci = c + i * c_i;
    if (beta == T{0}) {
      for (std::size_t j = 0; j < n; ++j) ci[j * c_j] = T{0};
    } else if (beta != T{1}) {
      for (std::size_t j = 0; j < n; ++j) ci[j * c_j] *= beta;
    }
    if (k == 0) return;
    const T* ai = a + i * a_i;
    if (b_j == 1 && c_j == 1) {
      for (std::size_t p = 0; p < k; ++p) {
        const T aip = alpha * ai[p * a_p];
        const T* bp = b + p * b_p;
        for (std::size_t j = 0; j < n; ++j) ci[j] += aip * bp[j];
      }
    } else {
      for (std::size_t j = 0; j < n; ++j) {
        const T* bj = b + j * b_j;
        T s{0};
        for (std::size_t p = 0; p < k; ++p) s += ai[p * a_p] * bj[p * b_p];
        ci[j * c_j] += alpha * s;
      }
    }
  }
};

/// meshlib's product kernel on a GPU: one output element `(i, j)` per work item, `j` fastest, so
/// that the threads of a warp read one row of `op(B)` and write one row of `C` in consecutive
/// addresses and share their `op(A)` element (the row kernel above gives each thread a row of `C`
/// of its own: a warp's accesses are `n` elements apart, and one thread per row leaves all but a
/// few hundred of a GPU's threads idle). Each element is computed with the row kernel's operations
/// in the row kernel's order (`beta` first, then one `+= (alpha a) b` per `p`; or a dot product added
/// once), so a GPU built without contracted multiply-adds (nvcc `--fmad=false`) gives the host
/// kernel's bits: what scripts/gpu-check.sh compares (`MESHLIB_NO_BLAS=1` on the CPU side).
template <class T>
struct matmul_into_element_functor {
  matmul_into_functor<T> op;  ///< the operands, strides and scalars, as the row kernel has them

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t e) const {
    const std::size_t i = e / op.n, j = e % op.n;
    T& cij = op.c[i * op.c_i + j * op.c_j];
    T v = op.beta == T{0} ? T{0} : (op.beta == T{1} ? cij : cij * op.beta);
    if (op.k != 0) {
      const T* ai = op.a + i * op.a_i;
      if (op.b_j == 1 && op.c_j == 1) {  // the row kernel's i-p-j order
        for (std::size_t p = 0; p < op.k; ++p) v += (op.alpha * ai[p * op.a_p]) * op.b[p * op.b_p + j];
      } else {  // its dot product
        const T* bj = op.b + j * op.b_j;
        T s{0};
        for (std::size_t p = 0; p < op.k; ++p) s += ai[p * op.a_p] * bj[p * op.b_p];
        v += op.alpha * s;
      }
    }
    cij = v;
  }
};

/// `(r, c)` for a message.
inline std::string shape_text(std::size_t r, std::size_t c) {
  return "(" + std::to_string(r) + ", " + std::to_string(c) + ")";
}

/// Throws when `op(A) . op(B)` does not chain or does not fit `C` (see `matmul_into`).
template <class VC, class VA, class VB>
void check_matmul_into_shapes(const VC& c, const VA& a, const VB& b, bool ta, bool tb) {
  const std::size_t m = ta ? a.extent(1) : a.extent(0), k = ta ? a.extent(0) : a.extent(1);
  const std::size_t k2 = tb ? b.extent(1) : b.extent(0), n = tb ? b.extent(0) : b.extent(1);
  if (k == k2 && c.extent(0) == m && c.extent(1) == n) return;
  const std::string operands = "op(A) . op(B) with A " + shape_text(a.extent(0), a.extent(1)) +
                               (ta ? " transposed" : " not transposed") + " and B " +
                               shape_text(b.extent(0), b.extent(1)) + (tb ? " transposed" : " not transposed") + " is " +
                               shape_text(m, k) + " . " + shape_text(k2, n);
  if (k != k2)
    throw sharding_error("meshlib: matmul_into: " + operands + ": the contraction sizes " + std::to_string(k) + " and " +
                         std::to_string(k2) + " differ; check the operands' shapes and the transpose flags");
  throw sharding_error("meshlib: matmul_into: " + operands + " = " + shape_text(m, n) + ", but C is " +
                       shape_text(c.extent(0), c.extent(1)) + "; pass a C of shape " + shape_text(m, n));
}

template <class V>
inline constexpr bool blas_layout_v =
    std::is_same_v<typename V::array_layout, Kokkos::LayoutRight> || std::is_same_v<typename V::array_layout, Kokkos::LayoutLeft>;

/// meshlib's kernel on `exec` (no BLAS), after the shapes were checked: also what tests call to
/// exercise it for types that do have a BLAS.
template <class Exec, class VC, class VA, class VB>
void matmul_into_kernel(const Exec& exec, const VC& c, const VA& a, const VB& b, bool ta, bool tb,
                        typename VC::non_const_value_type alpha, typename VC::non_const_value_type beta) {
  using T = typename VC::non_const_value_type;
  const std::size_t m = c.extent(0), n = c.extent(1), k = alpha == T{0} ? 0 : (ta ? a.extent(0) : a.extent(1));
  if (m == 0 || n == 0) return;
  matmul_into_functor<T> f{a.data(),
                           b.data(),
                           c.data(),
                           ta ? a.stride(1) : a.stride(0),
                           ta ? a.stride(0) : a.stride(1),
                           tb ? b.stride(1) : b.stride(0),
                           tb ? b.stride(0) : b.stride(1),
                           c.stride(0),
                           c.stride(1),
                           n,
                           k,
                           alpha,
                           beta};
  if constexpr (host_accessible_v<typename Exec::memory_space>) launch_on(exec, m, f);
  else launch_on(exec, m * n, matmul_into_element_functor<T>{f});
}

}  // namespace detail

/// @brief The options of `matmul_into`: the transpose of each operand, and `alpha`, `beta`
/// (converted to the element type). Designated initialisers name what a positional BLAS call hides
/// (`{.transpose_a = true, .beta = 1}`); the scalars are `double`, not the element type, so that one
/// non-template struct serves every type (exact for the values products use: 0, 1, integers).
struct matmul_into_options {
  bool transpose_a = false;  ///< `op(A) = A^T` (`A` stored `k x m`)
  bool transpose_b = false;  ///< `op(B) = B^T` (`B` stored `n x k`)
  double alpha = 1;          ///< scales the product
  double beta = 0;           ///< scales `C`'s previous contents; 0: `C` is not read
};

/// @brief `C = alpha * op(A) * op(B) + beta * C` on `exec` (see the file comment for the kernel and
/// the edge cases). `op(A)` is `m x k`, `op(B)` is `k x n`, `C` is `m x n`; any rank-2 views of one
/// element type, in a memory space `exec` can access (`A` and `B` may be views of `const`).
/// @pre `C` overlaps neither `A` nor `B`.
/// @post `C` holds the result when the call returns (host spaces; a device kernel is fenced).
/// @throws sharding_error naming the three shapes and the transposes when the contraction sizes
/// differ or `C`'s shape is not `m x n`.
template <class Exec, class VC, class VA, class VB>
  requires(Kokkos::is_execution_space<Exec>::value && Kokkos::is_view<VC>::value && Kokkos::is_view<VA>::value &&
           Kokkos::is_view<VB>::value)
void matmul_into(const Exec& exec, const VC& c, const VA& a, const VB& b, const matmul_into_options& o = {}) {
  using T = typename VC::non_const_value_type;
  using space = typename VC::memory_space;
  static_assert(VA::rank == 2 && VB::rank == 2 && VC::rank == 2, "meshlib: matmul_into needs three rank-2 views");
  static_assert(std::is_same_v<typename VA::non_const_value_type, T> && std::is_same_v<typename VB::non_const_value_type, T>,
                "meshlib: matmul_into: A, B and C must have the same element type");
  static_assert(std::is_same_v<typename VC::value_type, T>, "meshlib: matmul_into: C must be writable (not a view of const)");
  using entry = detail::diag_op_t<"matmul_into">;
  constexpr bool accessible = require_accessible<entry, detail::diag_op_t<"C">, Exec, space>() &&
                              require_accessible<entry, detail::diag_op_t<"A">, Exec, typename VA::memory_space>() &&
                              require_accessible<entry, detail::diag_op_t<"B">, Exec, typename VB::memory_space>();
  if constexpr (accessible) {
    detail::check_matmul_into_shapes(c, a, b, o.transpose_a, o.transpose_b);
    // The views' types say device memory; their pointers may still be host memory (a view wrapped
    // around a host buffer): asked at run time where the space has a pointer query (pointer_check.hpp).
    check_device_readable<space>(c.data(), "matmul_into", "C");
    check_device_readable<typename VA::memory_space>(a.data(), "matmul_into", "A");
    check_device_readable<typename VB::memory_space>(b.data(), "matmul_into", "B");
    const T alpha = static_cast<T>(o.alpha), beta = static_cast<T>(o.beta);
    const std::size_t k = o.transpose_a ? a.extent(0) : a.extent(1);
    if constexpr (detail::use_blas_v<T, space> && std::is_same_v<typename VA::memory_space, space> &&
                  std::is_same_v<typename VB::memory_space, space> &&
                  std::is_same_v<typename VA::array_layout, typename VC::array_layout> &&
                  std::is_same_v<typename VB::array_layout, typename VC::array_layout> && detail::blas_layout_v<VC>) {
      if (c.extent(0) == 0 || c.extent(1) == 0) return;
      if (k == 0 || alpha == T{0} || !detail::blas_allowed())
        return detail::matmul_into_kernel(exec, c, a, b, o.transpose_a, o.transpose_b, alpha, beta);
#if defined(MESHLIB_ENABLE_KOKKOS_KERNELS) && MESHLIB_ENABLE_KOKKOS_KERNELS
      detail::ensure_blas_threads();
      // Unmanaged: no reference count is touched, so any device thread may call this (tensor/view.hpp).
      using layout = typename VC::array_layout;
      using um = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
      const Kokkos::View<const T**, layout, space, um> av = a;
      const Kokkos::View<const T**, layout, space, um> bv = b;
      const Kokkos::View<T**, layout, space, um> cv = c;
      const char* ta = o.transpose_a ? "T" : "N";
      const char* tb = o.transpose_b ? "T" : "N";
      const detail::blas_product_scope region;
#if KOKKOS_VERSION >= 40000
      if constexpr (std::is_same_v<Exec, typename space::execution_space>) KokkosBlas::gemm(exec, ta, tb, alpha, av, bv, beta, cv);
      else KokkosBlas::gemm(ta, tb, alpha, av, bv, beta, cv);
#else
      KokkosBlas::gemm(ta, tb, alpha, av, bv, beta, cv);  // Kokkos Kernels 3.x has no instance overload
#endif
#endif
    } else {
      detail::matmul_into_kernel(exec, c, a, b, o.transpose_a, o.transpose_b, alpha, beta);
    }
  }
}

/// @brief `matmul_into` on the running device's execution-space instance (inside `spmd` /
/// `shard_map`), else the default instance of `C`'s memory space.
template <class VC, class VA, class VB>
  requires(Kokkos::is_view<VC>::value && Kokkos::is_view<VA>::value && Kokkos::is_view<VB>::value)
void matmul_into(const VC& c, const VA& a, const VB& b, const matmul_into_options& o = {}) {
  matmul_into(detail::current_exec<typename VC::memory_space>(), c, a, b, o);
}

}  // namespace meshlib
// end meshlib/tensor/matmul_into.hpp
// begin meshlib/tensor/matmul.hpp
/// @file
/// @brief `matmul` of rank-2 tensors with GSPMD's sharding rules, on local values and on global
/// `sharded_tensor`s.
///
/// For `C = A . B` with `A` split as `P<r, k>` and `B` as `P<k2, c>`:
/// | case | requirement | result |
/// | --- | --- | --- |
/// | batch (rows) sharded x replicated | `k == k2 == none` | `P<r, c>`, no communication |
/// | column-sharded weights | `B = P<none, c>` | columns sharded over `c` |
/// | contraction sharded on both sides | `k == k2` (same axes, same order) | local view: partial over `k` (complete with `psum`, or `psum_scatter` to get it sharded); global view: summed, replicated over `k` |
/// | contraction sharded differently | `k != k2` | does not compile: reshard one side |
/// | one axis on both output dimensions | `r` and `c` share an axis | does not compile |
/// Local view only: a pending sum times a value is a pending sum (matmul is linear in each side),
/// unless the other side varies over (or is partial over) the same axis: that does not compile.
///
/// Kernel: `matmul_into` (tensor/matmul_into.hpp) into a fresh block: `KokkosBlas::gemm` for
/// `float` / `double` when meshlib is built with Kokkos Kernels, otherwise meshlib's own Kokkos
/// kernel; it also sets the BLAS to one thread per device (`set_blas_threads_per_device`).

#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <vector>


namespace meshlib {

namespace detail {

/// C = A . B for row-major blocks, into a fresh view (`matmul_into` with `beta = 0` writes every
/// element, so the block is not zero-filled first).
template <class Space, class VA, class VB>
auto gemm_view(const VA& a, const VB& b) {
  using T = typename VA::non_const_value_type;
  const std::size_t m = a.extent(0), k = a.extent(1), n = b.extent(1);
  if (b.extent(0) != k)
    throw sharding_error("meshlib: matmul: local blocks of shapes (" + std::to_string(m) + ", " + std::to_string(k) +
                         ") and (" + std::to_string(b.extent(0)) + ", " + std::to_string(n) +
                         ") do not chain; the contraction dimensions differ in size");
  auto c = allocate<T, 2, Space>({m, n}, "meshlib::matmul", /*zero=*/false);
  matmul_into(unmanaged(c), unmanaged(a), unmanaged(b));
  return c;
}

// ---- diagnostics --------------------------------------------------------------------------------
// Each is a function whose one static_assert names, in its failing condition, the axes or specs at
// fault spelled out with axis names (core/diagnostics.hpp): one error on GCC and Clang.

template <class LhsContractionAxes, class RhsContractionAxes>
consteval bool matmul_contraction_sharded_differently() {
  static_assert(always_false<LhsContractionAxes, RhsContractionAxes>,
                "meshlib: matmul: the contraction dimension must be sharded over the same mesh axes on both sides, "
                "but lhs dimension 1 and rhs dimension 0 are sharded over the axes spelled out in the condition "
                "(lhs, rhs); reshard (or all_gather) one operand so that they match");
  return false;
}

template <class SharedAxes>
consteval bool matmul_output_dims_share_an_axis() {
  static_assert(always_false<SharedAxes>,
                "meshlib: matmul: the same mesh axis would shard both the rows (lhs dimension 0) and the columns "
                "(rhs dimension 1) of the result (the axis is spelled out in the condition); reshard one operand "
                "to replicate that dimension");
  return false;
}

template <class Axes>
consteval bool matmul_of_partial_value() {
  static_assert(always_false<Axes>,
                "meshlib: matmul: one operand is a pending sum over the axes spelled out in the condition and the "
                "other varies over (or is also partial over) them, so the product is not a pending sum of anything; "
                "psum the partial operand first");
  return false;
}

template <class LhsSpec, class RhsSpec>
consteval bool matmul_incompatible_shardings() {
  static_assert(always_false<LhsSpec, RhsSpec>,
                "meshlib: matmul: incompatible shardings: the contraction dimension (lhs dimension 1, rhs dimension "
                "0) must be sharded over the same mesh axes on both sides, and no axis may shard both output "
                "dimensions (the specs are spelled out in the condition); reshard one operand with "
                "meshlib::reshard<Spec>(x) first");
  return false;
}

template <class Op, class LhsRank, class RhsRank>
consteval bool matmul_needs_rank_2() {
  static_assert(always_false<Op, LhsRank, RhsRank>, "meshlib: matmul needs two rank-2 operands");
  return false;
}

template <class Op, class LhsMesh, class RhsMesh>
consteval bool matmul_of_different_meshes() {
  static_assert(always_false<Op, LhsMesh, RhsMesh>, "meshlib: matmul of operands over different mesh types");
  return false;
}

template <class Op, class LhsType, class RhsType>
consteval bool matmul_of_different_element_types() {
  static_assert(always_false<Op, LhsType, RhsType>, "meshlib: matmul operands must have the same element type");
  return false;
}

/// The checks both views share: ranks, mesh and element type.
template <class A, class B>
consteval bool diagnose_matmul_operands() {
  using op_t = diag_op_t<"matmul">;
  if constexpr (A::rank != 2 || B::rank != 2)
    return matmul_needs_rank_2<op_t, diagnostic::size<A::rank>, diagnostic::size<B::rank>>();
  else if constexpr (!std::is_same_v<typename A::mesh_type, typename B::mesh_type>)
    return matmul_of_different_meshes<op_t, typename A::mesh_type, typename B::mesh_type>();
  else if constexpr (!std::is_same_v<typename A::value_type, typename B::value_type>)
    return matmul_of_different_element_types<op_t, typename A::value_type, typename B::value_type>();
  else return true;
}

template <class A, class B>
consteval bool diagnose_matmul_local() {
  if constexpr (!diagnose_matmul_operands<A, B>()) {
    return false;
  } else {
    using M = typename A::mesh_type;
    constexpr axis_mask a1 = A::dims_type::at(1), b0 = B::dims_type::at(0);
    constexpr axis_mask shared = A::dims_type::at(0) & B::dims_type::at(1);
    constexpr axis_mask bad_partial = (A::partial & B::partial) | (A::partial & B::vary) | (B::partial & A::vary);
    if constexpr (a1 != b0) return matmul_contraction_sharded_differently<diag_axes_t<M, a1>, diag_axes_t<M, b0>>();
    else if constexpr (shared != 0) return matmul_output_dims_share_an_axis<diag_axes_t<M, shared>>();
    else if constexpr (bad_partial != 0) return matmul_of_partial_value<diag_axes_t<M, bad_partial>>();
    else return true;
  }
}

template <class A, class B>
consteval bool diagnose_matmul_global() {
  if constexpr (!diagnose_matmul_operands<A, B>()) {
    return false;
  } else {
    using SA = typename A::spec_type;
    using SB = typename B::spec_type;
    using shA = typename A::sharding_type;
    using shB = typename B::sharding_type;
    if constexpr (SA::dim(1) == SB::dim(0) && (shA::dim_mask(0) & shB::dim_mask(1)) == 0) return true;
    else return matmul_incompatible_shardings<diag_spec_t<SA>, diag_spec_t<SB>>();
  }
}

}  // namespace detail

/// @brief The product of two rank-2 local values (see the file comment for the result's layout).
template <local_tensor_type A, local_tensor_type B>
auto matmul(const A& a, const B& b) {
  constexpr bool ok = detail::diagnose_matmul_local<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
  constexpr axis_mask partial = A::partial | B::partial | A::dims_type::at(1);
  constexpr axis_mask vary = (A::vary | B::vary) & ~partial;
  using out_t = rebind_local_t<A, typename A::value_type, 2, vary, partial,
                               dim_masks<A::dims_type::at(0), B::dims_type::at(1)>>;
  return out_t(detail::gemm_view<typename A::memory_space>(a.view(), b.view()), a.mesh(), a.device());
  }
}

/// @brief The product of two rank-2 sharded tensors: spec `P<r, k> . P<k, c> = P<r, c>`, the
/// contraction over `k`'s axes completed (summed over each group, in group-rank order).
template <sharded_tensor_type A, sharded_tensor_type B>
auto matmul(const A& a, const B& b) {
  constexpr bool ok = detail::diagnose_matmul_global<A, B>();
  if constexpr (!ok) {
    return;  // the diagnostic above has fired
  } else {
  using T = typename A::value_type;
  using SA = typename A::spec_type;
  using SB = typename B::spec_type;
  using M = typename A::mesh_type;
  using space = typename A::memory_space;
  using out_spec = detail::spec_from_array_t<std::array<dim_spec, 2>{SA::dim(0), SB::dim(1)}>;
  using out_sharding = named_sharding<M, out_spec>;
  using out_t = sharded_tensor<T, 2, out_sharding, space>;
  constexpr axis_mask c = A::sharding_type::dim_mask(1);
  if (!(a.mesh() == b.mesh()) || a.sharding().rule() != b.sharding().rule() || a.extent(1) != b.extent(0))
    throw sharding_error("meshlib: matmul: " + a.to_string() + " and " + b.to_string() +
                         " need the same mesh sizes and shard rule and a common contraction size");
  const std::size_t n = a.num_devices();
  std::vector<typename out_t::view_type> prod(n);
  std::vector<bool> local(n);
  for (std::size_t dev : a.local_devices()) {
    if (!b.is_local(dev))
      throw sharding_error("meshlib: matmul: device " + std::to_string(dev) + " holds a block of the lhs but not of the rhs");
    local[dev] = true;
  }
  // Every device's block product at once, each on its own instance (for_each_device.hpp).
  const std::size_t flops = a.extent(0) * a.extent(1) * b.extent(1);
  detail::for_each_device<space>(a.local_devices(), n, flops, [&](std::size_t dev) {
    prod[dev] = detail::gemm_view<space>(a.local(dev), b.local(dev));
  });
  out_sharding s(a.mesh(), a.sharding().rule());
  if constexpr (c == 0) {
    return out_t(s, {a.extent(0), b.extent(1)}, std::move(prod), std::move(local));
  } else {
    std::vector<typename out_t::view_type> sum(n);
    for (std::size_t dev : a.local_devices())
      for (std::size_t g : a.mesh().group(dev, c))
        if (!local[g])
          throw sharding_error("meshlib: matmul: completing the contraction over " + describe_axes<M>(c) +
                               " needs device " + std::to_string(g) +
                               "'s block, which is not local; use the local view and psum");
    // Each device sums its group's products in group-rank order (the same bits on every device).
    detail::for_each_device<space>(a.local_devices(), n, a.extent(0) * b.extent(1) * n, [&](std::size_t dev) {
      const auto& first = prod[dev];
      sum[dev] = detail::allocate<T, 2, space>({first.extent(0), first.extent(1)}, "meshlib::matmul", true);
      T* dst = sum[dev].data();
      for (std::size_t g : a.mesh().group(dev, c)) {
        const T* src = prod[g].data();
        for (std::size_t i = 0; i < sum[dev].span(); ++i) dst[i] += src[i];
      }
    });
    return out_t(s, {a.extent(0), b.extent(1)}, std::move(sum), std::move(local));
  }
  }
}

}  // namespace meshlib
// end meshlib/tensor/matmul.hpp
// end meshlib/tensor.hpp
// begin meshlib/collectives.hpp
/// @file
/// @brief The collectives layer: the device context (`axis_index`, `axis_size`), backends, typed
/// collectives (`psum`, `pmean`, `pmax`, `pmin`, `all_gather`, `psum_scatter`, `all_to_all`,
/// `ppermute`, `broadcast`, `pvary`), the local relabelling steps (`forget_dims`, `reshape`,
/// `axis_index(x)`) and `reshard`. Depends on core, comm and tensor.

// begin meshlib/collectives/errors.hpp
/// @file
/// @brief The exceptions of SPMD execution: `device_error` (how a failure on one device of
/// `shard_map` / `spmd` / `reshard` reaches the caller) and `spmd_context_error` (a collective or
/// axis query used where no device runs).

#include <cstddef>
#include <exception>
#include <string>


namespace meshlib {

/// @brief A collective or axis query used where it cannot run: outside `shard_map` / `spmd`, or
/// naming an axis the running mesh does not have.
class spmd_context_error : public error {
 public:
  using error::error;
};

/// @brief A device of `shard_map` / `spmd` threw. `device()` is the device that failed first (the
/// root cause: devices that only saw their peers' failure, as `comm_aborted`, are not reported),
/// `cause()` the exception it threw, and `what()` reads
/// `meshlib: device 3 of mesh{'x': 4} failed: <the cause's what()>`.
/// @code
/// try { meshlib::spmd(m, fn); }
/// catch (const meshlib::device_error& e) {
///   e.device();            // 3
///   e.rethrow_cause();     // throws the original exception, with its own type
/// }
/// @endcode
class device_error : public error {
 public:
  /// @brief Wraps the exception `cause` thrown on `device`; `what` is the message naming the device.
  device_error(std::size_t device, std::exception_ptr cause, const std::string& what)
      : error(what), device_(device), cause_(std::move(cause)) {}

  /// The index of the device whose body threw.
  [[nodiscard]] std::size_t device() const noexcept { return device_; }
  /// The original exception, for `std::rethrow_exception`.
  [[nodiscard]] std::exception_ptr cause() const noexcept { return cause_; }
  /// Rethrows the original exception, to catch it by its own type.
  [[noreturn]] void rethrow_cause() const { std::rethrow_exception(cause_); }

 private:
  std::size_t device_;
  std::exception_ptr cause_;
};

}  // namespace meshlib
// end meshlib/collectives/errors.hpp
// begin meshlib/collectives/workspace.hpp
/// @file
/// @brief `collective_workspace`: the buffers one device's typed collectives write their results
/// and staging into, reused from call to call, so that a collective called again with the same
/// shapes allocates nothing (issue 9: a typed `psum` used to allocate and copy its result on every
/// call, which doubled its latency at 8 B and cost 40% of the bandwidth at 16 MiB).
///
/// Why reuse is safe: a buffer is handed out again only while the workspace holds its only
/// reference (`Kokkos::View::use_count() == 1`). A result the caller still holds keeps the count
/// above one, so a later call never overwrites it: it takes another buffer, or a fresh one.
///
/// Lifetime: one workspace per thread (`thread_workspace`), so it outlives the `shard_map` /
/// `spmd` call: a training loop that runs one call per step reuses the previous step's buffers
/// instead of allocating them again and taking a page fault on every page of each (issue 9: on
/// this VM, first-touch faults cost a typed psum 60% of its bandwidth at 16 MiB). A device always
/// runs on the same persistent thread (exec/thread_runner.hpp), so its workspace follows it.
/// Three rules keep that within the Kokkos 3.4.1 rule of tensor/view.hpp (a device thread copies
/// and drops handles only of its own blocks): when a call ends, its device's thread drops the
/// buffers someone else still holds (results that leave the call), keeping only those nobody
/// holds; a thread's workspace is emptied on that thread when it exits; and a Kokkos finalize hook
/// empties the workspaces of idle threads (a buffer must not outlive Kokkos). It keeps at most
/// `max_shapes` shapes, dropping the least recently used unheld ones past that.

#include <array>
#include <cstddef>
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <mutex>
#include <memory>
#include <tuple>
#include <typeindex>
#include <typeinfo>
#include <vector>


namespace meshlib::detail {

/// The reusable buffers of one device (see the file comment), by view type and extents. Used as
/// `collective_workspace`: a template only so that its map and vectors are compiled where
/// collectives run, not in every translation unit that includes meshlib (core/deferred.hpp).
template <class Tag = void>
class basic_collective_workspace {
 public:
  /// How many buffers of one type and shape are kept; past that, a call whose every kept buffer is
  /// still held gets a fresh one that the workspace does not keep.
  static constexpr std::size_t buffers_per_shape = 4;
  /// How many types and shapes are kept across calls (a program's collectives use a few; one that
  /// keeps changing its shapes must not keep a buffer of each for ever).
  static constexpr std::size_t max_shapes = 32;

  basic_collective_workspace() = default;
  basic_collective_workspace(const basic_collective_workspace&) = delete;
  basic_collective_workspace& operator=(const basic_collective_workspace&) = delete;

  /// A block of `shape` (uninitialised) that nobody but the workspace holds.
  template <class T, std::size_t Rank, class Space>
  block_view_t<T, Rank, Space> acquire(const std::array<std::size_t, Rank>& shape) {
    using view_t = block_view_t<T, Rank, Space>;
    auto& entry = slots_[key_of<view_t>(shape)];
    entry.last_use = ++uses_;
    auto& kept = entry.buffers;
    for (auto& s : kept) {
      auto& v = static_cast<slot<view_t>&>(*s).view;
      if (v.use_count() == 1) return v;
    }
    ++allocations_;
    view_t fresh = allocate<T, Rank, Space>(shape, "meshlib::collective", false);
    if (kept.size() < buffers_per_shape) {
      kept.push_back(std::make_unique<slot<view_t>>(fresh));
      trim();
    }
    return fresh;
  }

  /// Drops the buffers that someone else still holds (see the file comment: called on the
  /// device's thread when its call ends), keeping those nobody holds for the next call.
  void release_held() {
    for (auto it = slots_.begin(); it != slots_.end();) {
      auto& kept = it->second.buffers;
      kept.erase(std::remove_if(kept.begin(), kept.end(), [](const auto& s) { return s->use_count() > 1; }), kept.end());
      it = kept.empty() ? slots_.erase(it) : std::next(it);
    }
  }

  /// Drops every buffer (a Kokkos finalize hook, or the thread's exit).
  void clear() noexcept { slots_.clear(); }

  /// Types and shapes kept.
  [[nodiscard]] std::size_t shapes() const noexcept { return slots_.size(); }

  /// A one-dimensional staging buffer of `n` elements, for use within one collective call.
  template <class T, class Space>
  block_view_t<T, 1, Space> scratch(std::size_t n) {
    return acquire<T, 1, Space>(std::array<std::size_t, 1>{n});
  }

  /// Whether `v` is one of the workspace's buffers (then the workspace holds one of its references).
  template <class View>
  [[nodiscard]] bool holds(const View& v) const {
    const auto it = slots_.find(key_of<View>(extents_of(v)));
    if (it == slots_.end()) return false;
    for (const auto& s : it->second.buffers)
      if (static_cast<const slot<View>&>(*s).view.data() == v.data()) return true;
    return false;
  }

  /// Buffers allocated so far (a fresh workspace: 0; after warm-up a repeated call adds none).
  [[nodiscard]] std::size_t allocations() const noexcept { return allocations_; }

 private:
  struct slot_base {
    virtual ~slot_base() = default;
    [[nodiscard]] virtual long use_count() const noexcept = 0;
  };
  template <class View>
  struct slot final : slot_base {
    explicit slot(View v) : view(std::move(v)) {}
    long use_count() const noexcept override { return static_cast<long>(view.use_count()); }
    View view;
  };
  struct entry {
    std::vector<std::unique_ptr<slot_base>> buffers;
    std::uint64_t last_use = 0;
  };
  /// The view type and its extents (unused ones 0): a buffer is reused only for the same shape,
  /// because a Kokkos view cannot be re-shaped while sharing ownership.
  using key = std::tuple<std::type_index, std::array<std::size_t, 8>>;

  template <class View, std::size_t Rank>
  static key key_of(const std::array<std::size_t, Rank>& shape) {
    std::array<std::size_t, 8> e{};
    for (std::size_t d = 0; d < Rank; ++d) e[d] = shape[d];
    return key{std::type_index(typeid(View)), e};
  }

  /// Past `max_shapes`, drops the least recently used shapes whose buffers nobody holds.
  void trim() {
    while (slots_.size() > max_shapes) {
      auto victim = slots_.end();
      for (auto it = slots_.begin(); it != slots_.end(); ++it) {
        const auto& kept = it->second.buffers;
        const bool unheld = std::all_of(kept.begin(), kept.end(), [](const auto& s) { return s->use_count() == 1; });
        if (unheld && it->second.last_use != uses_ && (victim == slots_.end() || it->second.last_use < victim->second.last_use))
          victim = it;
      }
      if (victim == slots_.end()) return;  // every other shape is in use: keep them until the call ends
      slots_.erase(victim);
    }
  }

  std::map<key, entry> slots_;
  std::size_t allocations_ = 0;
  std::uint64_t uses_ = 0;
};

/// The buffers of one device (see `basic_collective_workspace`).
using collective_workspace = basic_collective_workspace<>;

/// The workspaces of every thread that has one, so that a Kokkos finalize hook can empty them
/// (their buffers must not outlive Kokkos, and a pool thread lives until the process exits). Used
/// as `workspace_registry` (a template for the reason `basic_collective_workspace` is).
template <class Tag = void>
class basic_workspace_registry {
  using workspace = basic_collective_workspace<Tag>;

 public:
  /// Never destroyed: threads deregister at their exit, which may come after static destruction.
  static basic_workspace_registry& get() {
    static auto* r = new basic_workspace_registry;
    return *r;
  }
  void add(workspace* w) {
    std::lock_guard lock(m_);
    all_.push_back(w);
  }
  void remove(workspace* w) {
    std::lock_guard lock(m_);
    all_.erase(std::remove(all_.begin(), all_.end(), w), all_.end());
  }
  /// Pushes the finalize hook once per Kokkos initialisation (a finalize runs and pops it). Called
  /// by `run_devices` on the calling thread before any device thread can keep a buffer.
  void hook() {
    if (hooked_.load(std::memory_order_acquire)) return;
    std::lock_guard lock(m_);
    if (hooked_.load(std::memory_order_relaxed)) return;
    hooked_.store(true, std::memory_order_release);
    push_finalize_hook([this] {
      // Every device thread is idle (Kokkos is finalised outside shard_map / spmd), and the pool's
      // job hand-off orders their last use before this.
      std::lock_guard l(m_);
      for (auto* w : all_) w->clear();
      hooked_.store(false, std::memory_order_release);
    });
  }

 private:
  std::mutex m_;
  std::vector<workspace*> all_;
  std::atomic<bool> hooked_{false};
};

/// The registry of every thread's workspace (see `basic_workspace_registry`).
using workspace_registry = basic_workspace_registry<>;

/// The calling thread's workspace (see the file comment), emptied on that thread when it exits.
template <class Tag = void>
basic_collective_workspace<Tag>& thread_workspace() {
  struct owner {
    basic_collective_workspace<Tag> ws;
    owner() { basic_workspace_registry<Tag>::get().add(&ws); }
    ~owner() {
      basic_workspace_registry<Tag>::get().remove(&ws);
      ws.clear();
    }
    owner(const owner&) = delete;
    owner& operator=(const owner&) = delete;
  };
  thread_local owner o;
  return o.ws;
}

}  // namespace meshlib::detail
// end meshlib/collectives/workspace.hpp
// begin meshlib/collectives/comm_stream.hpp
/// @file
/// @brief `detail::comm_stream`: one device's communication worker, what makes the typed
/// collectives' `*_start` forms (collectives/collective_request.hpp) asynchronous on host backends.
///
/// Why a worker thread and one queue per device: a host backend (thread, MPI) moves the bytes on
/// the thread that calls it, so a collective can only run beside the device's computation on
/// another thread. One queue per device, run in issue order, is an NCCL stream: every device of a
/// group issues the same collectives in the same order (SPMD does), so the workers of a group meet
/// in the same order too, and nothing can deadlock that would not deadlock synchronously.
///
/// Why reuse is safe: a communicator handle belongs to one thread at a time. The device thread
/// hands a group's handle to the worker while anything is queued on it, and takes it back only
/// after `drain(group)`: every synchronous collective (`device_context::comm`) drains its group
/// first, so each communicator sees the device's collectives in one order, whichever thread runs
/// them, and the mutex orders the memory between the two threads. A synchronous collective on
/// another group runs beside the worker (a tensor-parallel `psum` during backward while a gradient
/// bucket is summed over the data axis): on a host backend groups are independent, and each
/// group's order is the program's on every device, so no device waits for one that waits for it.
/// A stream backend (NCCL) drains everything: its kernels of different groups must be launched in
/// one order on every device.
///
/// Errors: a queued operation that throws (a peer failed, a timeout, a mismatch: the backend's own
/// abort and timeout machinery, so no wait is unbounded) keeps its exception in its `stream_op`,
/// rethrown by the request's `wait()`; later operations run (and fail as the backend decides:
/// a failed world refuses every later call with the root cause's error).

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>


#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace meshlib::detail {

/// One queued operation's completion, shared by the worker and the request that waits for it.
struct stream_op {
  /// Set (release) after `error`, under the stream's mutex. Atomic so that a request can see it
  /// without the stream: every operation is done once its stream has stopped, so a request that
  /// outlives its device's call (dropped in an unwinding, say) never touches the stream again.
  std::atomic<bool> done{false};
  std::exception_ptr error;  ///< what the operation threw, if it did
};

/// A completion that is already complete (an operation a `*_start` form ran at once).
inline std::shared_ptr<stream_op> completed_op() {
  auto op = std::make_shared<stream_op>();
  op->done.store(true, std::memory_order_release);
  return op;
}

/// A communication worker thread, parked between the calls that use it (see `comm_stream`): a
/// device thread's `spmd` / `shard_map` calls take one from that thread's pool (`take`) and give it
/// back when their stream stops (`give_back`), so a training loop of one call per step starts its
/// workers once, not once per step per device.
class comm_worker {
 public:
  comm_worker() = default;
  comm_worker(const comm_worker&) = delete;
  comm_worker& operator=(const comm_worker&) = delete;
  ~comm_worker() {
    {
      std::lock_guard lock(m_);
      quit_ = true;
    }
    cv_.notify_one();
    if (thread_.joinable()) thread_.join();
  }

  /// Runs `loop` on the worker thread (started on the first call); the caller makes sure that the
  /// previous loop has returned.
  void post(std::function<void()> loop) {
    {
      std::lock_guard lock(m_);
      loop_ = std::move(loop);
      if (!thread_.joinable()) thread_ = std::thread([this] { main(); });
    }
    cv_.notify_one();
  }

  /// A parked worker of this thread's pool, or a new one.
  static std::unique_ptr<comm_worker> take() {
    auto& pool = parked();
    if (pool.empty()) return std::make_unique<comm_worker>();
    auto w = std::move(pool.back());
    pool.pop_back();
    return w;
  }
  /// Parks `w` (whose loop has returned) in this thread's pool, joined when this thread ends.
  static void give_back(std::unique_ptr<comm_worker> w) noexcept {
    try {
      parked().push_back(std::move(w));
    } catch (...) {  // no room to park it: `w` is joined here instead
    }
  }

 private:
  static std::vector<std::unique_ptr<comm_worker>>& parked() {
    thread_local std::vector<std::unique_ptr<comm_worker>> pool;
    return pool;
  }
  void main() {
#if defined(__linux__)
    // No wake-up preemption of the device thread: on a machine without a spare core, a started
    // collective's worker, woken by the device thread, would otherwise take that core at once and
    // the computation it should overlap would wait for it (docs/benchmarks.md, "Overlapped
    // gradient synchronisation", has the measurements, which this did not change much).
    sched_param param{};
    (void)pthread_setschedparam(pthread_self(), SCHED_BATCH, &param);
#endif
    prefer_blocking_waits() = true;  // nothing waits on this thread but the busy device thread
    std::unique_lock lock(m_);
    for (;;) {
      cv_.wait(lock, [&] { return quit_ || loop_ != nullptr; });
      if (loop_ == nullptr) return;  // quitting, nothing posted
      auto loop = std::move(loop_);
      loop_ = nullptr;
      lock.unlock();
      loop();
      loop = nullptr;
      lock.lock();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  std::function<void()> loop_;
  bool quit_ = false;
  std::thread thread_;
};

/// A device's communication worker (see the file comment). The worker starts on the first
/// `enqueue` (a parked `comm_worker` of the device thread when it has one); the destructor drains
/// the queue and parks it again.
class comm_stream {
 public:
  comm_stream() = default;
  comm_stream(const comm_stream&) = delete;
  comm_stream& operator=(const comm_stream&) = delete;
  ~comm_stream() { stop(); }

  /// Queues `job`, an operation on the communicator named `group` (an axis mask), behind every
  /// operation queued before it; returns its completion.
  std::shared_ptr<stream_op> enqueue(std::function<void()> job, std::uint64_t group) {
    auto op = std::make_shared<stream_op>();
    {
      std::lock_guard lock(m_);
      if (!worker_) {
        worker_ = comm_worker::take();
        running_ = true;
        worker_->post([this] { run(); });
      }
      queue_.push_back({std::move(job), op, group});
      ++count_of(group);
      ++pending_;
      outstanding_.store(pending_, std::memory_order_release);
    }
    work_.notify_one();
    return op;
  }

  /// Blocks until `op` is complete; rethrows what it threw.
  void wait(const stream_op& op) {
    if (!op.done.load(std::memory_order_acquire)) {
      std::unique_lock lock(m_);
      done_.wait(lock, [&] { return op.done.load(std::memory_order_acquire); });
    }
    if (op.error) std::rethrow_exception(op.error);
  }

  /// Whether `op` is complete (does not throw: `wait` reports its error).
  [[nodiscard]] static bool test(const stream_op& op) noexcept { return op.done.load(std::memory_order_acquire); }

  /// Blocks until every queued operation is complete (their errors stay with their requests).
  void drain() {
    std::unique_lock lock(m_);
    done_.wait(lock, [&] { return pending_ == 0; });
  }
  /// Blocks until every queued operation on `group` is complete (and so every one queued before
  /// them: the queue runs in order).
  void drain(std::uint64_t group) {
    std::unique_lock lock(m_);
    done_.wait(lock, [&] { return count_of(group) == 0; });
  }

  /// Whether nothing is queued or running: the synchronous collectives' fast path, one load (the
  /// device thread is the only one that queues, so `false` cannot turn stale into `true` unseen).
  [[nodiscard]] bool idle() const noexcept { return outstanding_.load(std::memory_order_acquire) == 0; }

  /// Drains the queue and parks the worker (the device context calls it before its communicators
  /// go): once it returns, the worker no longer touches this stream.
  void stop() noexcept {
    std::unique_ptr<comm_worker> w;
    {
      std::unique_lock lock(m_);
      if (!worker_) return;
      done_.wait(lock, [&] { return pending_ == 0; });
      stopping_ = true;
      work_.notify_one();
      done_.wait(lock, [&] { return !running_; });
      stopping_ = false;
      w = std::move(worker_);
    }
    comm_worker::give_back(std::move(w));
  }

 private:
  /// The worker's loop for this stream: returns once `stop` asks and the queue is empty.
  void run() {
    std::unique_lock lock(m_);
    for (;;) {
      work_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) {  // stopping, nothing left: the last touch of this stream
        running_ = false;
        done_.notify_all();
        return;
      }
      auto [job, op, group] = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::exception_ptr error;
      try {
        job();
      } catch (...) {
        error = std::current_exception();
      }
      job = nullptr;  // what the job holds goes before the device thread is told it may go on
      lock.lock();
      op->error = std::move(error);
      op->done.store(true, std::memory_order_release);
      --count_of(group);
      --pending_;
      outstanding_.store(pending_, std::memory_order_release);
      done_.notify_all();
    }
  }

  struct entry {
    std::function<void()> job;
    std::shared_ptr<stream_op> op;
    std::uint64_t group;
  };
  /// Queued or running operations on `group` (a device uses a handful of groups: a short list).
  std::size_t& count_of(std::uint64_t group) {
    for (auto& [g, n] : per_group_)
      if (g == group) return n;
    return per_group_.emplace_back(group, 0).second;
  }

  std::mutex m_;
  std::condition_variable work_;  ///< the worker waits for a job
  std::condition_variable done_;  ///< the device thread waits for completions
  std::deque<entry> queue_;
  std::vector<std::pair<std::uint64_t, std::size_t>> per_group_;
  std::size_t pending_ = 0;  ///< queued or running
  std::atomic<std::size_t> outstanding_{0};  ///< `pending_`, readable without the lock
  bool stopping_ = false;
  bool running_ = false;  ///< the worker is in `run` (from the first `enqueue` until `stop`)
  std::unique_ptr<comm_worker> worker_;
};

}  // namespace meshlib::detail
// end meshlib/collectives/comm_stream.hpp
// begin meshlib/collectives/device_context.hpp
/// @file
/// @brief The device a piece of SPMD code runs as: its id, its mesh coordinates, and the
/// communicator of each of its axis groups. `shard_map` and `spmd` install one per device thread
/// (`detail::scoped_device`); typed collectives and `axis_index` / `axis_size` read it.
///
/// Why type-erased: a collective sees only a `local_tensor`, whose type names the mesh but not the
/// backend, and the same program must run on the thread, MPI and NCCL backends unchanged. So the
/// context holds its communicators behind `device_comm`, a small virtual interface over raw
/// buffers and a run-time `datatype` tag, implemented once per backend by `device_comm_for<C>` on
/// top of the `communicator` concept. The virtual call costs nothing next to the collective.
///
/// Sub-communicators come from the comm layer's `axis_communicators`: split on first use from the
/// device's world communicator, cached per axis set. That is safe because every device of an SPMD
/// program reaches the same collectives in the same order (what every backend already requires).

#include <cstddef>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

// begin meshlib/collectives/observer.hpp
/// @file
/// @brief The observer interface of a run's collectives, and `observed_comm`, the forwarding
/// decorator that reports every operation of a device's communicator (`device_comm`) to it.
///
/// Why here, beside `device_comm`, and not in the debug layer: the device context
/// (device_context.hpp) must hand out decorated communicators, and the layer that declares a
/// decorator point must not include the layer that fills it. So collectives declare the interface
/// (`comm_observer`) and forward to it; debug implements it (`run_observer`, debug/observe.hpp:
/// trace, Kokkos regions, NaN/Inf checks, the slow-peer watchdog); exec, which runs the devices,
/// creates one per run and installs it in every device's context. Without an observer, or with an
/// inactive one, nothing is wrapped: one predictable branch per collective.
/// @code
/// struct counting final : meshlib::experimental::comm_observer {   // e.g. a test's observer
///   std::atomic<int> calls{0};
///   bool active() const noexcept override { return true; }
///   void open(meshlib::experimental::comm_site&) override {}
///   void enter(const meshlib::experimental::comm_site&, meshlib::experimental::comm_call&) override { ++calls; }
///   void leave(const meshlib::experimental::comm_site&, const meshlib::experimental::comm_call&) noexcept override {}
///   void done(const meshlib::experimental::comm_site&, const meshlib::experimental::comm_call&) override {}
/// };
/// @endcode

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>


namespace meshlib::detail {

/// Inside this scope the calling thread's collectives are not observed: the debug layer's own
/// collectives (ordered printing, replica checks) stay out of the trace and the checks.
inline int& unobserved_depth() noexcept {
  thread_local int depth = 0;
  return depth;
}
/// Leaves the calling thread's collectives unobserved while it lives (nests).
struct unobserved_scope {
  unobserved_scope() noexcept { ++unobserved_depth(); }
  ~unobserved_scope() { --unobserved_depth(); }
  unobserved_scope(const unobserved_scope&) = delete;
  unobserved_scope& operator=(const unobserved_scope&) = delete;
};

/// "device 3 (data=1, model=1)".
template <mesh_type Mesh>
std::string device_label(const Mesh& m, std::size_t device) {
  std::string s = "device " + std::to_string(device) + " (";
  const auto c = m.coords(device);
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    s += (a ? ", " : "") + std::string(Mesh::axis_names[a]) + "=" + std::to_string(c[a]);
  return s + ")";
}

/// "0,2,4".
inline std::string join_ids(const std::vector<std::size_t>& ids) {
  std::string s;
  for (std::size_t i = 0; i < ids.size(); ++i) s += (i ? "," : "") + std::to_string(ids[i]);
  return s;
}

}  // namespace meshlib::detail

/// Interfaces that cross layers and may still change: the debug layer implements `comm_observer`,
/// and a user may too (see the file comment).
namespace meshlib::experimental {

/// Where a device's communicator sits: the device, its group along `mask` and the axes' names.
struct comm_site {
  std::size_t device = 0;  ///< the device id
  std::string device_label;  ///< the device as messages name it
  axis_mask mask = 0;  ///< the mesh axes the group spans
  std::string axes;  ///< their names, comma-separated ("model", "data,model")
  std::size_t color = 0;  ///< which group of the split along `mask` this is
  std::vector<std::size_t> group;  ///< the group's device ids in group-rank order
  std::size_t group_rank = 0;  ///< this device's rank in `group`
  /// The observer's own state for this site, set by `comm_observer::open` (debug: its trace track).
  void* data = nullptr;
};

/// One collective as the decorator reports it: its user-level name, element type, the elements
/// this device sends, its input and output (for checks), and its sequence number on the group.
struct comm_call {
  const char* name = "";  ///< the collective's user-level name ("all_reduce")
  datatype dt = datatype::float32;  ///< the element type
  std::size_t send_count = 0;  ///< elements this device sends
  const void* in = nullptr;  ///< the input buffer (for checks)
  std::size_t in_count = 0;  ///< elements in `in`
  const void* out = nullptr;  ///< the output buffer (for checks)
  std::size_t out_count = 0;  ///< elements in `out`
  std::uint64_t seq = 0;  ///< the call's sequence number on the group (from 0)
  /// When the observer saw it start (its clock; set by `enter`, read by `done`).
  std::int64_t start_ns = 0;
};

/// @brief What a run's observer is told about every collective of every device it observes; the
/// debug layer implements it (debug/observe.hpp). Called on the device threads, concurrently.
class comm_observer {
 public:
  /// Whether to wrap at all: an inactive observer costs one branch per collective.
  [[nodiscard]] virtual bool active() const noexcept = 0;
  /// Once per device and group, when its decorated communicator is made: may set `site.data`.
  virtual void open(comm_site& site) = 0;
  /// Before the operation; may throw to refuse it (then neither `leave` nor `done` follows).
  virtual void enter(const comm_site& site, comm_call& call) = 0;
  /// After the operation, whether it returned or threw.
  virtual void leave(const comm_site& site, const comm_call& call) noexcept = 0;
  /// After `leave`, when the operation returned; may throw (a check of the output).
  virtual void done(const comm_site& site, const comm_call& call) = 0;

 protected:
  comm_observer() = default;
  ~comm_observer() = default;
  /// Copyable by the implementing class only (no slicing through the base).
  comm_observer(const comm_observer&) = default;
  /// Assignable by the implementing class only.
  comm_observer& operator=(const comm_observer&) = default;
};

}  // namespace meshlib::experimental

namespace meshlib::detail {

/// The site of device `device`'s communicator over the axes in `mask` of `m`.
template <mesh_type Mesh>
experimental::comm_site make_comm_site(const Mesh& m, std::size_t device, axis_mask mask) {
  experimental::comm_site s;
  s.device = device;
  s.device_label = device_label(m, device);
  s.mask = mask & Mesh::all_axes;
  for (std::size_t a = 0; a < Mesh::ndim; ++a)
    if (s.mask & (axis_mask{1} << a)) s.axes += (s.axes.empty() ? "" : ",") + std::string(Mesh::axis_names[a]);
  s.color = m.group_color(device, s.mask);
  s.group = m.group(device, s.mask);
  s.group_rank = m.group_rank(device, s.mask);
  return s;
}

/// The user-level name of a reduction: psum, pmean, pmax, pmin (the typed collectives' names).
constexpr const char* reduction_name(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return "psum";
    case reduce_op::mean: return "pmean";
    case reduce_op::max: return "pmax";
    case reduce_op::min: return "pmin";
    default: return "all_reduce";
  }
}

/// `Iface` (the typed collectives' per-device communicator interface, `device_comm`) decorated:
/// every operation goes to `inner`, reported to `obs` around it (see the file comment).
template <class Iface>
class observed_comm final : public Iface {
 public:
  observed_comm(Iface& inner, experimental::comm_observer& obs, experimental::comm_site site) : inner_(inner), obs_(obs), site_(std::move(site)) {
    obs_.open(site_);
  }

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }

  void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, buf, count, buf, count, [&] { inner_.all_reduce(buf, count, dt, op); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    observe(reduction_name(op), dt, count, send, count, recv, count,
            [&] { inner_.all_reduce(send, recv, count, dt, op); });
  }
  void all_gather(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_gather", dt, count, send, count, recv, count * n(), [&] { inner_.all_gather(send, recv, count, dt); });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    const char* name = op == reduce_op::sum ? "psum_scatter" : "reduce_scatter";
    observe(name, dt, count * n(), send, count * n(), recv, count,
            [&] { inner_.reduce_scatter(send, recv, count, dt, op); });
  }
  void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) override {
    observe("all_to_all", dt, count * n(), send, count * n(), recv, count * n(),
            [&] { inner_.all_to_all(send, recv, count, dt); });
  }
  void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                    void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                    std::size_t send_total, std::size_t recv_total, datatype dt) override {
    observe("all_to_all_v", dt, send_total, send, send_total, recv, recv_total, [&] {
      inner_.all_to_all_v(send, send_counts, send_displs, recv, recv_counts, recv_displs, send_total, recv_total, dt);
    });
  }
  void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                std::span<const permute_pair> pairs) override {
    observe("ppermute", dt, count, send, count, recv, count, [&] { inner_.ppermute(send, recv, count, dt, pairs); });
  }
  void synchronize() override { inner_.synchronize(); }
  void broadcast(void* buf, std::size_t count, datatype dt, int root) override {
    // Only the root's buffer is an input: the others' may hold anything before the call.
    const bool is_root = static_cast<int>(site_.group_rank) == root;
    observe("broadcast", dt, is_root ? count : 0, buf, is_root ? count : 0, buf, count,
            [&] { inner_.broadcast(buf, count, dt, root); });
  }

 private:
  std::size_t n() const { return static_cast<std::size_t>(inner_.size()); }

  template <class F>
  void observe(const char* name, datatype dt, std::size_t send_count, const void* in, std::size_t in_count,
               const void* out, std::size_t out_count, F&& call) {
    if (unobserved_depth() > 0) {
      call();
      return;
    }
    experimental::comm_call c{name, dt, send_count, in, in_count, out, out_count, seq_++, 0};
    obs_.enter(site_, c);
    struct leave {
      observed_comm& self;
      const experimental::comm_call& c;
      ~leave() { self.obs_.leave(self.site_, c); }
    };
    {
      leave guard{*this, c};
      call();
    }
    obs_.done(site_, c);
  }

  Iface& inner_;
  experimental::comm_observer& obs_;
  experimental::comm_site site_;
  std::uint64_t seq_ = 0;
};

}  // namespace meshlib::detail
// end meshlib/collectives/observer.hpp

/// Set to 0 to compile the debug layer's hook out of the device context (only bench/trace_bench
/// does, to measure what the hook costs when tracing and debug mode are off).
#ifndef MESHLIB_DEBUG_HOOKS
#define MESHLIB_DEBUG_HOOKS 1
#endif

namespace meshlib {

namespace detail {

/// Calls `f.template operator()<T>()` with the element type `T` that `dt` names.
template <class F>
decltype(auto) with_element_type(datatype dt, F&& f) {
  switch (dt) {
    case datatype::float32: return f.template operator()<float>();
    case datatype::float64: return f.template operator()<double>();
    case datatype::int32: return f.template operator()<std::int32_t>();
    case datatype::int64: return f.template operator()<std::int64_t>();
    case datatype::bfloat16: return f.template operator()<bfloat16>();
  }
  return f.template operator()<float>();
}

/// One device's handle on one group (see the file comment): raw buffers, `count` elements of `dt`.
class device_comm {
 public:
  virtual ~device_comm() = default;
  [[nodiscard]] virtual int rank() const = 0;
  [[nodiscard]] virtual int size() const = 0;
  /// In place: `buf[i]` = op over ranks.
  virtual void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) = 0;
  /// Out of place: `recv[i]` = op over ranks of `send[i]` (the typed collectives' form: the
  /// backend reads the input where it lies, so no copy into the result comes first).
  virtual void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) = 0;
  /// `recv` = [send of rank 0, rank 1, ...], `count` elements each.
  virtual void all_gather(const void* send, void* recv, std::size_t count, datatype dt) = 0;
  /// `recv` = block `rank` (of `count` elements) of the reduction of `send` (`count * size()` elements).
  virtual void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) = 0;
  /// Block j (of `count` elements) of `send` goes to rank j and lands at block `rank` of `recv`.
  virtual void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) = 0;
  /// Variable-sized all-to-all, counts and displacements in elements.
  virtual void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts,
                            std::span<const std::int64_t> send_displs, void* recv,
                            std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                            std::size_t send_total, std::size_t recv_total, datatype dt) = 0;
  /// `recv` = the `send` of the rank that sends to this one; zeros when none does.
  virtual void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                        std::span<const permute_pair> pairs) = 0;
  /// In place: every rank's `buf` = root's.
  virtual void broadcast(void* buf, std::size_t count, datatype dt, int root) = 0;
  /// Waits for the operations this handle has enqueued on its stream (a stream backend: NCCL,
  /// shared-GPU) and throws their error; nothing to do on a host backend, whose calls complete.
  virtual void synchronize() {}
};

/// Whether backend communicator `C` orders its operations on a stream (NCCL, shared-GPU: its
/// `context_type` is a CUDA stream) rather than completing them on the host: its buffers are device
/// memory, and the typed collectives enqueue on it without waiting (collectives/reductions.hpp).
template <class C>
inline constexpr bool stream_ordered_v = !std::is_same_v<typename C::context_type, host_context>;

/// `device_comm` over a backend communicator `C` (a reference: the communicator lives in
/// `axis_communicators`).
template <communicator C>
class device_comm_for final : public device_comm {
 public:
  explicit device_comm_for(C& comm) : comm_(comm) {}
  C& get() noexcept { return comm_; }

  int rank() const override { return comm_.rank(); }
  int size() const override { return comm_.size(); }

  void all_reduce(void* buf, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() { settle(comm_.all_reduce(std::span<T>(static_cast<T*>(buf), count), op)); });
  }
  void all_reduce(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_reduce(std::span<const T>(static_cast<const T*>(send), count), std::span<T>(static_cast<T*>(recv), count), op));
    });
  }
  void all_gather(const void* send, void* recv, std::size_t count, datatype dt) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_gather(std::span<const T>(static_cast<const T*>(send), count),
                       std::span<T>(static_cast<T*>(recv), count * static_cast<std::size_t>(comm_.size()))));
    });
  }
  void reduce_scatter(const void* send, void* recv, std::size_t count, datatype dt, reduce_op op) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.reduce_scatter(std::span<const T>(static_cast<const T*>(send), count * static_cast<std::size_t>(comm_.size())),
                           std::span<T>(static_cast<T*>(recv), count), op));
    });
  }
  void all_to_all(const void* send, void* recv, std::size_t count, datatype dt) override {
    const std::size_t total = count * static_cast<std::size_t>(comm_.size());
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_to_all(std::span<const T>(static_cast<const T*>(send), total), std::span<T>(static_cast<T*>(recv), total)));
    });
  }
  void all_to_all_v(const void* send, std::span<const std::int64_t> send_counts, std::span<const std::int64_t> send_displs,
                    void* recv, std::span<const std::int64_t> recv_counts, std::span<const std::int64_t> recv_displs,
                    std::size_t send_total, std::size_t recv_total, datatype dt) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.all_to_all_v(std::span<const T>(static_cast<const T*>(send), send_total), send_counts, send_displs,
                         std::span<T>(static_cast<T*>(recv), recv_total), recv_counts, recv_displs));
    });
  }
  void ppermute(const void* send, void* recv, std::size_t count, datatype dt,
                std::span<const permute_pair> pairs) override {
    with_element_type(dt, [&]<class T>() {
      settle(comm_.ppermute(std::span<const T>(static_cast<const T*>(send), count), std::span<T>(static_cast<T*>(recv), count),
                     pairs));
    });
  }
  void broadcast(void* buf, std::size_t count, datatype dt, int root) override {
    with_element_type(dt, [&]<class T>() { settle(comm_.broadcast(std::span<T>(static_cast<T*>(buf), count), root)); });
  }
  void synchronize() override {
    if constexpr (stream_ordered_v<C>) {
      if (last_) {
        auto r = std::move(*last_);
        last_.reset();
        r.wait();
      }
    }
  }

 private:
  C& comm_;
  /// A stream backend's last enqueued operation (its stream completes them in order).
  std::optional<typename C::request_type> last_;

  /// A host backend's operation completes here; a stream backend's stays enqueued on the
  /// communicator's stream (the device's execution-space instance's: exec/gpu_runner.hpp), so the
  /// host does not wait: kernels after it on that stream see its result. The previous operation's
  /// error, if it has one by now, is thrown (a poll, never a wait).
  template <class Request>
  void settle(Request&& r) {
    if constexpr (stream_ordered_v<C>) {
      if (last_) (void)last_->test();
      last_.emplace(std::forward<Request>(r));
    } else {
      r.wait();
    }
  }
};

/// The device this thread runs as (see the file comment).
class device_context {
 public:
  virtual ~device_context() = default;
  /// The device id: its row-major index in the mesh.
  [[nodiscard]] virtual std::size_t device() const noexcept = 0;
  /// Position of the axis called `name` in the running mesh, or the mesh's rank when it has none.
  [[nodiscard]] virtual std::size_t find_axis(std::string_view name) const noexcept = 0;
  [[nodiscard]] virtual std::size_t axis_count() const noexcept = 0;
  [[nodiscard]] virtual std::string_view axis_name(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::size_t axis_size(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::size_t coord(std::size_t axis) const noexcept = 0;
  [[nodiscard]] virtual std::string describe_mesh() const = 0;
  /// The communicator of this device's group along the axes in `mask`, in group-rank order, for a
  /// synchronous collective on this thread: the device's queued asynchronous collectives complete
  /// first (collectives/comm_stream.hpp), so its collectives keep one order.
  [[nodiscard]] device_comm& comm(axis_mask mask) {
    if (!stream_.idle()) {
      if (independent_groups()) stream_.drain(mask);  // (collectives/comm_stream.hpp: why)
      else stream_.drain();
    }
    return handle(mask);
  }
  /// Starts `job` on the communicator of `mask` on the device's communication worker, behind its
  /// earlier asynchronous collectives; the typed `*_start` collectives' one way in. With an active
  /// observer (tracing, debug mode) the job runs here and now, where the observer expects it (its
  /// checks may issue collectives of their own); its error is still reported at `wait()`.
  [[nodiscard]] std::shared_ptr<stream_op> start(axis_mask mask, std::function<void(device_comm&)> job) {
    device_comm& c = handle(mask);
    if (synchronous_starts()) {
      std::exception_ptr error;
      try {
        job(c);
      } catch (...) {
        error = std::current_exception();
      }
      auto op = completed_op();
      op->error = std::move(error);
      return op;
    }
    return stream_.enqueue([&c, job = std::move(job)] { job(c); }, mask);
  }
  /// The device's communication worker (requests wait on it).
  [[nodiscard]] comm_stream& stream() noexcept { return stream_; }
  /// Whether this device's communicators take device memory: a stream backend (NCCL, shared-GPU),
  /// whose collectives the typed layer enqueues on the device's stream (`stream_ordered_v`).
  [[nodiscard]] virtual bool takes_device_memory() const noexcept { return false; }
  /// Waits for the collectives this device enqueued on its stream (a stream backend) and throws
  /// their error, bounded by the communicator's timeout; the end of every device call
  /// (exec/detail/run_devices.hpp). Nothing to do on a host backend.
  void synchronize() {
    stream_.drain();
    synchronize_handles();
  }
  /// The buffers this device's typed collectives reuse (collectives/workspace.hpp): its thread's,
  /// which outlive the call; the buffers the call's results still hold are dropped when it ends.
  /// (Templates, as the workspace is: compiled where collectives run; call them as plain functions.)
  template <class Tag = void>
  [[nodiscard]] basic_collective_workspace<Tag>& workspace() noexcept {
    return thread_workspace<Tag>();
  }

 protected:
  device_context() = default;
  /// The communicator of `mask`. Its first use splits it from the world communicator, a collective
  /// on the device thread, after the worker has drained.
  [[nodiscard]] virtual device_comm& handle(axis_mask mask) = 0;
  /// Whether starts run at once on the device thread (an active observer).
  [[nodiscard]] virtual bool synchronous_starts() const noexcept = 0;
  /// Whether collectives of different groups may run at once on two threads (a host backend).
  [[nodiscard]] virtual bool independent_groups() const noexcept = 0;
  /// `device_comm::synchronize` on every communicator handed out.
  virtual void synchronize_handles() {}
  /// The worker: stopped by the derived context's destructor, before its communicators go.
  comm_stream stream_;
  /// The end of the device's call, on its own thread: results that leave the call keep their
  /// buffers, and the workspace lets go of them (collectives/workspace.hpp).
  template <class Tag = void>
  void end_call() noexcept {
    try {
      thread_workspace<Tag>().release_held();
    } catch (...) {  // nothing in it allocates; a failure only keeps a buffer for longer
    }
  }
};

/// The `device_context` of a device of mesh `Mesh` on backend communicator `C`: owns the world
/// communicator and the device's `axis_communicators`. With an active `observer` (collectives/
/// observer.hpp; the runner installs the debug layer's while tracing, debug mode or a Kokkos tool
/// is on), its communicators are handed out decorated.
template <communicator C, mesh_type Mesh>
class device_context_for final : public device_context {
 public:
  device_context_for(const Mesh& mesh, std::size_t device, C world, experimental::comm_observer* observer = nullptr)
      : mesh_(mesh),
        device_(device),
        coords_(mesh.coords(device)),
        world_(std::move(world)),
        axes_(world_, mesh),
        observer_(observer != nullptr && observer->active() ? observer : nullptr) {}
  device_context_for(const device_context_for&) = delete;
  device_context_for& operator=(const device_context_for&) = delete;
  ~device_context_for() override {
    stream_.stop();  // the worker may be using the communicators below
    end_call();
  }

  std::size_t device() const noexcept override { return device_; }
  std::size_t find_axis(std::string_view name) const noexcept override { return Mesh::find_axis(name); }
  std::size_t axis_count() const noexcept override { return Mesh::ndim; }
  std::string_view axis_name(std::size_t axis) const noexcept override { return Mesh::axis_names[axis]; }
  std::size_t axis_size(std::size_t axis) const noexcept override { return mesh_.axis_size(axis); }
  std::size_t coord(std::size_t axis) const noexcept override { return coords_[axis]; }
  std::string describe_mesh() const override { return mesh_.to_string(); }
  const Mesh& mesh() const noexcept { return mesh_; }
  bool independent_groups() const noexcept override { return std::is_same_v<typename C::context_type, host_context>; }
  bool takes_device_memory() const noexcept override { return stream_ordered_v<C>; }
  void synchronize_handles() override {
    if constexpr (stream_ordered_v<C>)
      for (auto& [mask, h] : handles_) h->synchronize();
  }
  bool synchronous_starts() const noexcept override {
#if MESHLIB_DEBUG_HOOKS
    return observer_ != nullptr;
#else
    return false;
#endif
  }

  device_comm& handle(axis_mask mask) override {
    auto it = handles_.find(mask);
    if (it == handles_.end()) {
      // The split is a collective on the world communicator, on this thread: the worker must not
      // be using any of the device's communicators meanwhile (the world may be one of them).
      stream_.drain();
      it = handles_.emplace(mask, std::make_unique<device_comm_for<C>>(axes_.over(mask))).first;
    }
#if MESHLIB_DEBUG_HOOKS
    if (observer_ == nullptr) [[likely]] return *it->second;
    return observed(mask, *it->second);
#else
    return *it->second;
#endif
  }

 private:
  Mesh mesh_;
  std::size_t device_;
  typename Mesh::coord_type coords_;
  C world_;
  axis_communicators<C, Mesh> axes_;
  std::map<axis_mask, std::unique_ptr<device_comm_for<C>>> handles_;
  // The decorator point (collectives/observer.hpp): only with an active observer.
  experimental::comm_observer* observer_;
  std::map<axis_mask, std::unique_ptr<observed_comm<device_comm>>> observed_;

  device_comm& observed(axis_mask mask, device_comm& raw) {
    auto it = observed_.find(mask);
    if (it == observed_.end())
      it = observed_.emplace(mask, std::make_unique<observed_comm<device_comm>>(raw, *observer_,
                                                                                make_comm_site(mesh_, device_, mask)))
               .first;
    return *it->second;
  }
};

inline device_context*& current_device_slot() noexcept {
  thread_local device_context* current = nullptr;
  return current;
}

/// Installs `ctx` as this thread's device for its lifetime (nests: restores the previous one).
class scoped_device {
 public:
  explicit scoped_device(device_context& ctx) noexcept : previous_(current_device_slot()) { current_device_slot() = &ctx; }
  ~scoped_device() { current_device_slot() = previous_; }
  scoped_device(const scoped_device&) = delete;
  scoped_device& operator=(const scoped_device&) = delete;

 private:
  device_context* previous_;
};

/// The running device; throws `spmd_context_error` outside `shard_map` / `spmd`.
inline device_context& current_device(std::string_view what) {
  device_context* c = current_device_slot();
  if (!c)
    throw spmd_context_error("meshlib: " + std::string(what) +
                             " called outside shard_map / spmd: collectives and axis queries need a running device");
  return *c;
}

inline std::size_t current_axis(std::string_view what, std::string_view name) {
  device_context& c = current_device(what);
  const std::size_t a = c.find_axis(name);
  if (a >= c.axis_count())
    throw spmd_context_error("meshlib: " + std::string(what) + "<\"" + std::string(name) + "\">: the running mesh " +
                             c.describe_mesh() + " has no axis '" + std::string(name) + "'");
  return a;
}

}  // namespace detail

/// @brief This device's index along mesh axis `Name` (JAX's `lax.axis_index`), inside `shard_map` / `spmd`.
/// @throws spmd_context_error outside them, or when the running mesh has no axis `Name`.
template <fixed_string Name>
[[nodiscard]] std::size_t axis_index() {
  const std::size_t a = detail::current_axis("axis_index", Name.view());
  return detail::current_device("axis_index").coord(a);
}

/// @brief The size of mesh axis `Name` (JAX's `lax.axis_size` / `psum(1, name)`), inside `shard_map` / `spmd`.
/// @throws spmd_context_error outside them, or when the running mesh has no axis `Name`.
template <fixed_string Name>
[[nodiscard]] std::size_t axis_size() {
  const std::size_t a = detail::current_axis("axis_size", Name.view());
  return detail::current_device("axis_size").axis_size(a);
}

/// @brief Makes this device's communicator of its group along the axes `Names...` now, inside
/// `shard_map` / `spmd`. A group's first collective in a call makes it (a split of the call's
/// communicator of the whole mesh: a rendezvous of *every* device, not only the group's); calling
/// this where the devices are together anyway (at the start of the call) keeps that rendezvous out
/// of a later place where devices are apart, such as the first bucket started during a backward.
/// Every device must call it for the same axes in the same order, as it does collectives.
/// @code
/// meshlib::spmd(mesh, [&] {
///   meshlib::prepare_group<"data">();   // the split here, while the devices start together
///   auto g = backward();                 // ... psum_start<"data">(bucket) inside: no split there
/// });
/// @endcode
/// @throws spmd_context_error outside them, or when the running mesh lacks one of the axes.
template <fixed_string... Names>
void prepare_group() {
  static_assert(sizeof...(Names) > 0, "meshlib: prepare_group<>() names no axis; name the group's axes, e.g. "
                                      "prepare_group<\"data\">()");
  axis_mask mask = 0;
  ((mask |= axis_mask{1} << detail::current_axis("prepare_group", Names.view())), ...);
  (void)detail::current_device("prepare_group").comm(mask);
}

/// @brief The id of the device running this code (its row-major index in the mesh), inside `shard_map` / `spmd`.
[[nodiscard]] inline std::size_t device_index() { return detail::current_device("device_index").device(); }

}  // namespace meshlib
// end meshlib/collectives/device_context.hpp
// begin meshlib/collectives/collective_request.hpp
/// @file
/// @brief `collective_request<Result>`: what a typed collective's asynchronous form (`psum_start`)
/// returns, as c10d's `Work` or an MPI request with the typed result attached: `wait()` gives the
/// very value the synchronous form would have returned (its type computed and checked at compile
/// time as the synchronous form's), `test()` says whether it is ready.
/// @code
/// // inside shard_map / spmd, g a gradient bucket that is a pending sum over "data":
/// auto r = meshlib::psum_start<"data">(std::move(g));  // returns at once; the sum runs beside
/// compute_more();                                        // ... the device's own work
/// auto sum = r.wait();                                   // psum<"data">(g)'s value, same bits
/// @endcode
/// A request must be waited for on the device that started it, inside the same `shard_map` /
/// `spmd` call. One that is destroyed unwaited still completes first (its buffers may be in use);
/// its error, if any, is then dropped: the device's later collectives report the failure.

#include <any>
#include <memory>
#include <utility>


namespace meshlib {

/// @brief The pending result of an asynchronous typed collective (see the file comment).
/// @tparam Result the type the synchronous collective returns.
template <class Result>
class [[nodiscard]] collective_request {
 public:
  /// An empty request (nothing to wait for; `wait()` throws).
  collective_request() = default;
  /// Used by the `*_start` collectives: `op` completes on `stream`; `keep` holds the inputs the
  /// operation reads (released after completion, on the waiting thread).
  collective_request(detail::comm_stream& stream, std::shared_ptr<detail::stream_op> op, Result result,
                     std::any keep = {})
      : stream_(&stream), op_(std::move(op)), result_(std::move(result)), keep_(std::move(keep)) {}
  /// Takes over `o`'s operation (a moved-from request has none: its `wait()` is not called).
  collective_request(collective_request&& o) noexcept
      : stream_(o.stream_), op_(std::move(o.op_)), result_(std::move(o.result_)), keep_(std::move(o.keep_)) {}
  /// Completes this request's own operation first (a dropped request still completes), then takes
  /// over `o`'s.
  collective_request& operator=(collective_request&& o) noexcept {
    if (this != &o) {
      complete_quietly();
      stream_ = o.stream_;
      op_ = std::move(o.op_);
      result_ = std::move(o.result_);
      keep_ = std::move(o.keep_);
    }
    return *this;
  }
  collective_request(const collective_request&) = delete;
  collective_request& operator=(const collective_request&) = delete;
  ~collective_request() { complete_quietly(); }

  /// Whether the request has an operation not yet waited for.
  [[nodiscard]] bool valid() const noexcept { return op_ != nullptr; }

  /// @brief Blocks until the collective is complete and returns its result (once).
  /// @throws the backend's error (`comm_aborted`, `comm_timeout`, `collective_mismatch`, ...) when
  /// the collective failed; `meshlib::error` on an empty or already-waited request.
  Result wait() {
    if (!op_) throw error("meshlib: collective_request::wait() on an empty request (default-constructed, moved from or "
                          "already waited for); wait for each started collective once");
    auto op = std::move(op_);
    stream_->wait(*op);  // rethrows the collective's error
    keep_.reset();
    return std::move(result_);
  }

  /// Whether the collective is complete (`wait()` will not block). Does not throw its error.
  [[nodiscard]] bool test() const noexcept { return !op_ || detail::comm_stream::test(*op_); }

 private:
  void complete_quietly() noexcept {
    if (!op_) return;
    try {
      stream_->wait(*op_);
    } catch (...) {  // dropped on purpose (file comment): the device's next collective reports it
    }
    op_.reset();
  }

  detail::comm_stream* stream_ = nullptr;
  std::shared_ptr<detail::stream_op> op_;
  Result result_{};
  std::any keep_;
};

}  // namespace meshlib
// end meshlib/collectives/collective_request.hpp
// begin meshlib/collectives/axis_group.hpp
/// @file
/// @brief `axis_group<"i", "j">`: several mesh axes named together in one collective, as JAX's
/// tuple `axis_name=("i", "j")`. The group position of a device is row-major over the axes *in the
/// order written*, which may differ from the mesh's order; `axis_index<"i", "j">()` returns it.
/// @code
/// // mesh<axis<"i">, axis<"j">>, sizes 2 x 3: device (i, j) is at position j * 2 + i of ("j", "i")
/// auto g = meshlib::all_gather<meshlib::axis_group<"j", "i">, 0>(x);  // blocks in ("j", "i") order
/// std::size_t p = meshlib::axis_index<"j", "i">();                    // this device's position
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>


namespace meshlib {

/// @brief The mesh axes `Names...`, in the order written, as one collective's group (JAX's tuple
/// of axis names). Only a tag: it names axes, it holds nothing.
template <fixed_string... Names>
struct axis_group {
  static_assert(sizeof...(Names) > 0, "meshlib: axis_group needs at least one axis: axis_group<\"data\">");
  /// Tag that opts the group into the `axis_group_type` concept checks.
  using is_axis_group = void;
  /// How many axes the group names.
  static constexpr std::size_t size = sizeof...(Names);
  /// `F<Names...>`: how the library reaches the names. nvcc's front end (EDG, CUDA 13) does not
  /// match a partial specialization on `axis_group<Names...>` (a pack of class-type template
  /// parameters), so the traits below are written over this alias, never specialised on the group.
  template <template <fixed_string...> class F>
  using apply = F<Names...>;
  /// The group with `Name` appended.
  template <fixed_string Name>
  using append = axis_group<Names..., Name>;
};

/// @brief A type that is an `axis_group<...>`.
template <class G>
concept axis_group_type = requires { typename G::is_axis_group; };

namespace detail {

template <fixed_string... Names>
struct group_traits_of {
  /// Mesh positions of the axes, in the order written (`Mesh::ndim` for a name the mesh lacks).
  template <class Mesh>
  static constexpr std::array<std::size_t, sizeof...(Names)> positions{Mesh::find_axis(Names.view())...};
  /// The names, in the order written.
  static constexpr std::array<std::string_view, sizeof...(Names)> names{Names.view()...};
};

/// The traits of group `G` (`axis_group::apply`: see there why not a specialisation).
template <class G>
using group_traits = typename G::template apply<group_traits_of>;

/// Mesh positions of the axes of `G`, in the order written.
template <class Mesh, class G>
inline constexpr auto group_positions_v = group_traits<G>::template positions<Mesh>;

/// "'i'" or "('j', 'i')": the group as a message names it.
template <class G>
std::string describe_group() {
  const auto& n = group_traits<G>::names;
  if (n.size() == 1) return "'" + std::string(n[0]) + "'";
  std::string s = "(";
  for (std::size_t k = 0; k < n.size(); ++k) s += (k ? ", '" : "'") + std::string(n[k]) + "'";
  return s + ")";
}

/// Whether the axes at mesh positions `pos`, written in that order, are in mesh order: then the
/// communicator's rank is the group position and nothing needs reordering.
template <std::size_t K>
constexpr bool in_mesh_order(const std::array<std::size_t, K>& pos) noexcept {
  for (std::size_t k = 1; k < K; ++k)
    if (pos[k] < pos[k - 1]) return false;
  return true;
}

/// The position, row-major over the axes `pos` in the order written, of the device with mesh
/// coordinates `coord` (JAX's axis_index of a tuple of axes).
template <class Coord, std::size_t K>
std::size_t written_position(const Coord& coord, const std::vector<std::size_t>& sizes, const std::array<std::size_t, K>& pos) {
  std::size_t w = 0;
  for (std::size_t k = 0; k < K; ++k) w = w * sizes[pos[k]] + coord[pos[k]];
  return w;
}

/// For each rank `r` of the communicator over the axes `pos` (whose ranks run row-major in mesh
/// order), its position in the order written. Empty when the two orders agree.
template <std::size_t K>
std::vector<std::size_t> written_order(const std::vector<std::size_t>& axis_sizes, std::array<std::size_t, K> pos) {
  if (in_mesh_order(pos)) return {};
  std::array<std::size_t, K> sorted = pos;
  std::sort(sorted.begin(), sorted.end());
  std::size_t n = 1;
  for (auto p : pos) n *= axis_sizes[p];
  std::vector<std::size_t> coord(axis_sizes.size(), 0), out(n);
  for (std::size_t r = 0; r < n; ++r) {
    std::size_t rest = r;
    for (std::size_t k = K; k-- > 0;) {
      coord[sorted[k]] = rest % axis_sizes[sorted[k]];
      rest /= axis_sizes[sorted[k]];
    }
    out[r] = written_position(coord, axis_sizes, pos);
  }
  return out;
}

/// `written_order` for the group `G` on the running device's mesh.
template <class Mesh, class G>
std::vector<std::size_t> written_order_of(const Mesh& mesh) {
  std::vector<std::size_t> sizes(Mesh::ndim);
  for (std::size_t a = 0; a < Mesh::ndim; ++a) sizes[a] = mesh.axis_size(a);
  return written_order(sizes, group_positions_v<Mesh, G>);
}

}  // namespace detail

/// @brief This device's position in the group of the axes `A, B, More...`, row-major over them in
/// the order written (JAX's `lax.axis_index(("i", "j"))`). One axis: see `axis_index<"i">()`.
/// @throws spmd_context_error outside `shard_map` / `spmd`, or for an axis the running mesh lacks.
template <fixed_string A, fixed_string B, fixed_string... More>
[[nodiscard]] std::size_t axis_index() {
  constexpr std::array<std::string_view, 2 + sizeof...(More)> names{A.view(), B.view(), More.view()...};
  std::size_t w = 0;
  for (auto name : names) {
    const std::size_t a = detail::current_axis("axis_index", name);
    auto& dev = detail::current_device("axis_index");
    w = w * dev.axis_size(a) + dev.coord(a);
  }
  return w;
}

/// @brief The size of the group of the axes `A, B, More...` (the product of their sizes).
template <fixed_string A, fixed_string B, fixed_string... More>
[[nodiscard]] std::size_t axis_size() {
  return axis_size<A>() * axis_size<B>() * (std::size_t{1} * ... * axis_size<More>());
}

}  // namespace meshlib
// end meshlib/collectives/axis_group.hpp
// begin meshlib/collectives/type_rules.hpp
/// @file
/// @brief The compile-time rules of the typed collectives: what each accepts, the type it returns,
/// and the one `static_assert` a misuse fires.
///
/// A `local_tensor` carries `vary` (axes it may differ over), `partial` (axes over which it is a
/// pending sum) and `Dims` (per dimension, the axes it is a block of). The rules, as JAX's
/// `check_vma` plus the pending-sum set:
///
/// | op | needs, for its axis `a` | result |
/// | --- | --- | --- |
/// | `psum`, `pmean` | `a` in vary or partial | `a` out of vary, partial and every dim |
/// | `pmax`, `pmin` | `a` in vary; partial over no axis | `a` out of vary and every dim |
/// | `all_gather<a, d>` | `a` in vary; no dim but `d` a block of `a` | `a` out of vary and dim `d` |
/// | `psum_scatter<a, d>` | `a` in vary or partial; `d` not already a block of `a` | `a` in vary and dim `d`, out of partial |
/// | `all_to_all<a, s, c>` | `a` in vary; no dim but `c` a block of `a` | dim `c`'s `a` moves to dim `s` |
/// | `ppermute<a>` | `a` in vary | unchanged |
/// | `broadcast<a>` | `a` not in partial | `a` out of vary and every dim |
/// | `pvary<a>` | `a` in neither vary nor partial | `a` in vary |
///
/// Every collective other than psum / pmean / psum_scatter refuses a value partial over its axis,
/// because moving summands around does not move the sum; and pmax / pmin refuse any partial value,
/// because the max of summands is not the max of the sum.
///
/// Why a diagnostic function per rule: C++20 cannot put the axis name into a `static_assert` message,
/// so the message states the rule and the fix, and the failing condition (printed by GCC and Clang
/// on the error line or the note right under it) spells the operation, the axis and the value's
/// layout as `meshlib::diagnostic` types (see core/diagnostics.hpp): one error on either compiler.

#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>


namespace meshlib::detail {

// diag_value_t (a local value's layout spelled out) lives in tensor/local_tensor.hpp.

// Each diagnostic is a function whose one static_assert names, in its failing condition, the
// operation, the axis and the value's layout (see core/diagnostics.hpp); it returns false.

template <class Op, class Axis, class MeshAxes>
consteval bool collective_axis_not_in_mesh() {
  static_assert(always_false<Op, Axis, MeshAxes>,
                "meshlib: a collective names an axis that the mesh does not have (the operation, the axis and the "
                "mesh's axes are spelled out in the condition); name one of the mesh's axes");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool psum_over_invariant_axis() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: psum / pmean / psum_scatter over an axis the value neither varies over nor is partial over: "
                "it is already equal on every device of that axis, so the sum would only scale it by the axis size; "
                "drop the axis, or write pvary<axis>(x) first if you mean the scaled sum");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool reduction_over_invariant_axis() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: pmax / pmin over an axis the value does not vary over: it is already equal on every device "
                "of that axis; drop the axis, or write pvary<axis>(x) first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool extremum_of_partial_value() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: pmax / pmin of a value that is a pending sum (partial) over some axis: the max of the "
                "summands is not the max of the sum; psum over the partial axes first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool collective_of_partial_value() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: a data-movement collective over an axis the value is a pending sum (partial) over: moving "
                "summands does not move the sum; psum or psum_scatter over that axis first");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool collective_needs_varying_input() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: all_gather / all_to_all / ppermute over an axis the value does not vary over: every device "
                "of that axis already holds the same block; drop the collective, or write pvary<axis>(x) first if you "
                "mean it");
  return false;
}

template <class Op, class Axis, class Dim, class ShardedDim, class Value>
consteval bool gather_along_unsharded_dim() {
  static_assert(always_false<Op, Axis, Dim, ShardedDim, Value>,
                "meshlib: all_gather along a dimension that is not the one sharded on the axis (the second "
                "diagnostic::dim is the sharded one); gather along the sharded dimension, all_to_all to move the "
                "sharding first, or forget_dims<axis>(x) first to treat the block as unlabelled, as JAX does");
  return false;
}

template <class Op, class Axis, class Dim, class ShardedDim, class Value>
consteval bool concat_along_unsharded_dim() {
  static_assert(always_false<Op, Axis, Dim, ShardedDim, Value>,
                "meshlib: all_to_all concatenates along a dimension that is not the one sharded on the axis (the "
                "second diagnostic::dim is the sharded one); concatenate along the sharded dimension, or "
                "forget_dims<axis>(x) first to treat the block as unlabelled, as JAX does");
  return false;
}

template <class Op, class Axis, class Dim, class Value>
consteval bool dimension_already_sharded_on_axis() {
  static_assert(always_false<Op, Axis, Dim, Value>,
                "meshlib: psum_scatter / all_to_all would split a dimension over an axis that dimension is already "
                "sharded on; split another dimension, or forget_dims<axis>(x) first to treat the block as "
                "unlabelled (the JAX tutorial's psum_scatter of an already scattered block)");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool pvary_of_varying_value() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: pvary / pbroadcast over an axis the value already varies over or is partial over; drop the "
                "axis");
  return false;
}

template <class Op, class Axis, class Value>
consteval bool broadcast_of_partial_value() {
  static_assert(always_false<Op, Axis, Value>,
                "meshlib: broadcast over an axis the value is a pending sum (partial) over: one summand is not the "
                "sum; psum first");
  return false;
}

template <class Op, class Dim, class Rank>
consteval bool collective_dimension_out_of_range() {
  static_assert(always_false<Op, Dim, Rank>,
                "meshlib: a collective names a dimension past the value's rank (negative numbers count from the "
                "end, as in JAX)");
  return false;
}

template <class Op, class Axis>
consteval bool collective_axis_repeated() {
  static_assert(always_false<Op, Axis>, "meshlib: a collective names the same axis twice; name each axis once");
  return false;
}

template <class Op, class T>
consteval bool collective_element_type() {
  static_assert(always_false<Op, T>,
                "meshlib: collectives move float, double, bfloat16 and 32- or 64-bit signed integers only");
  return false;
}

/// The element-type check: true, or the diagnostic.
template <fixed_string Op, class T>
consteval bool check_element_type() {
  if constexpr (comm_element<T>) return true;
  else return collective_element_type<diag_op_t<Op>, T>();
}

/// The axis-in-mesh check: true, or the diagnostic.
template <fixed_string Op, fixed_string Axis, class Mesh>
consteval bool check_axis_in_mesh() {
  if constexpr (Mesh::template has_axis<Axis>) return true;
  else return collective_axis_not_in_mesh<diag_op_t<Op>, diag_axis_t<Axis>, diag_axes_t<Mesh, Mesh::all_axes>>();
}

/// A dimension number as JAX counts it: negative numbers count from `Rank` (the rank, or the rank
/// plus one where a dimension is inserted). Out of range maps to `Rank` (diagnosed by the caller).
template <int Dim, std::size_t Rank>
inline constexpr std::size_t norm_dim_v =
    Dim < 0 ? (static_cast<long long>(Rank) + Dim < 0 ? Rank : static_cast<std::size_t>(static_cast<long long>(Rank) + Dim))
            : (static_cast<std::size_t>(Dim) < Rank ? static_cast<std::size_t>(Dim) : Rank);

/// The range check of a dimension number: true, or the diagnostic.
template <fixed_string Op, int Dim, std::size_t Rank>
consteval bool check_dim() {
  if constexpr (norm_dim_v<Dim, Rank> < Rank) return true;
  else {
    using dim_t = std::conditional_t<(Dim < 0), diagnostic::dim<static_cast<std::size_t>(-Dim)>, diagnostic::dim<static_cast<std::size_t>(Dim)>>;
    return collective_dimension_out_of_range<diag_op_t<Op>, dim_t, diagnostic::size<Rank>>();
  }
}

/// Mask of the axes `Names...` of `Mesh` that exist (unknown names are diagnosed separately, so that
/// computing a result type never fires a second error).
template <class Mesh, fixed_string... Names>
inline constexpr axis_mask safe_mask_v =
    ((Mesh::template has_axis<Names> ? axis_mask{1} << Mesh::find_axis(Names.view()) : axis_mask{0}) | ... | axis_mask{0});

/// The first dimension of `Dims` that is a block of an axis in `bit`, or `Dims::size`.
template <class Dims>
constexpr std::size_t dim_sharded_on(axis_mask bit) noexcept {
  for (std::size_t d = 0; d < Dims::size; ++d)
    if (Dims::at(d) & bit) return d;
  return Dims::size;
}

// ---- result Dims ------------------------------------------------------------------------------

// (Written with index packs, not std::array template arguments, which crash GCC 12.)
template <class Dims, axis_mask Mask, class Seq = std::make_index_sequence<Dims::size>>
struct dims_without_impl;
template <class Dims, axis_mask Mask, std::size_t... I>
struct dims_without_impl<Dims, Mask, std::index_sequence<I...>> {
  using type = dim_masks<static_cast<axis_mask>(Dims::at(I) & ~Mask)...>;
};
template <class Dims, axis_mask Bit, std::size_t D, class Seq = std::make_index_sequence<Dims::size>>
struct dims_moved_impl;
template <class Dims, axis_mask Bit, std::size_t D, std::size_t... I>
struct dims_moved_impl<Dims, Bit, D, std::index_sequence<I...>> {
  using type = dim_masks<static_cast<axis_mask>((Dims::at(I) & ~Bit) | (I == D ? Bit : axis_mask{0}))...>;
};
template <class Dims, std::size_t D, class Seq = std::make_index_sequence<Dims::size + 1>>
struct dims_insert_impl;
template <class Dims, std::size_t D, std::size_t... I>
struct dims_insert_impl<Dims, D, std::index_sequence<I...>> {
  using type = dim_masks<(I == D ? axis_mask{0} : Dims::at(I < D ? I : I - 1))...>;
};

template <class Dims, std::size_t D, bool = (Dims::size > 0)>
struct remove_dim_or_self {
  using type = Dims;
};
template <class Dims, std::size_t D>
struct remove_dim_or_self<Dims, D, true> {
  using type = typename remove_dim_impl<Dims, D>::type;
};
/// `Dims` without dimension `D` (itself when it has no dimension: only in a refused call).
template <class Dims, std::size_t D>
using remove_dim_or_self_t = typename remove_dim_or_self<Dims, D>::type;

/// `Dims` with the axes of `Mask` removed from every dimension.
template <class Dims, axis_mask Mask>
using dims_without_t = typename dims_without_impl<Dims, Mask>::type;
/// `Dims` with `Bit` removed everywhere and added to dimension `D`.
template <class Dims, axis_mask Bit, std::size_t D>
using dims_moved_to_t = typename dims_moved_impl<Dims, Bit, D>::type;
/// `Dims` with a replicated dimension inserted at position `D` (untiled all_gather).
template <class Dims, std::size_t D>
using dims_insert_t = typename dims_insert_impl<Dims, D>::type;

}  // namespace meshlib::detail
// end meshlib/collectives/type_rules.hpp
// begin meshlib/collectives/block_ops.hpp
/// @file
/// @brief Copies of rectangular boxes between row-major buffers: what every collective does to
/// pack what it sends and unpack what it receives. Kernels in the blocks' memory space (issue 9:
/// no `std::vector` staging and host loops, so that device memory works unchanged), one index per
/// row: RangePolicy `parallel_for` through `launch`, the only launch that is safe from several
/// device threads on Kokkos 3.4.1 (tensor/view.hpp), over plain pointers.

#include <array>
#include <cstddef>
#include <span>


namespace meshlib::detail {

/// Number of elements of a box of shape `e`.
template <std::size_t Rank>
constexpr std::size_t box_size(const std::array<std::size_t, Rank>& e) noexcept {
  std::size_t n = 1;
  for (auto x : e) n *= x;
  return n;
}

/// One row (the last dimension) per index of a box copy between row-major buffers: plain
/// pointers and fixed arrays, so it runs on any execution space and copies no View (view.hpp).
template <class T, std::size_t Rank>
struct box_copy_kernel {
  static constexpr std::size_t n = Rank == 0 ? 1 : Rank;
  const T* src;
  T* dst;
  std::size_t src_shape[n], src_off[n], dst_shape[n], dst_off[n], ext[n];

  KOKKOS_INLINE_FUNCTION void operator()(std::size_t row) const {
    if constexpr (Rank == 0) {
      dst[0] = src[0];
    } else {
      std::size_t idx[n] = {};
      for (std::size_t k = Rank - 1; k-- > 0;) {  // row -> position in the box, last dimension excluded
        idx[k] = row % ext[k];
        row /= ext[k];
      }
      std::size_t s = 0, d = 0;
      for (std::size_t k = 0; k < Rank; ++k) {
        s = s * src_shape[k] + src_off[k] + idx[k];
        d = d * dst_shape[k] + dst_off[k] + idx[k];
      }
      for (std::size_t e = 0; e < ext[Rank - 1]; ++e) dst[d + e] = src[s + e];
    }
  }
};

/// Copies the box of extent `ext` at `src_off` in `src` (shape `src_shape`) to `dst_off` in `dst`
/// (shape `dst_shape`), both row-major and contiguous in memory `Space`: a kernel over the box's
/// rows on the running device's execution-space instance (`launch`).
template <class Space, class T, std::size_t Rank>
void copy_box(const T* src, const std::array<std::size_t, Rank>& src_shape, const std::array<std::size_t, Rank>& src_off,
              T* dst, const std::array<std::size_t, Rank>& dst_shape, const std::array<std::size_t, Rank>& dst_off,
              const std::array<std::size_t, Rank>& ext) {
  box_copy_kernel<T, Rank> k{src, dst, {}, {}, {}, {}, {}};
  if constexpr (Rank == 0) {
    launch<Space>(1, k);
  } else {
    if (box_size(ext) == 0) return;
    for (std::size_t d = 0; d < Rank; ++d) {
      k.src_shape[d] = src_shape[d];
      k.src_off[d] = src_off[d];
      k.dst_shape[d] = dst_shape[d];
      k.dst_off[d] = dst_off[d];
      k.ext[d] = ext[d];
    }
    launch<Space>(box_size(ext) / ext[Rank - 1], k);
  }
}

/// `n` contiguous elements from `src` to `dst` in memory `Space`, as a kernel.
template <class Space, class T>
void copy_elements(const T* src, std::size_t n, T* dst) {
  copy_box<Space>(src, std::array<std::size_t, 1>{n}, std::array<std::size_t, 1>{}, dst, std::array<std::size_t, 1>{n},
                  std::array<std::size_t, 1>{}, std::array<std::size_t, 1>{n});
}

/// `shape` with dimension `d` replaced by `v`.
template <std::size_t Rank>
constexpr std::array<std::size_t, Rank> with_extent(std::array<std::size_t, Rank> shape, std::size_t d, std::size_t v) noexcept {
  shape[d] = v;
  return shape;
}

/// Offset `o` along dimension `d`, zero elsewhere.
template <std::size_t Rank>
constexpr std::array<std::size_t, Rank> offset_along(std::size_t d, std::size_t o) noexcept {
  std::array<std::size_t, Rank> r{};
  r[d] = o;
  return r;
}

/// Which chunk block `r` of a packed buffer is: `order[r]`, or `r` when `order` is empty (the
/// group's rank order is the order written; see `written_order` in axis_group.hpp).
inline std::size_t chunk_of(std::span<const std::size_t> order, std::size_t r) noexcept {
  return order.empty() ? r : order[r];
}

/// Packs `src` (shape `shape`, memory `Space`) as `parts` consecutive blocks split along dimension
/// `d`: block r is chunk `chunk_of(order, r)`, the slab `[j*c, (j+1)*c)` of `d` for that j,
/// `c = shape[d] / parts`. (Packing and reordering are one pass: no staging buffer.)
template <class Space, class T, std::size_t Rank>
void pack_chunks(const T* src, const std::array<std::size_t, Rank>& shape, std::size_t d, std::size_t parts, T* dst,
                 std::span<const std::size_t> order = {}) {
  const std::size_t c = shape[d] / parts;
  const auto chunk = with_extent(shape, d, c);
  const std::size_t n = box_size(chunk);
  for (std::size_t r = 0; r < parts; ++r)
    copy_box<Space>(src, shape, offset_along<Rank>(d, chunk_of(order, r) * c), dst + r * n, chunk,
                    std::array<std::size_t, Rank>{}, chunk);
}

/// The inverse: `parts` consecutive blocks of shape `chunk` in `src`, block r placed as chunk
/// `chunk_of(order, r)` along dimension `d` of `dst` (whose extent along `d` is `parts * chunk[d]`).
template <class Space, class T, std::size_t Rank>
void unpack_chunks(const T* src, const std::array<std::size_t, Rank>& chunk, std::size_t d, std::size_t parts, T* dst,
                   std::span<const std::size_t> order = {}) {
  const auto shape = with_extent(chunk, d, chunk[d] * parts);
  const std::size_t n = box_size(chunk);
  for (std::size_t r = 0; r < parts; ++r)
    copy_box<Space>(src + r * n, chunk, std::array<std::size_t, Rank>{}, dst, shape,
                    offset_along<Rank>(d, chunk_of(order, r) * chunk[d]), chunk);
}

}  // namespace meshlib::detail
// end meshlib/collectives/block_ops.hpp
// begin meshlib/collectives/reductions.hpp
/// @file
/// @brief `psum`, `pmean`, `pmax`, `pmin`: all-reduce over one or more mesh axes, as `jax.lax.psum`
/// and friends. The result is invariant over the axes (and no longer partial over them). Results
/// are written out of place into the device's workspace (collectives/workspace.hpp): after the
/// first call of a shape, a call allocates and copies nothing, and never overwrites a result
/// that is still held.
/// @code
/// // inside shard_map over mesh<axis<"data">, axis<"model">>, x varies over both:
/// auto s = meshlib::psum<"model">(x);          // the sum over the model group; varies over data only
/// auto m = meshlib::pmean<"data", "model">(x); // the mean over every device
/// @endcode

#include <algorithm>
#include <any>
#include <array>
#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>


namespace meshlib {

namespace detail {

/// A fresh, uninitialised block of `shape` for the result of a collective on `L`.
template <class L, std::size_t R = L::rank>
auto result_view(const std::array<std::size_t, R>& shape) {
  return allocate<typename L::value_type, R, typename L::memory_space>(shape, "meshlib::collective", false);
}

/// A block of `shape` for the result of a collective, from the running device's workspace
/// (collectives/workspace.hpp): reused when nobody holds it any more, so a repeated call allocates nothing.
template <class T, std::size_t R, class Space>
block_view_t<T, R, Space> workspace_view(device_context& ctx, const std::array<std::size_t, R>& shape) {
  return ctx.workspace().template acquire<T, R, Space>(shape);
}

/// The contiguous data of `x` (collectives move whole blocks; a strided view must be copied first).
/// A block in device memory needs a stream backend (NCCL, shared-GPU: `gpu_runner`): without NCCL
/// compiled in (`MESHLIB_ENABLE_NCCL`) that is a compile-time error, with it the running device's
/// communicator is checked (a host one, thread or MPI, cannot read device memory).
template <class L>
const typename L::value_type* contiguous_data(const L& x, std::string_view op) {
  using space_t = typename L::memory_space;
  static_assert(host_accessible_v<space_t> || config::nccl,
                "meshlib: the host collectives need host-accessible blocks; use the NCCL backend for device memory");
  if constexpr (!host_accessible_v<space_t>) {
    if (!current_device(op).takes_device_memory())
      throw sharding_error("meshlib: " + std::string(op) + " on a block in device memory (" +
                           std::string(space_t::name()) +
                           "), but this device's communicator is a host one (thread or MPI), which reads host memory; "
                           "run on meshlib::gpu_runner (NCCL or shared-GPU communicators; default_runner picks it "
                           "when a GPU is present), or copy the block to host memory first");
  }
  if (x.size() != 0 && !x.view().span_is_contiguous())
    throw sharding_error("meshlib: " + std::string(op) + " needs a contiguous block; copy the strided view first");
  return x.data();
}

template <fixed_string Op, class L, bool AllowPartial, fixed_string Axis>
consteval bool check_reduction_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) {
    return check_axis_in_mesh<Op, Axis, mesh_t>();
  } else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    using op_t = diag_op_t<Op>;
    using axis_t = diag_axis_t<Axis>;
    if constexpr (!AllowPartial && L::partial != 0) return extremum_of_partial_value<op_t, axis_t, diag_value_t<L>>();
    else if constexpr (AllowPartial && ((L::vary | L::partial) & bit) == 0)
      return psum_over_invariant_axis<op_t, axis_t, diag_value_t<L>>();
    else if constexpr (!AllowPartial && (L::vary & bit) == 0)
      return reduction_over_invariant_axis<op_t, axis_t, diag_value_t<L>>();
    else return true;
  }
}

template <fixed_string Op, class L, bool AllowPartial, fixed_string... Names>
consteval bool check_reduction() {
  static_assert(sizeof...(Names) > 0, "meshlib: psum / pmean / pmax / pmin need at least one axis: psum<\"data\">(x)");
  if constexpr (!check_element_type<Op, typename L::value_type>()) return false;
  else return (check_reduction_axis<Op, L, AllowPartial, Names>() && ...);
}

/// The element type of `pmean`'s result: JAX's true division, so an integer mean is a floating
/// value (int32 -> float, as JAX's float32; int64 -> double), never a truncated integer.
template <class T>
using mean_value_t = std::conditional_t<std::is_integral_v<T>, std::conditional_t<(sizeof(T) <= 4), float, double>, T>;

/// `m[i] = s[i] / n` for `i < count`, on `Space`. A named function rather than a lambda in
/// `all_reduce_over`: nvcc refuses an extended device lambda inside a function whose return type is
/// deduced.
template <class Space, class T, class U>
void divide_into(U* m, const T* s, U n, std::size_t count) {
  launch<Space>(count, KOKKOS_LAMBDA(std::size_t i) { m[i] = static_cast<U>(s[i]) / n; });
}

/// Runs `op` on the communicator of `mask` and returns `result`: now (`Async` false), or started on
/// the device's communication worker, returning the `collective_request` of `result`; `keep` holds
/// what the operation reads until it is complete. One function, so the synchronous form is the
/// asynchronous one minus the worker, with the same types, checks and buffers.
template <bool Async, class Result, class F>
auto issue(device_context& ctx, axis_mask mask, Result result, F op, std::any keep = {}) {
  if constexpr (Async) {
    auto started = ctx.start(mask, std::move(op));
    return collective_request<Result>(ctx.stream(), std::move(started), std::move(result), std::move(keep));
  } else {
    op(ctx.comm(mask));
    return result;
  }
}

/// The all-reduce `op` over the axes `Names...` of `x` (`Async`: started, see `issue`).
template <fixed_string Op, reduce_op ROp, bool AllowPartial, fixed_string... Names, class L, bool Async = false>
auto all_reduce_over(const L& x, std::bool_constant<Async> = {}) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_reduction<Op, L, AllowPartial, Names...>();
  constexpr axis_mask mask = safe_mask_v<mesh_t, Names...>;
  using T = typename L::value_type;
  // An integer mean is a sum in T (wrapping, as JAX's int32 psum) then a true division.
  constexpr bool int_mean = ROp == reduce_op::mean && std::is_integral_v<T>;
  using U = std::conditional_t<int_mean, mean_value_t<T>, T>;
  using result_t = rebind_local_t<L, U, L::rank, L::vary & ~mask, L::partial & ~mask,
                                  dims_without_t<typename L::dims_type, mask>>;
  if constexpr (!ok) {
    if constexpr (Async) return collective_request<result_t>{};
    else return result_t{};
  } else if constexpr (Async) {
    static_assert(!int_mean, "meshlib: the asynchronous form of an integer pmean is not provided; psum_start and divide");
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, Op.view());
    device_context& ctx = current_device(Op.view());
    auto out = workspace_view<T, L::rank, space_t>(ctx, x.shape());
    T* dst = out.data();
    const std::size_t count = x.size();
    return issue<true>(ctx, mask, result_t(out, x.mesh(), x.device()),
                       [src, dst, count](device_comm& c) { c.all_reduce(src, dst, count, datatype_of<T>, ROp); },
                       std::any(x));
  } else {
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, Op.view());
    device_context& ctx = current_device(Op.view());
    auto& comm = ctx.comm(mask);
    if constexpr (int_mean) {
      // The integer sum in a staging buffer, then the true division into the result.
      auto sum = ctx.workspace().template scratch<T, space_t>(x.size());
      comm.all_reduce(src, sum.data(), x.size(), datatype_of<T>, reduce_op::sum);
      auto mean = workspace_view<U, L::rank, space_t>(ctx, x.shape());
      divide_into<space_t>(mean.data(), static_cast<const T*>(sum.data()), static_cast<U>(comm.size()), x.size());
      return result_t(mean, x.mesh(), x.device());
    } else {
      // Out of place: the backend reads x where it lies and writes the workspace's buffer.
      auto out = workspace_view<T, L::rank, space_t>(ctx, x.shape());
      comm.all_reduce(src, out.data(), x.size(), datatype_of<T>, ROp);
      return result_t(out, x.mesh(), x.device());
    }
  }
}

/// The all-reduce of a donated `x` (an rvalue): in `x`'s own buffer when `x` is its only holder,
/// or when `x` is a view over a caller's buffer (an unmanaged view: no holder count, the caller
/// owns the buffer and gave it up by moving it), and contiguous, so the call allocates and copies
/// nothing; otherwise as `all_reduce_over`.
template <fixed_string Op, reduce_op ROp, bool AllowPartial, fixed_string... Names, class L, bool Async = false>
auto all_reduce_donated(L&& x, std::bool_constant<Async> async = {}) {
  constexpr bool ok = check_reduction<Op, L, AllowPartial, Names...>();
  if constexpr (!ok) {
    return all_reduce_over<Op, ROp, AllowPartial, Names...>(x, async);  // fires the same diagnostic
  } else {
    // One holder: the handle is this device's own block (view.hpp's rule), so the count is exact.
    // A result of an earlier collective is held by the workspace too, which counts as no holder.
    // A caller's buffer (use_count 0) is the caller's to give.
    device_context& ctx = current_device(Op.view());
    const long count = x.view().use_count();
    const bool borrowed = count == 0 && x.data() != nullptr;
    const long holders = count - (ctx.workspace().holds(x.view()) ? 1 : 0);
    if ((!borrowed && holders != 1) || (x.size() != 0 && !x.view().span_is_contiguous()))
      return all_reduce_over<Op, ROp, AllowPartial, Names...>(x, async);
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = safe_mask_v<mesh_t, Names...>;
    using result_t = with_vary_partial_t<with_dims_t<L, dims_without_t<typename L::dims_type, mask>>, L::vary & ~mask,
                                         L::partial & ~mask>;
    using T = typename L::value_type;
    auto buffer = x.view();
    T* data = buffer.data();
    const std::size_t elements = x.size();
    return issue<Async>(ctx, mask, result_t(std::move(buffer), x.mesh(), x.device()),
                        [data, elements](device_comm& c) { c.all_reduce(data, elements, datatype_of<T>, ROp); });
  }
}

}  // namespace detail

/// @brief Sum over the devices of the axes `Names...` (JAX `lax.psum`). `x` must vary over, or be
/// partial over, each axis; the result is invariant over them. Sums in rank order: bitwise
/// reproducible.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum(const L& x) {
  return detail::all_reduce_over<"psum", reduce_op::sum, true, Names...>(x);
}

/// @brief `psum` of a donated value (JAX's `donate_argnums`): `psum<"x">(std::move(x))` sums in
/// `x`'s buffer when nothing else holds it, with no allocation or copy, and the result takes the
/// buffer over (`x` must not be read afterwards). A block something else still holds (an input of
/// `shard_map`, a copy) is copied first, as the lvalue overload does. A value over a caller's
/// buffer (a view made from a pointer, which counts no holders) is summed in that buffer: the
/// caller owns it and donates it by moving (a temporary that wraps a buffer still to be read must
/// be passed as an lvalue, which copies).
/// @code
/// auto g = meshlib::psum<"data">(std::move(grad));   // grad's buffer now holds the sum
/// // a bucket of a caller's flat buffer, summed where it lies:
/// using B = meshlib::local_tensor<float, 1, mesh_t, 0, mesh_t::mask_of<"data">()>;
/// (void)meshlib::psum<"data">(B(B::view_type(flat + offset, len), mesh, dev));
/// @endcode
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto psum(L&& x) {
  return detail::all_reduce_donated<"psum", reduce_op::sum, true, Names...>(std::move(x));
}

/// @brief `psum` started asynchronously: returns at once a `collective_request` whose `wait()`
/// returns what `psum<Names...>(x)` returns (same type, same bits: the same reduction in the same
/// order), while the sum runs on the device's communication worker (collectives/comm_stream.hpp).
/// The same compile-time checks as `psum`. `x` is kept alive by the request; every device of the
/// group must start the same collectives in the same order (as for every collective).
/// @code
/// auto r = meshlib::psum_start<"data">(x);
/// auto other = local_work();        // overlaps the sum
/// auto s = r.wait();                // == psum<"data">(x); errors (comm_aborted, ...) surface here
/// @endcode
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto psum_start(const L& x) {
  return detail::all_reduce_over<"psum", reduce_op::sum, true, Names...>(x, std::true_type{});
}

/// @brief `psum_start` of a donated value: summed in `x`'s buffer under `psum`'s donation rule, which
/// the request's result takes over; nothing is allocated or copied. The training layer's gradient
/// buckets are started this way, as soon as backward has completed them.
/// @code
/// auto r = meshlib::psum_start<"data">(std::move(grad));  // grad must not be read afterwards
/// auto g = r.wait();                                      // grad's buffer, now the sum
/// @endcode
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto psum_start(L&& x) {
  return detail::all_reduce_donated<"psum", reduce_op::sum, true, Names...>(std::move(x), std::true_type{});
}

/// @brief Mean over the devices of the axes `Names...` (JAX `lax.pmean`); the type rule of `psum`.
/// The mean of integers is a true division, as in JAX: `float` for 32-bit integers (JAX's float32),
/// `double` for 64-bit ones; for a truncated integer mean write `psum` and divide.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmean(const L& x) {
  return detail::all_reduce_over<"pmean", reduce_op::mean, true, Names...>(x);
}

/// @brief Elementwise maximum over the devices of the axes `Names...` (JAX `lax.pmax`). `x` must
/// vary over each axis and be partial over none.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmax(const L& x) {
  return detail::all_reduce_over<"pmax", reduce_op::max, false, Names...>(x);
}

/// @brief Elementwise minimum over the devices of the axes `Names...` (JAX `lax.pmin`); the type rule of `pmax`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pmin(const L& x) {
  return detail::all_reduce_over<"pmin", reduce_op::min, false, Names...>(x);
}

/// @brief `pmax` of a donated value: in `x`'s buffer under `psum`'s donation rule.
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto pmax(L&& x) {
  return detail::all_reduce_donated<"pmax", reduce_op::max, false, Names...>(std::move(x));
}

/// @brief `pmin` of a donated value: in `x`'s buffer under `psum`'s donation rule.
template <fixed_string... Names, local_tensor_type L>
  requires(!std::is_reference_v<L>)
[[nodiscard]] auto pmin(L&& x) {
  return detail::all_reduce_donated<"pmin", reduce_op::min, false, Names...>(std::move(x));
}

}  // namespace meshlib
// end meshlib/collectives/reductions.hpp
// begin meshlib/collectives/gathers.hpp
/// @file
/// @brief `all_gather`, `psum_scatter`, `all_to_all`: the collectives that change a block's shape,
/// as `jax.lax.all_gather`, `jax.lax.psum_scatter` and `jax.lax.all_to_all`, tiled (meshlib's
/// default) or untiled (`meshlib::untiled`, JAX's default `tiled=False`), over one axis (`"i"`) or
/// several in the order written (`axis_group<"j", "i">`). Blocks are placed in group-position order:
/// the block of the device at position `p` of the group (`axis_index<...>()`) is chunk `p` of the
/// gathered (or scattered) dimension. Dimension numbers may be negative and count from the end, as
/// in JAX (for the untiled all_gather, from the end of the result).
/// @code
/// // x: block of a P<"data", none> array, shape (2, 6) on each of 4 devices of axis "data"
/// auto full   = meshlib::all_gather<"data", 0>(x);                    // (8, 6), invariant over data
/// auto stack  = meshlib::all_gather<"data", 0>(x, meshlib::untiled);  // (4, 2, 6)
/// auto moved  = meshlib::all_to_all<"data", 1, 0>(x);                 // (8, 6/4): now sharded on dim 1
/// auto shard  = meshlib::psum_scatter<"data", 0>(y);                  // sum over data, scattered on dim 0
/// auto both   = meshlib::all_gather<meshlib::axis_group<"model", "data">, -1>(z);  // ('model', 'data')
/// @endcode

#include <any>
#include <array>
#include <bit>
#include <cstddef>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>


namespace meshlib {

/// @brief Tag of the untiled forms (JAX `tiled=False`): `all_gather` stacks the blocks along a new
/// dimension, `psum_scatter` removes the scattered dimension, `all_to_all` removes the split
/// dimension and inserts one of the group size at the concat position.
struct untiled_t {
  explicit untiled_t() = default;
};
/// @brief Tag for the untiled all_gather (a new leading dimension, as `lax.all_gather(tiled=False)`).
inline constexpr untiled_t untiled{};

namespace detail {

/// What a collective needs of the value, per axis of its group.
enum class axis_rule {
  moves,  ///< varies over the axis, not partial over it (all_gather, all_to_all, ppermute)
  sums,   ///< varies over or is partial over the axis (psum_scatter)
};

template <fixed_string Op, class L, fixed_string Axis, axis_rule Rule>
consteval bool check_group_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) {
    return check_axis_in_mesh<Op, Axis, mesh_t>();
  } else {
    constexpr axis_mask bit = axis_mask{1} << mesh_t::find_axis(Axis.view());
    if constexpr (Rule == axis_rule::sums && ((L::vary | L::partial) & bit) == 0)
      return psum_over_invariant_axis<diag_op_t<Op>, diag_axis_t<Axis>, diag_value_t<L>>();
    else if constexpr (Rule == axis_rule::moves && (L::partial & bit) != 0)
      return collective_of_partial_value<diag_op_t<Op>, diag_axis_t<Axis>, diag_value_t<L>>();
    else if constexpr (Rule == axis_rule::moves && (L::vary & bit) == 0)
      return collective_needs_varying_input<diag_op_t<Op>, diag_axis_t<Axis>, diag_value_t<L>>();
    else return true;
  }
}

template <fixed_string... Names>
struct group_checks_of {
  /// Element type, each axis in the mesh and as `Rule` wants it, no axis twice.
  template <fixed_string Op, class L, axis_rule Rule>
  static consteval bool run() {
    using mesh_t = typename L::mesh_type;
    if constexpr (!check_element_type<Op, typename L::value_type>()) return false;
    else if constexpr (!(check_group_axis<Op, L, Names, Rule>() && ...)) return false;
    else if constexpr (std::popcount(safe_mask_v<mesh_t, Names...>) != sizeof...(Names))
      return collective_axis_repeated<diag_op_t<Op>, diag_axes_t<mesh_t, safe_mask_v<mesh_t, Names...>>>();
    else return true;
  }
  template <class Mesh>
  static constexpr axis_mask mask = safe_mask_v<Mesh, Names...>;
};

/// The checks of group `G` (`axis_group::apply`: nvcc matches no specialisation on the group).
template <class G>
using group_checks = typename G::template apply<group_checks_of>;

/// Mask of the axes of group `G` (those the mesh has).
template <class Mesh, class G>
inline constexpr axis_mask group_mask_v = group_checks<G>::template mask<Mesh>;

/// The first dimension other than `Keep` that is a block of an axis of `Mask`, or `Dims::size`.
template <class Dims>
constexpr std::size_t other_dim_sharded_on(axis_mask mask, std::size_t keep) noexcept {
  for (std::size_t d = 0; d < Dims::size; ++d)
    if (d != keep && (Dims::at(d) & mask) != 0) return d;
  return Dims::size;
}

template <class L, class G, int DimArg>
consteval bool check_all_gather() {
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"all_gather", L, axis_rule::moves>()) return false;
  else if constexpr (!check_dim<"all_gather", DimArg, L::rank>()) return false;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    constexpr std::size_t other = other_dim_sharded_on<typename L::dims_type>(mask, dim);
    if constexpr (other != L::rank)
      return gather_along_unsharded_dim<diag_op_t<"all_gather">, diag_axes_t<mesh_t, mask & L::dims_type::at(other)>,
                                        diagnostic::dim<dim>, diagnostic::dim<other>, diag_value_t<L>>();
    else return true;
  }
}

template <class L, class G, int DimArg>
consteval bool check_all_gather_untiled() {
  if constexpr (!group_checks<G>::template run<"all_gather", L, axis_rule::moves>()) return false;
  else return check_dim<"all_gather", DimArg, L::rank + 1>();
}

template <class L, class G, int DimArg, bool Tiled>
consteval bool check_psum_scatter() {
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"psum_scatter", L, axis_rule::sums>()) return false;
  else if constexpr (!check_dim<"psum_scatter", DimArg, L::rank>()) return false;
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    if constexpr (Tiled && (L::dims_type::at(dim) & mask) != 0)
      return dimension_already_sharded_on_axis<diag_op_t<"psum_scatter">, diag_axes_t<mesh_t, mask & L::dims_type::at(dim)>,
                                               diagnostic::dim<dim>, diag_value_t<L>>();
    else return true;
  }
}

template <class L, class G, int SplitArg, int ConcatArg, bool Tiled>
consteval bool check_all_to_all() {
  constexpr std::size_t split = norm_dim_v<SplitArg, L::rank>;
  constexpr std::size_t concat = norm_dim_v<ConcatArg, L::rank>;
  if constexpr (!group_checks<G>::template run<"all_to_all", L, axis_rule::moves>()) return false;
  else if constexpr (!check_dim<"all_to_all", SplitArg, L::rank>()) return false;
  else if constexpr (!check_dim<"all_to_all", ConcatArg, L::rank>()) return false;
  else if constexpr (!Tiled) return true;  // the untiled form forgets the per-dimension labels of its axes
  else {
    using mesh_t = typename L::mesh_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    constexpr std::size_t other = other_dim_sharded_on<typename L::dims_type>(mask, concat);
    if constexpr (split != concat && (L::dims_type::at(split) & mask) != 0)
      return dimension_already_sharded_on_axis<diag_op_t<"all_to_all">, diag_axes_t<mesh_t, mask & L::dims_type::at(split)>,
                                               diagnostic::dim<split>, diag_value_t<L>>();
    else if constexpr (other != L::rank)
      return concat_along_unsharded_dim<diag_op_t<"all_to_all">, diag_axes_t<mesh_t, mask & L::dims_type::at(other)>,
                                        diagnostic::dim<concat>, diagnostic::dim<other>, diag_value_t<L>>();
    else return true;
  }
}

/// Throws unless dimension `dim` of size `extent` splits into `n` chunks (tiled: `n` divides it;
/// untiled: it equals `n`).
template <class G>
void check_split(std::string_view op, std::size_t dim, std::size_t extent, std::size_t n, bool tiled) {
  if (tiled ? extent % n != 0 : extent != n)
    throw sharding_error("meshlib: " + std::string(op) + " over " + describe_group<G>() + " (group size " +
                         std::to_string(n) + ") splits dimension " + std::to_string(dim) + " of size " +
                         std::to_string(extent) + (tiled ? ", which is not divisible by " : ", which the untiled form needs to equal ") +
                         std::to_string(n));
}

/// `shape` without dimension `d`.
template <std::size_t Rank>
std::array<std::size_t, Rank - 1> without_dim(const std::array<std::size_t, Rank>& shape, std::size_t d) {
  std::array<std::size_t, Rank - 1> out{};
  for (std::size_t i = 0, j = 0; i < Rank; ++i)
    if (i != d) out[j++] = shape[i];
  return out;
}

/// `shape` with a dimension of size `v` inserted at position `d`.
template <std::size_t Rank>
std::array<std::size_t, Rank + 1> with_dim(const std::array<std::size_t, Rank>& shape, std::size_t d, std::size_t v) {
  std::array<std::size_t, Rank + 1> out{};
  for (std::size_t i = 0, j = 0; i < Rank + 1; ++i) out[i] = i == d ? v : shape[j++];
  return out;
}

/// Whether the chunks of `shape` along dimension `d` are consecutive blocks in memory (every
/// dimension before `d` of extent 1), so that a collective's packed buffer is the block itself.
template <std::size_t Rank>
constexpr bool chunks_contiguous(const std::array<std::size_t, Rank>& shape, std::size_t d) noexcept {
  for (std::size_t k = 0; k < d; ++k)
    if (shape[k] != 1) return false;
  return true;
}

/// All-gathers `src` (a block of shape `chunk`) over `comm` into `out`, the `n` blocks side by side
/// along dimension `dim` in the order written (`order`, see `written_order`): straight into `out`
/// when its chunks are consecutive in memory, else through a workspace staging buffer.
template <class Space, class T, std::size_t Rank>
void gather_into(device_context& ctx, device_comm& comm, const T* src, const std::array<std::size_t, Rank>& chunk,
                 std::size_t dim, std::size_t n, const std::vector<std::size_t>& order, T* out) {
  const std::size_t count = box_size(chunk);
  if (order.empty() && chunks_contiguous(chunk, dim)) {
    comm.all_gather(src, out, count, datatype_of<T>);
    return;
  }
  auto recv = ctx.workspace().template scratch<T, Space>(count * n);
  comm.all_gather(src, recv.data(), count, datatype_of<T>);
  unpack_chunks<Space>(recv.data(), chunk, dim, n, out, order);
}

/// The block a collective writes its result of `shape` into: `into`'s own when the caller gave
/// one (`Into` a local tensor: its shape must be `shape`, contiguous), else one from the workspace.
template <class T, std::size_t Rank, class Space, class Into>
block_view_t<T, Rank, Space> result_block(device_context& ctx, std::string_view op, const std::array<std::size_t, Rank>& shape,
                                          const Into& into) {
  if constexpr (std::is_same_v<Into, std::nullptr_t>) {
    return workspace_view<T, Rank, Space>(ctx, shape);
  } else {
    static_assert(std::is_same_v<typename Into::value_type, T> && Into::rank == Rank &&
                      std::is_same_v<typename Into::memory_space, Space>,
                  "meshlib: the output block of a collective's _into form needs the result's element type, rank "
                  "and memory space");
    if (into.shape() != shape || (into.size() != 0 && !into.view().span_is_contiguous()))
      throw sharding_error("meshlib: " + std::string(op) + "_into: the output block has shape " +
                           describe_shape(into.shape()) + ", but the result has shape " + describe_shape(shape) +
                           " (a contiguous block is needed); pass a block of the result's shape");
    return into.view();
  }
}

template <class G, int DimArg, class L, class Into = std::nullptr_t, bool Async = false>
auto all_gather_tiled(const L& x, const Into& into = nullptr, std::bool_constant<Async> = {}) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_gather<L, G, DimArg>();
  constexpr std::size_t dim = norm_dim_v<DimArg, L::rank>;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  using result_t = with_vary_t<with_dims_t<L, dims_without_t<typename L::dims_type, mask>>, L::vary & ~mask>;
  if constexpr (!ok) {
    if constexpr (Async) return collective_request<result_t>{};
    else return result_t{};
  } else if constexpr (Async) {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    const std::size_t n = x.mesh().axes_size(mask);  // (comm(mask) would wait for the started ones)
    auto out = result_block<T, L::rank, space_t>(ctx, "all_gather", with_extent(x.shape(), dim, x.extent(dim) * n), into);
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    if (order.empty() && chunks_contiguous(x.shape(), dim)) {  // the blocks land where they belong: started
      T* dst = out.data();
      const std::size_t count = x.size();
      return issue<true>(ctx, mask, result_t(out, x.mesh(), x.device()),
                         [src, dst, count](device_comm& c) { c.all_gather(src, dst, count, datatype_of<T>); },
                         std::any(x));
    }
    // Reordered or strided chunks are unpacked by a kernel on this thread: gathered now, complete.
    gather_into<space_t>(ctx, ctx.comm(mask), src, x.shape(), dim, n, order, out.data());
    return collective_request<result_t>(ctx.stream(), completed_op(), result_t(out, x.mesh(), x.device()));
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    auto out = result_block<T, L::rank, space_t>(ctx, "all_gather", with_extent(x.shape(), dim, x.extent(dim) * n), into);
    gather_into<space_t>(ctx, comm, src, x.shape(), dim, n, written_order_of<mesh_t, G>(x.mesh()), out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int DimArg, class L>
auto all_gather_untiled(const L& x) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_gather_untiled<L, G, DimArg>();
  constexpr std::size_t dim = ok ? norm_dim_v<DimArg, L::rank + 1> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  using dims_t = dims_insert_t<dims_without_t<typename L::dims_type, mask>, dim>;
  using result_t = rebind_local_t<L, typename L::value_type, L::rank + 1, L::vary & ~mask, L::partial, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_gather");
    device_context& ctx = current_device("all_gather");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    const auto chunk = with_dim(x.shape(), dim, 1);
    auto out = workspace_view<T, L::rank + 1, space_t>(ctx, with_extent(chunk, dim, n));
    gather_into<space_t>(ctx, comm, src, chunk, dim, n, written_order_of<mesh_t, G>(x.mesh()), out.data());
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int DimArg, bool Tiled, class L, class Into = std::nullptr_t>
auto psum_scatter_impl(const L& x, const Into& into = nullptr) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_psum_scatter<L, G, DimArg, Tiled>();
  constexpr std::size_t dim = ok ? norm_dim_v<DimArg, L::rank> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  constexpr std::size_t out_rank = Tiled || L::rank == 0 ? L::rank : L::rank - 1;
  using dims_t = std::conditional_t<Tiled, dims_moved_to_t<typename L::dims_type, mask, dim>,
                                    remove_dim_or_self_t<typename L::dims_type, dim>>;
  using result_t = rebind_local_t<L, typename L::value_type, out_rank, L::vary | mask, L::partial & ~mask, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "psum_scatter");
    device_context& ctx = current_device("psum_scatter");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    check_split<G>("psum_scatter", dim, x.extent(dim), n, Tiled);
    auto out = [&] {
      if constexpr (Tiled)
        return result_block<T, L::rank, space_t>(ctx, "psum_scatter", with_extent(x.shape(), dim, x.extent(dim) / n), into);
      else return result_block<T, out_rank, space_t>(ctx, "psum_scatter", without_dim(x.shape(), dim), into);
    }();
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    if (order.empty() && chunks_contiguous(x.shape(), dim)) {
      comm.reduce_scatter(src, out.data(), x.size() / n, datatype_of<T>, reduce_op::sum);  // x is packed already
    } else {
      auto send = ctx.workspace().template scratch<T, space_t>(x.size());
      pack_chunks<space_t>(src, x.shape(), dim, n, send.data(), order);
      comm.reduce_scatter(send.data(), out.data(), x.size() / n, datatype_of<T>, reduce_op::sum);
    }
    return result_t(out, x.mesh(), x.device());
  }
}

template <class G, int SplitArg, int ConcatArg, bool Tiled, class L>
auto all_to_all_impl(const L& x) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = check_all_to_all<L, G, SplitArg, ConcatArg, Tiled>();
  constexpr std::size_t split = ok ? norm_dim_v<SplitArg, L::rank> : 0;
  constexpr std::size_t concat = ok ? norm_dim_v<ConcatArg, L::rank> : 0;
  constexpr axis_mask mask = group_mask_v<mesh_t, G>;
  constexpr bool tracked = (L::dims_type::at(concat) & mask) != 0;
  using dims_t = std::conditional_t<
      Tiled, std::conditional_t<tracked, dims_moved_to_t<typename L::dims_type, mask, split>, typename L::dims_type>,
      dims_insert_t<remove_dim_or_self_t<dims_without_t<typename L::dims_type, mask>, split>, concat>>;
  using result_t = with_dims_t<L, dims_t>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    using space_t = typename L::memory_space;
    const T* src = contiguous_data(x, "all_to_all");
    device_context& ctx = current_device("all_to_all");
    auto& comm = ctx.comm(mask);
    const std::size_t n = static_cast<std::size_t>(comm.size());
    check_split<G>("all_to_all", split, x.extent(split), n, Tiled);
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    const std::size_t block = x.size() / n;
    // Tiled: chunk j has the input's shape with split cut by n. Untiled: the split dimension
    // (now of size 1) removed and a size-1 dimension inserted at concat: the same elements in the
    // same order, stacked along concat.
    const auto chunk = [&] {
      if constexpr (Tiled) return with_extent(x.shape(), split, x.extent(split) / n);
      else return with_dim(without_dim(x.shape(), split), concat, 1);
    }();
    auto out = workspace_view<T, L::rank, space_t>(ctx, with_extent(chunk, concat, chunk[concat] * n));
    // Staging only where a packed buffer is not the block itself (chunks_contiguous).
    const bool direct_send = order.empty() && chunks_contiguous(x.shape(), split);
    const bool direct_recv = order.empty() && chunks_contiguous(chunk, concat);
    block_view_t<T, 1, space_t> send, recv;
    if (!direct_send) {
      send = ctx.workspace().template scratch<T, space_t>(x.size());
      pack_chunks<space_t>(src, x.shape(), split, n, send.data(), order);
    }
    if (!direct_recv) recv = ctx.workspace().template scratch<T, space_t>(x.size());
    comm.all_to_all(direct_send ? src : send.data(), direct_recv ? out.data() : recv.data(), block, datatype_of<T>);
    if (!direct_recv) unpack_chunks<space_t>(recv.data(), chunk, concat, n, out.data(), order);
    return result_t(out, x.mesh(), x.device());
  }
}

}  // namespace detail

/// @brief Tiled all-gather over axis `Axis` along dimension `Dim` (JAX `all_gather(x, axis, axis=Dim,
/// tiled=True)`): the blocks of the axis group, concatenated along `Dim` in axis-index order. `x`
/// must vary over `Axis`, and if some dimension is sharded on `Axis` it must be `Dim`; the result
/// is invariant over `Axis` and dimension `Dim` is no longer sharded on it.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x) {
  return detail::all_gather_tiled<axis_group<Axis>, Dim>(x);
}
/// @brief The tiled all-gather over several axes, in the order written (JAX `axis_name=('i', 'j')`).
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x) {
  return detail::all_gather_tiled<G, Dim>(x);
}

/// @brief `all_gather<Axis, Dim>(x)` written into the caller's block `out` (the result's shape,
/// element type and memory space; contiguous) instead of a fresh one: the result is a view of
/// `out`'s buffer with the all_gather's type (`out`'s own vary / partial sets are not read).
/// For a caller that keeps its own buffers, as a training step's flat parameter vector.
/// @code
/// using F = meshlib::local_tensor<float, 1, mesh_t, mesh_t::mask_of<"data">()>;
/// auto full = meshlib::all_gather_into<"data", 0>(F(F::view_type(mine, n), mesh, dev),
///                                                  F(F::view_type(all, n * dp), mesh, dev));
/// @endcode
/// @throws sharding_error when `out` does not have the result's shape.
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into(const L& x, const O& out) {
  return detail::all_gather_tiled<axis_group<Axis>, Dim>(x, out);
}
/// @brief `all_gather_into` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into(const L& x, const O& out) {
  return detail::all_gather_tiled<G, Dim>(x, out);
}

/// @brief `all_gather_into` started asynchronously (see `psum_start`): returns a
/// `collective_request` whose `wait()` returns what `all_gather_into<Axis, Dim>(x, out)` returns;
/// the gather runs on the device's communication worker. FSDP prefetches the next layer's
/// parameters with it. Chunks that need reordering (axes written out of mesh order, a dimension
/// other than the leading non-trivial one) are gathered at once and the request is complete.
/// @code
/// auto r = meshlib::all_gather_into_start<"fsdp", 0>(shard, whole);  // whole: the caller's buffer
/// compute_this_layer();
/// auto full = r.wait();                                             // a view of whole
/// @endcode
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into_start(const L& x, const O& out) {
  return detail::all_gather_tiled<axis_group<Axis>, Dim>(x, out, std::true_type{});
}
/// @brief `all_gather_into_start` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto all_gather_into_start(const L& x, const O& out) {
  return detail::all_gather_tiled<G, Dim>(x, out, std::true_type{});
}

/// @brief Untiled all-gather (JAX `tiled=False`): the blocks stacked along a new dimension inserted
/// at position `Dim` of the result (`Dim = 0`: a leading dimension of the group size; `-1`: a
/// trailing one). The type rule of the tiled form.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x, untiled_t) {
  return detail::all_gather_untiled<axis_group<Axis>, Dim>(x);
}
/// @brief The untiled all-gather over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto all_gather(const L& x, untiled_t) {
  return detail::all_gather_untiled<G, Dim>(x);
}

/// @brief Reduce-scatter over axis `Axis` along dimension `Dim` (JAX `psum_scatter(x, axis,
/// scatter_dimension=Dim, tiled=True)`): the sum over the group, of which the device at axis index
/// `i` keeps chunk `i` of dimension `Dim`. `x` must vary over or be partial over `Axis`; the result
/// varies over `Axis`, is no longer partial over it, and dimension `Dim` is sharded on it. A
/// dimension already sharded on `Axis` is refused: `forget_dims<Axis>(x)` first to scatter it again.
/// @throws sharding_error when the axis size does not divide dimension `Dim`.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x) {
  return detail::psum_scatter_impl<axis_group<Axis>, Dim, true>(x);
}
/// @brief The tiled reduce-scatter over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x) {
  return detail::psum_scatter_impl<G, Dim, true>(x);
}
/// @brief `psum_scatter<Axis, Dim>(x)` written into the caller's block `out` (the result's shape,
/// element type and memory space; contiguous): the result is a view of `out`'s buffer with the
/// psum_scatter's type. For a caller that keeps its own buffers (ZeRO's gradient slices).
/// @throws sharding_error when the axis size does not divide dimension `Dim`, or when `out` does
/// not have the result's shape.
template <fixed_string Axis, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto psum_scatter_into(const L& x, const O& out) {
  return detail::psum_scatter_impl<axis_group<Axis>, Dim, true>(x, out);
}
/// @brief `psum_scatter_into` over several axes, in the order written.
template <axis_group_type G, int Dim, local_tensor_type L, local_tensor_type O>
[[nodiscard]] auto psum_scatter_into(const L& x, const O& out) {
  return detail::psum_scatter_impl<G, Dim, true>(x, out);
}

/// @brief Untiled reduce-scatter (JAX `tiled=False`): dimension `Dim`, whose size must equal the
/// group size, is removed; the device at group position `i` keeps slice `i` of the sum.
/// @throws sharding_error when dimension `Dim` is not the group size.
template <fixed_string Axis, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x, untiled_t) {
  return detail::psum_scatter_impl<axis_group<Axis>, Dim, false>(x);
}
template <axis_group_type G, int Dim, local_tensor_type L>
[[nodiscard]] auto psum_scatter(const L& x, untiled_t) {
  return detail::psum_scatter_impl<G, Dim, false>(x);
}

/// @brief All-to-all over axis `Axis` (JAX `all_to_all(x, axis, split_axis=Split,
/// concat_axis=Concat, tiled=True)`): dimension `Split` is cut into axis-size chunks, chunk `j` goes
/// to the device at axis index `j`, and the received chunks are concatenated along `Concat` in
/// axis-index order. Moves sharding on `Axis` from dimension `Concat` to dimension `Split`.
/// @throws sharding_error when the axis size does not divide dimension `Split`.
template <fixed_string Axis, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x) {
  return detail::all_to_all_impl<axis_group<Axis>, Split, Concat, true>(x);
}
/// @brief The tiled all-to-all over several axes, in the order written.
template <axis_group_type G, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x) {
  return detail::all_to_all_impl<G, Split, Concat, true>(x);
}
/// @brief Untiled all-to-all (JAX `tiled=False`): dimension `Split`, whose size must equal the group
/// size `n`, is removed, and a dimension of size `n` is inserted at position `Concat` of the result;
/// entry `j` along it is what the device at group position `j` sent. The result's dimensions carry
/// no sharding on the group's axes (as after `forget_dims`).
/// @throws sharding_error when dimension `Split` is not the group size.
template <fixed_string Axis, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x, untiled_t) {
  return detail::all_to_all_impl<axis_group<Axis>, Split, Concat, false>(x);
}
template <axis_group_type G, int Split, int Concat, local_tensor_type L>
[[nodiscard]] auto all_to_all(const L& x, untiled_t) {
  return detail::all_to_all_impl<G, Split, Concat, false>(x);
}

}  // namespace meshlib
// end meshlib/collectives/gathers.hpp
// begin meshlib/collectives/permutes.hpp
/// @file
/// @brief `ppermute`, `broadcast`, `pvary` / `pbroadcast`: the collectives that keep a block's shape.
/// @code
/// // ring shift over axis "x" of size n: device i sends to i + 1
/// std::vector<std::pair<std::size_t, std::size_t>> ring;
/// for (std::size_t i = 0; i < n; ++i) ring.push_back({i, (i + 1) % n});
/// auto y = meshlib::ppermute<"x">(x, ring);
/// auto z = meshlib::broadcast<"x">(x, 0);   // every device of the group gets index 0's block
/// auto v = meshlib::pvary<"x">(w);          // w replicated over x, now typed as varying (no copy)
/// @endcode

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>


namespace meshlib {

namespace detail {

template <class L, fixed_string Axis>
consteval bool check_pvary_axis() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!mesh_t::template has_axis<Axis>) return check_axis_in_mesh<"pvary", Axis, mesh_t>();
  else if constexpr (((L::vary | L::partial) & (axis_mask{1} << mesh_t::find_axis(Axis.view()))) != 0)
    return pvary_of_varying_value<diag_op_t<"pvary">, diag_axis_t<Axis>, diag_value_t<L>>();
  else return true;
}

template <class L, fixed_string Axis>
consteval bool check_broadcast() {
  using mesh_t = typename L::mesh_type;
  if constexpr (!check_element_type<"broadcast", typename L::value_type>()) return false;
  else if constexpr (!mesh_t::template has_axis<Axis>) return check_axis_in_mesh<"broadcast", Axis, mesh_t>();
  else if constexpr ((L::partial & (axis_mask{1} << mesh_t::find_axis(Axis.view()))) != 0)
    return broadcast_of_partial_value<diag_op_t<"broadcast">, diag_axis_t<Axis>, diag_value_t<L>>();
  else return true;
}

template <class G, class L>
auto ppermute_impl(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = group_checks<G>::template run<"ppermute", L, axis_rule::moves>();
  if constexpr (!ok) {
    return L{};
  } else {
    using T = typename L::value_type;
    constexpr axis_mask mask = group_mask_v<mesh_t, G>;
    const T* src = contiguous_data(x, "ppermute");
    device_context& ctx = current_device("ppermute");
    auto& comm = ctx.comm(mask);
    // perm names group positions in the order written; the communicator ranks run in mesh order.
    const auto order = written_order_of<mesh_t, G>(x.mesh());
    std::vector<std::size_t> rank_of(order.size());
    for (std::size_t r = 0; r < order.size(); ++r) rank_of[order[r]] = r;
    const auto to_rank = [&](std::size_t p) { return p < rank_of.size() ? rank_of[p] : p; };  // out of range: the communicator says so
    std::vector<permute_pair> pairs;
    pairs.reserve(perm.size());
    for (const auto& [s, d] : perm) pairs.push_back(permute_pair{static_cast<int>(to_rank(s)), static_cast<int>(to_rank(d))});
    auto out = workspace_view<T, L::rank, typename L::memory_space>(ctx, x.shape());
    comm.ppermute(src, out.data(), x.size(), datatype_of<T>, pairs);  // zeros where nothing arrives
    return L(out, x.mesh(), x.device());
  }
}

}  // namespace detail

/// @brief Sends this device's block to another index of axis `Axis` (JAX `lax.ppermute(x, axis,
/// perm)`): `perm` holds (source, destination) axis indices; a device that no pair sends to gets
/// zeros. No index may appear twice as a source or twice as a destination. `x` must vary over
/// `Axis`; the result has the same type.
/// @throws comm_argument_error for an index out of range or repeated (from the communicator).
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto ppermute(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return detail::ppermute_impl<axis_group<Axis>>(x, perm);
}
/// @brief `ppermute` over several axes: `perm` holds group positions, row-major over the axes in
/// the order written (JAX `ppermute(x, ('i', 'j'), perm)`).
template <axis_group_type G, local_tensor_type L>
[[nodiscard]] auto ppermute(const L& x, const std::vector<std::pair<std::size_t, std::size_t>>& perm) {
  return detail::ppermute_impl<G>(x, perm);
}

/// @brief Every device of the `Axis` group gets the block of the device at axis index `root`
/// (MPI's / NCCL's broadcast; in JAX, `all_gather(x, axis)[root]`). The result is invariant over
/// `Axis`; `x` must not be partial over it. A value already invariant over `Axis` passes through.
template <fixed_string Axis, local_tensor_type L>
[[nodiscard]] auto broadcast(const L& x, std::size_t root) {
  constexpr bool ok = detail::check_broadcast<L, Axis>();
  constexpr axis_mask bit = detail::safe_mask_v<typename L::mesh_type, Axis>;
  using result_t = with_vary_t<with_dims_t<L, detail::dims_without_t<typename L::dims_type, bit>>, L::vary & ~bit>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    using T = typename L::value_type;
    const T* src = detail::contiguous_data(x, "broadcast");
    auto& ctx = detail::current_device("broadcast");
    auto& comm = ctx.comm(bit);
    if (root >= static_cast<std::size_t>(comm.size()))
      throw sharding_error("meshlib: broadcast<\"" + std::string(Axis.view()) + "\">: root index " + std::to_string(root) +
                           " is out of range for an axis of size " + std::to_string(comm.size()));
    using space_t = typename L::memory_space;
    auto out = detail::workspace_view<T, L::rank, space_t>(ctx, x.shape());
    detail::copy_elements<space_t>(src, x.size(), out.data());
    comm.broadcast(out.data(), x.size(), datatype_of<T>, static_cast<int>(root));
    return result_t(out, x.mesh(), x.device());
  }
}

/// @brief Marks a value invariant over the axes `Names...` as varying over them (JAX `lax.pvary`,
/// formerly `pbroadcast`): no data moves, only the type changes, so that it can meet varying values
/// (`x + axis-dependent value`) or go into a collective that needs a varying input.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pvary(const L& x) {
  static_assert(sizeof...(Names) > 0, "meshlib: pvary needs at least one axis: pvary<\"data\">(x)");
  constexpr bool ok = (detail::check_pvary_axis<L, Names>() && ...);
  constexpr axis_mask mask = detail::safe_mask_v<typename L::mesh_type, Names...>;
  using result_t = with_vary_t<L, L::vary | mask>;
  if constexpr (!ok) return result_t{};
  else return result_t(x.view(), x.mesh(), x.device());
}

/// @brief The older JAX name of `pvary`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto pbroadcast(const L& x) {
  return pvary<Names...>(x);
}

}  // namespace meshlib
// end meshlib/collectives/permutes.hpp
// begin meshlib/collectives/relabel.hpp
/// @file
/// @brief Local steps that change what the type says about a per-device value, without
/// communication: `forget_dims` (drop the record of which dimension is a block of which axis),
/// `reshape` (a new local shape for the same elements) and `axis_index(x)` (this device's group
/// position as a per-device int32 scalar, as JAX's `lax.axis_index`).
///
/// Why `forget_dims` exists: meshlib tracks, per dimension, the axes it is a block of, and uses it
/// to refuse a gather or scatter along the wrong dimension. JAX does not track it, so some valid JAX
/// programs split a dimension that is already a block of the axis (the tutorial's `psum_scatter` of
/// a scattered block) or concatenate along another one. `forget_dims<"i">(x)` says "treat this block
/// as unlabelled along 'i'": the value still varies over 'i', only the per-dimension record goes.
/// @code
/// auto y = meshlib::psum_scatter<"i", 0>(meshlib::forget_dims<"i">(x));  // x's dim 0 was a block of 'i'
/// auto r = meshlib::reshape(x, std::array<std::size_t, 1>{x.size()});    // flatten the local block
/// auto k = meshlib::axis_index<"i">(x);   // local_tensor<std::int32_t, 0, ...> varying over 'i'
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>


namespace meshlib {

/// @brief `x` with no dimension recorded as a block of the axes `Names...` (see the file comment).
/// The value, its `vary` and `partial` sets are unchanged and no data moves.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto forget_dims(const L& x) {
  static_assert(sizeof...(Names) > 0, "meshlib: forget_dims needs at least one axis: forget_dims<\"data\">(x)");
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = (detail::check_axis_in_mesh<"forget_dims", Names, mesh_t>() && ...);
  using result_t = with_dims_t<L, detail::dims_without_t<typename L::dims_type, detail::safe_mask_v<mesh_t, Names...>>>;
  if constexpr (!ok) return result_t{};
  else return result_t(x.view(), x.mesh(), x.device());
}

/// @brief A copy of the local block `x` with local shape `shape` (row-major order kept, as
/// `jnp.reshape`). The per-dimension record is dropped (as after `forget_dims`); `vary` and
/// `partial` are kept.
/// @throws sharding_error when `shape` does not hold exactly `x.size()` elements.
template <std::size_t R, local_tensor_type L>
[[nodiscard]] auto reshape(const L& x, const std::array<std::size_t, R>& shape) {
  using result_t = rebind_local_t<L, typename L::value_type, R, L::vary, L::partial, replicated_dims<R>>;
  const std::size_t n = detail::checked_product(std::span<const std::size_t>(shape), "reshape: the new shape");
  if (n != x.size())
    throw sharding_error("meshlib: reshape of a local block of shape " + detail::describe_shape(x.shape()) + " (" +
                         std::to_string(x.size()) + " elements) to shape " + detail::describe_shape(shape) + " (" +
                         std::to_string(n) + " elements); the element counts must agree");
  const auto* src = detail::contiguous_data(x, "reshape");
  auto out = detail::result_view<L, R>(shape);
  std::copy_n(src, n, out.data());
  return result_t(out, x.mesh(), x.device());
}

/// @brief This device's position in the group of the axes `Names...` (row-major in the order
/// written) as a per-device value on `like`'s mesh: an `std::int32_t` scalar that varies over those
/// axes, as JAX's `lax.axis_index` inside `shard_map`. `like` only names the mesh and device.
/// @throws spmd_context_error outside `shard_map` / `spmd`.
template <fixed_string... Names, local_tensor_type L>
[[nodiscard]] auto axis_index(const L& like) {
  static_assert(sizeof...(Names) > 0, "meshlib: axis_index needs at least one axis: axis_index<\"data\">(x)");
  using mesh_t = typename L::mesh_type;
  constexpr bool ok = (detail::check_axis_in_mesh<"axis_index", Names, mesh_t>() && ...);
  using result_t = local_tensor<std::int32_t, 0, mesh_t, detail::safe_mask_v<mesh_t, Names...>, 0, replicated_dims<0>,
                                typename L::memory_space>;
  if constexpr (!ok) {
    return result_t{};
  } else {
    std::size_t p = 0;
    if constexpr (sizeof...(Names) == 1) p = (axis_index<Names>(), ...);
    else p = axis_index<Names...>();
    auto out = detail::allocate<std::int32_t, 0, typename L::memory_space>({}, "meshlib::axis_index", false);
    *out.data() = static_cast<std::int32_t>(p);
    return result_t(out, like.mesh(), like.device());
  }
}

}  // namespace meshlib
// end meshlib/collectives/relabel.hpp
// begin meshlib/collectives/reshard_plan.hpp
/// @file
/// @brief `reshard_plan`: the collectives that move an array from one sharding of a mesh to another,
/// chosen before anything moves, so that a user can print the plan and see the bytes each device
/// will send.
///
/// The planner works on the run-time form of a spec (per dimension, the mesh positions of the axes
/// that split it, major to minor) and walks from the source spec to the target spec:
/// - a dimension whose axes are not a prefix of its target's loses its minor axis `a`; when `a`
///   is exactly the next axis the target adds to another dimension, one `all_to_all` over `a`
///   moves it there; otherwise an `all_gather` over `a` drops it;
/// - once every dimension's axes are a prefix of its target's, one local slice adds the rest (no
///   communication: the target block lies inside the block the device already holds).
/// Each step is exact only when every sharded dimension divides evenly by its shard counts, which
/// the planner checks; otherwise (the `uneven` rule with sizes that do not divide), it falls back to
/// the general `exchange`, where every device receives, from one holder each, the intersection of
/// its target block with the source blocks.

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>


namespace meshlib {

/// @brief What one step of a reshard plan does.
enum class reshard_kind {
  local_slice,  ///< keep a sub-block of the local block; no communication
  all_gather,   ///< tiled all_gather over one axis along one dimension (shard -> replicate)
  all_to_all,   ///< all_to_all over one axis: split one dimension, concatenate another (move)
  exchange,     ///< general point-to-point exchange of block intersections (any -> any)
};

/// @brief The name of a resharding step kind, as printed in plans.
[[nodiscard]] constexpr std::string_view to_string(reshard_kind k) noexcept {
  switch (k) {
    case reshard_kind::local_slice: return "local_slice";
    case reshard_kind::all_gather: return "all_gather";
    case reshard_kind::all_to_all: return "all_to_all";
    case reshard_kind::exchange: return "exchange";
  }
  return "unknown";
}

namespace detail {

/// Run-time partition spec: per dimension, the mesh positions of its axes, major to minor.
using dyn_spec = std::vector<std::vector<std::size_t>>;

/// The run-time form of the spec of sharding `S`, padded to `Rank` dimensions.
template <sharding_type S>
dyn_spec to_dyn_spec(std::size_t rank) {
  dyn_spec out(rank);
  for (std::size_t d = 0; d < rank; ++d) {
    const auto ax = S::dim_axes(d);
    for (std::size_t k = 0; k < S::dim_axis_count(d); ++k) out[d].push_back(ax[k]);
  }
  return out;
}

/// Number of shards of one dimension split over `axes`.
template <class Mesh>
std::size_t dyn_shards(const Mesh& m, const std::vector<std::size_t>& axes) {
  std::size_t n = 1;
  for (auto a : axes) n *= m.axis_size(a);
  return n;
}

/// The block of `device` for global shape `shape` under the run-time spec `spec`.
template <class Mesh, std::size_t Rank>
block<Rank> dyn_block_of(const Mesh& m, const dyn_spec& spec, const std::array<std::size_t, Rank>& shape,
                         std::size_t device, shard_rule rule) {
  const auto c = m.coords(device);
  block<Rank> b;
  for (std::size_t d = 0; d < Rank; ++d) {
    std::size_t idx = 0;
    for (auto a : spec[d]) idx = idx * m.axis_size(a) + c[a];
    const auto [off, ext] = split_dim(shape[d], dyn_shards(m, spec[d]), idx, rule);
    b.offset[d] = off;
    b.extent[d] = ext;
  }
  return b;
}

/// Intersection of two blocks (extent 0 somewhere when they do not meet).
template <std::size_t Rank>
block<Rank> intersect(const block<Rank>& a, const block<Rank>& b) {
  block<Rank> r;
  for (std::size_t d = 0; d < Rank; ++d) {
    const std::size_t lo = std::max(a.offset[d], b.offset[d]);
    const std::size_t hi = std::min(a.offset[d] + a.extent[d], b.offset[d] + b.extent[d]);
    r.offset[d] = lo;
    r.extent[d] = hi > lo ? hi - lo : 0;
  }
  return r;
}

inline bool is_prefix(const std::vector<std::size_t>& p, const std::vector<std::size_t>& v) {
  return p.size() <= v.size() && std::equal(p.begin(), p.end(), v.begin());
}

template <class Mesh>
std::string describe_dyn_spec(const dyn_spec& s) {
  // Built with a stream: GCC 12 warns falsely (-Wrestrict) on `"\"" + std::string(...)` at -O2.
  std::ostringstream os;
  os << "P<";
  for (std::size_t d = 0; d < s.size(); ++d) {
    if (d) os << ", ";
    if (s[d].empty()) {
      os << "none";
    } else if (s[d].size() == 1) {
      os << '"' << Mesh::axis_names[s[d][0]] << '"';
    } else {
      os << "axes(";
      for (std::size_t k = 0; k < s[d].size(); ++k) os << (k ? ", " : "") << '"' << Mesh::axis_names[s[d][k]] << '"';
      os << ')';
    }
  }
  os << '>';
  return os.str();
}

}  // namespace detail

/// @brief One step of a reshard plan.
struct reshard_step {
  /// Which kind of step: a local slice or the collective it runs.
  reshard_kind kind = reshard_kind::local_slice;
  /// Mesh position of the axis the collective runs over (all_gather, all_to_all).
  std::size_t axis = 0;
  /// all_gather: the dimension gathered; all_to_all: the dimension split (it becomes sharded).
  std::size_t split_dim = 0;
  /// all_to_all: the dimension concatenated (it stops being sharded on `axis`).
  std::size_t concat_dim = 0;
  /// The spec after this step.
  detail::dyn_spec after;
  /// Bytes each device sends to other devices in this step, indexed by device.
  std::vector<std::size_t> bytes_sent;
  /// A line such as `all_gather over 'model' along dim 1 -> P<"data", none>`.
  std::string description;
};

/// @brief The plan that `reshard<To>(x)` runs: inspect it with `plan_reshard<To>(x)` first.
/// @code
/// auto plan = meshlib::plan_reshard<meshlib::P<meshlib::none, "data">>(x);
/// std::cout << plan;                 // one line per collective
/// plan.max_bytes_sent();             // the busiest device's traffic
/// @endcode
class reshard_plan {
 public:
  reshard_plan() = default;
  /// @brief A plan from sharding `from` to `to` (both as printed) over `devices` devices, running `steps` in order.
  reshard_plan(std::string from, std::string to, std::size_t devices, std::vector<reshard_step> steps)
      : from_(std::move(from)), to_(std::move(to)), devices_(devices), steps_(std::move(steps)) {}

  /// The steps in the order they run; empty when nothing moves.
  [[nodiscard]] const std::vector<reshard_step>& steps() const noexcept { return steps_; }
  /// True when source and target are the same sharding: nothing runs.
  [[nodiscard]] bool empty() const noexcept { return steps_.empty(); }
  /// True when no step sends data.
  [[nodiscard]] bool communication_free() const noexcept {
    for (const auto& s : steps_)
      for (auto b : s.bytes_sent)
        if (b) return false;
    return true;
  }
  /// Bytes device `device` sends over the whole plan.
  [[nodiscard]] std::size_t bytes_sent(std::size_t device) const noexcept {
    std::size_t n = 0;
    for (const auto& s : steps_) n += device < s.bytes_sent.size() ? s.bytes_sent[device] : 0;
    return n;
  }
  /// The largest `bytes_sent(d)` over devices.
  [[nodiscard]] std::size_t max_bytes_sent() const noexcept {
    std::size_t m = 0;
    for (std::size_t d = 0; d < devices_; ++d) m = std::max(m, bytes_sent(d));
    return m;
  }
  /// Sum of `bytes_sent(d)` over devices.
  [[nodiscard]] std::size_t total_bytes_sent() const noexcept {
    std::size_t m = 0;
    for (std::size_t d = 0; d < devices_; ++d) m += bytes_sent(d);
    return m;
  }
  /// The kinds of the steps, in order (handy in tests).
  [[nodiscard]] std::vector<reshard_kind> kinds() const {
    std::vector<reshard_kind> k;
    for (const auto& s : steps_) k.push_back(s.kind);
    return k;
  }

  /// Prints `reshard P<"data", none> -> P<none, "data">: all_to_all over 'data' ... (N bytes/device max)`.
  friend std::ostream& operator<<(std::ostream& os, const reshard_plan& p) {
    os << "reshard " << p.from_ << " -> " << p.to_ << ":";
    if (p.steps_.empty()) os << " nothing to do";
    for (const auto& s : p.steps_) {
      std::size_t mx = 0;
      for (auto b : s.bytes_sent) mx = std::max(mx, b);
      os << "\n  " << s.description << " (max " << mx << " bytes sent per device)";
    }
    return os;
  }
  /// The plan as printed by `operator<<`: one line per step.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }

 private:
  std::string from_, to_;
  std::size_t devices_ = 0;
  std::vector<reshard_step> steps_;
};

namespace detail {

/// Whether the step-by-step plan is exact: every dimension divides evenly by the shard counts of
/// both specs (then every intermediate spec, whose counts divide one of them, divides evenly too).
template <class Mesh, std::size_t Rank>
bool stepwise_exact(const Mesh& m, const dyn_spec& from, const dyn_spec& to, const std::array<std::size_t, Rank>& shape) {
  for (std::size_t d = 0; d < Rank; ++d) {
    if (shape[d] % dyn_shards(m, from[d]) != 0 || shape[d] % dyn_shards(m, to[d]) != 0) return false;
    // A dimension that passes through an intermediate spec: the common prefix keeps it divisible.
  }
  return true;
}

/// For the general exchange: which device sends device `dst` its piece of the source block that
/// `src_rep` (any holder of that block) holds: `dst` itself when it holds that block, otherwise one
/// holder chosen by `dst`'s index so that the load spreads over the replicas.
template <class Mesh>
std::size_t exchange_source(const Mesh& m, const dyn_spec& from, std::size_t src_rep, std::size_t dst) {
  axis_mask used = 0;
  for (const auto& axes : from)
    for (auto a : axes) used |= axis_mask{1} << a;
  const axis_mask rep = Mesh::all_axes & ~used;
  const auto holders = m.group(src_rep, rep);
  for (auto h : holders)
    if (h == dst) return dst;
  return holders[dst % holders.size()];
}

/// The devices whose source block is distinct: one representative per block (the group leaders
/// along the replicated axes).
template <class Mesh>
std::vector<std::size_t> block_representatives(const Mesh& m, const dyn_spec& from) {
  axis_mask used = 0;
  for (const auto& axes : from)
    for (auto a : axes) used |= axis_mask{1} << a;
  const axis_mask rep = Mesh::all_axes & ~used;
  std::vector<std::size_t> out;
  for (std::size_t d = 0; d < m.size(); ++d)
    if (m.group_rank(d, rep) == 0) out.push_back(d);
  return out;
}

/// The plan from `from` to `to` for global shape `shape`, elements of `elem_size` bytes.
template <class Mesh, std::size_t Rank>
reshard_plan make_reshard_plan(const Mesh& m, const dyn_spec& from, shard_rule from_rule, const dyn_spec& to,
                               shard_rule to_rule, const std::array<std::size_t, Rank>& shape, std::size_t elem_size) {
  const std::size_t n = m.size();
  std::vector<reshard_step> steps;
  // Under the step-wise plan every dimension divides evenly, where both rules give the same blocks.
  const shard_rule rule = shard_rule::even;
  auto local_bytes = [&](const dyn_spec& s, std::size_t dev) {
    return dyn_block_of(m, s, shape, dev, rule).size() * elem_size;
  };
  const bool same_blocks = stepwise_exact(m, from, to, shape) || from_rule == to_rule;
  if (from == to && same_blocks) return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, {});

  if (!stepwise_exact(m, from, to, shape)) {
    reshard_step st;
    st.kind = reshard_kind::exchange;
    st.after = to;
    st.bytes_sent.assign(n, 0);
    const auto reps = block_representatives(m, from);
    for (std::size_t dst = 0; dst < n; ++dst) {
      const auto want = dyn_block_of(m, to, shape, dst, to_rule);
      for (auto r : reps) {
        const auto piece = intersect(want, dyn_block_of(m, from, shape, r, from_rule));
        if (piece.size() == 0) continue;
        const std::size_t src = exchange_source(m, from, r, dst);
        if (src != dst) st.bytes_sent[src] += piece.size() * elem_size;
      }
    }
    st.description = "exchange of block intersections (general plan) -> " + describe_dyn_spec<Mesh>(to);
    steps.push_back(std::move(st));
    return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, std::move(steps));
  }

  dyn_spec cur = from;
  while (true) {
    std::size_t bad = Rank;
    for (std::size_t d = 0; d < Rank; ++d)
      if (!is_prefix(cur[d], to[d])) {
        bad = d;
        break;
      }
    if (bad == Rank) break;
    const std::size_t a = cur[bad].back();
    // Does the target add `a` to another dimension right after what that dimension holds now?
    std::size_t dest = Rank;
    for (std::size_t d = 0; d < Rank; ++d)
      if (d != bad && is_prefix(cur[d], to[d]) && to[d].size() > cur[d].size() && to[d][cur[d].size()] == a) dest = d;
    reshard_step st;
    st.axis = a;
    st.bytes_sent.assign(n, 0);
    const std::size_t g = m.axis_size(a);
    if (dest != Rank) {
      st.kind = reshard_kind::all_to_all;
      st.split_dim = dest;
      st.concat_dim = bad;
      for (std::size_t dev = 0; dev < n; ++dev) st.bytes_sent[dev] = local_bytes(cur, dev) / g * (g - 1);
      cur[bad].pop_back();
      cur[dest].push_back(a);
      st.description = "all_to_all over '" + std::string(Mesh::axis_names[a]) + "' (split dim " +
                       std::to_string(dest) + ", concat dim " + std::to_string(bad) + ") -> " +
                       describe_dyn_spec<Mesh>(cur);
    } else {
      st.kind = reshard_kind::all_gather;
      st.split_dim = bad;
      for (std::size_t dev = 0; dev < n; ++dev) st.bytes_sent[dev] = local_bytes(cur, dev) * (g - 1);
      cur[bad].pop_back();
      st.description = "all_gather over '" + std::string(Mesh::axis_names[a]) + "' along dim " + std::to_string(bad) +
                       " -> " + describe_dyn_spec<Mesh>(cur);
    }
    st.after = cur;
    steps.push_back(std::move(st));
  }
  if (cur != to) {
    reshard_step st;
    st.kind = reshard_kind::local_slice;
    st.after = to;
    st.bytes_sent.assign(n, 0);
    st.description = "local slice (no communication) -> " + describe_dyn_spec<Mesh>(to);
    steps.push_back(std::move(st));
  }
  return reshard_plan(describe_dyn_spec<Mesh>(from), describe_dyn_spec<Mesh>(to), n, std::move(steps));
}

}  // namespace detail

/// @brief The plan that moves an array of shape `shape` with elements of `elem_size` bytes from
/// sharding `from` to spec `ToSpec` of the same mesh.
template <partition_spec_type ToSpec, sharding_type From, std::size_t Rank>
reshard_plan make_reshard_plan(const From& from, const std::array<std::size_t, Rank>& shape, std::size_t elem_size) {
  using to_sharding = named_sharding<typename From::mesh_type, ToSpec>;
  static_assert(From::template check_rank<Rank>() && to_sharding::template check_rank<Rank>());
  return detail::make_reshard_plan(from.mesh(), detail::to_dyn_spec<From>(Rank), from.rule(),
                                   detail::to_dyn_spec<to_sharding>(Rank), from.rule(), shape, elem_size);
}

}  // namespace meshlib
// end meshlib/collectives/reshard_plan.hpp
// begin meshlib/collectives/reshard.hpp
/// @file
/// @brief `reshard<ToSpec>(x)`: the same global array under another sharding of the same mesh, as
/// `jax.device_put(x, NamedSharding(mesh, spec))` / DTensor's `redistribute`. The plan (see
/// reshard_plan.hpp) is chosen first and can be inspected with `plan_reshard<ToSpec>(x)`; then every
/// device runs it on its own block, each step a collective over its axis group.
/// @code
/// auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"data", none>>{m}, shape, host);
/// std::cout << meshlib::plan_reshard<meshlib::P<none, "data">>(x);   // all_to_all over 'data' ...
/// auto y = meshlib::reshard<meshlib::P<none, "data">>(x, runner);    // to_host(y) == to_host(x)
/// // reshard<...>(x) without a runner: on the default runner
/// @endcode
/// This header holds the plan and the per-device steps; `reshard` itself runs devices, so it is in
/// the exec layer with the runners (meshlib/exec/global_reshard.hpp).

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>


namespace meshlib {

namespace detail {

/// Runs `plan` on one device: `src` is its block under `from` (rule `from_rule`), the result its
/// block under the plan's target (rule `to_rule`), written to `dst` (already of the target shape).
/// Every buffer lives in memory `Space` and every copy is a kernel (block_ops.hpp); the last step
/// writes straight into `dst`, so no step is followed by a copy.
template <class T, class Space, class Mesh, std::size_t Rank>
void run_reshard_plan(const reshard_plan& plan, const Mesh& m, std::size_t device, const dyn_spec& from,
                      shard_rule from_rule, shard_rule to_rule, const std::array<std::size_t, Rank>& shape, const T* src,
                      T* dst) {
  device_context& ctx = current_device("reshard");
  using shape_t = std::array<std::size_t, Rank>;
  using buffer_t = block_view_t<T, 1, Space>;
  auto staging = [](std::size_t n, bool zero = false) {
    return allocate<T, 1, Space>(std::array<std::size_t, 1>{n}, "meshlib::reshard", zero);
  };
  dyn_spec cur = from;
  shape_t cur_shape = dyn_block_of(m, cur, shape, device, from_rule).extent;
  const T* in = src;  // the current block: x's own, then the last step's output
  buffer_t held;      // keeps `in` alive once it is a staging buffer
  const auto& steps = plan.steps();
  for (std::size_t i = 0; i < steps.size(); ++i) {
    const auto& st = steps[i];
    const bool last = i + 1 == steps.size();
    const std::size_t in_size = box_size(cur_shape);
    buffer_t next;
    // Where this step writes its block of `out_size` elements: `dst` for the last step.
    auto output = [&](std::size_t out_size, bool zero = false) -> T* {
      if (last) return dst;
      next = staging(out_size, zero);
      return next.data();
    };
    switch (st.kind) {
      case reshard_kind::all_gather: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        buffer_t recv = staging(in_size * n);
        comm.all_gather(in, recv.data(), in_size, datatype_of<T>);
        unpack_chunks<Space>(recv.data(), cur_shape, st.split_dim, n, output(in_size * n));
        cur_shape[st.split_dim] *= n;
        break;
      }
      case reshard_kind::all_to_all: {
        auto& comm = ctx.comm(axis_mask{1} << st.axis);
        const std::size_t n = static_cast<std::size_t>(comm.size());
        buffer_t send = staging(in_size), recv = staging(in_size);
        pack_chunks<Space>(in, cur_shape, st.split_dim, n, send.data());
        comm.all_to_all(send.data(), recv.data(), in_size / n, datatype_of<T>);
        shape_t chunk = cur_shape;
        chunk[st.split_dim] /= n;
        unpack_chunks<Space>(recv.data(), chunk, st.concat_dim, n, output(in_size));
        cur_shape = chunk;
        cur_shape[st.concat_dim] *= n;
        break;
      }
      case reshard_kind::local_slice: {
        const auto have = dyn_block_of(m, cur, shape, device, shard_rule::even);
        const auto want = dyn_block_of(m, st.after, shape, device, shard_rule::even);
        shape_t off{};
        for (std::size_t d = 0; d < Rank; ++d) off[d] = want.offset[d] - have.offset[d];
        copy_box<Space>(in, cur_shape, off, output(want.size()), want.extent, shape_t{}, want.extent);
        cur_shape = want.extent;
        break;
      }
      case reshard_kind::exchange: {
        auto& comm = ctx.comm(Mesh::all_axes);
        const std::size_t n = m.size();
        const auto reps = block_representatives(m, from);
        const auto mine = dyn_block_of(m, from, shape, device, from_rule);
        const auto want = dyn_block_of(m, st.after, shape, device, to_rule);
        // The plan of the exchange (host metadata only): what this device sends to each
        // destination, every piece it is the chosen source of, and what it receives from each
        // source, in the order that source packs it.
        std::vector<std::int64_t> send_counts(n, 0), send_displs(n, 0), recv_counts(n, 0), recv_displs(n, 0);
        std::vector<block<Rank>> sent, pieces;
        std::size_t send_total = 0;
        for (std::size_t to = 0; to < n; ++to) {
          send_displs[to] = static_cast<std::int64_t>(send_total);
          const auto their = dyn_block_of(m, st.after, shape, to, to_rule);
          for (auto r : reps) {
            const auto piece = intersect(their, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, to) != device) continue;
            sent.push_back(piece);
            send_total += piece.size();
          }
          send_counts[to] = static_cast<std::int64_t>(send_total) - send_displs[to];
        }
        std::size_t recv_total = 0;
        for (std::size_t s = 0; s < n; ++s) {
          recv_displs[s] = static_cast<std::int64_t>(recv_total);
          for (auto r : reps) {
            const auto piece = intersect(want, dyn_block_of(m, from, shape, r, from_rule));
            if (piece.size() == 0 || exchange_source(m, from, r, device) != s) continue;
            pieces.push_back(piece);
            recv_total += piece.size();
          }
          recv_counts[s] = static_cast<std::int64_t>(recv_total) - recv_displs[s];
        }
        buffer_t send = staging(send_total), recv = staging(recv_total);
        std::size_t at = 0;
        for (const auto& piece : sent) {
          shape_t off{};
          for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - mine.offset[d];
          copy_box<Space>(in, cur_shape, off, send.data() + at, piece.extent, shape_t{}, piece.extent);
          at += piece.size();
        }
        comm.all_to_all_v(send.data(), send_counts, send_displs, recv.data(), recv_counts, recv_displs, send_total,
                          recv_total, datatype_of<T>);
        T* out = output(want.size(), true);
        at = 0;
        for (const auto& piece : pieces) {
          shape_t off{};
          for (std::size_t d = 0; d < Rank; ++d) off[d] = piece.offset[d] - want.offset[d];
          copy_box<Space>(recv.data() + at, piece.extent, shape_t{}, out, want.extent, off, piece.extent);
          at += piece.size();
        }
        cur_shape = want.extent;
        break;
      }
    }
    held = next;
    in = held.data();
    cur = st.after;
  }
}

}  // namespace detail

/// @brief The plan `reshard(x, to)` runs, without running it.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] reshard_plan plan_reshard(const X& x, const To& to) {
  using from_t = typename X::sharding_type;
  static_assert(std::is_same_v<typename from_t::mesh_type, typename To::mesh_type>,
                "meshlib: reshard moves an array between shardings of the same mesh type");
  static_assert(To::template check_rank<X::rank>());
  if (!(x.mesh() == to.mesh()))
    throw sharding_error("meshlib: reshard from mesh " + x.mesh().to_string() + " to mesh " + to.mesh().to_string() +
                         ": both shardings must use the same mesh");
  return detail::make_reshard_plan(x.mesh(), detail::to_dyn_spec<from_t>(X::rank), x.sharding().rule(),
                                   detail::to_dyn_spec<To>(X::rank), to.rule(), x.global_shape(),
                                   sizeof(typename X::value_type));
}

/// @brief The plan `reshard<ToSpec>(x)` runs, without running it.
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] reshard_plan plan_reshard(const X& x) {
  return plan_reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()));
}

}  // namespace meshlib
// end meshlib/collectives/reshard.hpp
// end meshlib/collectives.hpp
// begin meshlib/exec.hpp
/// @file
/// @brief The exec layer: runners (`runner`, `thread_runner`; `mpi_runner` and `hybrid_runner`
/// through <meshlib/mpi.hpp>), the device thread pool, `spmd(mesh, fn)`,
/// `shard_map(fn, mesh, in_specs, out_specs)`, `reshard` on a runner or the default one, and JAX's
/// names for it (`device_put`, `with_sharding_constraint`).

// begin meshlib/exec/runner.hpp
/// @file
/// @brief The `runner` concept: what runs one program per device for `spmd`, `shard_map` and
/// `reshard`. Satisfied by `thread_runner` (persistent threads in this process), with MPI by
/// `mpi_runner` (a process per device) and `hybrid_runner` (persistent threads in processes;
/// exec/mpi_runner.hpp), and by `default_runner`, which picks one of them at each call
/// (exec/default_runner.hpp). One name each: `thread_backend`, `mpi_backend` and
/// `hybrid_backend` are deprecated names kept for one release.
/// @code
/// static_assert(meshlib::runner<meshlib::thread_runner>);
/// meshlib::thread_runner r;                     // owns its device threads while it lives
/// meshlib::spmd(m, [] { /* ... */ }, r);        // every call reuses them
/// @endcode

#include <concepts>
#include <cstddef>
#include <vector>

namespace meshlib {

namespace detail {
/// A device body as `run_devices` hands it to a runner: called once per local device with that
/// device's world communicator, whatever its type.
struct runner_body_archetype {
  template <class Communicator>
  void operator()(std::size_t, Communicator) const {}
};
}  // namespace detail

/// @brief A runner: opts in with `using is_runner = void;` and provides
/// - `r.run(n, body)`: calls `body(device, world)` once for each device of an `n`-device mesh that
///   this process runs, `world` being that device's communicator over all `n` devices (rank =
///   device id); returns when every call has returned. When a call throws, peers blocked in
///   collectives are released (the communicator aborts) and `run` throws `participant_error`
///   naming the root cause's rank, the device's exception nested.
/// - `r.local_devices(n)`: the devices this process runs, ascending.
///
/// Which runner is the default (`default_runner`): a `thread_runner` on the process-wide device
/// threads in one process; once `mpi::initialize` has started a run of several processes, those
/// processes' device threads (a `hybrid_runner`, n / P devices per process).
template <class R>
concept runner = requires { typename R::is_runner; } &&
                 requires(const R& r, std::size_t n, detail::runner_body_archetype body) {
                   r.run(n, body);
                   { r.local_devices(n) } -> std::same_as<std::vector<std::size_t>>;
                 };

}  // namespace meshlib
// end meshlib/exec/runner.hpp
// begin meshlib/exec/thread_runner.hpp
/// @file
/// @brief `thread_runner`: the runner (exec/runner.hpp) with one device per thread of this
/// process, each call on a fresh `thread_world`, run by persistent device threads
/// (`detail::device_workers`). A runner the user makes owns its device threads for as long as it
/// (or any copy of it) lives; `spmd` and `shard_map` without a runner run on the process-wide
/// device threads, which are just as persistent. An own runner keeps a library's or a test's
/// devices off the threads that global-view operations and other callers use, and ends its
/// threads when it goes.
/// A device is one core by default; `threads_per_device` makes each a team of cores (Kokkos 4
/// OpenMP), so that a mesh smaller than the machine still uses all of it.
/// @code
/// meshlib::mesh<meshlib::axis<"x">> m{4};
/// meshlib::thread_runner runner({.timeout = std::chrono::seconds(10)});
/// runner.threads_per_device = 4;                         // 16 cores: 4 devices of 4 cores
/// for (int step = 0; step < 1000; ++step)
///   meshlib::spmd(m, [] { /* one step */ }, runner);     // the same 3 worker threads every step
/// @endcode

#include <cstddef>
#include <memory>
#include <numeric>
#include <utility>
#include <vector>

// begin meshlib/exec/detail/device_workers.hpp
/// @file
/// @brief The persistent device threads that run every local device at once: `spmd` and
/// `shard_map` calls on a `thread_runner` (exec/thread_runner.hpp), and global-view operations
/// (elementwise, reductions, matmul, transpose on `sharded_tensor`s), which reach them through the
/// tensor layer's dispatcher hook (tensor/for_each_device.hpp) that this header installs.
///
/// Why persistent: starting and joining a thread per device costs tens of microseconds per device
/// and call (measured: an empty 8-device `spmd` took 3.5 ms that way), more than a small kernel or
/// a training step's collectives; these threads start on first use and wait, blocked on a futex so
/// that an oversubscribed machine loses no core to them, for the next job. Only while every index
/// of the job has a core of its own do the waiting threads (worker and caller) first poll for
/// at most 50 us: on an idle virtual machine a futex wake-up of a sleeping core took 27-50 us per
/// empty 2-device `spmd` (1.5-2.8 us with the bounded poll); oversubscribed, they block at once
/// (an unbounded spin made a 2-device call 5x slower on a busy machine: the spinner held the core
/// the caller needed). Index `i` of a job is
/// always run by the same thread (the caller runs index 0, worker `i` the others), so device `i`
/// keeps its thread, its thread-local state and its execution-space instance from call to call.
/// Workers are pinned to one core each, none to the core the caller runs on when it submits the
/// job, while a job has no more indices than the process has cores, which keeps two device threads
/// off one core (measured: unpinned, one in a few launches
/// took 150x longer); for a larger job they are unpinned again, free to move to an idle core.
///
/// The pool lives in the exec layer with the runners that own it (ARCHITECTURE.md: exec owns the
/// device threads); the tensor layer below only declares the hook its global-view operations
/// dispatch through. There is one process-wide pool (`get()`), and a `thread_runner` owns one of
/// its own for as long as the user keeps it.
///
/// No job waits for the pool: a job submitted from inside a job (from a device thread of any pool)
/// or while another thread's job runs is refused by `try_run`, and `run` then runs its indices one
/// after another on the calling thread (global-view operations: their devices do not talk to each
/// other), while `spmd` starts threads of its own (its devices do).

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif


namespace meshlib::detail {

/// Whether the calling thread is running an index of a `device_workers` job (any pool's).
inline bool& in_device_worker() noexcept {
  thread_local bool inside = false;
  return inside;
}

/// A pool of persistent device threads (see the file comment).
class device_workers {
 public:
  /// The process-wide pool: started on first use, its threads joined at exit.
  static device_workers& get() {
    static device_workers w;
    return w;
  }
  /// An empty pool; threads start on the first job that needs them. `may_pin`: whether workers
  /// pin themselves to a core while a job fits the cores (false for the threads of a process
  /// that shares its node's cores with other processes of one run: each would pin its worker `i`
  /// to the same core `i`; MPI launchers bind the processes themselves).
  explicit device_workers(bool may_pin = true) : may_pin_(may_pin) {}
  device_workers(const device_workers&) = delete;
  device_workers& operator=(const device_workers&) = delete;
  /// Stops and joins every worker (none may be running a job: jobs are synchronous).
  ~device_workers() {
#if defined(__linux__)
    if (forked()) {  // the workers live in the parent only: nothing to stop or join here
      for (auto& w : workers_) (void)w.release();
      return;
    }
#endif
    stop_.store(true, std::memory_order_release);
    for (auto& w : workers_) {
      w->go.fetch_add(1, std::memory_order_release);
      w->go.notify_one();
    }
    for (auto& w : workers_) w->thread.join();
  }

  /// Calls `f(i)` for every `i` in `[0, count)` at once, `i = 0` on the calling thread and `i` on
  /// worker `i`, and returns when all have returned; rethrows the exception of the lowest `i` that
  /// threw. When the pool cannot take the job (see the file comment), runs the indices one after
  /// another on the calling thread instead.
  template <class F>
  void run(std::size_t count, F& f) {
    std::vector<std::exception_ptr> errors(count);
    auto guarded = [&](std::size_t i) {
      try {
        f(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    };
    if (!try_run(count, guarded)) {
      inside_guard g;
      for (std::size_t i = 0; i < count; ++i) guarded(i);
    }
    for (auto& e : errors)
      if (e) std::rethrow_exception(e);
  }

  /// As `run`, but refuses (returns false, having run nothing) when called from a device thread or
  /// while another thread's job runs, so that a caller whose indices must run at the same time
  /// (they communicate) can start threads of its own instead.
  /// `width`: the cores each index computes on (its device's team of Kokkos threads, which the
  /// index's thread starts and which inherit its pinning); workers are pinned to `width` cores each
  /// while `count * width` cores are there.
  /// @pre `f` does not throw (a worker has nowhere to send an exception: catch inside `f`).
  template <class F>
  [[nodiscard]] bool try_run(std::size_t count, F& f, std::size_t width = 1) {
    if (count == 0) return true;
    if (in_device_worker()) return false;
#if defined(__linux__)
    if (forked()) return false;  // a child of fork() has none of the workers
#endif
    std::unique_lock submit(submit_, std::try_to_lock);
    if (!submit.owns_lock()) return false;
    if (count == 1) {
      inside_guard g;
      f(std::size_t{0});
      return true;
    }
    grow(count - 1);
    const bool pin = may_pin_ && pin_fits(count * width);
    job_ = job{[](void* p, std::size_t i) { (*static_cast<F*>(p))(i); }, &f, count, pin, pin ? caller_cpu() : -1, width};
    remaining_.store(static_cast<std::uint32_t>(count - 1), std::memory_order_relaxed);
    for (std::size_t i = 1; i < count; ++i) {
      auto& w = *workers_[i - 1];
      w.go.fetch_add(1, std::memory_order_release);  // publishes job_ to worker i
      w.go.notify_one();
    }
    {
      inside_guard g;
      f(std::size_t{0});
    }
    const bool spin = job_.pin;
    for (std::uint32_t left = remaining_.load(std::memory_order_acquire); left != 0;
         left = remaining_.load(std::memory_order_acquire))
      if (!spin || !spin_while_equal(remaining_, left)) remaining_.wait(left, std::memory_order_acquire);
    return true;
  }

  /// Worker threads started so far (index `i` of a job runs on the `i`-th, for `i >= 1`).
  [[nodiscard]] std::size_t size() const noexcept { return workers_.size(); }

 private:
  /// Polls `a` for up to `spin_window` while it still holds `old`; true when it changed: the
  /// thread communicator's spin-then-block path (comm/detail/spin_then_block.hpp, where the window
  /// is measured), used only while every index of the job has a core of its own (never when
  /// oversubscribed). Waking a blocked thread on an idle core of a virtual machine costs tens of
  /// microseconds (measured on the idle 2-core machine: 27-50 us per empty 2-device call blocked,
  /// against 6 us when the cores were busy), more than the short calls of a training step take; a
  /// bounded spin keeps that cost off the common back-to-back calls and gives the core back soon after.
  static bool spin_while_equal(const std::atomic<std::uint32_t>& a, std::uint32_t old) noexcept {
    return poll_for([&] { return a.load(std::memory_order_acquire) != old; }, spin_window);
  }

  struct inside_guard {
    bool previous = in_device_worker();
    inside_guard() { in_device_worker() = true; }
    ~inside_guard() { in_device_worker() = previous; }
  };

  struct job {
    void (*call)(void*, std::size_t) = nullptr;
    void* ctx = nullptr;
    std::size_t count = 0;
    bool pin = false;
    int caller_cpu = -1;  // where the caller (index 0) ran when it submitted the job; -1: unknown
    std::size_t width = 1;  // cores per index
  };

  struct worker {
    std::atomic<std::uint32_t> go{0};  // bumped once per job for this worker, and at stop
    std::thread thread;
  };

#if defined(__linux__)
  /// The CPUs this process may run on when the pool started its first worker.
  static const cpu_set_t& allowed_cpus() {
    static const cpu_set_t set = [] {
      cpu_set_t s;
      CPU_ZERO(&s);
      if (pthread_getaffinity_np(pthread_self(), sizeof(s), &s) != 0) CPU_ZERO(&s);
      return s;
    }();
    return set;
  }
#endif
  /// The CPU the calling thread runs on, or -1.
  static int caller_cpu() noexcept { return current_cpu(); }

#if defined(__linux__)
  /// Pins worker `index` to `width` CPUs of its own beside the caller's: with the allowed CPUs in
  /// order but the caller's first, block `index` of `width` of them (block 0, with the caller's
  /// CPU, is left to the caller and its team). Why not simply the `index`-th CPU: the caller
  /// (device 0) is the user's thread and is never pinned, so on a busy machine the scheduler had
  /// left it on the CPU of worker 1 for whole runs (issue 27), and two device threads on one core
  /// wait for each other through context switches (9 us per 8 B psum, ~107 us with the full spin,
  /// against 0.5 us apart). A worker's team threads (Kokkos OpenMP) inherit its block.
  static void pin_beside(std::size_t index, int caller, std::size_t width) {
    const cpu_set_t& allowed = allowed_cpus();
    std::vector<int> order;
    if (caller >= 0 && caller < CPU_SETSIZE && CPU_ISSET(caller, &allowed)) order.push_back(caller);
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &allowed) && cpu != caller) order.push_back(cpu);
    if (order.empty()) return;
    cpu_set_t block;
    CPU_ZERO(&block);
    for (std::size_t k = index * width; k < (index + 1) * width; ++k) CPU_SET(order[k % order.size()], &block);
    pthread_setaffinity_np(pthread_self(), sizeof(block), &block);
  }
#endif

  /// Whether every index of a `count`-index job (the caller's included) gets a core of its own.
  static bool pin_fits([[maybe_unused]] std::size_t count) {
#if defined(__linux__)
    return count <= static_cast<std::size_t>(CPU_COUNT(&allowed_cpus()));
#else
    return false;
#endif
  }

#if defined(__linux__)
  /// Whether this is a child process of the one that started the workers.
  [[nodiscard]] bool forked() const noexcept { return ::getpid() != owner_; }
  const pid_t owner_ = ::getpid();
#endif

  /// Starts workers until there are `n`.
  void grow(std::size_t n) {
    while (workers_.size() < n) {
      auto w = std::make_unique<worker>();
      const std::size_t index = workers_.size() + 1;
      w->thread = std::thread([this, index, &go = w->go] { serve(index, go); });
      workers_.push_back(std::move(w));
    }
  }

  /// Worker `index`'s loop: block until its `go` moves, run its index of the job, count down.
  void serve(std::size_t index, std::atomic<std::uint32_t>& go) {
    in_device_worker() = true;
    bool pinned = false;
    int pinned_beside = -1;  // the caller's CPU this worker's pin avoids
    std::size_t pinned_width = 1;  // the cores of its block
    std::uint32_t seen = 0;
    for (;;) {
      if (!pinned || !spin_while_equal(go, seen)) go.wait(seen, std::memory_order_acquire);
      seen = go.load(std::memory_order_acquire);
      if (stop_.load(std::memory_order_acquire)) return;
      const job j = job_;
#if defined(__linux__)
      // Pinned while the job fits the cores, off the caller's CPU (`pin_beside`); given all CPUs
      // back for a larger job. A syscall only when the policy or the caller's CPU changes.
      if (j.pin != pinned || (j.pin && (j.caller_cpu != pinned_beside || j.width != pinned_width))) {
        if (j.pin) pin_beside(index, j.caller_cpu, j.width);
        else pthread_setaffinity_np(pthread_self(), sizeof(cpu_set_t), &allowed_cpus());
        pinned = j.pin;
        pinned_beside = j.caller_cpu;
        pinned_width = j.width;
      }
#endif
      j.call(j.ctx, index);
      if (remaining_.fetch_sub(1, std::memory_order_acq_rel) == 1) remaining_.notify_one();
    }
  }

  const bool may_pin_ = true;
  std::mutex submit_;  // one job at a time; held only by try_lock (no job waits for another)
  job job_{};
  std::atomic<std::uint32_t> remaining_{0};
  std::atomic<bool> stop_{false};
  std::vector<std::unique_ptr<worker>> workers_;  // workers_[i] serves index i + 1
};

/// Runs `call(ctx, i)` for every `i` in `[0, count)` on the process-wide device threads: what
/// the tensor layer's global-view operations dispatch to (tensor/for_each_device.hpp).
inline void run_on_device_workers(std::size_t count, void* ctx, void (*call)(void*, std::size_t)) {
  auto f = [ctx, call](std::size_t i) { call(ctx, i); };
  device_workers::get().run(count, f);
}

/// Installs the device threads as the tensor layer's dispatcher when a program includes exec:
/// tensor cannot include this layer, so it exposes the hook and this layer fills it (before
/// `main`; a global-view operation run before that runs its devices one after another).
inline const bool device_workers_installed = [] {
  device_dispatcher.store(&run_on_device_workers, std::memory_order_release);
  return true;
}();

}  // namespace meshlib::detail
// end meshlib/exec/detail/device_workers.hpp

namespace meshlib {

namespace detail {
/// Tag of the `thread_runner` that runs on the process-wide device threads (what `spmd` and
/// `shard_map` use without a runner, through `default_runner`).
struct process_wide_threads_t {
  explicit process_wide_threads_t() = default;
};
/// The tag's value.
inline constexpr process_wide_threads_t process_wide_threads{};
}  // namespace detail

/// @brief One thread per device, all in this process (see the file comment). Device 0 runs on the
/// calling thread and device `d` always on the pool's worker `d`, so repeated calls reuse the same
/// threads, which start on the first call that needs them (as many as the largest mesh run on it,
/// less the calling thread) and are joined when the last copy of the runner is destroyed.
///
/// Calls on one runner run one at a time. A call the threads cannot take (a `spmd` inside a device
/// of another call, or while another thread's call runs on them) runs on threads started for it
/// (`run_on_threads`), with the same results and errors: nested calls never wait for the threads
/// of their caller.
struct thread_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;

  /// Options of each call's `thread_world` (timeout, spin policy). `pin_threads` applies only to
  /// calls that start their own threads: the persistent ones pin themselves whenever every device
  /// has a core (exec/detail/device_workers.hpp).
  thread_comm_options options{};
  /// The device threads, shared by every copy of this runner; null: the process-wide ones.
  std::shared_ptr<detail::device_workers> workers{};
  /// The cores each device computes on: its execution-space instance is a team of this many
  /// Kokkos threads (Kokkos 4 with the OpenMP backend; with any other backend only 1 is
  /// accepted), and its device thread is pinned to as many cores of its own while the machine has
  /// them all. 1, the default, is one core per device; a (2, 1) mesh on a 16-core machine uses all
  /// cores with 8.
  std::size_t threads_per_device = 1;

  /// A runner with device threads of its own, whose calls' communicators get `options`.
  explicit thread_runner(thread_comm_options options = {})
      : options(std::move(options)), workers(std::make_shared<detail::device_workers>()) {}
  /// A runner on the process-wide device threads (`default_runner`'s in one process).
  explicit thread_runner(detail::process_wide_threads_t, thread_comm_options options = {})
      : options(std::move(options)) {}

  /// @brief Runs `body(device, communicator)` on `n` threads, one per device; returns when all finish.
  /// @throws participant_error naming the root-cause device (exec/runner.hpp).
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    auto device = [&](thread_communicator& c) {
      const auto d = static_cast<std::size_t>(c.rank());
      body(d, std::move(c));
    };
    const int size = static_cast<int>(n);
    detail::device_workers& pool = workers ? *workers : detail::device_workers::get();
    // A fresh world for every call: a failed world stays failed, and a fresh one costs less than
    // a microsecond per device next to the wake-up of the threads.
    thread_world world(size, options);
    detail::participant_failures failures(size);
    auto task = [&](std::size_t d) { failures.run(world, static_cast<int>(d), device); };
    if (!pool.try_run(n, task, threads_per_device)) {
      run_on_threads(size, device, options);
      return;
    }
    failures.rethrow(world);
  }

  /// The devices this process runs: all `n` of them, `0 .. n-1` (one process owns every thread).
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    std::vector<std::size_t> d(n);
    std::iota(d.begin(), d.end(), std::size_t{0});
    return d;
  }
};

/// @brief Deprecated name of a `thread_runner` on the process-wide device threads (what it was
/// before runners had one name each); removed in the next release.
struct [[deprecated("use meshlib::thread_runner")]] thread_backend : thread_runner {
  /// Options of each call's `thread_world`.
  thread_backend(thread_comm_options options = {})  // NOLINT(google-explicit-constructor): as before
      : thread_runner(detail::process_wide_threads, std::move(options)) {}
};

static_assert(runner<thread_runner>);

}  // namespace meshlib
// end meshlib/exec/thread_runner.hpp
// begin meshlib/exec/gpu_runner.hpp
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


#if defined(MESHLIB_ENABLE_NCCL) && MESHLIB_ENABLE_NCCL && defined(KOKKOS_ENABLE_CUDA)
#define MESHLIB_HAS_GPU_RUNNER 1
#include <Kokkos_Core.hpp>
#include <cuda_runtime.h>

#include <exception>
#include <memory>
#include <optional>
#include <type_traits>

// begin meshlib/comm/nccl/nccl_communicator.hpp
/// @file
/// @brief The NCCL communicator: one participant per GPU, collectives on device buffers, ordered on
/// a CUDA stream. Satisfies `communicator`.
///
/// @code
/// // one process per GPU (ids exchanged by MPI: <meshlib/comm/nccl/mpi_bootstrap.hpp>, or by the
/// // launcher's environment: meshlib::nccl::connect_from_environment in <meshlib/nccl.hpp>)
/// meshlib::nccl_communicator comm(id, nranks, rank, {.device = local_rank});
/// float* x = nullptr;
/// cudaMalloc(&x, n * sizeof(float));
/// auto r = comm.all_reduce(std::span(x, n), meshlib::reduce_op::sum);   // enqueued on comm.stream()
/// r.wait();                                                             // or keep computing on the stream
/// @endcode
///
/// Streams. Every communicator is bound to one CUDA stream (`nccl_comm_options::stream`: the
/// stream of the Kokkos execution-space instance the device computes on, e.g.
/// `{.stream = Kokkos::Cuda(...)}`, or any `cudaStream_t`; by default a new non-blocking stream
/// the communicator owns). Every operation enqueues its NCCL calls on that stream, or on the
/// stream given as its last argument, and returns at once with a request that completes when an
/// event recorded after the calls does. Kernels before the call on the same stream are ordered
/// before it, kernels after it see its result: no host synchronisation in between. Buffers are
/// device memory (checked with `cudaPointerGetAttributes` unless `check_pointers` is off).
///
/// Faults. The communicator is created non-blocking (`ncclCommInitRankConfig` with
/// `blocking = 0`), so no NCCL call blocks the host. `wait()` polls the event and
/// `ncclCommGetAsyncError` against the timeout (`MESHLIB_COMM_TIMEOUT`, default 60 s); an
/// asynchronous error or a passed deadline calls `ncclCommAbort` and throws `comm_aborted` or
/// `comm_timeout` naming the operation and NCCL's error text. After that every operation is
/// refused with the same root cause. Every CUDA and NCCL return code is checked
/// (`detail/nccl_types.hpp` maps them to meshlib's exceptions). Argument errors are thrown before
/// anything is enqueued. NCCL cannot detect mismatched collectives (a rank that calls another
/// collective, or another count), so meshlib checks them by default (`verify_collectives`,
/// batched: `detail::call_batch` says when, and what is left to the timeout; docs/gpu.md the cost):
/// ranks that disagree get `collective_mismatch` naming the call and each rank's call.
///
/// Threads. A handle and its copies share one NCCL communicator and must be used by one thread at
/// a time, as NCCL's; `abort()` may be called from any thread. The last handle's destruction
/// finalizes the communicator (`ncclCommFinalize`, which waits for the peers to finalize too, then
/// `ncclCommDestroy`; `ncclCommAbort` if that does not finish within the timeout): communicators of
/// several GPUs in one process are destroyed concurrently (`run_on_gpus` does, and
/// `destroy_communicators` for the result of `nccl_communicators`).

#if MESHLIB_ENABLE_NCCL

#include <algorithm>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <atomic>
#include <chrono>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/nccl/detail/call_fingerprint.hpp
/// @file
/// @brief A collective call packed into one int64, so that a device communicator can compare every
/// participant's calls with one small all-gather on its stream (NCCL has no other channel), a batch
/// of calls at a time (`call_batch`), and say in the `collective_mismatch` message which call
/// differed and what each participant called (in the words every backend uses, call_text.hpp).
///
/// Layout (low to high bits): operation 5, element type 4 (15: none), reduce op 3 (7: none),
/// root 16 (65535: none), count 36. Counts of 2^36 elements or more are compared modulo 2^36.

#if MESHLIB_ENABLE_NCCL

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>


namespace meshlib::detail {

struct call_fingerprint {
  op_kind op = op_kind::barrier;
  int type = -1;     ///< datatype, or -1
  int reduce = -1;   ///< reduce_op, or -1
  int root = -1;     ///< or -1
  std::uint64_t count = 0;

  [[nodiscard]] std::int64_t pack() const noexcept {
    const std::uint64_t t = type < 0 ? 15u : static_cast<std::uint64_t>(type);
    const std::uint64_t r = reduce < 0 ? 7u : static_cast<std::uint64_t>(reduce);
    const std::uint64_t o = root < 0 ? 65535u : static_cast<std::uint64_t>(root) & 0xffffu;
    const std::uint64_t bits = static_cast<std::uint64_t>(op) | (t << 5) | (r << 9) | (o << 12) |
                               ((count & ((std::uint64_t{1} << 36) - 1)) << 28);
    return static_cast<std::int64_t>(bits);
  }
  [[nodiscard]] static call_fingerprint unpack(std::int64_t packed) noexcept {
    const auto bits = static_cast<std::uint64_t>(packed);
    call_fingerprint f;
    f.op = static_cast<op_kind>(bits & 31u);
    const auto t = static_cast<int>((bits >> 5) & 15u);
    const auto r = static_cast<int>((bits >> 9) & 7u);
    const auto o = static_cast<int>((bits >> 12) & 0xffffu);
    f.type = t == 15 ? -1 : t;
    f.reduce = r == 7 ? -1 : r;
    f.root = o == 65535 ? -1 : o;
    f.count = bits >> 28;
    return f;
  }
  /// What a mismatch message shows of the call (`describe_call`): "all_reduce(float32, count 8,
  /// op sum)", "broadcast(int64, count 3, root 1)", "barrier()". An element type without a
  /// `datatype` (14: CUDA's own 16-bit types) shows as "-"; the fingerprint keeps no ppermute pairs.
  [[nodiscard]] call_summary summary() const noexcept {
    call_summary c;
    c.kind = op;
    if (type >= 0 && type <= static_cast<int>(datatype::bfloat16)) c.dtype = static_cast<datatype>(type);
    c.count = count;
    if (reduce >= 0) c.op = static_cast<reduce_op>(reduce);
    c.root = root;
    return c;
  }
};

/// The `collective_mismatch` message for the gathered fingerprints (one per rank), or empty when
/// they agree. `call` > 0: the number of the collective on its communicator (1 for the first),
/// which the message names, so that a batched check points at the exact call.
[[nodiscard]] inline std::string mismatch_message(std::string_view seen_by, std::span<const std::int64_t> all,
                                                  std::uint64_t call = 0) {
  bool agree = true;
  for (std::int64_t f : all) agree = agree && f == all[0];
  if (agree) return {};
  std::string m = "meshlib: collective mismatch" +
                  (call > 0 ? " in collective " + std::to_string(call) + " on this communicator" : std::string()) +
                  " (seen by " + std::string(seen_by) + "):";
  for (std::size_t r = 0; r < all.size(); ++r)
    m += " rank " + std::to_string(r) + " called " + describe_call(call_fingerprint::unpack(all[r]).summary()) +
         (r + 1 < all.size() ? ";" : "");
  return m;
}

/// The message of the first call of a gathered batch on which the ranks disagree, or empty.
/// `all` holds every rank's `per` fingerprints, rank after rank (what an all-gather of each rank's
/// batch gives); `first_call` is the number of the batch's first collective.
[[nodiscard]] inline std::string batch_mismatch_message(std::string_view seen_by, std::uint64_t first_call,
                                                        std::size_t per, std::span<const std::int64_t> all) {
  if (per == 0) return {};
  const std::size_t ranks = all.size() / per;
  std::vector<std::int64_t> column(ranks);
  for (std::size_t j = 0; j < per; ++j) {
    for (std::size_t r = 0; r < ranks; ++r) column[r] = all[r * per + j];
    if (std::string m = mismatch_message(seen_by, column, first_call + j); !m.empty()) return m;
  }
  return {};
}

/// @brief When a device communicator checks its calls: the fingerprints of the collectives made
/// since the last check, and the schedule. Each of the first `each_first` collectives is checked
/// on its own, before its data moves (a program's first step, where most shape bugs show, and
/// where a disagreement on a count would otherwise hang NCCL); after that the calls are exchanged
/// `every` at a time, the last one's before its data moves, so the check's cost (a small
/// all-gather and two copies on the stream, several microseconds) is paid once per `every` calls.
/// The schedule depends only on the number of calls, so every rank exchanges at the same calls
/// (as NCCL needs: an all-gather on one rank against a data collective on another would hang).
/// A disagreement among the batched calls is named exactly (the call's number and every rank's
/// call); one that hangs NCCL before its batch is exchanged ends in the timeout, whose message
/// lists the calls this rank made since its last check (`describe_pending`).
class call_batch {
 public:
  /// Checks each of the first `each_first` calls, then every `every` calls (at least 1).
  explicit call_batch(std::size_t every = 1, std::size_t each_first = 0)
      : every_(every < 1 ? 1 : every), each_first_(each_first) {
    pending_.reserve(every_);  // no allocation on the per-call path
  }
  /// Records the fingerprint of the next collective; true when the calls since the last exchange
  /// (`pending()`) must be exchanged now, before this call's data moves (then `clear()`).
  bool add(std::int64_t fingerprint) {
    pending_.push_back(fingerprint);
    ++calls_;
    return calls_ <= each_first_ || pending_.size() >= every_;
  }
  /// The fingerprints recorded since the last exchange, oldest first.
  [[nodiscard]] std::span<const std::int64_t> pending() const noexcept { return pending_; }
  /// The number of the oldest pending call (1 for a communicator's first collective).
  [[nodiscard]] std::uint64_t first_pending() const noexcept { return calls_ - pending_.size() + 1; }
  /// Collectives recorded so far.
  [[nodiscard]] std::uint64_t calls() const noexcept { return calls_; }
  /// The largest batch: what a check slot must hold per rank.
  [[nodiscard]] std::size_t every() const noexcept { return every_; }
  /// After an exchange.
  void clear() noexcept { pending_.clear(); }
  /// "; the collectives this rank made since its last mismatch check: 37 all_reduce(float32,
  /// count 8, op sum), 38 barrier()" (empty when none): what a timeout adds, so that each rank's
  /// message shows what it called where the ranks may have disagreed.
  [[nodiscard]] std::string describe_pending() const {
    if (pending_.empty()) return {};
    std::string m = "; the collectives this rank made since its last mismatch check:";
    for (std::size_t i = 0; i < pending_.size(); ++i)
      m += (i ? ", " : " ") + std::to_string(first_pending() + i) + " " +
           describe_call(call_fingerprint::unpack(pending_[i]).summary());
    return m;
  }

 private:
  std::size_t every_;
  std::size_t each_first_;
  std::uint64_t calls_ = 0;
  std::vector<std::int64_t> pending_;
};

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/detail/call_fingerprint.hpp
// begin meshlib/comm/nccl/detail/nccl_types.hpp
/// @file
/// @brief How meshlib's element types, reduce ops and errors map to NCCL's and CUDA's: the pure
/// part of the NCCL backend, which needs the headers and libraries but no GPU (so CI tests it).
///
/// | meshlib | NCCL |
/// | --- | --- |
/// | `float`, `double`, `int32`, `int64` | `ncclFloat32`, `ncclFloat64`, `ncclInt32`, `ncclInt64` |
/// | `bfloat16` (meshlib's, or CUDA's `__nv_bfloat16`) | `ncclBfloat16` |
/// | `__half` (CUDA's, NCCL backend only) | `ncclFloat16` |
/// | `sum`, `prod`, `min`, `max`, `mean` | `ncclSum`, `ncclProd`, `ncclMin`, `ncclMax`, `ncclAvg` |
///
/// Errors: every CUDA and NCCL return code goes through `check_nccl` / `check_cuda`, which throw
///
/// | code | meshlib exception |
/// | --- | --- |
/// | `ncclInvalidArgument`, `ncclInvalidUsage`; `cudaErrorInvalidValue`, `cudaErrorInvalidDevice`, `cudaErrorInvalidDevicePointer` | `comm_argument_error` |
/// | `ncclRemoteError` (a peer failed or left) | `comm_aborted` |
/// | every other failure (`ncclSystemError`, `ncclInternalError`, `ncclUnhandledCudaError`, CUDA errors) | `comm_error` |
///
/// with the message "meshlib: <operation> <where>: <call> failed: <NCCL's or CUDA's error
/// string>[ (<ncclGetLastError>)]".

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <string>
#include <string_view>
#include <type_traits>


// CUDA's 16-bit float types, when the program already includes their headers (nvcc always does for
// __half through cuda_runtime.h); forward declarations would clash with them, so they are only
// recognised when present.
#if defined(__CUDA_FP16_TYPES_EXIST__) || defined(__CUDA_FP16_HPP__) || defined(__CUDA_FP16_H__)
#define MESHLIB_NCCL_HAS_CUDA_HALF 1
#endif
#if defined(__CUDA_BF16_TYPES_EXIST__) || defined(__CUDA_BF16_HPP__) || defined(__CUDA_BF16_H__)
#define MESHLIB_NCCL_HAS_CUDA_BF16 1
#endif

namespace meshlib {

namespace detail {
template <class T>
consteval int nccl_type_index() {
  using U = std::remove_cv_t<T>;
#if defined(MESHLIB_NCCL_HAS_CUDA_HALF)
  if constexpr (std::is_same_v<U, __half>) return ncclFloat16;
  else
#endif
#if defined(MESHLIB_NCCL_HAS_CUDA_BF16)
  if constexpr (std::is_same_v<U, __nv_bfloat16>) return ncclBfloat16;
  else
#endif
  if constexpr (comm_element<U>) {
    switch (datatype_of<U>) {
      case datatype::float32: return ncclFloat32;
      case datatype::float64: return ncclFloat64;
      case datatype::int32: return ncclInt32;
      case datatype::int64: return ncclInt64;
      case datatype::bfloat16: return ncclBfloat16;
    }
    return -1;
  } else {
    return -1;
  }
}
}  // namespace detail

/// @brief An element type the NCCL communicator moves and reduces: every `comm_element`, plus CUDA's
/// `__half` and `__nv_bfloat16` when their headers are included (`<cuda_fp16.h>`, `<cuda_bf16.h>`).
template <class T>
concept nccl_element = (detail::nccl_type_index<T>() >= 0);

/// @brief NCCL's data type of element type `T` (`ncclBfloat16` for meshlib's `bfloat16`,
/// `ncclFloat16` for `__half`).
template <nccl_element T>
inline constexpr ncclDataType_t nccl_datatype_of = static_cast<ncclDataType_t>(detail::nccl_type_index<T>());

/// @brief NCCL's data type of a run-time `datatype` tag.
[[nodiscard]] constexpr ncclDataType_t to_nccl(datatype t) noexcept {
  switch (t) {
    case datatype::float32: return ncclFloat32;
    case datatype::float64: return ncclFloat64;
    case datatype::int32: return ncclInt32;
    case datatype::int64: return ncclInt64;
    case datatype::bfloat16: return ncclBfloat16;
  }
  return ncclNumTypes;
}

/// @brief NCCL's reduction of a `reduce_op`; `mean` is NCCL's own `ncclAvg` (one pass, no division
/// kernel afterwards). Integer `mean` in NCCL rounds as its sum divided by the count, as meshlib's.
[[nodiscard]] constexpr ncclRedOp_t to_nccl(reduce_op op) noexcept {
  switch (op) {
    case reduce_op::sum: return ncclSum;
    case reduce_op::prod: return ncclProd;
    case reduce_op::min: return ncclMin;
    case reduce_op::max: return ncclMax;
    case reduce_op::mean: return ncclAvg;
  }
  return ncclNumOps;
}

namespace detail {

/// Which meshlib exception an NCCL result becomes (see the file comment).
enum class comm_failure_kind { argument, aborted, timeout, error };

[[nodiscard]] constexpr comm_failure_kind failure_kind_of(ncclResult_t rc) noexcept {
  switch (rc) {
    case ncclInvalidArgument:
    case ncclInvalidUsage: return comm_failure_kind::argument;
    case ncclRemoteError: return comm_failure_kind::aborted;
    default: return comm_failure_kind::error;
  }
}

[[nodiscard]] constexpr comm_failure_kind failure_kind_of(cudaError_t rc) noexcept {
  switch (rc) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidDevice:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorInvalidResourceHandle: return comm_failure_kind::argument;
    default: return comm_failure_kind::error;
  }
}

/// Throws the exception of `kind` with `message`.
[[noreturn]] inline void throw_comm_failure(comm_failure_kind kind, const std::string& message) {
  switch (kind) {
    case comm_failure_kind::argument: throw comm_argument_error(message);
    case comm_failure_kind::aborted: throw comm_aborted(message);
    case comm_failure_kind::timeout: throw comm_timeout(message);
    case comm_failure_kind::error: break;
  }
  throw comm_error(message);
}

/// "ncclInvalidArgument: invalid argument" style text for an NCCL result: the enumerator's name
/// (what users search for) and NCCL's description.
[[nodiscard]] inline std::string nccl_result_text(ncclResult_t rc) {
  const char* name = "ncclResult";
  switch (rc) {
    case ncclSuccess: name = "ncclSuccess"; break;
    case ncclUnhandledCudaError: name = "ncclUnhandledCudaError"; break;
    case ncclSystemError: name = "ncclSystemError"; break;
    case ncclInternalError: name = "ncclInternalError"; break;
    case ncclInvalidArgument: name = "ncclInvalidArgument"; break;
    case ncclInvalidUsage: name = "ncclInvalidUsage"; break;
    case ncclRemoteError: name = "ncclRemoteError"; break;
    case ncclInProgress: name = "ncclInProgress"; break;
    default: return "NCCL error " + std::to_string(static_cast<int>(rc));
  }
  return std::string(name) + " (" + ncclGetErrorString(rc) + ")";
}

/// "cudaErrorNoDevice (no CUDA-capable device is detected)" for a CUDA error.
[[nodiscard]] inline std::string cuda_error_text(cudaError_t rc) {
  return std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
}

/// The message of a failed call: "meshlib: <what>: <call> failed: <text>[: <detail>]".
[[nodiscard]] inline std::string failed_call_message(std::string_view what, std::string_view call,
                                                     const std::string& text, std::string_view detail = {}) {
  std::string m = "meshlib: " + std::string(what) + ": " + std::string(call) + " failed: " + text;
  if (!detail.empty()) m += std::string(": ") + std::string(detail);
  return m;
}

/// Throws the meshlib exception of a failed NCCL call (`rc` other than ncclSuccess and
/// ncclInProgress); `last_error` is `ncclGetLastError(comm)` where a communicator exists.
inline void check_nccl(ncclResult_t rc, std::string_view what, std::string_view call, const char* last_error = nullptr) {
  if (rc == ncclSuccess || rc == ncclInProgress) return;
  throw_comm_failure(failure_kind_of(rc),
                     failed_call_message(what, call, nccl_result_text(rc),
                                         last_error != nullptr ? std::string_view(last_error) : std::string_view{}));
}

/// Throws the meshlib exception of a failed CUDA runtime call, and clears CUDA's sticky last error
/// for non-sticky failures so that the next call does not report it again.
inline void check_cuda(cudaError_t rc, std::string_view what, std::string_view call) {
  if (rc == cudaSuccess) return;
  (void)cudaGetLastError();
  throw_comm_failure(failure_kind_of(rc), failed_call_message(what, call, cuda_error_text(rc)));
}

}  // namespace detail
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/detail/nccl_types.hpp
// begin meshlib/comm/nccl/detail/stream_state.hpp
/// @file
/// @brief What the two device communicators' participants have in common: a GPU, a stream (owned
/// or borrowed), a pool of completion events, options, and the failure that refuses later calls.
/// The base of `nccl_comm_state` and `shared_gpu_state` (the `Channel`s of their requests).

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>

#include <atomic>
#include <concepts>
#include <type_traits>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

// begin meshlib/comm/nccl/stream_request.hpp
/// @file
/// @brief `basic_stream_request<Channel>`: the request of a stream-ordered backend. An operation
/// is enqueued on a CUDA stream and an event recorded after it; the request completes when that
/// event does. Waiting polls the event and the channel's asynchronous error against the
/// communicator's timeout, so no wait is unbounded: an error of the channel (NCCL's
/// `ncclCommGetAsyncError`) or a passed deadline aborts the channel (`ncclCommAbort`) and throws
/// `comm_aborted` or `comm_timeout` naming the operation.
///
/// The state machine is independent of CUDA (CI tests it with a fake stream):
///
/// | state | `test()` | `wait()` |
/// | --- | --- | --- |
/// | empty (default-constructed) | true | returns |
/// | pending | polls once: complete -> true; failed -> aborts, throws; deadline passed -> aborts, throws `comm_timeout`; else false | polls until one of those |
/// | complete | true | returns |
/// | failed | throws the same error again | throws the same error again |
///
/// A channel that checks the participants' calls (the NCCL communicator's `verify_collectives`)
/// reports a disagreement as a failed poll marked `mismatch`: the request throws
/// `collective_mismatch` with the channel's message and aborts the channel (the mismatched
/// collective itself may never finish).
///
/// A `Channel` provides `event_type`, `poll(event_type) -> stream_poll` (never blocks),
/// `abort(reason, timed_out)` (stops the channel's outstanding work; later operations on the channel are
/// refused), `release(event_type)` (takes back an event for reuse) and `describe(op)` (the
/// operation and the participant, for messages).

#include <chrono>
#include <concepts>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>


namespace meshlib {

/// @brief What one poll of a stream event found.
struct stream_poll {
  /// Where the operation stands.
  enum class state { pending, complete, failed };
  /// What this poll found.
  state status = state::pending;
  /// For `failed`: why (NCCL's or CUDA's error text), and whether a peer failed (`comm_aborted`) or
  /// this participant's own call did (`comm_error`).
  std::string error;
  /// For `failed`: true when a peer failed (`comm_aborted`), false when this call did (`comm_error`).
  bool peer_failed = true;
  /// For `failed`: the participants called different collectives (`collective_mismatch`); `error`
  /// is then the whole message, listing each participant's call.
  bool mismatch = false;

  /// Not done yet: poll again.
  [[nodiscard]] static stream_poll pending() { return {}; }
  /// Done without error.
  [[nodiscard]] static stream_poll complete() { return {state::complete, {}, false}; }
  /// Failed because of `why`; `peer` says whether a peer (true) or this call (false) failed.
  [[nodiscard]] static stream_poll failed(std::string why, bool peer = true) {
    return {state::failed, std::move(why), peer};
  }
  /// Failed because participants called different collectives; `message` lists each call.
  [[nodiscard]] static stream_poll mismatched(std::string message) {
    return {state::failed, std::move(message), false, true};
  }
};

/// @brief A request that completes when its stream event does. Movable, not copyable; destroying a
/// pending request does not wait (the work stays ordered on its stream) and returns its event.
template <class Channel>
class basic_stream_request {
 public:
  /// The event type the channel records on the stream.
  using event_type = typename Channel::event_type;

  /// An empty request: already complete.
  basic_stream_request() = default;

  /// @brief A pending request for `op`, whose completion `event` marks; waits end with
  /// `comm_timeout` after `timeout` (zero or negative: never).
  basic_stream_request(std::shared_ptr<Channel> channel, event_type event, std::string op,
                       std::chrono::nanoseconds timeout)
      : channel_(std::move(channel)), event_(event), op_(std::move(op)), state_(state::pending) {
    if (timeout.count() > 0) deadline_ = std::chrono::steady_clock::now() + timeout;
  }

  /// Movable: the moved-from request no longer waits on anything.
  basic_stream_request(basic_stream_request&& o) noexcept { *this = std::move(o); }
  /// Move assignment: the moved-from request no longer waits on anything.
  basic_stream_request& operator=(basic_stream_request&& o) noexcept {
    if (this != &o) {
      give_back();
      channel_ = std::move(o.channel_);
      event_ = o.event_;
      has_event_ = std::exchange(o.has_event_, false);
      op_ = std::move(o.op_);
      state_ = std::exchange(o.state_, state::empty);
      deadline_ = o.deadline_;
      failure_ = std::move(o.failure_);
      failure_is_timeout_ = o.failure_is_timeout_;
      failure_is_abort_ = o.failure_is_abort_;
      failure_is_mismatch_ = o.failure_is_mismatch_;
    }
    return *this;
  }
  basic_stream_request(const basic_stream_request&) = delete;
  basic_stream_request& operator=(const basic_stream_request&) = delete;
  ~basic_stream_request() { give_back(); }

  /// @brief Whether the operation is complete, without blocking.
  /// @throws comm_aborted, comm_timeout or comm_error as `wait()`.
  [[nodiscard]] bool test() {
    switch (state_) {
      case state::empty:
      case state::complete: return true;
      case state::failed: rethrow();
      case state::pending: break;
    }
    return step();
  }

  /// @brief Blocks until the operation is complete (its receive buffers hold the result).
  /// @throws comm_aborted when the channel reports an error (a peer failed, the communicator was
  /// aborted), comm_timeout when the deadline passes first (the channel is aborted then too).
  void wait() {
    while (!test()) std::this_thread::yield();
  }

  /// Whether the request is still pending (neither complete nor failed).
  [[nodiscard]] bool pending() const noexcept { return state_ == state::pending; }
  /// The operation's name, as in error messages.
  [[nodiscard]] const std::string& operation() const noexcept { return op_; }

 private:
  enum class state { empty, pending, complete, failed };

  bool step() {
    stream_poll p = channel_->poll(event_);
    if (p.status == stream_poll::state::complete) {
      state_ = state::complete;
      give_back();
      return true;
    }
    if (p.status == stream_poll::state::failed && p.mismatch) {
      failure_is_mismatch_ = true;
      fail(p.error.starts_with("meshlib: ") ? p.error.substr(9) : p.error, false, false);
    } else if (p.status == stream_poll::state::failed) {
      fail(channel_->describe(op_) + " failed: " + p.error, false, p.peer_failed);
    } else if (deadline_ && std::chrono::steady_clock::now() > *deadline_) {
      fail(channel_->describe(op_) + " did not complete within the communicator's timeout (" +
               std::to_string(timeout_ms()) + " ms); a peer never joined, or the collectives were called in "
               "different orders (NCCL cannot tell); the communicator was aborted" + unchecked_calls(),
           true, false);
    }
    return false;
  }
  /// The channel's calls not yet checked against the peers' (`unchecked_calls()`, where it has
  /// one: the NCCL communicator's batched mismatch check), for the timeout's message.
  [[nodiscard]] std::string unchecked_calls() const {
    if constexpr (requires(const Channel& c) { { c.unchecked_calls() } -> std::convertible_to<std::string>; })
      return channel_->unchecked_calls();
    else
      return {};
  }
  [[nodiscard]] long long timeout_ms() const noexcept {
    // Recomputed for the message only: the deadline minus the creation time is not kept.
    return channel_ ? channel_->timeout_ms() : 0;
  }
  [[noreturn]] void fail(std::string message, bool timeout, bool aborted) {
    failure_ = "meshlib: " + std::move(message);
    failure_is_timeout_ = timeout;
    failure_is_abort_ = aborted;
    state_ = state::failed;
    channel_->abort(failure_, timeout);
    give_back();
    rethrow();
  }
  [[noreturn]] void rethrow() const {
    if (failure_is_mismatch_) throw collective_mismatch(failure_);
    if (failure_is_timeout_) throw comm_timeout(failure_);
    if (failure_is_abort_) throw comm_aborted(failure_);
    throw comm_error(failure_);
  }
  void give_back() noexcept {
    if (channel_ && has_event_) channel_->release(event_);
    has_event_ = false;
  }

  std::shared_ptr<Channel> channel_;
  event_type event_{};
  bool has_event_ = true;
  std::string op_;
  state state_ = state::empty;
  std::optional<std::chrono::steady_clock::time_point> deadline_;
  std::string failure_;
  bool failure_is_timeout_ = false;
  bool failure_is_abort_ = false;
  bool failure_is_mismatch_ = false;
};

}  // namespace meshlib
// end meshlib/comm/nccl/stream_request.hpp

namespace meshlib {

/// @brief The execution context of the device communicators: the CUDA stream an operation is
/// enqueued on. Default-constructed it means "the communicator's own stream"; it converts from a
/// `cudaStream_t` and from any execution-space instance with `cuda_stream()` (`Kokkos::Cuda`),
/// without meshlib including Kokkos' CUDA headers.
class cuda_stream_ref {
 public:
  /// The communicator's bound stream.
  constexpr cuda_stream_ref() noexcept = default;
  /// `s` (`nullptr` is CUDA's legacy default stream, not "unset").
  constexpr cuda_stream_ref(cudaStream_t s) noexcept : stream_(s), given_(true) {}  // NOLINT: implicit, as a stream
  /// The stream of a Kokkos CUDA execution-space instance (anything with `cuda_stream()`).
  template <class Exec>
    requires(!std::same_as<std::remove_cvref_t<Exec>, cuda_stream_ref>) && requires(const Exec& e) {
      { e.cuda_stream() } -> std::convertible_to<cudaStream_t>;
    }
  cuda_stream_ref(const Exec& exec) : cuda_stream_ref(static_cast<cudaStream_t>(exec.cuda_stream())) {}  // NOLINT

  /// Whether a stream was given.
  [[nodiscard]] constexpr bool given() const noexcept { return given_; }
  /// The given stream, or `fallback` when none was.
  [[nodiscard]] constexpr cudaStream_t or_else(cudaStream_t fallback) const noexcept { return given_ ? stream_ : fallback; }

 private:
  cudaStream_t stream_ = nullptr;
  bool given_ = false;
};

/// @brief Options of the device communicators (`nccl_communicator`, `shared_gpu_communicator`).
struct nccl_comm_options {
  /// The GPU of this participant; negative: the calling thread's current device.
  int device = -1;
  /// The stream the communicator is bound to; unset: a new non-blocking stream it owns.
  cuda_stream_ref stream{};
  /// How long `wait()` lets an operation run before the communicator is aborted with
  /// `comm_timeout`. Zero or negative: no deadline.
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// Check with `cudaPointerGetAttributes` that every buffer is device memory of this GPU (a host
  /// pointer would otherwise crash a kernel). About 0.2 us a buffer; off for measured code.
  bool check_pointers = true;
  /// NCCL communicator: check that every rank made the same collectives (operation, type, count,
  /// reduce op, root), so that ranks that disagree get `collective_mismatch` naming the call's
  /// number and each rank's call instead of a hang and a timeout. On by default (issue 40): the
  /// fingerprints of the calls are all-gathered on the stream, each of the first
  /// `verify_each_first` calls before its data moves, then `verify_every` calls at a time
  /// (`detail::call_batch` says why and what a batch leaves to the timeout), so the check costs
  /// one small all-gather and two tiny copies per batch (several microseconds), under 1 us per
  /// call at the default batch (docs/gpu.md). Every rank must use the same three settings. The
  /// shared-GPU communicator always checks every call, on its host rendezvous, whatever these say.
  bool verify_collectives = true;
  /// NCCL communicator: how many collectives one check covers after the first
  /// `verify_each_first` (1: every call checked before it runs, as before issue 40).
  std::size_t verify_every = 16;
  /// NCCL communicator: how many of a communicator's first collectives are each checked on their own.
  std::size_t verify_each_first = 64;
};

namespace detail {

/// Makes `device` the calling thread's current CUDA device for a scope.
class cuda_device_scope {
 public:
  cuda_device_scope(int device, std::string_view what) {
    check_cuda(cudaGetDevice(&previous_), what, "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), what, "cudaSetDevice(" + std::to_string(device) + ")");
  }
  ~cuda_device_scope() {
    int now = previous_;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) (void)cudaSetDevice(previous_);
  }
  cuda_device_scope(const cuda_device_scope&) = delete;
  cuda_device_scope& operator=(const cuda_device_scope&) = delete;

 private:
  int previous_ = 0;
};

/// The same, for destructors: never throws, does nothing without a device.
struct cuda_device_scope_noexcept {
  int previous = -1;
  explicit cuda_device_scope_noexcept(int d) noexcept {
    if (cudaGetDevice(&previous) != cudaSuccess) previous = -1;
    else if (previous != d) (void)cudaSetDevice(d);
  }
  ~cuda_device_scope_noexcept() {
    if (previous >= 0) (void)cudaSetDevice(previous);
  }
  cuda_device_scope_noexcept(const cuda_device_scope_noexcept&) = delete;
  cuda_device_scope_noexcept& operator=(const cuda_device_scope_noexcept&) = delete;
};

/// What is wrong with a buffer that must be device (or managed) memory of GPU `device`, or empty:
/// a host pointer would crash a kernel instead of failing.
[[nodiscard]] inline std::string device_buffer_problem(std::string_view name, const void* p, std::size_t bytes, int device) {
  if (bytes == 0) return {};
  cudaPointerAttributes a{};
  const cudaError_t rc = cudaPointerGetAttributes(&a, p);
  if (rc != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string(name) + " buffer is not memory CUDA knows (" + cuda_error_text(rc) +
           "); device communicators move device memory";
  }
  if (a.type != cudaMemoryTypeDevice && a.type != cudaMemoryTypeManaged)
    return std::string(name) + " buffer is host memory; NCCL moves device memory (cudaMalloc, or a Kokkos::CudaSpace view)";
  if (a.type == cudaMemoryTypeDevice && a.device != device)
    return std::string(name) + " buffer is on GPU " + std::to_string(a.device) + ", not on this rank's GPU " +
           std::to_string(device);
  return {};
}

/// A participant's GPU, stream, events, options and failure.
struct stream_state {
  using event_type = cudaEvent_t;

  int device = 0;
  cudaStream_t stream = nullptr;
  std::shared_ptr<void> stream_owner;  ///< holds a stream this participant (or its parent) created
  nccl_comm_options options;
  std::vector<cudaEvent_t> free_events;

  mutable std::mutex mutex;  ///< guards the failure (and the NCCL communicator) against abort() from another thread
  std::atomic<bool> failed{false};
  bool failed_by_timeout = false;
  std::string failure;

  stream_state() = default;
  stream_state(const stream_state&) = delete;
  stream_state& operator=(const stream_state&) = delete;
  ~stream_state() {
    cuda_device_scope_noexcept g(device);
    for (cudaEvent_t e : free_events) (void)cudaEventDestroy(e);
  }

  [[nodiscard]] long long timeout_ms() const noexcept {
    return std::chrono::duration_cast<std::chrono::milliseconds>(options.timeout).count();
  }
  /// Records the root cause (without its "meshlib: " prefix); false when one was recorded already.
  bool record_failure(const std::string& reason, bool by_timeout) {
    if (failed.load()) return false;
    constexpr std::string_view prefix = "meshlib: ";
    failure = std::string_view(reason).starts_with(prefix) ? reason.substr(prefix.size()) : reason;
    failed_by_timeout = by_timeout;
    failed.store(true);
    return true;
  }
  /// What is wrong with a buffer of `bytes` bytes for this participant (`device_buffer_problem` on
  /// its GPU), or empty; always empty when `options.check_pointers` is off. Both device
  /// communicators' transports call this one check before they touch a pointer.
  [[nodiscard]] std::string buffer_problem(std::string_view name, const void* p, std::size_t bytes) const {
    if (!options.check_pointers) return {};
    return device_buffer_problem(name, p, bytes, device);
  }
  /// Throws the refusal of operation `where` when the participant has failed.
  void refuse_if_failed(const std::string& where) const {
    if (!failed.load()) return;
    std::lock_guard lock(mutex);
    const std::string m = "meshlib: refused " + where + ": the communicator has failed: " + failure;
    if (failed_by_timeout) throw comm_timeout(m);
    throw comm_aborted(m);
  }
  cudaEvent_t acquire_event(std::string_view what) {
    if (!free_events.empty()) {
      cudaEvent_t e = free_events.back();
      free_events.pop_back();
      return e;
    }
    cudaEvent_t e = nullptr;
    check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what, "cudaEventCreateWithFlags");
    return e;
  }
  void release(cudaEvent_t e) noexcept {
    try {
      free_events.push_back(e);
    } catch (...) {
      (void)cudaEventDestroy(e);
    }
  }
};

}  // namespace detail
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/detail/stream_state.hpp
// begin meshlib/comm/nccl/nccl_version.hpp
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
  detail::check_nccl(ncclGetVersion(&code), "nccl_version", "ncclGetVersion");
  return nccl_version_number::from_code(code);
}

namespace detail {

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

}  // namespace detail
}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/nccl_version.hpp

namespace meshlib {

namespace detail {

/// The NCCL communicator, stream and event pool shared by the handles and requests of one
/// participant: the `Channel` of `basic_stream_request`.
struct nccl_comm_state : stream_state {
  ncclComm_t comm = nullptr;
  int rank = 0;
  int size = 0;
  int* scratch = nullptr;  ///< one device int: the payload of barrier()

  // verify_collectives: the calls not yet exchanged and when to exchange them (call_batch); a
  // ring of check slots, each (1 + size) * every int64 (own batch, then every rank's), on the
  // device and in pinned host memory; checks whose copies have not been compared.
  static constexpr int check_slots = 64;
  call_batch batch;
  std::int64_t* check_dev = nullptr;
  std::int64_t* check_host = nullptr;
  struct pending_check {
    cudaEvent_t event;
    int slot;
    std::uint64_t first_call;  ///< the number of the batch's first collective
    std::size_t per;           ///< the calls in the batch
  };
  std::deque<pending_check> checks;
  int next_slot = 0;

  nccl_comm_state() = default;

  ~nccl_comm_state() {
    cuda_device_scope_noexcept g(device);
    if (comm != nullptr && !failed.load()) {
      // Finish outstanding work, then free NCCL's resources; a finalize that does not finish
      // within the timeout (a peer is gone) is an abort.
      const ncclResult_t fin = ncclCommFinalize(comm);  // non-blocking: usually ncclInProgress
      bool clean = fin == ncclSuccess || fin == ncclInProgress;
      if (clean) clean = settle_for_destroy();
      if (clean) (void)ncclCommDestroy(comm);
      else (void)ncclCommAbort(comm);
    }
    if (scratch != nullptr) (void)cudaFree(scratch);
    for (const auto& c : checks) (void)cudaEventDestroy(c.event);
    if (check_dev != nullptr) (void)cudaFree(check_dev);
    if (check_host != nullptr) (void)cudaFreeHost(check_host);
  }

  /// Compares the fingerprints of every check whose copies have arrived: the message of the first
  /// disagreement, else empty. Never blocks.
  std::string compare_checks(std::string* cuda_failure) {
    for (auto it = checks.begin(); it != checks.end();) {
      const cudaError_t q = cudaEventQuery(it->event);
      if (q == cudaErrorNotReady) {
        ++it;
        continue;
      }
      if (q != cudaSuccess) {
        (void)cudaGetLastError();
        *cuda_failure = "cudaEventQuery failed: " + cuda_error_text(q);
        return {};
      }
      const auto slot = static_cast<std::size_t>(it->slot);
      const std::size_t slot_size = static_cast<std::size_t>(size + 1) * batch.every();
      const std::int64_t* all = check_host + slot * slot_size + batch.every();
      std::string m = batch_mismatch_message(
          "NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + ", GPU " + std::to_string(device),
          it->first_call, it->per, std::span<const std::int64_t>(all, static_cast<std::size_t>(size) * it->per));
      release(it->event);
      it = checks.erase(it);
      if (!m.empty()) return m;
    }
    return {};
  }

  /// What a timeout adds to its message: the collectives this rank made since its last check
  /// (`call_batch::describe_pending`), where the ranks may have disagreed.
  [[nodiscard]] std::string unchecked_calls() const { return batch.describe_pending(); }

  /// "all_reduce on NCCL rank 1 of 4 (GPU 1)".
  [[nodiscard]] std::string describe(std::string_view op) const {
    return std::string(op) + " on NCCL rank " + std::to_string(rank) + " of " + std::to_string(size) + " (GPU " +
           std::to_string(device) + ")";
  }
  /// One look at `event` and at the communicator's asynchronous error; never blocks.
  stream_poll poll(cudaEvent_t event) {
    std::lock_guard lock(mutex);
    if (failed.load()) return stream_poll::failed("the communicator has failed: " + failure);
    // The event first: when it has completed, so has this operation's check (enqueued before it on
    // the same stream), which compare_checks then sees.
    const cudaError_t q = cudaEventQuery(event);
    std::string cuda_failure;
    if (std::string m = compare_checks(&cuda_failure); !m.empty()) return stream_poll::mismatched(std::move(m));
    if (!cuda_failure.empty()) return stream_poll::failed(cuda_failure, false);
    if (q == cudaSuccess) return stream_poll::complete();
    if (q != cudaErrorNotReady) {
      (void)cudaGetLastError();
      return stream_poll::failed("cudaEventQuery failed: " + cuda_error_text(q), false);
    }
    ncclResult_t async = ncclSuccess;
    const ncclResult_t rc = ncclCommGetAsyncError(comm, &async);
    if (rc != ncclSuccess) return stream_poll::failed("ncclCommGetAsyncError failed: " + nccl_result_text(rc), false);
    if (async != ncclSuccess && async != ncclInProgress) {
      const char* last = ncclGetLastError(comm);
      return stream_poll::failed(nccl_result_text(async) + (last != nullptr && *last ? std::string(": ") + last : ""));
    }
    return stream_poll::pending();
  }

  /// Aborts the NCCL communicator (its kernels stop, peers see ncclRemoteError) and records why;
  /// later operations are refused with `reason`. Idempotent, callable from any thread.
  void abort(const std::string& reason, bool by_timeout = false) {
    std::lock_guard lock(mutex);
    if (!record_failure(reason, by_timeout)) return;
    if (comm != nullptr) {
      cuda_device_scope_noexcept g(device);
      (void)ncclCommAbort(comm);
    }
  }

 private:
  bool settle_for_destroy() noexcept {
    const auto deadline = std::chrono::steady_clock::now() + (options.timeout.count() > 0 ? options.timeout : std::chrono::hours(1));
    for (;;) {
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) return false;
      if (async == ncclSuccess) return true;
      if (async != ncclInProgress || std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::yield();
    }
  }
};

}  // namespace detail

/// @brief The request of the NCCL communicator: completes when the event recorded after the
/// operation's NCCL calls does (see `basic_stream_request`).
using nccl_request = basic_stream_request<detail::nccl_comm_state>;

/// @brief One GPU's handle on an NCCL communicator. Copies share it.
class nccl_communicator : public communicator_frontend<nccl_communicator, nccl_request, cuda_stream_ref> {
  friend class communicator_frontend<nccl_communicator, nccl_request, cuda_stream_ref>;

 public:

  /// An empty handle; only assignable and destructible.
  nccl_communicator() = default;

  /// @brief Joins the group of `nranks` participants that share `id` as participant `rank`
  /// (collective over the group: every participant makes this call, each with its own GPU).
  /// @throws comm_argument_error for a rank outside [0, nranks) or a device that does not exist;
  /// comm_timeout when the group is not complete within the timeout; comm_error when NCCL fails.
  nccl_communicator(const ncclUniqueId& id, int nranks, int rank, nccl_comm_options options = {}) {
    if (nranks < 1 || rank < 0 || rank >= nranks)
      throw comm_argument_error("meshlib: nccl_communicator: rank " + std::to_string(rank) +
                                " is outside a group of " + std::to_string(nranks) +
                                " participants; ranks are 0 <= rank < nranks and nranks >= 1");
    detail::require_nccl_version("nccl_communicator");
    auto s = make_state(options, rank, nranks, "nccl_communicator");
    {
      detail::cuda_device_scope g(s->device, "nccl_communicator");
      ncclConfig_t config = nonblocking_config();
      ncclUniqueId copy = id;
      init_checked(*s, ncclCommInitRankConfig(&s->comm, nranks, copy, rank, &config), "ncclCommInitRankConfig");
    }
    state_ = std::move(s);
  }

  /// @brief Adopts state made by a creation function (`run_on_gpus`, `split`).
  explicit nccl_communicator(std::shared_ptr<detail::nccl_comm_state> s) noexcept : state_(std::move(s)) {}

  /// @brief A new unique id (`ncclGetUniqueId`), made by one participant and given to all.
  [[nodiscard]] static ncclUniqueId new_unique_id() {
    ncclUniqueId id{};
    detail::check_nccl(ncclGetUniqueId(&id), "nccl_communicator", "ncclGetUniqueId");
    return id;
  }

  /// This GPU's rank in the NCCL communicator (0 when moved from).
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  /// The number of ranks (0 when moved from).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// The GPU of this participant.
  [[nodiscard]] int device() const noexcept { return state_ ? state_->device : -1; }
  /// The stream the communicator is bound to.
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_ ? state_->stream : nullptr; }
  /// NCCL's communicator, for calls meshlib does not wrap.
  [[nodiscard]] ncclComm_t native() const noexcept { return state_ ? state_->comm : nullptr; }
  /// The options the communicator was made with.
  [[nodiscard]] const nccl_comm_options& options() const {
    require_valid("options");
    return state_->options;
  }
  /// Whether the communicator has failed (aborted, or an operation timed out).
  [[nodiscard]] bool failed() const noexcept { return state_ && state_->failed.load(); }

  /// @brief Aborts the communicator (`ncclCommAbort`): outstanding operations of every participant
  /// end in `comm_aborted` naming `reason`. Any thread may call it.
  void abort(std::string_view reason) {
    require_valid("abort");
    state_->abort("meshlib: " + state_->describe("abort") + ": " + std::string(reason));
  }

  // The operations (all_reduce, reduce, broadcast, all_gather, reduce_scatter, all_to_all,
  // all_to_all_v, ppermute, send, recv, barrier, in every overload) and their argument checks come
  // from communicator_frontend; `transport` below is the NCCL part.

  /// @brief `ncclCommSplit`: ranks with the same `color` (>= 0) form a new communicator, ordered by
  /// (key, rank), on the same GPU and stream, with the same options. Collective over this one.
  ///
  /// The parent is non-blocking, and NCCL (since 2.23, NVIDIA/nccl#1472) fills the new
  /// communicator's handle only when the split is done, which it reports on the *parent*: so the
  /// parent is polled until it leaves `ncclInProgress`, and only then the new communicator, until
  /// it is ready. Polling the new handle at once polls NULL (`ncclInvalidArgument`).
  nccl_communicator split(int color, int key) {
    constexpr std::string_view k = "split";
    check_split(color);
    auto s = std::make_shared<detail::nccl_comm_state>();
    s->options = state_->options;
    s->batch = batch_of(s->options);
    s->device = state_->device;
    s->stream = state_->stream;
    s->stream_owner = state_->stream_owner;
    {
      detail::cuda_device_scope g(s->device, state_->describe(k));
      ncclConfig_t config = nonblocking_config();
      // NCCL writes the handle from its own thread when the split completes: into a cell that
      // outlives that write (leaked, 8 bytes, if the split is abandoned before it completes).
      auto cell = std::make_unique<ncclComm_t>(nullptr);
      const ncclResult_t rc = ncclCommSplit(state_->comm, color, key, cell.get(), &config);
      if (rc != ncclSuccess && rc != ncclInProgress) fail_with(k, "ncclCommSplit", rc);
      s->comm = settle_split(k, color, cell);
      settle_new(*s, state_->describe(k), "ncclCommSplit");
      call(k, "ncclCommUserRank", ncclCommUserRank(s->comm, &s->rank));
      call(k, "ncclCommCount", ncclCommCount(s->comm, &s->size));
      detail::check_cuda(cudaMalloc(reinterpret_cast<void**>(&s->scratch), sizeof(int)), state_->describe(k), "cudaMalloc");
    }
    return nccl_communicator(std::move(s));
  }

  // ---- for creation functions ------------------------------------------------------------------

  /// The non-blocking configuration every meshlib NCCL communicator is made with.
  [[nodiscard]] static ncclConfig_t nonblocking_config() noexcept {
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    return config;
  }
  /// A state for participant `rank` of `nranks` on options' device and stream, without its NCCL
  /// communicator yet.
  [[nodiscard]] static std::shared_ptr<detail::nccl_comm_state> make_state(const nccl_comm_options& options, int rank,
                                                                           int nranks, std::string_view what) {
    auto s = std::make_shared<detail::nccl_comm_state>();
    s->options = options;
    s->batch = batch_of(options);
    s->rank = rank;
    s->size = nranks;
    int count = 0;
    detail::check_cuda(cudaGetDeviceCount(&count), what, "cudaGetDeviceCount");
    int device = options.device;
    if (device < 0) detail::check_cuda(cudaGetDevice(&device), what, "cudaGetDevice");
    if (device >= count)
      throw comm_argument_error("meshlib: " + std::string(what) + ": GPU " + std::to_string(device) +
                                " does not exist; this machine has " + std::to_string(count) + " CUDA device(s)");
    s->device = device;
    detail::cuda_device_scope g(device, what);
    if (options.stream.given()) {
      s->stream = options.stream.or_else(nullptr);
    } else {
      cudaStream_t st = nullptr;
      detail::check_cuda(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), what, "cudaStreamCreateWithFlags");
      s->stream = st;
      s->stream_owner = std::shared_ptr<void>(st, [device](void* p) {
        int prev = 0;
        const bool ok = cudaGetDevice(&prev) == cudaSuccess;
        (void)cudaSetDevice(device);
        (void)cudaStreamDestroy(static_cast<cudaStream_t>(p));
        if (ok) (void)cudaSetDevice(prev);
      });
    }
    detail::check_cuda(cudaMalloc(reinterpret_cast<void**>(&s->scratch), sizeof(int)), what, "cudaMalloc");
    return s;
  }
  /// Checks the result of a communicator-creating call and polls the new communicator until it is
  /// ready (non-blocking creation returns ncclInProgress), against the timeout.
  static void init_checked(detail::nccl_comm_state& s, ncclResult_t rc, std::string_view call_name) {
    const std::string what = s.describe("nccl_communicator creation");
    if (rc != ncclSuccess && rc != ncclInProgress)
      detail::check_nccl(rc, what, call_name, s.comm != nullptr ? ncclGetLastError(s.comm) : nullptr);
    settle_new(s, what, call_name);
  }

 private:
  // ---- enqueueing ------------------------------------------------------------------------------

  template <class F>
  request_type enqueue(std::string_view k, context_type ctx, std::optional<detail::call_fingerprint> fingerprint,
                       F&& calls) {
    detail::cuda_device_scope g(state_->device, state_->describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    if (fingerprint && state_->options.verify_collectives) verify(k, fingerprint->pack(), s);
    calls(s);
    cudaEvent_t ev = state_->acquire_event(state_->describe(k));
    cuda_call(k, "cudaEventRecord", cudaEventRecord(ev, s));
    return request_type(state_, ev, std::string(k), state_->options.timeout);
  }
  template <class T>
  static detail::call_fingerprint fp(detail::op_kind op, std::size_t count, std::optional<reduce_op> r = std::nullopt,
                                     int root = -1) {
    detail::call_fingerprint f;
    f.op = op;
    if constexpr (comm_element<T>) f.type = static_cast<int>(datatype_of<T>);
    else f.type = 14;  // CUDA's own 16-bit types: compared, printed as "-"
    f.reduce = r ? static_cast<int>(*r) : -1;
    f.root = root;
    f.count = count;
    return f;
  }
  /// Records a collective's fingerprint (verify_collectives) and, when the schedule says so
  /// (`detail::call_batch`), enqueues the check of the calls since the last one: this rank's batch
  /// to the device, all-gathered, every rank's back to pinned host memory, an event after; polls
  /// compare. The calls that are not exchanged cost a host-side append only.
  void verify(std::string_view k, std::int64_t fp, cudaStream_t s) {
    auto& st = *state_;
    if (!st.batch.add(fp)) return;
    const std::size_t per = st.batch.pending().size();
    const std::size_t every = st.batch.every();
    const auto n1 = static_cast<std::size_t>(st.size + 1) * every;
    const auto slots = static_cast<std::size_t>(detail::nccl_comm_state::check_slots);
    if (st.check_dev == nullptr) {
      cuda_call(k, "cudaMalloc", cudaMalloc(reinterpret_cast<void**>(&st.check_dev), slots * n1 * sizeof(std::int64_t)));
      cuda_call(k, "cudaHostAlloc",
                cudaHostAlloc(reinterpret_cast<void**>(&st.check_host), slots * n1 * sizeof(std::int64_t), cudaHostAllocDefault));
    }
    const int slot = st.next_slot;
    st.next_slot = (st.next_slot + 1) % detail::nccl_comm_state::check_slots;
    // The slot's previous check must have been compared before its memory is reused.
    const auto deadline = deadline_from_now();
    for (;;) {
      bool busy = false;
      for (const auto& c : st.checks) busy = busy || c.slot == slot;
      if (!busy) break;
      std::string cuda_failure;
      std::string m;
      {
        std::lock_guard lock(st.mutex);
        m = st.compare_checks(&cuda_failure);
      }
      if (!m.empty()) {
        st.abort(m);
        throw collective_mismatch(m);
      }
      if (!cuda_failure.empty()) detail::throw_comm_failure(detail::comm_failure_kind::error, "meshlib: " + st.describe(k) + ": " + cuda_failure);
      if (deadline.passed()) {
        const std::string t = "meshlib: " + st.describe(k) + ": the check of an earlier collective did not complete within the timeout; the communicator was aborted";
        st.abort(t, true);
        throw comm_timeout(t);
      }
      std::this_thread::yield();
    }
    std::int64_t* host = st.check_host + static_cast<std::size_t>(slot) * n1;
    std::int64_t* dev = st.check_dev + static_cast<std::size_t>(slot) * n1;
    const std::uint64_t first = st.batch.first_pending();
    std::copy(st.batch.pending().begin(), st.batch.pending().end(), host);
    st.batch.clear();
    const std::size_t bytes = per * sizeof(std::int64_t);
    cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, s));
    call(k, "ncclAllGather (call check)", ncclAllGather(dev, dev + every, per, ncclInt64, st.comm, s));
    cuda_call(k, "cudaMemcpyAsync",
              cudaMemcpyAsync(host + every, dev + every, static_cast<std::size_t>(st.size) * bytes,
                              cudaMemcpyDeviceToHost, s));
    cudaEvent_t ev = st.acquire_event(st.describe(k));
    cuda_call(k, "cudaEventRecord", cudaEventRecord(ev, s));
    st.checks.push_back({ev, slot, first, per});
  }
  /// A state's call schedule, from its options (`verify_every`, `verify_each_first`).
  static detail::call_batch batch_of(const nccl_comm_options& o) {
    return detail::call_batch(o.verify_every, o.verify_each_first);
  }
  /// Checks an NCCL call of operation k; ncclInProgress (non-blocking) is settled first.
  void call(std::string_view k, std::string_view name, ncclResult_t rc) const {
    if (rc == ncclSuccess) return;
    if (rc == ncclInProgress) {
      settle(k, name);
      return;
    }
    fail_with(k, name, rc);
  }
  [[noreturn]] void fail_with(std::string_view k, std::string_view name, ncclResult_t rc) const {
    const char* last = ncclGetLastError(state_->comm);
    const std::string message = detail::failed_call_message(state_->describe(k), name, detail::nccl_result_text(rc),
                                                            last != nullptr ? std::string_view(last) : std::string_view{});
    // Argument errors leave the communicator usable; anything else may have left it half-way
    // through a collective, so it is aborted and later calls are refused.
    if (detail::failure_kind_of(rc) != detail::comm_failure_kind::argument) state_->abort(message);
    detail::throw_comm_failure(detail::failure_kind_of(rc), message);
  }
  void cuda_call(std::string_view k, std::string_view name, cudaError_t rc) const {
    if (rc == cudaSuccess) return;
    detail::check_cuda(rc, state_->describe(k), name);
  }
  /// Polls `ncclCommGetAsyncError` until a non-blocking call has been issued.
  void settle(std::string_view k, std::string_view name) const {
    const auto deadline = deadline_from_now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(state_->comm, &async);
      if (rc != ncclSuccess) fail_with(k, "ncclCommGetAsyncError", rc);
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) fail_with(k, name, async);
      if (deadline.passed()) {
        const std::string m = "meshlib: " + state_->describe(k) + ": " + std::string(name) +
                              " was not issued within the communicator's timeout (" +
                              std::to_string(state_->timeout_ms()) + " ms); the communicator was aborted";
        state_->abort(m, true);
        throw comm_timeout(m);
      }
      std::this_thread::yield();
    }
  }
  /// The first half of a split on a non-blocking parent: polls the parent until the split has
  /// left ncclInProgress there (then NCCL has written the new handle into `cell`), against the
  /// timeout, and returns the new handle. A failure reported on the parent aborts the parent (as
  /// any failed NCCL call does) and the half-made new communicator; a timeout leaks `cell`, which
  /// NCCL may still write.
  ncclComm_t settle_split(std::string_view k, int color, std::unique_ptr<ncclComm_t>& cell) const {
    const auto deadline = deadline_from_now();
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(state_->comm, &async);
      if (rc != ncclSuccess) {
        (void)cell.release();  // NCCL's state is unknown: the cell may still be written
        fail_with(k, "ncclCommGetAsyncError", rc);
      }
      if (async == ncclSuccess) break;
      if (async != ncclInProgress) {
        if (*cell != nullptr) (void)ncclCommAbort(*cell);
        fail_with(k, "ncclCommSplit", async);
      }
      if (deadline.passed()) {
        (void)cell.release();
        const std::string m = "meshlib: " + state_->describe(k) +
                              ": ncclCommSplit did not complete within the communicator's timeout (" +
                              std::to_string(state_->timeout_ms()) +
                              " ms); not every participant called split; the communicator was aborted";
        state_->abort(m, true);
        throw comm_timeout(m);
      }
      std::this_thread::yield();
    }
    if (*cell == nullptr)
      throw comm_error("meshlib: " + state_->describe(k) + ": ncclCommSplit completed (color " + std::to_string(color) +
                       ") but gave no new communicator (NULL); this NCCL does not fill the handle as meshlib expects (" +
                       detail::nccl_versions_text(nccl_version()) + ")");
    return *cell;
  }
  static void settle_new(detail::nccl_comm_state& s, const std::string& what, std::string_view name) {
    if (s.comm == nullptr)  // NCCL would answer ncclInvalidArgument ("comm argument is NULL"); say what happened
      throw comm_error("meshlib: " + what + ": " + std::string(name) +
                       " returned without a communicator (NULL); this NCCL does not fill the handle as meshlib expects (" +
                       detail::nccl_versions_text(nccl_version()) + ")");
    const deadline_t deadline{s.options.timeout.count() > 0, std::chrono::steady_clock::now() + s.options.timeout};
    for (;;) {
      ncclResult_t async = ncclSuccess;
      const ncclResult_t rc = ncclCommGetAsyncError(s.comm, &async);
      if (rc != ncclSuccess) detail::check_nccl(rc, what, "ncclCommGetAsyncError");
      if (async == ncclSuccess) return;
      if (async != ncclInProgress) {
        const std::string last = ncclGetLastError(s.comm);
        (void)ncclCommAbort(s.comm);
        s.comm = nullptr;
        detail::check_nccl(async, what, name, last.c_str());
      }
      if (deadline.passed()) {
        (void)ncclCommAbort(s.comm);
        s.comm = nullptr;
        throw comm_timeout("meshlib: " + what + ": " + std::string(name) + " did not complete within the timeout (" +
                           std::to_string(s.timeout_ms()) + " ms); not every participant joined the group");
      }
      std::this_thread::yield();
    }
  }
  /// The communicator's timeout from now; `passed()` is never true without a timeout. A flag and a
  /// time point, not an optional: GCC at -O1 warns that an optional's value may be read
  /// uninitialised (-Wmaybe-uninitialized), which -Werror turns into an error.
  struct deadline_t {
    bool timed;
    std::chrono::steady_clock::time_point at;
    [[nodiscard]] bool passed() const { return timed && std::chrono::steady_clock::now() > at; }
  };
  [[nodiscard]] deadline_t deadline_from_now() const {
    return {state_->options.timeout.count() > 0, std::chrono::steady_clock::now() + state_->options.timeout};
  }
  /// Runs the NCCL calls of `body` as one group (`ncclGroupStart`/`ncclGroupEnd`).
  template <class F>
  void group(std::string_view k, F&& body) const {
    call(k, "ncclGroupStart", ncclGroupStart());
    try {
      body();
    } catch (...) {
      (void)ncclGroupEnd();
      throw;
    }
    call(k, "ncclGroupEnd", ncclGroupEnd());
  }
  template <class T>
  void exchange_blocks(std::string_view k, const T* send, T* recv, std::size_t c, cudaStream_t s) const {
    group(k, [&] {
      for (int p = 0; p < size(); ++p) {
        const std::size_t off = static_cast<std::size_t>(p) * c;
        call(k, "ncclSend", ncclSend(send + off, c, nccl_datatype_of<T>, p, state_->comm, s));
        call(k, "ncclRecv", ncclRecv(recv + off, c, nccl_datatype_of<T>, p, state_->comm, s));
      }
    });
  }
  template <class T>
  void permute(std::string_view k, const T* send, T* recv, std::size_t n, std::span<const permute_pair> pairs,
               cudaStream_t s) const {
    const int me = rank();
    const permute_pair* incoming = nullptr;
    for (const auto& p : pairs)
      if (p.dest == me) incoming = &p;
    if (incoming == nullptr) {
      cuda_call(k, "cudaMemsetAsync", cudaMemsetAsync(recv, 0, n * sizeof(T), s));  // all-zero bits are 0 in every type
    } else if (incoming->source == me) {
      cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(recv, send, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
    }
    group(k, [&] {
      for (const auto& p : pairs) {
        if (p.source == p.dest) continue;
        if (p.source == me) call(k, "ncclSend", ncclSend(send, n, nccl_datatype_of<T>, p.dest, state_->comm, s));
        if (p.dest == me) call(k, "ncclRecv", ncclRecv(recv, n, nccl_datatype_of<T>, p.source, state_->comm, s));
      }
    });
  }
  /// Runs `body(copy)` with a stream-ordered device copy of buf (`cudaMallocAsync`, freed after).
  template <class T, class F>
  void with_copy(std::string_view k, std::span<T> buf, cudaStream_t s, F&& body) const {
    if (buf.empty()) {
      body(static_cast<const T*>(nullptr));
      return;
    }
    void* copy = nullptr;
    cuda_call(k, "cudaMallocAsync", cudaMallocAsync(&copy, buf.size_bytes(), s));
    struct release {
      void* p;
      cudaStream_t s;
      ~release() { (void)cudaFreeAsync(p, s); }
    } r{copy, s};
    cuda_call(k, "cudaMemcpyAsync", cudaMemcpyAsync(copy, buf.data(), buf.size_bytes(), cudaMemcpyDeviceToDevice, s));
    body(static_cast<const T*>(copy));
  }

  // ---- the front end's hooks ---------------------------------------------------------------------

  [[nodiscard]] std::string label() const { return "NCCL rank " + std::to_string(rank()); }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty nccl_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    state_->refuse_if_failed(state_->describe(k));
  }
  void ensure_usable(detail::op_kind k) const { check_usable(detail::op_name(k)); }
  /// A buffer of `elems` elements of T must be device memory of this GPU (stream_state's check).
  template <detail::op_kind K, class T>
  void device_buffer(const char* name, const T* p, std::size_t elems) const {
    if (auto problem = state_->buffer_problem(name, p, elems * sizeof(T)); !problem.empty()) this->bad_argument(K, problem);
  }

  /// The NCCL transport of operation K, after the front end's checks.
  template <detail::op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type ctx) {
    using detail::op_kind;
    constexpr std::string_view k = detail::op_name(K);
    const std::size_t n = static_cast<std::size_t>(size());
    const std::size_t c = o.count;
    const ncclDataType_t t = nccl_datatype_of<T>;
    const ncclRedOp_t r = to_nccl(o.op);
    auto fingerprint = [&](int root = -1, bool reducing = false) {
      return fp<T>(K, K == op_kind::all_to_all_v ? 0 : c, reducing ? std::optional(o.op) : std::nullopt, root);
    };
    if constexpr (K == op_kind::all_reduce) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(-1, true), [&](cudaStream_t s) {
        call(k, "ncclAllReduce", ncclAllReduce(o.send, o.recv, c, t, r, state_->comm, s));
      });
    } else if constexpr (K == op_kind::reduce) {
      device_buffer<K>("send", o.send, c);
      if (o.recv != nullptr) device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(o.root, true), [&](cudaStream_t s) {
        call(k, "ncclReduce", ncclReduce(o.send, o.recv, c, t, r, o.root, state_->comm, s));
      });
    } else if constexpr (K == op_kind::reduce_scatter) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(-1, true), [&](cudaStream_t s) {
        call(k, "ncclReduceScatter", ncclReduceScatter(o.send, o.recv, c, t, r, state_->comm, s));
      });
    } else if constexpr (K == op_kind::broadcast) {
      if (o.send != nullptr) device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(o.root), [&](cudaStream_t s) {
        call(k, "ncclBroadcast", ncclBroadcast(o.send, o.recv, c, t, o.root, state_->comm, s));
      });
    } else if constexpr (K == op_kind::all_gather) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c * n);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        call(k, "ncclAllGather", ncclAllGather(o.send, o.recv, c, t, state_->comm, s));
      });
    } else if constexpr (K == op_kind::all_to_all) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c * n);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        if (o.in_place)
          with_copy<T>(k, std::span<T>(o.recv, c * n), s, [&](const T* copy) { exchange_blocks<T>(k, copy, o.recv, c, s); });
        else
          exchange_blocks<T>(k, o.send, o.recv, c, s);
      });
    } else if constexpr (K == op_kind::all_to_all_v) {
      std::size_t send_end = 0;
      std::size_t recv_end = 0;
      for (std::size_t j = 0; j < n; ++j) {
        send_end = std::max(send_end, static_cast<std::size_t>(o.v[0][j] + o.v[1][j]));
        recv_end = std::max(recv_end, static_cast<std::size_t>(o.v[2][j] + o.v[3][j]));
      }
      device_buffer<K>("send", o.send, send_end);
      device_buffer<K>("receive", o.recv, recv_end);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        group(k, [&] {
          for (std::size_t j = 0; j < n; ++j) {
            const int p = static_cast<int>(j);
            if (o.v[0][j] > 0)
              call(k, "ncclSend", ncclSend(o.send + o.v[1][j], static_cast<std::size_t>(o.v[0][j]), t, p, state_->comm, s));
            if (o.v[2][j] > 0)
              call(k, "ncclRecv", ncclRecv(o.recv + o.v[3][j], static_cast<std::size_t>(o.v[2][j]), t, p, state_->comm, s));
          }
        });
      });
    } else if constexpr (K == op_kind::ppermute) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return enqueue(k, ctx, fingerprint(), [&](cudaStream_t s) {
        if (o.in_place)
          with_copy<T>(k, std::span<T>(o.recv, c), s, [&](const T* copy) { permute<T>(k, copy, o.recv, c, o.pairs, s); });
        else
          permute<T>(k, o.send, o.recv, c, o.pairs, s);
      });
    } else if constexpr (K == op_kind::send || K == op_kind::recv) {
      if (o.tag != 0)
        this->bad_argument(K, "tag " + std::to_string(o.tag) +
                                  " given, but NCCL has no message tags; pass 0 (messages between two ranks match in order)");
      if constexpr (K == op_kind::send) {
        device_buffer<K>("send", o.send, c);
        return enqueue(k, ctx, std::nullopt, [&](cudaStream_t s) {
          call(k, "ncclSend", ncclSend(o.send, c, t, o.peer, state_->comm, s));
        });
      } else {
        device_buffer<K>("receive", o.recv, c);
        return enqueue(k, ctx, std::nullopt, [&](cudaStream_t s) {
          call(k, "ncclRecv", ncclRecv(o.recv, c, t, o.peer, state_->comm, s));
        });
      }
    } else {
      static_assert(K == op_kind::barrier);
      return enqueue(k, ctx, detail::call_fingerprint{}, [&](cudaStream_t s) {
        call(k, "ncclAllReduce", ncclAllReduce(state_->scratch, state_->scratch, 1, ncclInt32, ncclSum, state_->comm, s));
      });
    }
  }

  std::shared_ptr<detail::nccl_comm_state> state_;
};

static_assert(communicator<nccl_communicator>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/nccl_communicator.hpp
// begin meshlib/comm/nccl/run_on_gpus.hpp
/// @file
/// @brief One process driving several GPUs: `nccl_communicators(devices)` makes one communicator
/// per GPU in one call, and `run_on_gpus(devices, fn)` runs `fn(comm)` on one runner thread per
/// GPU, as `run_on_threads` does for the thread communicator.
///
/// @code
/// const int gpus[] = {0, 1, 2, 3};
/// meshlib::run_on_gpus(gpus, [&](meshlib::nccl_communicator& c) {   // thread r drives GPU gpus[r]
///   c.all_reduce(std::span(grad[c.rank()], n), meshlib::reduce_op::mean).wait();
/// });
/// @endcode
///
/// Creation follows `ncclCommInitAll` (one unique id, `ncclCommInitRank` for every GPU inside one
/// `ncclGroupStart`/`ncclGroupEnd`), but with the non-blocking configuration every meshlib
/// communicator has (`ncclCommInitAll` takes no configuration), so that a fault ends in an error
/// instead of a hang. NCCL refuses two ranks on one GPU: `devices` must be distinct.

#if MESHLIB_ENABLE_NCCL

#include <atomic>
#include <exception>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>


namespace meshlib {

/// @brief One NCCL communicator per GPU of `devices` (rank r on `devices[r]`), each bound to a new
/// stream of its own unless `options.stream` is given (then it must be usable on every device).
/// @throws comm_argument_error for an empty list, a repeated device or one that does not exist;
/// comm_error, comm_timeout when NCCL fails.
[[nodiscard]] inline std::vector<nccl_communicator> nccl_communicators(std::span<const int> devices,
                                                                      nccl_comm_options options = {}) {
  constexpr std::string_view what = "nccl_communicators";
  if (devices.empty()) throw comm_argument_error("meshlib: nccl_communicators needs at least one GPU");
  for (std::size_t i = 0; i < devices.size(); ++i)
    for (std::size_t j = 0; j < i; ++j)
      if (devices[i] == devices[j])
        throw comm_argument_error("meshlib: nccl_communicators: GPU " + std::to_string(devices[i]) +
                                  " is listed twice; NCCL refuses two ranks on one GPU (use one communicator per "
                                  "GPU, and the thread communicator between devices that share one)");
  detail::require_nccl_version(what);
  const int n = static_cast<int>(devices.size());
  const ncclUniqueId id = nccl_communicator::new_unique_id();
  std::vector<std::shared_ptr<detail::nccl_comm_state>> states;
  for (int r = 0; r < n; ++r) {
    nccl_comm_options o = options;
    o.device = devices[static_cast<std::size_t>(r)];
    states.push_back(nccl_communicator::make_state(o, r, n, what));
  }
  {
    ncclConfig_t config = nccl_communicator::nonblocking_config();
    detail::check_nccl(ncclGroupStart(), what, "ncclGroupStart");
    ncclResult_t first = ncclSuccess;
    for (int r = 0; r < n; ++r) {
      auto& s = *states[static_cast<std::size_t>(r)];
      detail::cuda_device_scope g(s.device, what);
      ncclUniqueId copy = id;
      const ncclResult_t rc = ncclCommInitRankConfig(&s.comm, n, copy, r, &config);
      if (first == ncclSuccess && rc != ncclSuccess && rc != ncclInProgress) first = rc;
    }
    const ncclResult_t end = ncclGroupEnd();
    detail::check_nccl(first, what, "ncclCommInitRankConfig");
    detail::check_nccl(end, what, "ncclGroupEnd");
  }
  std::vector<nccl_communicator> out;
  for (auto& s : states) {
    nccl_communicator::init_checked(*s, ncclInProgress, "ncclCommInitRankConfig");
    out.emplace_back(std::move(s));
  }
  return out;
}

/// @brief Destroys communicators of several GPUs of this process concurrently, one thread each:
/// finalizing one waits for its peers to finalize, so destroying them one after another from one
/// thread would wait for the timeout. Leaves `comms` empty.
inline void destroy_communicators(std::vector<nccl_communicator>& comms) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&c] { c = nccl_communicator{}; });
  for (auto& t : threads) t.join();
  comms.clear();
}

/// @brief Runs `fn(nccl_communicator&)` on one thread per communicator of `comms` (thread r has
/// `comms[r]`'s GPU current), and returns when all have returned: `run_on_gpus` on communicators
/// made before, which a caller keeps across calls (NCCL's initialisation costs far more than a
/// training step: `gpu_runner` keeps them). When one throws, every communicator is aborted (peers
/// waiting in a collective get `comm_aborted`; the communicators are unusable afterwards), and once
/// all threads have ended `participant_error` is thrown for the first failure, its exception nested.
template <class F>
  requires std::is_invocable_v<F&, nccl_communicator&>
void run_on_communicators(std::span<nccl_communicator> comms, F&& fn) {
  const int n = static_cast<int>(comms.size());
  std::vector<std::exception_ptr> errors(comms.size());
  std::atomic<int> first{-1};
  auto body = [&](int r) {
    auto& c = comms[static_cast<std::size_t>(r)];
    try {
      detail::check_cuda(cudaSetDevice(c.device()), "run_on_gpus", "cudaSetDevice");
      fn(c);
    } catch (...) {
      errors[static_cast<std::size_t>(r)] = std::current_exception();
      int none = -1;
      first.compare_exchange_strong(none, r);
      const std::string why = "participant " + std::to_string(r) + " failed: " +
                              detail::what_of(errors[static_cast<std::size_t>(r)]);
      for (auto& other : comms) other.abort(why);
    }
  };
  if (n == 1) {
    body(0);  // one GPU: on the caller's thread (no thread to start per call)
  } else {
    std::vector<std::thread> threads;
    threads.reserve(comms.size());
    try {
      for (int r = 0; r < n; ++r) threads.emplace_back(body, r);
    } catch (...) {
      for (auto& c : comms) c.abort("run_on_gpus could not start a thread");
      for (auto& t : threads) t.join();
      throw;  // aborted communicators are released without finalizing
    }
    for (auto& t : threads) t.join();
  }
  detail::rethrow_root_cause({.errors = errors, .size = n, .local_root = first.load()}, [&](int r) {
    return "participant " + std::to_string(r) + " of " + std::to_string(n) + " (GPU " +
           std::to_string(comms[static_cast<std::size_t>(r)].device()) + ")";
  });
}

/// @brief Runs `fn(nccl_communicator&)` on one thread per GPU of `devices` (thread r has
/// `devices[r]` current and rank r), and returns when all have returned: new communicators
/// (`nccl_communicators`), `run_on_communicators`, and the communicators destroyed again. When one
/// throws, every communicator is aborted (peers waiting in a collective get `comm_aborted`), and
/// once all threads have ended `participant_error` is thrown for the first failure, its exception nested.
template <class F>
  requires std::is_invocable_v<F&, nccl_communicator&>
void run_on_gpus(std::span<const int> devices, F&& fn, nccl_comm_options options = {}) {
  std::vector<nccl_communicator> comms = nccl_communicators(devices, std::move(options));
  struct destroy_at_end {
    std::vector<nccl_communicator>& c;
    ~destroy_at_end() { destroy_communicators(c); }
  } at_end{comms};
  run_on_communicators(std::span<nccl_communicator>(comms), fn);
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/run_on_gpus.hpp
// begin meshlib/comm/nccl/shared_gpu_communicator.hpp
/// @file
/// @brief Several mesh devices on one GPU: `shared_gpu_communicator`, one participant per device,
/// each with its own CUDA stream on the same GPU, as JAX users test sharded programs with several
/// CPU devices on one machine. NCCL refuses two ranks on one GPU, so the collectives run here:
/// device-to-device copies (`cudaMemcpyAsync`) and one reduction kernel (detail/reduce_kernel.hpp,
/// compiled at run time by NVRTC so that the library stays header-only for every host compiler).
/// Satisfies `communicator`; same options (`nccl_comm_options`), requests and errors as the NCCL
/// communicator.
///
/// @code
/// meshlib::run_on_shared_gpu(4, [&](meshlib::shared_gpu_communicator& c) {   // 4 devices on GPU 0
///   c.all_reduce(std::span(grad[c.rank()], n), meshlib::reduce_op::sum).wait();
/// });
/// @endcode
///
/// How an operation runs. The participants meet on the host (a `thread_communicator`, which also
/// gives them its fault handling: a participant that throws aborts the others' waits). Each
/// records a "ready" event on its stream and publishes it with its buffer pointers and a
/// descriptor of the call; the descriptors must agree (operation, type, count, root, pairs), else
/// every participant throws `collective_mismatch` listing each rank's call. Each stream then waits
/// for every peer's "ready" event and enqueues its share of the work: for the reductions,
/// participant r reduces block r of every input and writes it to every output (one kernel, so the
/// whole payload is read once and written once, and in-place works because blocks are disjoint);
/// for data movement, each participant pushes or pulls its blocks with copies. Finally each stream
/// records "done", the participants exchange those events, and each stream waits for all of them,
/// so no participant reuses a buffer a peer still reads. Nothing blocks the host on the GPU: the
/// request completes when the participant's stream passes that point. A peer's "ready" and "done"
/// events are waited on after the rendezvous that hands them over, when their owner may already
/// have returned and been destroyed: each event holds a reference for every peer until that
/// peer's wait is enqueued (detail/shared_event.hpp).

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/nccl/detail/reduce_kernel.hpp
/// @file
/// @brief The reduction kernel of several mesh devices on one GPU, compiled at run time with NVRTC
/// (CUDA's run-time compiler, part of every CUDA toolkit) and launched through the CUDA runtime's
/// library API. Why at run time: meshlib is header-only and its users compile with g++ or clang,
/// not nvcc; a kernel in a `__CUDACC__` header would exist only in nvcc-compiled programs, and one
/// through Kokkos only where Kokkos has CUDA. NVRTC keeps the kernel in this header, for every
/// compiler, at the cost of one compilation per process (about 0.1-0.3 s, on first use).
///
/// The kernel reduces element i of n inputs in rank order (((x0 op x1) op x2) ...), as the thread
/// backend does, so results are bitwise those of the thread communicator: integer sums and products
/// wrap (computed unsigned), integer mean is the wrapped sum divided by n toward zero, bfloat16 is
/// combined in float and rounded once (nearest even, NaNs stay NaN), and float min/max follow
/// meshlib's semantics on every backend: a NaN anywhere gives NaN, and -0 < +0 (`reduce_min`,
/// `reduce_max`, which the host compiles too, so that nccl_host_tests checks them without a GPU).
/// It writes the result to every output pointer, so that one launch per participant both reduces
/// its block and distributes it.

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


namespace meshlib::detail {

/// Most participants one launch reduces (the pointer tables go by value in the kernel arguments).
inline constexpr int max_local_devices = 32;

/// Pointer tables passed by value: inputs and outputs of one launch.
struct reduce_pointers {
  const void* in[max_local_devices];
  void* out[max_local_devices];
};

// min and max of the kernel, written once for the kernel and the host. `a` is the running result
// of the lower ranks. NaN: `b < a ? b : a` would keep `a` whenever `b` is NaN, losing it (and
// the result would depend on which rank held the NaN). Equal zeros: +0 and -0 compare equal, so
// the sign is chosen by IEEE addition, which needs no signbit() (NVRTC has no <cmath>):
// +0 + -0 = +0 (max), and -(-a - b) is -0 when either is -0 (min). Integers never take those
// branches with different values (x != x is false, and equal integers are the same value).
#define MESHLIB_DETAIL_REDUCE_MINMAX(QUALIFIER)                  \
  template <class V>                                             \
  QUALIFIER V reduce_max(V a, V b) {                             \
    if (a != a) return a;                                        \
    if (b != b) return b;                                        \
    if (a == b) return a == V(0) ? a + b : a;                    \
    return a < b ? b : a;                                        \
  }                                                              \
  template <class V>                                             \
  QUALIFIER V reduce_min(V a, V b) {                             \
    if (a != a) return a;                                        \
    if (b != b) return b;                                        \
    if (a == b) return a == V(0) ? -(-a - b) : a;                \
    return b < a ? b : a;                                        \
  }
#define MESHLIB_DETAIL_REDUCE_STR(...) #__VA_ARGS__
#define MESHLIB_DETAIL_REDUCE_XSTR(...) MESHLIB_DETAIL_REDUCE_STR(__VA_ARGS__)

/// @brief The kernel's min and max of two elements, compiled for the host (the kernel gets the same
/// text, see `reduce_minmax_source`): NaN anywhere gives NaN, -0 < +0, else the usual order.
MESHLIB_DETAIL_REDUCE_MINMAX(constexpr)

/// The kernel's `reduce_min` and `reduce_max`, as text for NVRTC (`meshlib_device_function` is
/// defined by the kernel source; a placeholder, not `__device__`, because nvcc defines that as a
/// macro and would expand it here).
inline constexpr std::string_view reduce_minmax_source =
    MESHLIB_DETAIL_REDUCE_XSTR(MESHLIB_DETAIL_REDUCE_MINMAX(meshlib_device_function));

#undef MESHLIB_DETAIL_REDUCE_XSTR
#undef MESHLIB_DETAIL_REDUCE_STR
#undef MESHLIB_DETAIL_REDUCE_MINMAX

/// The kernels' source after `reduce_minmax_source`: one `extern "C"` kernel per element type, named
/// `meshlib_reduce_<type>`.
inline constexpr std::string_view reduce_kernel_source = R"(
struct reduce_pointers { const void* in[32]; void* out[32]; };
__device__ inline float bf16_to_float(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ inline unsigned short float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
  unsigned rounding = 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)((u + rounding) >> 16);
}
// op: 0 sum, 1 prod, 2 min, 3 max, 4 mean (meshlib::reduce_op's order)
#define MESHLIB_REDUCE_KERNEL(NAME, T, ACC, UACC, LOAD, STORE, DIVIDE)                                   \
extern "C" __global__ void NAME(reduce_pointers p, int n_in, int n_out, unsigned long long count, int op) { \
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;                        \
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) { \
    ACC a = LOAD(((const T*)p.in[0])[i]);                                                               \
    for (int k = 1; k < n_in; ++k) {                                                                    \
      const ACC b = LOAD(((const T*)p.in[k])[i]);                                                       \
      switch (op) {                                                                                     \
        case 0: case 4: a = (ACC)((UACC)a + (UACC)b); break;                                            \
        case 1: a = (ACC)((UACC)a * (UACC)b); break;                                                    \
        case 2: a = reduce_min(a, b); break;                                                            \
        default: a = reduce_max(a, b); break;                                                           \
      }                                                                                                 \
    }                                                                                                   \
    if (op == 4) a = DIVIDE(a, n_in);                                                                   \
    const T r = STORE(a);                                                                               \
    for (int k = 0; k < n_out; ++k) ((T*)p.out[k])[i] = r;                                              \
  }                                                                                                     \
}
#define MESHLIB_SAME(x) (x)
#define MESHLIB_DIV(a, n) ((a) / (n))
MESHLIB_REDUCE_KERNEL(meshlib_reduce_float32, float, float, float, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_float64, double, double, double, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_int32, int, int, unsigned int, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_int64, long long, long long, unsigned long long, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_bfloat16, unsigned short, float, float, bf16_to_float, float_to_bf16, MESHLIB_DIV)
)";

/// The kernel name for element type `t`.
[[nodiscard]] inline std::string reduce_kernel_name(datatype t) { return "meshlib_reduce_" + std::string(to_string(t)); }

/// Compiles the kernels for `arch` (e.g. "compute_90") to PTX.
/// @throws comm_error with NVRTC's log when compilation fails.
[[nodiscard]] inline std::string compile_reduce_kernels(const std::string& arch) {
  nvrtcProgram prog = nullptr;
  auto check = [&](nvrtcResult rc, const char* call) {
    if (rc == NVRTC_SUCCESS) return;
    std::string log;
    std::size_t size = 0;
    if (prog != nullptr && nvrtcGetProgramLogSize(prog, &size) == NVRTC_SUCCESS && size > 1) {
      log.resize(size);
      (void)nvrtcGetProgramLog(prog, log.data());
    }
    if (prog != nullptr) (void)nvrtcDestroyProgram(&prog);
    throw comm_error("meshlib: compiling the device reduction kernel: " + std::string(call) + " failed: " +
                     nvrtcGetErrorString(rc) + (log.empty() ? "" : "\n" + log));
  };
  const std::string source = "#define meshlib_device_function __device__ inline\n" + std::string(reduce_minmax_source) +
                             "\n" + std::string(reduce_kernel_source);
  check(nvrtcCreateProgram(&prog, source.c_str(), "meshlib_reduce.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  const std::string arch_opt = "--gpu-architecture=" + arch;
  const char* opts[] = {arch_opt.c_str(), "--std=c++17"};
  check(nvrtcCompileProgram(prog, 2, opts), "nvrtcCompileProgram");
  std::size_t size = 0;
  check(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");
  std::string ptx(size, '\0');
  check(nvrtcGetPTX(prog, ptx.data()), "nvrtcGetPTX");
  (void)nvrtcDestroyProgram(&prog);
  return ptx;
}

/// The loaded kernels of the current device's architecture, compiled once per process and
/// architecture.
class reduce_kernels {
 public:
  /// The kernel for `t` on the current device.
  static cudaKernel_t get(datatype t, std::string_view what) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), what, "cudaGetDevice");
    int major = 0;
    int minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), what, "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), what, "cudaDeviceGetAttribute");
    const std::string arch = "compute_" + std::to_string(major * 10 + minor);
    static std::mutex mutex;
    static std::map<std::string, cudaLibrary_t> libraries;  // never unloaded: lives as long as the process
    std::lock_guard lock(mutex);
    auto it = libraries.find(arch);
    if (it == libraries.end()) {
      const std::string ptx = compile_reduce_kernels(arch);
      cudaLibrary_t lib = nullptr;
      check_cuda(cudaLibraryLoadData(&lib, ptx.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), what,
                 "cudaLibraryLoadData");
      it = libraries.emplace(arch, lib).first;
    }
    cudaKernel_t k = nullptr;
    check_cuda(cudaLibraryGetKernel(&k, it->second, reduce_kernel_name(t).c_str()), what, "cudaLibraryGetKernel");
    return k;
  }
};

/// Enqueues on `stream`: out[j][i] = op over in[0..n_in)[i], for i < count and every output j.
inline void launch_reduce(datatype t, reduce_op op, const std::vector<const void*>& in, const std::vector<void*>& out,
                          std::size_t count, cudaStream_t stream, std::string_view what) {
  if (count == 0) return;
  reduce_pointers p{};
  for (std::size_t i = 0; i < in.size(); ++i) p.in[i] = in[i];
  for (std::size_t i = 0; i < out.size(); ++i) p.out[i] = out[i];
  int n_in = static_cast<int>(in.size());
  int n_out = static_cast<int>(out.size());
  unsigned long long n = count;
  int o = static_cast<int>(op);
  void* args[] = {&p, &n_in, &n_out, &n, &o};
  const unsigned threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 4096));
  const cudaKernel_t k = reduce_kernels::get(t, what);
  check_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(k), dim3(blocks), dim3(threads), args, 0, stream), what,
             "cudaLaunchKernel");
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/detail/reduce_kernel.hpp
// begin meshlib/comm/nccl/detail/shared_event.hpp
/// @file
/// @brief `basic_shared_event`: an event one participant records and its peers wait on, handed to
/// them through a host rendezvous (the shared-GPU communicator's "ready" and "done" events), and
/// `peer_event_refs`, what a participant holds of its peers' events after the rendezvous.
///
/// Why jointly owned. A peer waits on the event (`cudaStreamWaitEvent`) after the rendezvous
/// that handed it over, and the rendezvous is the last meeting of the operation: the owner may
/// already have returned from it, ended its thread and destroyed its communicator. Destroying
/// the event there made the peer's wait use a destroyed event (the SIGSEGV of
/// shared-GPU conformance runs with 4 devices, issue 36). So the event is reference counted:
/// its owner holds one reference, adds one per peer *before* it publishes the handle
/// (`share`), and each peer gives its reference back once it has enqueued its wait (or has
/// failed before); the last reference destroys the event. No peer can see the handle without
/// holding a reference, however early its owner leaves.
///
/// If the rendezvous itself fails for the owner (an abort, a timeout), it cannot know which
/// peers received the handle: the references of those that did not are never given back and the
/// event is leaked (one event per failed rendezvous), never destroyed while a peer may use it.
///
/// Independent of CUDA (`Traits` supplies the event type and its destruction), so the protocol is
/// tested on the host with a fake event (tests/unit/nccl/test_nccl_host.cpp).

#include <atomic>
#include <cstdint>
#include <utility>
#include <vector>

namespace meshlib::detail {

/// @brief An event with a reference count. `Traits` provides `event_type` and
/// `static void destroy(event_type, int device) noexcept`.
template <class Traits>
class basic_shared_event {
 public:
  using event_type = typename Traits::event_type;

  /// Takes ownership of `e` (of GPU `device`) with one reference, its owner's.
  [[nodiscard]] static basic_shared_event* adopt(event_type e, int device) { return new basic_shared_event(e, device); }

  basic_shared_event(const basic_shared_event&) = delete;
  basic_shared_event& operator=(const basic_shared_event&) = delete;

  /// The event.
  [[nodiscard]] event_type get() const noexcept { return event_; }
  /// What a rendezvous carries: the address of this object.
  [[nodiscard]] std::int64_t handle() const noexcept { return reinterpret_cast<std::int64_t>(this); }
  /// The object a handle names (a handle received from a peer, which holds a reference for us).
  [[nodiscard]] static basic_shared_event* from_handle(std::int64_t h) noexcept {
    return reinterpret_cast<basic_shared_event*>(h);
  }

  /// @brief One reference for each of `peers` participants; call before publishing `handle()`.
  void share(int peers) noexcept { refs_.fetch_add(peers, std::memory_order_relaxed); }
  /// @brief Gives back one reference; the last one destroys the event and this object.
  void release() noexcept {
    if (refs_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      Traits::destroy(event_, device_);
      delete this;
    }
  }

 private:
  basic_shared_event(event_type e, int device) noexcept : event_(e), device_(device) {}
  ~basic_shared_event() = default;

  event_type event_;
  int device_;
  std::atomic<int> refs_{1};
};

/// @brief The references to its peers' events that a participant received in one rendezvous
/// (every rank's but its own), each given back exactly once: by `release_all` or on destruction,
/// whichever way the operation ends (a mismatch, a failed CUDA call).
template <class Traits>
class peer_event_refs {
 public:
  using event_type = typename Traits::event_type;

  /// Takes the reference of every rank q != `self` of `n`, whose handle is `handle_of(q)`. Call it
  /// right after the rendezvous, before anything can throw.
  template <class HandleOf>
  peer_event_refs(int n, int self, HandleOf&& handle_of) {
    events_.reserve(static_cast<std::size_t>(n));
    for (int q = 0; q < n; ++q)
      events_.push_back(q == self ? nullptr : basic_shared_event<Traits>::from_handle(handle_of(q)));
  }
  peer_event_refs(const peer_event_refs&) = delete;
  peer_event_refs& operator=(const peer_event_refs&) = delete;
  ~peer_event_refs() { release_all(); }

  /// The event of rank q (q != self).
  [[nodiscard]] event_type operator[](int q) const noexcept { return events_[static_cast<std::size_t>(q)]->get(); }
  /// Gives every reference back (their waits are enqueued).
  void release_all() noexcept {
    for (auto*& e : events_)
      if (e != nullptr) std::exchange(e, nullptr)->release();
  }

 private:
  std::vector<basic_shared_event<Traits>*> events_;
};

}  // namespace meshlib::detail
// end meshlib/comm/nccl/detail/shared_event.hpp

namespace meshlib {

namespace detail {

/// CUDA events for `basic_shared_event`.
struct cuda_event_traits {
  using event_type = cudaEvent_t;
  static void destroy(cudaEvent_t e, int device) noexcept {
    cuda_device_scope_noexcept g(device);
    (void)cudaEventDestroy(e);
  }
};
/// An event peers wait on after the rendezvous that handed it to them (detail/shared_event.hpp).
using shared_cuda_event = basic_shared_event<cuda_event_traits>;

/// A new event of GPU `device` (current), with its owner's reference.
inline shared_cuda_event* make_shared_cuda_event(int device, std::string_view what) {
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), what, "cudaEventCreateWithFlags");
  try {
    return shared_cuda_event::adopt(e, device);
  } catch (...) {
    (void)cudaEventDestroy(e);
    throw;
  }
}

/// One participant's stream, events and host handle: the `Channel` of its requests.
struct shared_gpu_state : stream_state {
  thread_communicator host;
  /// Recorded when this participant's inputs are ready, and when its share of the work is
  /// enqueued; peers wait on them after the rendezvous that hands them over, possibly after this
  /// participant is gone, so they are jointly owned (detail/shared_event.hpp).
  shared_cuda_event* ready = nullptr;
  shared_cuda_event* done = nullptr;

  shared_gpu_state() = default;
  ~shared_gpu_state() {
    if (ready != nullptr) ready->release();
    if (done != nullptr) done->release();
  }

  [[nodiscard]] std::string describe(std::string_view op) const {
    return std::string(op) + " on shared-GPU device " + std::to_string(host.rank()) + " of " +
           std::to_string(host.size()) + " (GPU " + std::to_string(device) + ")";
  }
  stream_poll poll(cudaEvent_t event) {
    if (failed.load()) return stream_poll::failed("the communicator has failed: " + failure);
    const cudaError_t q = cudaEventQuery(event);
    if (q == cudaSuccess) return stream_poll::complete();
    if (q == cudaErrorNotReady) return stream_poll::pending();
    (void)cudaGetLastError();
    return stream_poll::failed("cudaEventQuery failed: " + cuda_error_text(q), false);
  }
  void abort(const std::string& reason, bool by_timeout = false) {
    {
      std::lock_guard lock(mutex);
      if (!record_failure(reason, by_timeout)) return;
    }
    if (host.valid()) (void)host.abort(failure);  // peers waiting on the host rendezvous stop too
  }
};

/// @brief The scratch copy that an in-place all_to_all or ppermute sends from (its peers overwrite
/// the buffer meanwhile): for a buffer of `bytes` > 0, `allocate(bytes)` then `copy(p)`, and the
/// copy is returned for the caller to free once its stream is past the peers' "done" events; for
/// an empty buffer (count 0: nothing moves) null, so nothing is freed. It never returns the
/// caller's own buffer: it once did for an empty one, and the communicator then freed the
/// user's cudaMalloc'ed buffer with cudaFreeAsync, whose owner's cudaFree freed it a second time
/// (the conformance kit's in-place rows with count 0). Independent of CUDA, so the host tests
/// check it (tests/unit/nccl/test_nccl_host.cpp).
template <class Allocate, class Copy>
[[nodiscard]] void* in_place_scratch(std::size_t bytes, Allocate&& allocate, Copy&& copy) {
  if (bytes == 0) return nullptr;
  void* p = allocate(bytes);
  copy(p);
  return p;
}

/// The descriptor every participant publishes for a collective (int64 words, so that the host
/// communicator's all_gather moves it).
struct shared_gpu_call {
  std::int64_t op = 0;      ///< detail::op_kind
  std::int64_t type = -1;   ///< datatype, or -1
  std::int64_t count = 0;   ///< elements (per rank, as the concept counts them)
  std::int64_t root = -1;   ///< root, or -1
  std::int64_t extra = 0;   ///< reduce op, or a hash of the ppermute pairs
  std::int64_t send = 0;    ///< device pointers
  std::int64_t recv = 0;
  std::int64_t ready = 0;   ///< cudaEvent_t
};
static_assert(sizeof(shared_gpu_call) == 8 * sizeof(std::int64_t));

/// What a mismatch message shows of a device's call (`describe_call`). The call keeps only a hash
/// of ppermute pairs (in `extra`), which is not shown.
inline call_summary summary_of(const shared_gpu_call& call) {
  call_summary c;
  c.kind = static_cast<op_kind>(call.op);
  if (call.type >= 0) c.dtype = static_cast<datatype>(call.type);
  c.count = static_cast<std::uint64_t>(call.count);
  if (uses_op(c.kind)) c.op = static_cast<reduce_op>(call.extra);
  c.root = static_cast<int>(call.root);
  return c;
}

}  // namespace detail

/// @brief The request of `shared_gpu_communicator`: completes when its stream passes the operation.
using shared_gpu_request = basic_stream_request<detail::shared_gpu_state>;

/// @brief One mesh device's handle on a group of devices that share one GPU. Move-only (its host
/// handle belongs to one thread).
class shared_gpu_communicator
    : public communicator_frontend<shared_gpu_communicator, shared_gpu_request, cuda_stream_ref> {
  friend class communicator_frontend<shared_gpu_communicator, shared_gpu_request, cuda_stream_ref>;

 public:

  shared_gpu_communicator() = default;

  /// @brief Device `host.rank()` of `host.size()` on GPU `options.device` (default: current),
  /// bound to `options.stream` (default: a new non-blocking stream). Not collective.
  explicit shared_gpu_communicator(thread_communicator host, nccl_comm_options options = {}) {
    if (!host.valid()) throw comm_argument_error("meshlib: shared_gpu_communicator needs a valid thread_communicator");
    if (host.size() > detail::max_local_devices)
      throw comm_argument_error("meshlib: shared_gpu_communicator: " + std::to_string(host.size()) +
                                " devices on one GPU; at most " + std::to_string(detail::max_local_devices) + " are supported");
    // The stream and device come from the same code as the NCCL communicator's.
    auto base = nccl_communicator::make_state(options, host.rank(), host.size(), "shared_gpu_communicator");
    auto s = std::make_shared<detail::shared_gpu_state>();
    s->host = std::move(host);
    s->device = base->device;
    s->stream = base->stream;
    s->stream_owner = base->stream_owner;
    s->options = options;
    {
      detail::cuda_device_scope g(s->device, "shared_gpu_communicator");
      s->ready = detail::make_shared_cuda_event(s->device, "shared_gpu_communicator");
      s->done = detail::make_shared_cuda_event(s->device, "shared_gpu_communicator");
    }
    state_ = std::move(s);
  }

  /// @brief Adopts a participant's state (for creation functions and tests).
  explicit shared_gpu_communicator(std::shared_ptr<detail::shared_gpu_state> s) noexcept : state_(std::move(s)) {}

  /// This participant's rank (0 when moved from).
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->host.rank() : 0; }
  /// The number of participants (0 when moved from).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->host.size() : 0; }
  /// The CUDA device this participant uses (-1 when moved from).
  [[nodiscard]] int device() const noexcept { return state_ ? state_->device : -1; }
  /// The CUDA stream the collectives run on (null when moved from).
  [[nodiscard]] cudaStream_t stream() const noexcept { return state_ ? state_->stream : nullptr; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// True once a participant failed; the others then stop waiting.
  [[nodiscard]] bool failed() const noexcept { return state_ && state_->failed.load(); }
  /// Aborts the group: every participant's pending and later calls fail naming `reason`.
  void abort(std::string_view reason) {
    require_valid("abort");
    state_->abort("meshlib: " + state_->describe("abort") + ": " + std::string(reason));
  }

  // The operations and their argument checks come from communicator_frontend; `transport` (below)
  // is the shared-GPU part.

  /// @brief Devices with the same `color` form a new group (`thread_communicator::split`), on the
  /// same GPU and stream.
  shared_gpu_communicator split(int color, int key) {
    check_split(color);
    nccl_comm_options o = state_->options;
    o.device = state_->device;
    o.stream = state_->stream;
    shared_gpu_communicator out(rendezvous("split", [&] { return state_->host.split(color, key); }), o);
    out.state_->stream_owner = state_->stream_owner;  // keeps the parent's stream alive
    return out;
  }

 private:
  [[nodiscard]] std::string describe(std::string_view k) const { return state_->describe(k); }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty shared_gpu_communicator handle (default-constructed or moved from)");
  }
  void check_usable(std::string_view k) const {
    require_valid(k);
    state_->refuse_if_failed(describe(k));
  }
  // ---- the front end's hooks
  [[nodiscard]] std::string label() const { return "shared-GPU device " + std::to_string(rank()); }
  void ensure_usable(detail::op_kind k) const { check_usable(detail::op_name(k)); }
  /// A buffer of `elems` elements of T must be device memory of this GPU (stream_state's check).
  template <detail::op_kind K, class T>
  void device_buffer(const char* name, const T* p, std::size_t elems) const {
    if (auto problem = state_->buffer_problem(name, p, elems * sizeof(T)); !problem.empty()) this->bad_argument(K, problem);
  }

  /// The shared-GPU transport of operation K, after the front end's checks.
  template <detail::op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type ctx) {
    using detail::op_kind;
    constexpr std::string_view k = detail::op_name(K);
    constexpr int code = static_cast<int>(K);
    const std::size_t n = static_cast<std::size_t>(size());
    const std::size_t c = o.count;
    const std::size_t me = static_cast<std::size_t>(rank());
    if constexpr (K == op_kind::all_reduce || K == op_kind::reduce) {
      device_buffer<K>("send", o.send, c);
      if (o.recv != nullptr) device_buffer<K>("receive", o.recv, c);
      return reduction<T>(k, K == op_kind::all_reduce ? 0 : 1, code, o.send, o.recv, c, o.op,
                          K == op_kind::reduce ? o.root : -1, ctx);
    } else if constexpr (K == op_kind::reduce_scatter) {
      device_buffer<K>("send", o.send, c * n);
      device_buffer<K>("receive", o.recv, c);
      // In place, the front end passes send = the buffer and recv = its block rank(): every
      // device reads block r of each send, so the sends' bases are what the peers need.
      return reduction<T>(k, 4, code, o.send, o.recv, c, o.op, -1, ctx);
    } else if constexpr (K == op_kind::broadcast) {
      if (o.send != nullptr) device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c);
      return movement<T>(k, code, o.send, o.recv, c, o.root, 0, ctx, [&](const auto& all, cudaStream_t s) {
        copy(k, o.recv, reinterpret_cast<const T*>(all[static_cast<std::size_t>(o.root)].send), c, s);
      });
    } else if constexpr (K == op_kind::all_gather) {
      device_buffer<K>("send", o.send, c);
      device_buffer<K>("receive", o.recv, c * n);
      return movement<T>(k, code, o.send, o.recv, c, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
        for (const auto& peer : all)  // push my block into every recv (in place: my own is there already)
          copy(k, reinterpret_cast<T*>(peer.recv) + me * c, o.send, c, s);
      });
    } else if constexpr (K == op_kind::all_to_all || K == op_kind::ppermute) {
      const std::size_t len = K == op_kind::all_to_all ? c * n : c;
      device_buffer<K>("send", o.send, len);
      device_buffer<K>("receive", o.recv, len);
      const cudaStream_t s0 = ctx.or_else(state_->stream);
      // In place, peers overwrite this buffer while this device sends from it: send from a copy,
      // which only a non-empty buffer has (detail::in_place_scratch): with nothing to move there
      // is no copy, and nothing to free.
      T* copy_of = o.in_place ? scratch_copy(k, std::span<T>(o.recv, len), s0) : nullptr;
      const T* from = copy_of != nullptr ? copy_of : o.send;
      const std::int64_t extra = K == op_kind::ppermute ? hash_pairs(o.pairs) : 0;
      auto r = movement<T>(k, code, from, o.recv, c, -1, extra, ctx, [&](const auto& all, cudaStream_t s) {
        if constexpr (K == op_kind::all_to_all) push_blocks(k, from, all, c, s);
        else pull_permuted(k, o.recv, c, all, o.pairs, s);
      });
      if (copy_of != nullptr) free_after(k, copy_of, s0);
      return r;
    } else if constexpr (K == op_kind::all_to_all_v) {
      // Every participant's receive counts and displacements (so that each sender pushes to the
      // right place) and send counts. With every participant's counts, every device checks every
      // (sender, receiver) pair in the same order before anything moves and names the same first
      // disagreement: the devices whose own counts agree fail too (as on the host backends).
      std::vector<std::int64_t> mine(3 * n);
      std::copy(o.v[2], o.v[2] + n, mine.begin());
      std::copy(o.v[3], o.v[3] + n, mine.begin() + static_cast<std::ptrdiff_t>(n));
      std::copy(o.v[0], o.v[0] + n, mine.begin() + static_cast<std::ptrdiff_t>(2 * n));
      std::vector<std::int64_t> theirs(3 * n * n);
      return movement<T>(k, code, o.send, o.recv, 0, -1, 0, ctx, [&](const auto& all, cudaStream_t s) {
        rendezvous(k, [&] { (void)state_->host.all_gather(std::span<const std::int64_t>(mine), std::span<std::int64_t>(theirs)); });
        if (const auto bad = detail::first_counts_disagreement(
                n, [&](std::size_t i, std::size_t j) { return theirs[i * 3 * n + 2 * n + j]; },
                [&](std::size_t j, std::size_t i) { return theirs[j * 3 * n + i]; }))
          throw collective_mismatch("meshlib: collective mismatch in all_to_all_v on the devices of GPU " +
                                    std::to_string(state_->device) + " (seen by device " + std::to_string(me) +
                                    "): the counts disagree: " +
                                    detail::describe_counts_disagreement("device " + std::to_string(bad->sender),
                                                                         "device " + std::to_string(bad->receiver),
                                                                         bad->sent, bad->expected));
        for (std::size_t j = 0; j < n; ++j) {
          const std::int64_t want = theirs[j * 3 * n + me];
          const std::int64_t at = theirs[j * 3 * n + n + me];
          copy(k, reinterpret_cast<T*>(all[j].recv) + at, o.send + o.v[1][j], static_cast<std::size_t>(want), s);
        }
      });
    } else if constexpr (K == op_kind::send) {
      device_buffer<K>("send", o.send, c);
      detail::cuda_device_scope g(state_->device, describe(k));
      const cudaStream_t s = ctx.or_else(state_->stream);
      cudaEvent_t ready = nullptr;
      cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&ready, cudaEventDisableTiming));
      cuda(k, "cudaEventRecord", cudaEventRecord(ready, s));
      const std::int64_t msg[4] = {reinterpret_cast<std::int64_t>(o.send), static_cast<std::int64_t>(c),
                                   static_cast<std::int64_t>(datatype_of<T>), reinterpret_cast<std::int64_t>(ready)};
      rendezvous(k, [&] { (void)state_->host.send(std::span<const std::int64_t>(msg), o.peer, o.tag); });
      std::int64_t done = 0;
      rendezvous(k, [&] { (void)state_->host.recv(std::span<std::int64_t>(&done, 1), o.peer, o.tag); });
      auto* done_event = reinterpret_cast<cudaEvent_t>(done);
      cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, done_event, 0));
      (void)cudaEventDestroy(done_event);  // the receiver has waited on `ready` and made `done` for us
      (void)cudaEventDestroy(ready);
      return complete_on(k, s);
    } else if constexpr (K == op_kind::recv) {
      device_buffer<K>("receive", o.recv, c);
      detail::cuda_device_scope g(state_->device, describe(k));
      const cudaStream_t s = ctx.or_else(state_->stream);
      std::int64_t msg[4] = {};
      rendezvous(k, [&] { (void)state_->host.recv(std::span<std::int64_t>(msg), o.peer, o.tag); });
      auto* ready = reinterpret_cast<cudaEvent_t>(msg[3]);
      cudaEvent_t done = nullptr;
      cuda(k, "cudaEventCreateWithFlags", cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
      const bool same = msg[1] == static_cast<std::int64_t>(c) && msg[2] == static_cast<std::int64_t>(datatype_of<T>);
      if (same) {
        cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, ready, 0));
        copy(k, o.recv, reinterpret_cast<const T*>(msg[0]), c, s);
      }
      cuda(k, "cudaEventRecord", cudaEventRecord(done, s));
      const std::int64_t reply = reinterpret_cast<std::int64_t>(done);
      rendezvous(k, [&] {  // the sender destroys both events
        (void)state_->host.send(std::span<const std::int64_t>(&reply, 1), o.peer, o.tag);
      });
      if (!same)
        throw collective_mismatch("meshlib: " + describe(k) + " expected " + std::to_string(c) + " elements of " +
                                  std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(o.peer) +
                                  " (tag " + std::to_string(o.tag) + ") but the message holds " + std::to_string(msg[1]) +
                                  " elements of " + std::string(to_string(static_cast<datatype>(msg[2]))));
      return complete_on(k, s);
    } else {
      static_assert(K == op_kind::barrier);
      return movement<float>(k, code, nullptr, nullptr, 0, -1, 0, ctx, [](const auto&, cudaStream_t) {});
    }
  }
  /// @brief Runs `f`, a rendezvous of the devices on their host communicator for operation `k`. A
  /// failure there (a peer threw, left, or never came; issue 40) is this communicator's failure
  /// too: recorded, so that `failed()` says so, pending requests fail and every later call is
  /// refused with it; and rethrown with the same type, naming the operation the user called and
  /// the device that saw it (the host's own words name its all_gather and its ranks, which are
  /// the devices' ranks here).
  template <class F>
  std::invoke_result_t<F&> rendezvous(std::string_view k, F&& f) {
    try {
      return f();
    } catch (const comm_timeout& e) {
      throw comm_timeout(host_failure(k, e.what(), true));
    } catch (const comm_aborted& e) {
      throw comm_aborted(host_failure(k, e.what(), false));
    }
  }
  std::string host_failure(std::string_view k, std::string_view host_what, bool by_timeout) {
    constexpr std::string_view prefix = "meshlib: ";
    if (host_what.starts_with(prefix)) host_what.remove_prefix(prefix.size());
    state_->abort(std::string(host_what), by_timeout);  // the host has failed already: records it here
    return "meshlib: " + describe(k) + ": " + std::string(host_what) + " (the devices' host communicator: its rank r is device r)";
  }
  void cuda(std::string_view k, std::string_view call, cudaError_t rc) const {
    if (rc != cudaSuccess) detail::check_cuda(rc, describe(k), call);
  }
  template <class T>
  void copy(std::string_view k, T* to, const T* from, std::size_t n, cudaStream_t s) const {
    if (n == 0 || to == from) return;
    cuda(k, "cudaMemcpyAsync", cudaMemcpyAsync(to, from, n * sizeof(T), cudaMemcpyDeviceToDevice, s));
  }
  /// A stream-ordered copy of a non-empty `buf` (`cudaMallocAsync`; `free_after` frees it), or
  /// null for an empty one: never the caller's own memory (detail::in_place_scratch).
  template <class T>
  T* scratch_copy(std::string_view k, std::span<T> buf, cudaStream_t s) const {
    detail::cuda_device_scope g(state_->device, describe(k));
    return static_cast<T*>(detail::in_place_scratch(
        buf.size_bytes(),
        [&](std::size_t bytes) {
          void* p = nullptr;
          cuda(k, "cudaMallocAsync", cudaMallocAsync(&p, bytes, s));
          return p;
        },
        [&](void* p) { copy(k, static_cast<T*>(p), buf.data(), buf.size(), s); }));
  }
  template <class T>
  void free_after(std::string_view k, T* p, cudaStream_t s) const {
    // Freed on the stream after the peers' "done" events it waited on: no peer reads it any more.
    if (p != nullptr) cuda(k, "cudaFreeAsync", cudaFreeAsync(p, s));
  }
  static std::int64_t hash_pairs(std::span<const permute_pair> pairs) {
    meshlib::detail::fnv1a h;  // over the pairs, in order
    for (const auto& p : pairs) h.add(static_cast<std::uint32_t>(p.source)).add(static_cast<std::uint32_t>(p.dest));
    return static_cast<std::int64_t>(h.value);
  }
  template <class T, class All>
  void push_blocks(std::string_view k, const T* from, const All& all, std::size_t c, cudaStream_t s) const {
    for (int j = 0; j < size(); ++j)
      copy(k, reinterpret_cast<T*>(all[static_cast<std::size_t>(j)].recv) + static_cast<std::size_t>(rank()) * c,
           from + static_cast<std::size_t>(j) * c, c, s);
  }
  template <class T, class All>
  void pull_permuted(std::string_view k, T* to, std::size_t n, const All& all, std::span<const permute_pair> pairs,
                     cudaStream_t s) const {
    for (const auto& p : pairs)
      if (p.dest == rank()) {
        copy(k, to, reinterpret_cast<const T*>(all[static_cast<std::size_t>(p.source)].send), n, s);
        return;
      }
    if (n != 0) cuda(k, "cudaMemsetAsync", cudaMemsetAsync(to, 0, n * sizeof(T), s));  // no source: zeros
  }

  /// Publishes this participant's call, checks that every participant made the same one, and
  /// orders this stream after every peer's "ready" event.
  ///
  /// Lifetimes: a peer's events are used after the rendezvous that handed them over, when that
  /// peer may have left (after `depart`'s rendezvous, the operation's last, it returns, and may
  /// destroy its communicator at once). Each event carries a reference for every peer, given back
  /// once its wait is enqueued (detail/shared_event.hpp); nothing else of a peer's is touched
  /// after a rendezvous but the buffers it passed, whose reuse the "done" events order.
  std::vector<detail::shared_gpu_call> arrive(std::string_view k, detail::shared_gpu_call mine, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->ready->get(), s));
    mine.ready = state_->ready->handle();
    const auto n = static_cast<std::size_t>(size());
    std::vector<detail::shared_gpu_call> all(n);
    state_->ready->share(size() - 1);  // before the handle is published
    rendezvous(k, [&] {
      (void)state_->host.all_gather(std::span<const std::int64_t>(reinterpret_cast<const std::int64_t*>(&mine), 8),
                                    std::span<std::int64_t>(reinterpret_cast<std::int64_t*>(all.data()), 8 * n));
    });
    detail::peer_event_refs<detail::cuda_event_traits> ready(size(), rank(), [&](int q) {
      return all[static_cast<std::size_t>(q)].ready;
    });
    bool agree = true;
    for (const auto& c : all)
      agree = agree && c.op == all[0].op && c.type == all[0].type && c.count == all[0].count && c.root == all[0].root &&
              c.extra == all[0].extra;
    if (!agree) {
      std::string m = "meshlib: collective mismatch on the devices of GPU " + std::to_string(state_->device) +
                      " (seen by device " + std::to_string(rank()) + "):";
      for (std::size_t q = 0; q < n; ++q)
        m += " device " + std::to_string(q) + " called " + detail::describe_call(detail::summary_of(all[q])) +
             (q + 1 < n ? ";" : "");
      throw collective_mismatch(m);
    }
    for (int q = 0; q < size(); ++q)
      if (q != rank()) cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, ready[q], 0));
    return all;  // (its `ready` handles are not used again: the references go with `ready`)
  }
  /// Records "done", waits for every peer's, and returns the request of this participant.
  request_type depart(std::string_view k, cudaStream_t s) {
    cuda(k, "cudaEventRecord", cudaEventRecord(state_->done->get(), s));
    const auto n = static_cast<std::size_t>(size());
    const std::int64_t mine = state_->done->handle();
    std::vector<std::int64_t> all(n);
    state_->done->share(size() - 1);  // before the handle is published
    rendezvous(k, [&] { (void)state_->host.all_gather(std::span<const std::int64_t>(&mine, 1), std::span<std::int64_t>(all)); });
    // The last rendezvous of the operation: a peer may return, and destroy its communicator,
    // before this participant has enqueued its waits; its reference keeps the event alive.
    detail::peer_event_refs<detail::cuda_event_traits> done(size(), rank(),
                                                            [&](int q) { return all[static_cast<std::size_t>(q)]; });
    for (int q = 0; q < size(); ++q)
      if (q != rank()) cuda(k, "cudaStreamWaitEvent", cudaStreamWaitEvent(s, done[q], 0));
    done.release_all();
    return complete_on(k, s);
  }
  request_type complete_on(std::string_view k, cudaStream_t s) {
    cudaEvent_t ev = state_->acquire_event(describe(k));
    cuda(k, "cudaEventRecord", cudaEventRecord(ev, s));
    return request_type(state_, ev, std::string(k), state_->options.timeout);
  }

  template <class T, class Body>
  request_type movement(std::string_view k, int op, const T* send, T* recv, std::size_t count, int root,
                        std::int64_t extra, context_type ctx, Body&& body) {
    detail::cuda_device_scope g(state_->device, describe(k));
    const cudaStream_t s = ctx.or_else(state_->stream);
    detail::shared_gpu_call mine;
    mine.op = op;
    mine.type = op == static_cast<int>(detail::op_kind::barrier) ? -1 : static_cast<std::int64_t>(datatype_of<T>);
    mine.count = static_cast<std::int64_t>(count);
    mine.root = root;
    mine.extra = extra;
    mine.send = reinterpret_cast<std::int64_t>(send);
    mine.recv = reinterpret_cast<std::int64_t>(recv);
    const auto all = arrive(k, mine, s);
    body(all, s);
    return depart(k, s);
  }

  /// all_reduce (shape 0), reduce (1) and reduce_scatter (4): participant r reduces block r.
  template <class T>
  request_type reduction(std::string_view k, int shape, int code, const T* send, T* recv, std::size_t count, reduce_op op,
                         int root, context_type ctx) {
    return movement<T>(k, code, send, recv, count, root, static_cast<std::int64_t>(op), ctx,
                       [&](const auto& all, cudaStream_t s) {
      const auto n = static_cast<std::size_t>(size());
      const auto r = static_cast<std::size_t>(rank());
      std::vector<const void*> in;
      std::vector<void*> out;
      std::size_t begin = 0;
      std::size_t len = 0;
      if (shape == 4) {  // reduce_scatter: my whole result block, from block r of every send
        len = count;
        for (const auto& c : all) in.push_back(reinterpret_cast<const T*>(c.send) + r * count);
        out.push_back(recv);
      } else {  // my slice of the payload, from every send, to every (all_reduce) or root's (reduce) recv
        begin = count * r / n;
        len = count * (r + 1) / n - begin;
        for (const auto& c : all) in.push_back(reinterpret_cast<const T*>(c.send) + begin);
        if (shape == 0)
          for (const auto& c : all) out.push_back(reinterpret_cast<T*>(c.recv) + begin);
        else
          out.push_back(reinterpret_cast<T*>(all[static_cast<std::size_t>(root)].recv) + begin);
      }
      detail::launch_reduce(datatype_of<T>, op, in, out, len, s, describe(k));
    });
  }

  std::shared_ptr<detail::shared_gpu_state> state_;
};

static_assert(communicator<shared_gpu_communicator>);

/// @brief Runs `fn(shared_gpu_communicator&)` for `n` mesh devices sharing one GPU
/// (`options.device`, default the current one), one thread and one new stream each, as
/// `run_on_threads` (whose fault handling it has: `participant_error` names the first failure).
template <class F>
  requires std::is_invocable_v<F&, shared_gpu_communicator&>
void run_on_shared_gpu(int n, F&& fn, nccl_comm_options options = {}, thread_comm_options host_options = {}) {
  if (n > detail::max_local_devices)
    throw comm_argument_error("meshlib: run_on_shared_gpu: " + std::to_string(n) + " devices on one GPU; at most " +
                              std::to_string(detail::max_local_devices) + " are supported");
  if (options.device < 0) detail::check_cuda(cudaGetDevice(&options.device), "run_on_shared_gpu", "cudaGetDevice");
  run_on_threads(
      n,
      [&](thread_communicator& host) {
        shared_gpu_communicator c(std::move(host), options);
        fn(c);
      },
      std::move(host_options));
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_NCCL
// end meshlib/comm/nccl/shared_gpu_communicator.hpp
// begin meshlib/runtime/nccl_runtime.hpp
/// @file
/// @brief One process per GPU without MPI: `nccl::connect_from_environment()` reads the process
/// index and count from the launcher's environment (`detect_launch`: meshlib's variables, OpenMPI,
/// MPICH/PMI, torchrun's `RANK`/`WORLD_SIZE`, Slurm), picks the GPU of the local rank, and lets
/// NCCL's own bootstrap connect the processes: every process derives the same unique id from
/// `NCCL_COMM_ID=host:port` (process 0 listens there). Where `NCCL_COMM_ID` is unset, it is taken
/// from torchrun-style `MASTER_ADDR` and `MASTER_PORT` as `MASTER_ADDR:(MASTER_PORT + 1)` (the
/// launcher's own store holds `MASTER_PORT`). No meshlib network layer is involved.
///
/// @code
/// // torchrun --nproc-per-node 8 ./train   (or srun, or mpirun without linking MPI)
/// meshlib::nccl_communicator world = meshlib::nccl::connect_from_environment();
/// @endcode

#if MESHLIB_ENABLE_NCCL

#include <cstdlib>
#include <string>


namespace meshlib::nccl {

using distributed::env_source;
using distributed::launch_info;

/// @brief The `host:port` NCCL's bootstrap uses, from `NCCL_COMM_ID`, else from `MASTER_ADDR` and
/// `MASTER_PORT`; empty for a single process with neither.
/// @throws distributed_error when several processes have neither, or `MASTER_PORT` is not a port.
[[nodiscard]] inline std::string bootstrap_address(const env_source& env, const launch_info& info) {
  if (auto id = env("NCCL_COMM_ID"); id && !id->empty()) return *id;
  const auto addr = env("MASTER_ADDR");
  const auto port = env("MASTER_PORT");
  if (addr && port && !addr->empty()) {
    const std::size_t p = distributed::detail::parse_count("MASTER_PORT", *port);
    if (p == 0 || p >= 65535)
      throw distributed_error("meshlib: MASTER_PORT='" + *port + "' is not a port in [1, 65534]");
    return *addr + ":" + std::to_string(p + 1);
  }
  if (info.process_count > 1)
    throw distributed_error("meshlib: nccl::connect_from_environment: " + std::to_string(info.process_count) +
                            " processes need a rendezvous address for NCCL; set NCCL_COMM_ID=host:port (process 0's "
                            "host, a free port) or MASTER_ADDR and MASTER_PORT, or create the communicator through MPI "
                            "(nccl_communicator_from_mpi)");
  return {};
}

/// @brief This process's NCCL communicator over every process of the run (see the file comment).
/// The GPU is `options.device` if set, else the local rank modulo the GPUs visible.
/// @throws distributed_error for a malformed or contradictory environment; as `nccl_communicator`.
[[nodiscard]] inline nccl_communicator connect_from_environment(nccl_comm_options options = {},
                                                                const env_source& env = distributed::process_env()) {
  const launch_info info = distributed::detect_launch(env);
  const std::string address = bootstrap_address(env, info);
  if (options.device < 0) {
    int count = 0;
    meshlib::detail::check_cuda(cudaGetDeviceCount(&count), "nccl::connect_from_environment", "cudaGetDeviceCount");
    options.device = static_cast<int>(info.local_rank.value_or(info.process_index % static_cast<std::size_t>(count)) %
                                      static_cast<std::size_t>(count));
  }
  // NCCL reads NCCL_COMM_ID in ncclGetUniqueId and, on rank 0, in ncclCommInitRank.
  if (!address.empty()) ::setenv("NCCL_COMM_ID", address.c_str(), 1);  // NOLINT(concurrency-mt-unsafe): start-up
  const ncclUniqueId id = nccl_communicator::new_unique_id();
  return nccl_communicator(id, static_cast<int>(info.process_count), static_cast<int>(info.process_index), options);
}

}  // namespace meshlib::nccl

#endif
// end meshlib/runtime/nccl_runtime.hpp
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
// begin meshlib/comm/nccl/mpi_bootstrap.hpp
/// @file
/// @brief One process per GPU, launched by MPI: `nccl_communicator_from_mpi(comm)` makes the NCCL
/// communicator of the processes of an `MPI_Comm` (rank 0 makes the unique id, `MPI_Bcast` gives
/// it to all; NCCL rank = MPI rank). Each process takes the GPU of its node-local rank unless
/// `options.device` says otherwise. Needs both `meshlib::mpi` and `meshlib::nccl`.
///
/// @code
/// MPI_Init(&argc, &argv);
/// { auto comm = meshlib::nccl_communicator_from_mpi(MPI_COMM_WORLD); ... }
/// MPI_Finalize();
/// @endcode

#if MESHLIB_ENABLE_NCCL && MESHLIB_ENABLE_MPI

#include <mpi.h>


namespace meshlib {

/// @brief The NCCL communicator over the processes of `comm` (collective over `comm`).
/// @throws comm_error when MPI is not initialised or an MPI call fails; as `nccl_communicator`.
[[nodiscard]] inline nccl_communicator nccl_communicator_from_mpi(MPI_Comm comm, nccl_comm_options options = {}) {
  int init = 0;
  MPI_Initialized(&init);
  if (!init) throw comm_error("meshlib: nccl_communicator_from_mpi needs MPI to be initialised first (MPI_Init)");
  int rank = 0;
  int size = 0;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  if (options.device < 0) {
    MPI_Comm node = MPI_COMM_NULL;
    if (MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node) != MPI_SUCCESS)
      throw comm_error("meshlib: nccl_communicator_from_mpi: MPI_Comm_split_type failed");
    int local = 0;
    MPI_Comm_rank(node, &local);
    MPI_Comm_free(&node);
    int count = 0;
    detail::check_cuda(cudaGetDeviceCount(&count), "nccl_communicator_from_mpi", "cudaGetDeviceCount");
    options.device = local % count;  // count >= 1 here: cudaGetDeviceCount fails without a device
  }
  ncclUniqueId id{};
  if (rank == 0) id = nccl_communicator::new_unique_id();
  if (MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, comm) != MPI_SUCCESS)
    throw comm_error("meshlib: nccl_communicator_from_mpi: MPI_Bcast of the NCCL unique id failed");
  return nccl_communicator(id, size, rank, options);
}

}  // namespace meshlib

#endif
// end meshlib/comm/nccl/mpi_bootstrap.hpp
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

namespace detail {

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

}  // namespace detail

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
    return detail::plan_gpu_mesh(n, visible_gpu_count(), distributed::launch(), options.gpus);
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
        meshlib::detail::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
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
                                  std::to_string(o.device) + ") failed: " + meshlib::detail::what_of(e);
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
        meshlib::detail::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
        run_on_shared_gpu(
            static_cast<int>(n),
            [&](shared_gpu_communicator& c) {
              meshlib::detail::check_cuda(cudaSetDevice(o.device), "gpu_runner", "cudaSetDevice");
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
    static_assert(std::is_same_v<meshlib::detail::exec_space_for_t<default_memory_space>, Kokkos::Cuda>,
                  "meshlib: gpu_runner needs Kokkos::Cuda as the default execution space (Kokkos_ENABLE_CUDA)");
    meshlib::detail::scoped_exec_space<default_memory_space> on(exec);
    meshlib::detail::runner_installed_exec() = true;  // read and cleared by run_devices
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
// end meshlib/exec/gpu_runner.hpp
// begin meshlib/exec/default_runner.hpp
/// @file
/// @brief `default_runner`: what `spmd` and `shard_map` run on when no runner is passed. In one
/// process, the process-wide persistent device threads (a `thread_runner` on them). Once
/// `mpi::initialize` (or `mpi::guard`) has started a run of several processes, the multi-process
/// runner: a mesh of n devices over the P processes of `mpi::world()` runs as P processes x
/// n / P device threads (a `hybrid_runner` on the process-wide hybrid device threads), device `p * (n / P) + t` being thread t of process p,
/// as `distributed::local_devices()` numbers them. The hybrid collectives reduce in the thread
/// backend's order, so a program gives the same bits under `mpirun` as on threads.
///
/// Exceptions: a call made inside a device (a nested `spmd`) runs on threads of its own process,
/// as before, because the other processes do not make it; a launcher that `distributed::initialize`
/// detected without MPI (torchrun, or mpirun with `distributed::initialize` alone) gives no
/// transport to run a mesh over the processes, and the default runner says so instead of running
/// every device in each process. Built with Kokkos CUDA and NCCL (`MESHLIB_HAS_GPU_RUNNER`), when a
/// GPU is visible, the default is `gpu_runner` (exec/gpu_runner.hpp), which also runs a launch of
/// several processes, one GPU each. Pass a runner explicitly to choose otherwise (`thread_runner{}`:
/// every device in this process; `mpi_runner{comm}`: one device per rank).
/// @code
/// meshlib::mpi::guard run;                                     // mpirun -np 2
/// meshlib::mesh<meshlib::axis<"x">> m{4};                        // 2 processes x 2 threads
/// auto ids = meshlib::spmd(m, [] { return meshlib::device_index(); });
/// // process 0: {0, 1, 0, 0}; process 1: {0, 0, 2, 3} (other processes' entries value-initialised)
/// @endcode

#include <cstddef>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#if MESHLIB_ENABLE_MPI
// begin meshlib/exec/mpi_runner.hpp
/// @file
/// @brief The multi-process runners (exec/runner.hpp): `mpi_runner` (one device per MPI rank)
/// and `hybrid_runner` (P processes x T device threads: device `p*T + t` is thread t of process p).
///
/// The device threads of a hybrid mesh are persistent, as a `thread_runner`'s: a `hybrid_runner`
/// owns threads of its own for as long as the user keeps it, and the default runner's runs them on
/// the process-wide hybrid device threads. What each call still builds is its hybrid world (the
/// communicators: a duplicate of the process communicator for the leaders, one for point-to-point
/// and the abort channel with its watcher thread), collectively over the processes, and frees it
/// at the end of the call (its messages settled first, comm/mpi/detail/settle.hpp). Why not keep
/// the world too: a world that failed refuses every later call, and a clean one would carry a
/// call's unreceived point-to-point messages and its collective sequence numbers into the next
/// call; a fresh world gives every call the error isolation of a new communicator. The price is
/// about 0.13 ms a call on 2 processes x 2 threads (bench/hybrid_bench, docs/benchmarks.md); the
/// watcher runs on a thread that parks between calls (comm/mpi/detail/watcher_threads.hpp).
///
/// Device threads of a hybrid mesh are not pinned to cores: every process of a node would pin
/// its thread `t` to the same core `t` (MPI launchers bind processes to cores themselves).
/// @code
/// meshlib::mpi::guard run;                                        // mpirun -np 2
/// meshlib::hybrid_runner runner(meshlib::mpi::world(), 4);        // 2 processes x 4 threads
/// meshlib::mesh<meshlib::axis<"process">, meshlib::axis<"thread">> m{2, 4};
/// for (int step = 0; step < 1000; ++step)
///   meshlib::spmd(m, [] { /* one step */ }, runner);             // the same 3 worker threads every step
/// @endcode

#if MESHLIB_ENABLE_MPI

#include <cstddef>
#include <exception>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

// begin meshlib/comm/mpi/hybrid_communicator.hpp
/// @file
/// @brief Hybrid meshes: P processes x T threads per process form one group of P*T devices.
/// Threads of one process talk through a `thread_communicator` (shared memory), processes through
/// an `mpi_communicator`. Satisfies `communicator`, so `axis_communicators`, the collectives and
/// `spmd` run on it unchanged.
///
/// @code
/// meshlib::mpi::guard run;                                   // MPI with MPI_THREAD_MULTIPLE
/// meshlib::run_hybrid(meshlib::mpi::world(), 2, [&](meshlib::hybrid_communicator& comm) {
///   // comm.rank() is the device p*2 + t; comm.size() is 2*P
///   meshlib::mesh<meshlib::axis<"process">, meshlib::axis<"thread">> m{P, 2};
///   meshlib::axis_communicators axes(comm, m);
///   float x = 1;
///   axes.over<"process">().all_reduce(std::span(&x, 1), meshlib::reduce_op::sum);  // crosses processes
/// });
/// @endcode
///
/// Devices. Device `p*T + t` is thread t of process p (the process-major order of
/// `distributed::devices()`), so in `mesh<axis<"process">, axis<"thread">>{P, T}` the last axis
/// stays inside a process.
///
/// Algorithms. A collective over a group that spans processes runs in three steps: the members in
/// one process exchange their inputs through the thread communicator, one thread per process (the
/// lowest member, "leader") exchanges the process's inputs with the other processes through MPI,
/// and the leader hands the result to its process's members through the thread communicator.
/// Reductions gather every member's input and reduce them in rank order with the thread backend's
/// own kernels, so every result is bitwise equal to the pure-thread run of the same program, for
/// floats too; the price is n times the traffic of a bandwidth-optimal all_reduce (docs/design.md).
/// Broadcast is a local broadcast in the root's process, an MPI broadcast between leaders and a
/// local broadcast elsewhere. A group inside one process never touches MPI. Point-to-point between
/// processes goes straight to MPI from the calling thread on the group's own duplicate communicator.
///
/// Requirements and faults: MPI must provide `MPI_THREAD_MULTIPLE` when T > 1 (leaders of
/// different groups call MPI concurrently), else `comm_error` at construction. When a device fails
/// (it throws, or a mismatch fails its process's thread group), every device of every process is
/// released within milliseconds with `comm_aborted` naming the global device ("hybrid device 3 of
/// 4 failed: <what>"): its process aborts its thread group and tells the others through an abort
/// channel (`detail::abort_channel`: a duplicate communicator polled by a watcher thread; on with
/// `MPI_THREAD_MULTIPLE`), whose leaders' MPI waits end too. A device that never arrives is
/// detected by its local peers, and every device of every process gets `comm_timeout` naming the
/// operation the user called and the global device(s) that never arrived ("all_reduce timed out on
/// hybrid device 2 of 4 after 1 s: hybrid device(s) 3 never arrived"; the leaders' exchange waits
/// a little longer, `hybrid_group::patience`, so that this precise report comes first). Errors of
/// the internal steps are rethrown naming the operation the user called; a failed world refuses
/// every later call. `run_hybrid` throws `participant_error` naming the global device at fault
/// (for a timeout, the device that never arrived).

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/mpi/detail/abort_channel.hpp
/// @file
/// @brief The abort channel: how one process tells the others that a participant failed, so that
/// their waits end within milliseconds instead of at the timeout. Used by `mpi_communicator`
/// (participants are MPI ranks) and `hybrid_world` (participants are global devices).

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// begin meshlib/comm/mpi/detail/settle.hpp
/// @file
/// @brief `settle_messages`: before meshlib frees one of its own MPI communicators that carries
/// unsolicited point-to-point messages (arrival notes, the hybrid abort channel), every rank
/// receives the messages still in flight to it. Internal to the MPI communicators.
///
/// Why: a message that arrives after `MPI_Comm_free` waits inside MPI for whichever communicator
/// later gets the freed one's context id, and OpenMPI 4.1 matches it there when that communicator
/// is created: it crashed in `mca_pml_ob1_add_comm` (under `MPI_Comm_dup`) when the new
/// communicator had fewer ranks than the message's source. A communicator that cannot be
/// settled is left allocated instead, so its context id is never reused.

#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

namespace meshlib::detail {

/// @brief Exchanges how many messages with tag `tag` each rank sent to each other rank on `comm`
/// (one all-to-all: freeing `comm` is collective anyway), then receives and drops the ones not
/// yet received (`received` counts per source, updated). Returns false when a peer does not take
/// part within `grace` or MPI fails: the caller must then not free `comm`.
///
/// `clean`, when given, is this rank's vote that the communicators it closes with `comm` carry no
/// abandoned operation (no timeout, no failure); it travels in the same all-to-all and comes back
/// true only when every rank voted so (false when the exchange fails). A rank that left cleanly
/// learns this way that a peer abandoned a collective whose messages may still reach it.
inline bool settle_messages(MPI_Comm comm, int tag, const std::vector<std::uint64_t>& sent,
                            std::vector<std::uint64_t>& received, std::chrono::milliseconds grace,
                            bool* clean = nullptr) noexcept {
  const int size = static_cast<int>(sent.size());
  if (size <= 1) return true;
  const bool mine = clean == nullptr || *clean;
  if (clean != nullptr) *clean = false;  // until every rank's vote is in
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + grace;
  // Heap buffers, released only on success: when a peer never joins, MPI keeps the all-to-all
  // pending and may still read and write them. Two words per peer: the count and the vote.
  auto* out = new std::vector<std::uint64_t>(2 * sent.size());
  auto* in = new std::vector<std::uint64_t>(2 * sent.size(), 0);
  for (std::size_t p = 0; p < sent.size(); ++p) {
    (*out)[2 * p] = sent[p];
    (*out)[2 * p + 1] = mine ? 1 : 0;
  }
  MPI_Request r = MPI_REQUEST_NULL;
  if (MPI_Ialltoall(out->data(), 2, MPI_UINT64_T, in->data(), 2, MPI_UINT64_T, comm, &r) != MPI_SUCCESS)
    return false;
  for (int done = 0; !done;) {
    if (MPI_Test(&r, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
    if (done) break;
    if (clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  delete out;
  bool all_clean = true;
  for (std::size_t p = 0; p < sent.size(); ++p) all_clean = all_clean && (*in)[2 * p + 1] != 0;
  std::vector<char> sink;
  for (int peer = 0; peer < size; ++peer) {
    const auto p = static_cast<std::size_t>(peer);
    while (received[p] < (*in)[2 * p]) {
      int found = 0;
      MPI_Status st;
      if (MPI_Iprobe(peer, tag, comm, &found, &st) != MPI_SUCCESS) return false;
      if (!found) {
        if (clock::now() > deadline) return false;
        std::this_thread::yield();
        continue;
      }
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      sink.resize(static_cast<std::size_t>(bytes > 0 ? bytes : 1));
      if (MPI_Recv(sink.data(), bytes, MPI_BYTE, peer, tag, comm, MPI_STATUS_IGNORE) != MPI_SUCCESS) return false;
      ++received[p];
    }
  }
  delete in;
  if (clean != nullptr) *clean = all_clean;
  return true;
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/detail/settle.hpp
// begin meshlib/comm/mpi/detail/watcher_threads.hpp
/// @file
/// @brief `watcher_threads`: the threads that run the hybrid worlds' abort-channel watchers,
/// started once and parked between calls. Internal to the MPI backends.
///
/// Why: every call on a hybrid mesh builds a world whose watcher polls the abort channel while the
/// call runs. Starting and joining a thread for it cost 37 us of the call's ~190 us (docs/design.md,
/// measured on 2 processes); a parked thread takes the next watcher in about a futex wake-up.
///
/// The threads are detached and never joined: a parked thread holds nothing, and one still running
/// a watcher at exit (a world not closed) must not make exit wait for it.

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace meshlib::detail {

/// @brief Runs jobs on parked threads, one job per thread at a time; a job that finds every thread
/// busy (two hybrid calls at once from different threads) gets a new thread, which stays.
class watcher_threads {
 public:
  /// What `run` returns: `join()` waits until the job has returned (as `std::thread::join`).
  class job {
   public:
    job() = default;
    /// True until `join()`: the job was given to a thread and not joined yet.
    [[nodiscard]] bool joinable() const noexcept { return state_ != nullptr; }
    /// Waits until the job has returned.
    void join() {
      if (!state_) return;
      std::unique_lock lk(state_->mutex);
      state_->cv.wait(lk, [&] { return state_->done; });
      lk.unlock();
      state_.reset();
    }

   private:
    friend class watcher_threads;
    struct state {
      std::mutex mutex;
      std::condition_variable cv;
      bool done = false;
    };
    std::shared_ptr<state> state_;
  };

  /// The process's threads (never destroyed: see the file comment).
  static watcher_threads& get() {
    static auto* threads = new watcher_threads;
    return *threads;
  }

  /// Runs `fn` (which must not throw) on a parked thread, or a new one when none is parked.
  job run(std::function<void()> fn) {
    job j;
    j.state_ = std::make_shared<job::state>();
    std::shared_ptr<slot> s;
    {
      std::lock_guard lk(mutex_);
      for (auto& candidate : slots_)
        if (!candidate->busy) {
          s = candidate;
          break;
        }
      if (!s) {
        s = slots_.emplace_back(std::make_shared<slot>());
        std::thread([s] { serve(*s); }).detach();
      }
      s->busy = true;  // under mutex_: no other run() picks this slot
    }
    {
      std::lock_guard lk(s->mutex);
      s->fn = std::move(fn);
      s->owner = j.state_;
    }
    s->cv.notify_one();
    return j;
  }

 private:
  struct slot {
    std::mutex mutex;
    std::condition_variable cv;
    std::function<void()> fn;               // guarded by mutex
    std::shared_ptr<job::state> owner;      // guarded by mutex
    bool busy = false;                      // guarded by watcher_threads::mutex_
  };

  static void serve(slot& s) {
    for (;;) {
      std::function<void()> fn;
      std::shared_ptr<job::state> owner;
      {
        std::unique_lock lk(s.mutex);
        s.cv.wait(lk, [&] { return static_cast<bool>(s.fn); });
        fn = std::move(s.fn);
        s.fn = nullptr;
        owner = std::move(s.owner);
      }
      fn();
      fn = nullptr;  // what the job captured is released before it counts as done
      {
        std::lock_guard lk(get().mutex_);
        s.busy = false;
      }
      {
        std::lock_guard lk(owner->mutex);
        owner->done = true;
      }
      owner->cv.notify_all();
    }
  }

  std::mutex mutex_;
  std::vector<std::shared_ptr<slot>> slots_;  // guarded by mutex_
};

}  // namespace meshlib::detail
// end meshlib/comm/mpi/detail/watcher_threads.hpp

namespace meshlib::detail {

/// Fault propagation between processes, shared by the MPI communicator (one rank per process) and
/// the hybrid world. Each process posts one receive on a duplicate communicator of its own. When a
/// participant fails, its process sends "<epoch><participant><kind><what>" to every other process (once);
/// a process that receives it (`poll`, called by the MPI waits of `mpi_communicator`, or by the
/// hybrid world's watcher thread every millisecond) records the root cause (`interrupt`), and its
/// waits end with the root cause's error (`check`): `comm_aborted` naming the participant that
/// failed, or the `comm_timeout` or `collective_mismatch` that another process detected. The owner names participants
/// (an MPI rank, a global hybrid device).
struct abort_channel {
  MPI_Comm comm = MPI_COMM_NULL;
  int process = 0;
  int processes = 1;
  bool enabled = false;
  /// Which hybrid world of this run the channel belongs to (every process opens its worlds in the
  /// same order: construction is collective). MPI may give a new duplicate the context id of a
  /// freed one, so a message sent to an earlier world can arrive here: it is recognised by its
  /// epoch and dropped.
  std::uint64_t epoch = 0;
  std::atomic<bool> interrupted{false};  ///< this process's devices must stop (a local or remote failure)
  std::atomic<int> remote_device{-1};    ///< the global device of a failure reported by another process
  std::atomic<int> root_cause{-1};       ///< the participant of the first recorded failure (-1: unnamed)
  /// The participant whose call differed in a collective mismatch (-1: none known). Every member
  /// of the mismatched collective computes it from every member's call, so it is the same on every
  /// process; processes that were not members learn it from the report (`notify`'s participant).
  std::atomic<int> mismatch_culprit{-1};
  std::mutex mutex;
  std::string message;                   ///< the root cause's message (guarded by mutex)
  failure_kind kind = failure_kind::aborted;  ///< the root cause's kind: the error waits throw (guarded by mutex)
  bool sent = false;                     ///< guarded by mutex
  std::vector<char> inbox = std::vector<char>(4096);
  MPI_Request inbox_request = MPI_REQUEST_NULL;
  std::vector<std::pair<MPI_Request, std::vector<char>>> outbox;  ///< guarded by mutex
  std::vector<std::uint64_t> sent_to;        ///< messages sent to each process (guarded by mutex)
  std::vector<std::uint64_t> received_from;  ///< messages received from each process (by the poller)
  std::atomic<bool> stop{false};
  std::mutex nap_mutex;              ///< with nap_cv: close() wakes a napping watcher at once
  std::condition_variable nap_cv;

  /// Waits up to `d` (the watcher's pause between polls), returning at once when the channel is
  /// closed: a watcher that slept its full pause made every hybrid call's close wait for it (up to
  /// a millisecond a call).
  void nap(std::chrono::milliseconds d) {
    std::unique_lock lk(nap_mutex);
    nap_cv.wait_for(lk, d, [this] { return stop.load(); });
  }
  watcher_threads::job watcher;          ///< the hybrid world's poller (the MPI communicator polls from its waits)
  std::mutex poll_mutex;                 ///< one poller at a time (threads may share a split's channel)
  bool closed = false;

  abort_channel() = default;
  abort_channel(const abort_channel&) = delete;
  abort_channel& operator=(const abort_channel&) = delete;
  ~abort_channel() { close(std::chrono::milliseconds(1000)); }

  /// Every process opens its channels in the same order (construction of the owners is
  /// collective), so this counter names the same channel on every process.
  static std::uint64_t next_epoch() {
    static std::atomic<std::uint64_t> channels{0};
    return ++channels;
  }

  /// Collective over `parent`: duplicates it and posts the receive (when `enable`).
  void open(MPI_Comm parent, bool enable) {
    MPI_Comm_rank(parent, &process);
    MPI_Comm_size(parent, &processes);
    epoch = next_epoch();
    enabled = enable && processes > 1;
    sent_to.assign(static_cast<std::size_t>(processes), 0);
    received_from.assign(static_cast<std::size_t>(processes), 0);
    if (!enabled) return;
    if (MPI_Comm_dup(parent, &comm) != MPI_SUCCESS) throw comm_error("meshlib: abort channel: MPI_Comm_dup failed");
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    post();
  }
  void post() {
    MPI_Irecv(inbox.data(), static_cast<int>(inbox.size()), MPI_CHAR, MPI_ANY_SOURCE, 0, comm, &inbox_request);
  }

  /// The header of a report: epoch, participant, kind (`failure_kind`).
  static constexpr std::size_t head = sizeof(std::uint64_t) + 2 * sizeof(int);

  /// Tests for a report from another process: true (with its participant, message and kind) once
  /// one of this channel's epoch has arrived; reports meant for an earlier channel are dropped.
  bool poll(int& device, std::string& what, failure_kind& reported) {
    if (!enabled || stop.load()) return false;
    std::unique_lock lk(poll_mutex, std::try_to_lock);
    if (!lk.owns_lock() || inbox_request == MPI_REQUEST_NULL) return false;
    int done = 0;
    MPI_Status st;
    MPI_Test(&inbox_request, &done, &st);
    if (!done) return false;
    ++received_from[static_cast<std::size_t>(st.MPI_SOURCE)];
    int bytes = 0;
    MPI_Get_count(&st, MPI_CHAR, &bytes);
    std::uint64_t e = 0;
    int wire_kind = 0;
    if (bytes >= static_cast<int>(head)) {
      std::memcpy(&e, inbox.data(), sizeof(std::uint64_t));
      std::memcpy(&device, inbox.data() + sizeof(std::uint64_t), sizeof(int));
      std::memcpy(&wire_kind, inbox.data() + sizeof(std::uint64_t) + sizeof(int), sizeof(int));
    }
    if (e != epoch) {  // meant for an earlier channel (MPI reuses a freed duplicate's context id)
      post();
      return false;
    }
    what.assign(inbox.data() + head, static_cast<std::size_t>(bytes) - head);
    reported = wire_kind == 1 ? failure_kind::timeout : wire_kind == 2 ? failure_kind::mismatch : failure_kind::aborted;
    remote_device.store(device);
    return true;
  }

  /// Records the root cause (`participant` failed, -1 when the owner does not name it) once and
  /// releases the waits that check the channel.
  /// `k`: the error the waits then throw (a timeout or mismatch seen elsewhere keeps its type).
  void interrupt(const std::string& msg, int participant = -1, failure_kind k = failure_kind::aborted) {
    std::lock_guard lk(mutex);
    if (interrupted.load()) return;
    message = msg;
    kind = k;
    root_cause.store(participant);
    interrupted.store(true, std::memory_order_release);
  }
  /// Records the participant whose call differed in a collective mismatch (the first one wins:
  /// every member computes the same).
  void blame_mismatch(int participant) noexcept {
    int none = -1;
    mismatch_culprit.compare_exchange_strong(none, participant);
  }
  /// The leaders' MPI waits call this (mpi_comm_state::check_interrupt).
  void check() {
    if (interrupted.load(std::memory_order_acquire)) rethrow("");
  }
  /// The recorded root cause: its kind, and its message in `msg`.
  failure_kind recorded(std::string& msg) {
    std::lock_guard lk(mutex);
    msg = message;
    return kind;
  }
  /// Throws the recorded root cause (its kind's error) with `suffix` appended.
  [[noreturn]] void rethrow(const std::string& suffix) {
    std::string m;
    failure_kind k;
    {
      std::lock_guard lk(mutex);
      m = message + suffix;
      k = kind;
    }
    throw_failure(k, std::move(m));
  }
  /// Tells every other process that participant `device` failed (`k` aborted), or that a timeout
  /// or collective mismatch was seen here, with `what` (once per channel).
  void notify(int device, const std::string& what, failure_kind k = failure_kind::aborted) {
    if (!enabled) return;
    std::lock_guard lk(mutex);
    if (sent) return;
    sent = true;
    const int wire_kind = static_cast<int>(k);
    std::vector<char> msg(head + std::min<std::size_t>(what.size(), inbox.size() - head));
    std::memcpy(msg.data(), &epoch, sizeof(std::uint64_t));
    std::memcpy(msg.data() + sizeof(std::uint64_t), &device, sizeof(int));
    std::memcpy(msg.data() + sizeof(std::uint64_t) + sizeof(int), &wire_kind, sizeof(int));
    std::memcpy(msg.data() + head, what.data(), msg.size() - head);
    for (int p = 0; p < processes; ++p) {
      if (p == process) continue;
      outbox.emplace_back(MPI_REQUEST_NULL, msg);
      auto& [req, buf] = outbox.back();
      MPI_Isend(buf.data(), static_cast<int>(buf.size()), MPI_CHAR, p, 0, comm, &req);
      ++sent_to[static_cast<std::size_t>(p)];
    }
  }
  /// Ends the watcher and completes or abandons the channel's requests (at most `grace` for the sends).
  void close(std::chrono::milliseconds grace) noexcept {
    if (closed) return;
    closed = true;
    {
      std::lock_guard lk(nap_mutex);  // a watcher between its check and its wait sees the flag
      stop.store(true);
    }
    nap_cv.notify_all();
    if (watcher.joinable()) watcher.join();
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin || !enabled) return;
    if (inbox_request != MPI_REQUEST_NULL) {
      MPI_Cancel(&inbox_request);
      MPI_Status st;
      MPI_Wait(&inbox_request, &st);
      int cancelled = 0;
      MPI_Test_cancelled(&st, &cancelled);
      if (!cancelled && st.MPI_SOURCE >= 0 && st.MPI_SOURCE < processes)
        ++received_from[static_cast<std::size_t>(st.MPI_SOURCE)];
    }
    const auto deadline = std::chrono::steady_clock::now() + grace;
    bool pending = false;
    for (auto& [req, buf] : outbox) {
      int done = 0;
      while (req != MPI_REQUEST_NULL && !done && std::chrono::steady_clock::now() < deadline) {
        MPI_Test(&req, &done, MPI_STATUS_IGNORE);
        if (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (req != MPI_REQUEST_NULL && !done) {
        pending = true;
        MPI_Request_free(&req);  // MPI finishes it on its own, reading buf: leak it on purpose
        (void)new std::vector<char>(std::move(buf));
      }
    }
    // Failure messages still in flight to this process must be received before the free
    // (detail/settle.hpp says why); when they cannot be, the duplicate stays allocated.
    if (!pending && settle_messages(comm, 0, sent_to, received_from, grace)) MPI_Comm_free(&comm);
  }
};

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/detail/abort_channel.hpp
// begin meshlib/comm/mpi/detail/call_record.hpp
/// @file
/// @brief The call record of the MPI fingerprint exchange as text (`describe_record`, through the
/// describer every backend shares) and the fingerprint of ppermute pairs (`pairs_hash`). Apart
/// from either communicator because the MPI and the hybrid communicators both use them, so that
/// both fingerprint and name calls the same way. Internal to the MPI communicators.

#if MESHLIB_ENABLE_MPI

#include <cstdint>
#include <span>
#include <string>


namespace meshlib::detail {

/// What a mismatch message shows of a call record of the mismatch fingerprint (`describe_call`):
/// {call number, op_kind, datatype + 1 (0: none), count, reduce op, root, extra}. The record
/// keeps only a hash of ppermute pairs and none of the all_to_all_v counts, which are not shown.
inline call_summary summary_of_record(const std::uint64_t* d) {
  call_summary c;
  c.kind = static_cast<op_kind>(d[1]);
  if (d[2] != 0) c.dtype = static_cast<datatype>(d[2] - 1);
  c.count = d[3];
  c.op = static_cast<reduce_op>(d[4]);
  c.root = static_cast<int>(d[5]);
  return c;
}

/// "<who> called all_reduce(float32, count 8, op sum) as call #3", from a call record. Shared by
/// the MPI and hybrid communicators, so both frame calls the same way.
inline std::string describe_record(const std::string& who, const std::uint64_t* d) {
  return who + " called " + describe_call(summary_of_record(d)) + " as call #" + std::to_string(d[0]);
}

/// A fingerprint of ppermute pairs (every participant must pass the same).
inline std::uint64_t pairs_hash(std::span<const permute_pair> pairs) noexcept {
  fnv1a h;
  for (const auto& p : pairs) h.add(static_cast<std::uint32_t>(p.source)).add(static_cast<std::uint32_t>(p.dest));
  return h.value ^ pairs.size();
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/detail/call_record.hpp
// begin meshlib/comm/mpi/mpi_communicator.hpp
/// @file
/// @brief The MPI communicator: one participant per MPI process (rank), for CPU clusters and for
/// programs that already use MPI. Satisfies `communicator`.
///
/// @code
/// MPI_Init(&argc, &argv);
/// {
///   meshlib::mpi_communicator comm(MPI_COMM_WORLD);      // adopts: never frees MPI_COMM_WORLD
///   std::vector<float> x(1024, float(comm.rank()));
///   comm.all_reduce(std::span(x), meshlib::reduce_op::sum);
/// }
/// MPI_Finalize();
/// @endcode
///
/// Communicators. Adopting an `MPI_Comm` duplicates it once (`MPI_Comm_dup`, collective) into a
/// private communicator that carries every meshlib operation, with `MPI_ERRORS_RETURN` so that MPI
/// errors become `comm_error`s and meshlib's messages can never match the application's. The
/// duplicate, and every communicator `split` makes, is freed when the last handle goes (unless
/// MPI is already finalised); the adopted one is never freed or modified. `native()` is the
/// adopted `MPI_Comm`.
///
/// Threads. A handle and its copies share one MPI communicator and must be used by one thread at a
/// time (as an `MPI_Comm` in most programs); several threads use several communicators (`split`),
/// or `hybrid_communicator`.
///
/// Completion. Every operation is complete when it returns (the buffers hold the result) and
/// returns a `ready_request`, as the thread communicator does. `send` is buffered: it copies its
/// data and returns; the copy is sent in the background and progressed by later calls.
///
/// Determinism. Float and double sum, prod and mean over more than two ranks are reduced in rank
/// order with the thread backend's kernel (`detail/ordered_reduce.hpp`), not in MPI's unspecified
/// order, so every backend gives the same bits for the same inputs; two ranks, integers, min and
/// max run MPI's native reduction (whose result does not depend on the order there).
///
/// Mismatch detection (always on). Before its data moves, every collective exchanges a
/// fingerprint of the call (call number, operation, element type, count, reduce op, root,
/// ppermute pairs) in one polled 16-byte all-reduce; ranks that disagree (another count, type, op,
/// root, operation or order) all throw `collective_mismatch` naming every rank's call, so a
/// mismatch never reaches MPI's data collectives (no `MPI_ERR_TRUNCATE`, garbage or heap
/// corruption). all_to_all_v also checks every rank's receive counts against its peers' send
/// counts. The cost is measured in docs/benchmarks.md ("MPI overhead").
///
/// Timeouts (`mpi_comm_options::timeout`, default `MESHLIB_COMM_TIMEOUT` or 60 s). No wait is
/// unbounded: the fingerprint exchange is polled against the deadline, and it tells every rank
/// that all have arrived; then the payload runs as MPI's blocking collective, which can no longer
/// wait unboundedly and whose tuned algorithms are faster than the non-blocking ones at every size
/// (docs/benchmarks.md), except when the node runs more ranks than it has cores: there payloads
/// are polled non-blocking collectives, which yield the core (`large_payloads`,
/// `blocking_min_bytes`). A deadline that passes raises `comm_timeout` naming the operation and the
/// rank. MPI cannot cancel a collective, so the communicator is then failed: every later call
/// throws the root cause's error with the same message; end the run (an uncaught exception does
/// so through `MPI_Abort`, see `<meshlib/mpi.hpp>`).
///
/// Faults. A rank that throws and calls `fail(reason)` (as `mpi_runner` does) releases
/// its peers within milliseconds: they get `comm_aborted` naming "MPI rank R of N" and the reason,
/// through the abort channel (`detail::abort_channel`) that their polled waits test. An exception
/// that unwinds a handle does the same without `fail` (the reason then says that an exception left
/// the communicator's scope on rank R): any handle, a copy of `mpi::world()` included, so a
/// plain MPI program releases its peers within milliseconds when a rank's exception leaves the
/// scope of its handle. What still needs the timeout: a rank that catches its exception within
/// the handle's scope and stops calling collectives (meshlib never sees it), a rank that dies
/// without unwinding (a signal, `_exit`), and waits with no deadline; its peers then time out
/// (never hang), after which `root_cause_rank()` names it; a `fail_guard` around the step
/// releases them at once instead. `abort(reason)` (and the terminate handler `<meshlib/mpi.hpp>` installs) prints
/// "meshlib: MPI rank R of N aborts the run: <reason>" and calls `MPI_Abort`, which ends every
/// process. Argument errors (`comm_argument_error`, checked by `communicator_frontend`) are thrown
/// on the rank that made them, before any data moves; peers see a timeout. Errors on the adopted
/// communicator (the application's, e.g. `MPI_COMM_WORLD`) are never made fatal or otherwise
/// changed by meshlib: only its own duplicates use `MPI_ERRORS_RETURN`.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/comm/mpi/detail/mpi_comm_state.hpp
/// @file
/// @brief `mpi_comm_state`: the MPI state that the handles of one `mpi_communicator` share, and
/// its teardown (buffered sends given the timeout, `settle_messages` before the communicators are
/// freed). Apart from the communicator because its lifetime rules (what may be freed, and when,
/// after a failure) are a subject of their own. Internal to the MPI communicators.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

// begin meshlib/comm/mpi/mpi_comm_options.hpp
/// @file
/// @brief `mpi_comm_options`: the knobs of an `mpi_communicator`. Its own header because the
/// hybrid world and the MPI runtime configure MPI communicators too, and the options are public
/// API that reads better apart from the communicator's internals.

#if MESHLIB_ENABLE_MPI

#include <chrono>
#include <cstddef>


namespace meshlib {

/// @brief Options of an `mpi_communicator`.
struct mpi_comm_options {
  /// How long a rank waits for its peers in one operation before `comm_timeout`. Zero or
  /// negative: no deadline (MPI's blocking calls throughout).
  std::chrono::nanoseconds timeout = default_comm_timeout();
  /// Payloads (bytes per rank) at least this large are "large" (see `large_payloads`); smaller
  /// ones run MPI's non-blocking collective, polled. Default 0: every payload, because the
  /// fingerprint exchange that precedes each collective already shows that every rank arrived (so
  /// the blocking call cannot hang), and a polled `MPI_Iallreduce` of 8 B costs about 1.5 us more
  /// than `MPI_Allreduce` (docs/benchmarks.md, "MPI overhead").
  std::size_t blocking_min_bytes = 0;
  /// How large payloads wait under a deadline.
  enum class large_payload_mode {
    automatic,              ///< barrier then blocking, unless the node's ranks outnumber its cores
    barrier_then_blocking,  ///< a polled `MPI_Ibarrier`, then MPI's blocking collective
    nonblocking,            ///< MPI's non-blocking collective, polled
  };
  /// How payloads of `blocking_min_bytes` or more wait under a deadline (see `large_payload_mode`).
  large_payload_mode large_payloads = large_payload_mode::automatic;
  /// bfloat16 reductions: false (default) widens to float, reduces with MPI's float ops and rounds
  /// once (bitwise equal to the thread backend: sums in rank order, `detail/ordered_reduce.hpp`);
  /// true sends 16-bit values and combines them with a user-defined op in float, rounding after
  /// every combination (half the traffic; each combination may lose half an ulp of bfloat16).
  bool bfloat16_on_wire = false;
  /// Kept for source compatibility and ignored: every collective is checked (see the file comment).
  bool verify_collectives = true;
};

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/mpi_comm_options.hpp

namespace meshlib::detail {

/// The MPI state shared by the handles of one communicator.
struct mpi_comm_state {
  MPI_Comm adopted = MPI_COMM_NULL;  ///< the application's communicator; never freed
  MPI_Comm comm = MPI_COMM_NULL;     ///< meshlib's own (a dup or a split result); freed by meshlib
  /// A duplicate of `comm` for arrival notes: a rank that waits long in a collective tells its
  /// peers which call it waits in, so that a timeout can name the ranks that never arrived.
  MPI_Comm side = MPI_COMM_NULL;
  std::vector<std::uint64_t> peer_waits_in;  ///< per rank: 1 + the call it last said it waits in (0: none)
  static constexpr int arrival_tag = 1;      ///< the tag of arrival notes on `side`
  std::vector<std::uint64_t> notes_sent;     ///< per rank: arrival notes sent to it on `side`
  std::vector<std::uint64_t> notes_received; ///< per rank: arrival notes received from it on `side`
  int rank = 0;
  int size = 0;
  int tag_ub = 32767;
  /// Whether this node runs more ranks (of the adopted communicator) than it has cores.
  bool oversubscribed = false;
  mpi_comm_options options;
  bool failed = false;
  bool failed_by_mismatch = false;  ///< else a timeout
  std::string failure;
  /// Whether a handle that an exception unwinds fails the communicator (`~mpi_communicator`): the
  /// application's communicators and their splits, not a hybrid world's own.
  bool fail_on_unwind = false;
  /// A timeout of the fingerprint exchange: the ranks that never said they arrived (empty: unknown,
  /// or every rank arrived late), so that an owner can name them its own way (hybrid devices).
  std::vector<int> missing;
  std::uint64_t calls = 0;  ///< collectives called on this communicator (the fingerprint's sequence number)
  /// Set by an owner that can fail this communicator from outside (a hybrid world whose device
  /// failed, here or in another process): called by every wait while it polls, it throws that
  /// failure. Copied into split results.
  std::function<void()> check_interrupt;
  /// The abort channel of the adopted communicator (shared by its splits): `fail` reports through
  /// it, and every polled wait (through `check_interrupt`) ends when another rank has reported.
  std::shared_ptr<abort_channel> channel;
  struct pending_send {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
  };
  std::vector<pending_send> sends;

  mpi_comm_state() = default;
  mpi_comm_state(const mpi_comm_state&) = delete;
  mpi_comm_state& operator=(const mpi_comm_state&) = delete;

  ~mpi_comm_state() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;  // nothing can be freed any more
    // Buffered sends still in flight: give them the timeout to complete, then leave them to MPI.
    const auto deadline = std::chrono::steady_clock::now() + (options.timeout.count() > 0 ? options.timeout : std::chrono::nanoseconds(0));
    for (auto& s : sends) {
      int done = 0;
      while (s.request != MPI_REQUEST_NULL && !done) {
        MPI_Test(&s.request, &done, MPI_STATUS_IGNORE);
        if (!done && std::chrono::steady_clock::now() > deadline) break;
        if (!done) std::this_thread::yield();
      }
      if (!done && s.request != MPI_REQUEST_NULL) {
        MPI_Request_free(&s.request);  // allowed for point-to-point: MPI finishes it on its own
        // ... reading the buffer until then, so it must outlive this object: leak it on purpose.
        (void)new std::vector<unsigned char>(std::move(s.data));
      }
    }
    // `comm` is freed only when no rank left an operation pending on it. A rank that timed out,
    // or whose waits were released by a failure (the abort channel), abandoned a non-blocking
    // collective that MPI cannot cancel: it may still send to every rank, and a message that
    // arrives after the free waits for the next communicator given the same context id
    // (detail/settle.hpp). Every rank votes in the settle exchange of `side`, which also
    // receives the arrival notes still in flight; a rank that cannot settle keeps both.
    // A mismatch is detected after the exchanges complete on every rank: nothing is pending.
    const bool interrupted = channel && channel->interrupted.load(std::memory_order_acquire);
    bool clean = !interrupted && (!failed || failed_by_mismatch);
    const bool settled =
        side == MPI_COMM_NULL ||
        settle_messages(side, arrival_tag, notes_sent, notes_received, std::chrono::milliseconds(1000), &clean);
    if (comm != MPI_COMM_NULL && settled && clean) MPI_Comm_free(&comm);
    if (side != MPI_COMM_NULL && settled) MPI_Comm_free(&side);
  }
};

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/detail/mpi_comm_state.hpp
// begin meshlib/comm/mpi/detail/mpi_types.hpp
/// @file
/// @brief How meshlib's element types and reduce ops map to MPI's, and the error check of every
/// MPI call. Internal to the MPI communicator.
///
/// | meshlib | MPI datatype (min, max, moves) | MPI datatype (sum, prod, mean) | MPI op |
/// | --- | --- | --- | --- |
/// | float / double | `MPI_FLOAT` / `MPI_DOUBLE` | same | `MPI_SUM`, `MPI_PROD` (over more than 2 ranks: moved and reduced in rank order instead, `ordered_reduce.hpp`); min/max: meshlib's user ops (NaN propagates, -0 < +0); mean = `MPI_SUM` then / n |
/// | int32 / int64 | `MPI_INT32_T` / `MPI_INT64_T` | `MPI_UINT32_T` / `MPI_UINT64_T` | the same ops; unsigned so that sums wrap as the thread backend's do (signed overflow is undefined in MPI's C loops) |
/// | bfloat16 | `MPI_UINT16_T` (its bits) | widened to `MPI_FLOAT` (default) or 16-bit on the wire with a user-defined op that combines in float | see `mpi_comm_options::bfloat16_on_wire` |

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <type_traits>


#if MESHLIB_ENABLE_MPI

#include <mpi.h>

namespace meshlib::detail {

/// The text MPI gives for error code `rc`.
inline std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<std::size_t>(len));
}

/// MPI's datatype for T. `wrapping`: the unsigned twin of integers (sum, prod, mean).
template <comm_element T>
MPI_Datatype mpi_datatype(bool wrapping = false) noexcept {
  using U = std::remove_cv_t<T>;
  if constexpr (std::is_same_v<U, float>) return MPI_FLOAT;
  else if constexpr (std::is_same_v<U, double>) return MPI_DOUBLE;
  else if constexpr (std::is_same_v<U, bfloat16>) return MPI_UINT16_T;
  else if constexpr (sizeof(U) == 4) return wrapping ? MPI_UINT32_T : MPI_INT32_T;
  else return wrapping ? MPI_UINT64_T : MPI_INT64_T;
}

/// Whether op combines by addition or multiplication (wraps for integers).
constexpr bool wraps(reduce_op op) noexcept {
  return op == reduce_op::sum || op == reduce_op::prod || op == reduce_op::mean;
}

/// meshlib's min or max of float or double (`float_min`, `float_max`: NaN propagates, -0 < +0) as
/// an MPI user op; MPI's own MPI_MIN and MPI_MAX lose a NaN that is not in the first operand.
/// `in` holds the lower ranks' result (the op is created non-commutative, so MPI keeps rank order).
template <class F, reduce_op Op>
void float_minmax_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const F*>(in);
  auto* b = static_cast<F*>(inout);
  for (int i = 0; i < *len; ++i) b[i] = Op == reduce_op::min ? float_min(a[i], b[i]) : float_max(a[i], b[i]);
}

/// The user ops of `float_minmax_combine`: [float min, float max, double min, double max], created
/// on first use (after `MPI_Init`) and kept until `MPI_Finalize`.
inline MPI_Op float_minmax_op(bool is_double, reduce_op op) {
  static MPI_Op ops[4] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  static const bool made = [] {
    MPI_Op_create(&float_minmax_combine<float, reduce_op::min>, 0, &ops[0]);
    MPI_Op_create(&float_minmax_combine<float, reduce_op::max>, 0, &ops[1]);
    MPI_Op_create(&float_minmax_combine<double, reduce_op::min>, 0, &ops[2]);
    MPI_Op_create(&float_minmax_combine<double, reduce_op::max>, 0, &ops[3]);
    return true;
  }();
  (void)made;
  return ops[(is_double ? 2 : 0) + (op == reduce_op::max ? 1 : 0)];
}

/// MPI's op for a meshlib op on T (mean is a sum followed by a division by the participant count;
/// min and max of floating-point values are meshlib's user ops).
template <class T>
MPI_Op mpi_op(reduce_op op) {
  if constexpr (std::is_floating_point_v<T>)
    if (op == reduce_op::min || op == reduce_op::max) return float_minmax_op(std::is_same_v<T, double>, op);
  switch (op) {
    case reduce_op::sum:
    case reduce_op::mean: return MPI_SUM;
    case reduce_op::prod: return MPI_PROD;
    case reduce_op::min: return MPI_MIN;
    case reduce_op::max: return MPI_MAX;
  }
  return MPI_SUM;
}

/// bfloat16 user-defined ops: each combination is done in float and rounded to bfloat16.
template <reduce_op Op>
void bf16_combine(void* in, void* inout, int* len, MPI_Datatype*) {
  const auto* a = static_cast<const bfloat16*>(in);
  auto* b = static_cast<bfloat16*>(inout);
  for (int i = 0; i < *len; ++i) {
    const float x = a[i];
    const float y = b[i];
    float r;
    if constexpr (Op == reduce_op::sum || Op == reduce_op::mean) r = x + y;
    else if constexpr (Op == reduce_op::prod) r = x * y;
    else if constexpr (Op == reduce_op::min) r = float_min(x, y);
    else r = float_max(x, y);
    b[i] = bfloat16(r);
  }
}

/// The user-defined `MPI_Op` for bfloat16 and `op`, created on first use (after `MPI_Init`) and
/// kept until `MPI_Finalize` frees it with the rest of MPI's state.
inline MPI_Op bf16_mpi_op(reduce_op op) {
  static MPI_Op ops[5] = {MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL, MPI_OP_NULL};
  static const bool made = [] {
    MPI_Op_create(&bf16_combine<reduce_op::sum>, 1, &ops[static_cast<int>(reduce_op::sum)]);
    MPI_Op_create(&bf16_combine<reduce_op::prod>, 1, &ops[static_cast<int>(reduce_op::prod)]);
    MPI_Op_create(&bf16_combine<reduce_op::min>, 1, &ops[static_cast<int>(reduce_op::min)]);
    MPI_Op_create(&bf16_combine<reduce_op::max>, 1, &ops[static_cast<int>(reduce_op::max)]);
    ops[static_cast<int>(reduce_op::mean)] = ops[static_cast<int>(reduce_op::sum)];
    return true;
  }();
  (void)made;
  return ops[static_cast<int>(op)];
}

/// After a sum: divide by the participant count as the thread backend's mean does (integers:
/// the wrapped sum, as signed, divided toward zero).
template <comm_element T>
void finish_avg(T* data, std::size_t count, int n) noexcept {
  for (std::size_t i = 0; i < count; ++i) {
    if constexpr (std::is_integral_v<T>) data[i] = static_cast<T>(data[i] / static_cast<T>(n));
    else if constexpr (std::is_same_v<T, bfloat16>) data[i] = bfloat16(static_cast<float>(data[i]) / static_cast<float>(n));
    else data[i] = static_cast<T>(data[i] / static_cast<T>(n));
  }
}

}  // namespace meshlib::detail

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/detail/mpi_types.hpp
// begin meshlib/comm/mpi/detail/ordered_reduce.hpp
/// @file
/// @brief Floating-point reductions in rank order on MPI: the same bits as the thread backend.
///
/// IEEE addition and multiplication are commutative but not associative, and `MPI_Allreduce`
/// combines the ranks' values in an order of its own (ring, tree, recursive halving: it depends on
/// the size, the message length and the MPI build). The thread backend combines every element as
/// `((x0 op x1) op x2) ...` in rank order. So for float and double sum, prod and mean over more
/// than two ranks, the MPI communicator moves the inputs instead and reduces them with the thread
/// backend's own kernel (`reduce_into`): an all-to-all of blocks, each rank reducing its block in
/// rank order (a reduce-scatter), then an all-gather for all_reduce, or a gather to the root for
/// reduce. With two ranks every order is `x0 op x1` (commutativity), so MPI's native path already
/// gives those bits and stays. Integers (exact, wrapping) and min / max (meshlib's NaN-aware ops
/// do not depend on the order) stay native too.

#include <cstddef>
#include <type_traits>
#include <vector>


namespace meshlib::detail {

/// Whether a reduction of T with `op` over `ranks` ranks must run in rank order to give the thread
/// backend's bits (see the file comment).
template <class T>
constexpr bool needs_rank_order(reduce_op op, int ranks) noexcept {
  return std::is_floating_point_v<T> && ranks > 2 &&
         (op == reduce_op::sum || op == reduce_op::prod || op == reduce_op::mean);
}

/// out[i] = blocks[0][i] op blocks[1][i] op ... in rank order (mean: divided by n), i < len, where
/// block r starts at `blocks + r * stride`. The thread backend's kernel, so its bits.
template <class T>
void reduce_blocks_in_order(reduce_op op, const T* blocks, int n, std::size_t stride, T* out, std::size_t len) {
  if (len == 0) return;
  std::vector<const T*> in(static_cast<std::size_t>(n));
  for (std::size_t r = 0; r < in.size(); ++r) in[r] = blocks + r * stride;
  T* outs[1] = {out};
  reduce_into<T>(op, in.data(), n, outs, 1, len);
}

}  // namespace meshlib::detail
// end meshlib/comm/mpi/detail/ordered_reduce.hpp

namespace meshlib {

/// @brief One MPI rank's handle on a communicator. Copies share the same MPI communicator.
class mpi_communicator : public communicator_frontend<mpi_communicator> {
  friend class communicator_frontend<mpi_communicator>;
  friend class hybrid_world;  // installs check_interrupt on its own duplicate
  friend class hybrid_communicator;  // its leaders read which processes never arrived (mpi_comm_state::missing)
  friend class fail_guard;           // fails the communicator when an exception unwinds it
  using op_kind = detail::op_kind;

 public:

  /// An empty handle; only assignable and destructible.
  mpi_communicator() = default;

  /// Another handle on the same communicator. Written out (not defaulted) so that the copy
  /// counts the exceptions in flight where it is made, not where `o` was (see the destructor).
  mpi_communicator(const mpi_communicator& o) : state_(o.state_), fail_on_unwind_(o.fail_on_unwind_) {}
  /// Takes `o`'s communicator over; `o` becomes an empty handle.
  mpi_communicator(mpi_communicator&& o) noexcept : state_(std::move(o.state_)), fail_on_unwind_(o.fail_on_unwind_) {}
  /// Makes this a handle on `o`'s communicator (this handle keeps its own exception count).
  mpi_communicator& operator=(const mpi_communicator& o) {
    state_ = o.state_;
    fail_on_unwind_ = o.fail_on_unwind_;
    return *this;
  }
  /// Takes `o`'s communicator over; `o` becomes an empty handle.
  mpi_communicator& operator=(mpi_communicator&& o) noexcept {
    state_ = std::move(o.state_);
    fail_on_unwind_ = o.fail_on_unwind_;
    return *this;
  }

  /// Any handle of an application's communicator (or of a split of it) that an exception unwinds
  /// (the rank threw, and nothing caught it within the handle's scope) fails the communicator as
  /// `fail` would: the rank will not reach its next collective on it, and its peers would
  /// otherwise wait for the whole timeout. Any handle, not only the last (issue 40 §4): the
  /// handle most programs use is a copy of `mpi::world()`, whose last handle the runtime keeps, so
  /// a rule on the last handle never fired in a plain MPI program. Handles whose owner reports
  /// failures itself opt out (`set_fail_on_unwind(false)`: the runners, whose message is the
  /// exception's own). The exception cannot be read from a destructor, so the peers'
  /// `comm_aborted` says that an exception left the communicator's scope on that rank, whose own
  /// handler has the message.
  ~mpi_communicator() {
    if (state_ && fail_on_unwind_ && std::uncaught_exceptions() > exceptions_at_birth_) fail_for_unwind();
  }

  /// @brief Whether this handle fails its communicator when an exception unwinds it (see the
  /// destructor; default on). Owners that report a rank's failure with its message themselves
  /// (`mpi_runner`, `hybrid_runner`) turn it off on the handles they hold; copies and splits of a
  /// handle inherit its setting.
  /// @code
  /// auto comm = meshlib::mpi::world();
  /// comm.set_fail_on_unwind(false);  // this program catches and recovers: its peers time out instead
  /// @endcode
  void set_fail_on_unwind(bool on) noexcept { fail_on_unwind_ = on; }
  /// Whether this handle fails its communicator when an exception unwinds it.
  [[nodiscard]] bool fails_on_unwind() const noexcept { return fail_on_unwind_; }

  /// @brief Adopts `comm` (collective over it: duplicates it once). `comm` stays the
  /// application's: meshlib never frees or modifies it.
  /// @throws comm_error when MPI is not initialised or `comm` is `MPI_COMM_NULL`.
  explicit mpi_communicator(MPI_Comm comm, mpi_comm_options options = {}) : mpi_communicator(comm, options, true) {}

  /// Rank of this process in the communicator.
  [[nodiscard]] int rank() const noexcept { return state_ ? state_->rank : 0; }
  /// Number of ranks (0 for an empty handle).
  [[nodiscard]] int size() const noexcept { return state_ ? state_->size : 0; }
  /// False after a move (the communicator owns nothing).
  [[nodiscard]] bool valid() const noexcept { return state_ != nullptr; }
  /// The adopted `MPI_Comm`, or for a split result meshlib's own.
  [[nodiscard]] MPI_Comm native() const noexcept {
    if (!state_) return MPI_COMM_NULL;
    return state_->adopted != MPI_COMM_NULL ? state_->adopted : state_->comm;
  }
  /// Whether this node runs more ranks than it has cores (decides `large_payload_mode::automatic`).
  [[nodiscard]] bool oversubscribed() const noexcept { return state_ && state_->oversubscribed; }
  /// The options the communicator was made with.
  [[nodiscard]] const mpi_comm_options& options() const {
    require_valid("options");
    return state_->options;
  }

 private:
  /// `own_channel` false: the owner (a hybrid world) installs its own abort channel and
  /// `check_interrupt` right after, so none is opened here (no extra duplicate).
  mpi_communicator(MPI_Comm comm, mpi_comm_options options, bool own_channel) {
    int init = 0;
    MPI_Initialized(&init);
    if (!init)
      throw comm_error("meshlib: mpi_communicator needs MPI to be initialised first (MPI_Init or "
                       "meshlib::mpi::initialize)");
    if (comm == MPI_COMM_NULL) throw comm_argument_error("meshlib: mpi_communicator cannot adopt MPI_COMM_NULL");
    auto s = std::make_shared<detail::mpi_comm_state>();
    s->adopted = comm;
    s->options = options;
    s->fail_on_unwind = own_channel;
    check_rc(MPI_Comm_dup(comm, &s->comm), "MPI_Comm_dup");
    finish(*s);
    if (own_channel) {
      // The abort channel is polled by the waiting thread itself (no watcher), at any thread level.
      s->channel = std::make_shared<detail::abort_channel>();
      s->channel->open(s->comm, true);
      s->check_interrupt = [ch = s->channel.get()] {
        int r = -1;
        std::string what;
        detail::failure_kind kind{};  // always aborted on a plain communicator: every rank detects the rest itself
        if (ch->poll(r, what, kind))
          ch->interrupt("meshlib: communicator aborted: MPI rank " + std::to_string(r) + " of " +
                        std::to_string(ch->processes) + " failed: " + what, r);
        ch->check();
      };
    }
    {
      MPI_Comm node = MPI_COMM_NULL;
      check_rc(MPI_Comm_split_type(s->comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node), "MPI_Comm_split_type");
      int on_node = 1;
      MPI_Comm_size(node, &on_node);
      MPI_Comm_free(&node);
      const unsigned cores = std::thread::hardware_concurrency();
      s->oversubscribed = cores != 0 && static_cast<unsigned>(on_node) > cores;
    }
    state_ = std::move(s);
  }

 public:

  /// @brief Ends every process of the run: prints "meshlib: MPI rank R of N aborts the run:
  /// <reason>" on stderr and calls `MPI_Abort` on this communicator.
  [[noreturn]] void abort(std::string_view reason, int exit_code = 1) const {
    meshlib::detail::write_stderr_line("meshlib: MPI rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                              " aborts the run: " + std::string(reason));
    MPI_Abort(state_ ? state_->comm : MPI_COMM_WORLD, exit_code);
    std::abort();  // MPI_Abort does not return; this satisfies [[noreturn]] if it ever did
  }

  /// @brief Fails this communicator with this rank as the root cause, without ending the
  /// process (the runner of a rank that threw calls it): every other rank's polled wait on this
  /// communicator or a split of it ends within milliseconds with `comm_aborted` "meshlib:
  /// communicator aborted: MPI rank R of N failed: <reason>" (R and N in the adopted
  /// communicator), and every later call on any rank throws it too. Waits without a deadline
  /// (`timeout` 0: blocking MPI calls) cannot be released.
  ///
  /// @code
  /// try { step(comm); } catch (const std::exception& e) { comm.fail(e.what()); throw; }
  /// @endcode
  void fail(std::string_view reason) const {
    require_valid("fail");
    auto& ch = *state_->channel;
    ch.interrupt("meshlib: communicator aborted: MPI rank " + std::to_string(ch.process) + " of " +
                 std::to_string(ch.processes) + " failed: " + std::string(reason), ch.process);
    if (ch.remote_device.load() < 0) ch.notify(ch.process, std::string(reason));  // a remote failure is not sent back
  }

  /// @brief The rank to blame for this communicator's failure, once this rank knows of it:
  /// - the rank that failed it (or the communicator it was split from) through `fail`, a
  ///   `fail_guard` or an unwound handle, here or in another process (-1 when that rank is not a
  ///   member of this split);
  /// - else, after this rank's `comm_timeout` "rank(s) R never arrived", the rank R that never
  ///   arrived; when several never arrived, the lowest of them (the message lists them all);
  /// - else -1: no failure, a collective mismatch (every rank's call is in the message), or a
  ///   timeout in which every rank arrived, but late.
  ///
  /// A rank that throws without failing the communicator (it caught the exception within the
  /// scope of its handle, so nothing unwound one) is named only after the timeout; a `fail_guard`
  /// names it within milliseconds.
  ///
  /// @code
  /// catch (const meshlib::comm_error&) { std::cerr << "rank " << comm.root_cause_rank() << " failed\n"; }
  /// @endcode
  [[nodiscard]] int root_cause_rank() const noexcept {
    if (!state_) return -1;
    const bool interrupted = state_->channel && state_->channel->interrupted.load(std::memory_order_acquire);
    if (!interrupted) {
      // The timeout of this rank's fingerprint exchange recorded who never arrived (ascending).
      if (state_->failed && !state_->failed_by_mismatch && !state_->missing.empty()) return state_->missing.front();
      return -1;
    }
    const int r = state_->channel->root_cause.load();
    if (r < 0 || state_->adopted != MPI_COMM_NULL || state_->channel->comm == MPI_COMM_NULL) return r;
    // A split: the channel names ranks of the adopted communicator.
    MPI_Group from = MPI_GROUP_NULL, to = MPI_GROUP_NULL;
    MPI_Comm_group(state_->channel->comm, &from);
    MPI_Comm_group(state_->comm, &to);
    int mine = MPI_UNDEFINED;
    MPI_Group_translate_ranks(from, 1, &r, to, &mine);
    MPI_Group_free(&from);
    MPI_Group_free(&to);
    return mine == MPI_UNDEFINED ? -1 : mine;
  }

  // The collectives, point to point and barrier: communicator_frontend; the transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// @brief `MPI_Comm_split`: ranks with the same `color` (>= 0) form a new communicator, ordered
  /// by (key, rank). The result owns its `MPI_Comm` and has this one's options.
  mpi_communicator split(int color, int key) {
    check_split(color);
    // Arrive first (polled, with the fingerprint), so that a rank that never splits is a timeout,
    // not a hang, and a rank that calls something else a mismatch.
    agree(op_kind::split, datatype::float32, 0, reduce_op::sum, 0);
    auto s = std::make_shared<detail::mpi_comm_state>();
    s->options = state_->options;
    s->oversubscribed = state_->oversubscribed;  // a property of the placement, not of the group
    s->check_interrupt = state_->check_interrupt;
    s->channel = state_->channel;
    s->fail_on_unwind = state_->fail_on_unwind;
    check_rc(MPI_Comm_split(state_->comm, color, key, &s->comm), "MPI_Comm_split");
    finish(*s);
    mpi_communicator out;
    out.state_ = std::move(s);
    out.fail_on_unwind_ = fail_on_unwind_;  // a runner's splits leave the report to the runner too
    return out;
  }

 private:
  // ---- the front end's hooks -------------------------------------------------------------------

  std::string label() const { return "MPI rank " + std::to_string(rank()); }
  std::string where(std::string_view k) const {
    return std::string(k) + " on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size());
  }
  void require_valid(std::string_view k) const {
    if (!state_)
      throw comm_error("meshlib: " + std::string(k) +
                       " called on an empty mpi_communicator handle (default-constructed or moved from)");
  }
  void ensure_usable(op_kind k) const {
    require_valid(detail::op_name(k));
    if (state_->channel && state_->channel->interrupted.load(std::memory_order_acquire))
      state_->channel->rethrow(" [refused " + where(detail::op_name(k)) + ": the communicator has failed]");
    if (!state_->failed) return;
    const std::string msg = "meshlib: refused " + where(detail::op_name(k)) + ": the communicator has failed: " + state_->failure;
    if (state_->failed_by_mismatch) throw collective_mismatch(msg);
    throw comm_timeout(msg);
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed" + (state_ ? " on MPI rank " + std::to_string(rank()) : "") +
                       ": " + detail::mpi_error_string(rc));
  }
  void check_tag_bound(op_kind k, int tag) const {
    if (tag >= state_->tag_ub)
      bad_argument(k, "tag " + std::to_string(tag) + " is out of range [0, " + std::to_string(state_->tag_ub) +
                          "); the top tag is meshlib's");
  }
  /// MPI counts are ints.
  void check_count(op_kind k, std::size_t count) const {
    if (count > static_cast<std::size_t>(INT_MAX))
      bad_argument(k, "count " + std::to_string(count) + " exceeds MPI's int count (" + std::to_string(INT_MAX) +
                          "); split the call");
  }
  /// An all_to_all_v side's counts or displacements as MPI's ints.
  std::vector<int> ints(op_kind k, const char* what, const std::int64_t* v) const {
    std::vector<int> out(static_cast<std::size_t>(size()));
    for (std::size_t j = 0; j < out.size(); ++j) {
      if (v[j] > INT_MAX)
        bad_argument(k, std::string(what) + "[" + std::to_string(j) + "] = " + std::to_string(v[j]) + " exceeds MPI's int");
      out[j] = static_cast<int>(v[j]);
    }
    return out;
  }

  /// The transport of operation K (the front end has checked its arguments).
  template <op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type) {
    const bool is_root = rank() == o.root;
    if constexpr (K == op_kind::all_reduce) {
      do_all_reduce<T>(o.in_place ? nullptr : o.send, o.recv, o.count, o.op);
    } else if constexpr (K == op_kind::reduce) {
      do_reduce<T>(o.in_place && is_root ? nullptr : o.send, o.recv, o.count, o.op, o.root);
    } else if constexpr (K == op_kind::reduce_scatter) {
      if (o.in_place) {
        // MPI's in-place form puts the result at the start of the buffer and may use the rest as
        // scratch; meshlib's leaves every other block as it was. So the input is copied, and the
        // result written straight into block rank().
        const std::vector<T> input(o.send, o.send + o.count * static_cast<std::size_t>(size()));
        do_reduce_scatter<T>(input.data(), o.recv, o.count, o.op);
      } else {
        do_reduce_scatter<T>(o.send, o.recv, o.count, o.op);
      }
    } else if constexpr (K == op_kind::broadcast) {
      if (is_root && !o.in_place && o.count != 0) std::memcpy(o.recv, o.send, o.count * sizeof(T));
      do_broadcast<T>(o.recv, o.count, o.root);
    } else if constexpr (K == op_kind::all_gather) {
      do_all_gather<T>(o.in_place ? nullptr : o.send, o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all) {
      do_all_to_all<T>(o.in_place ? nullptr : o.send, o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all_v) {
      do_all_to_all_v<T>(o);
    } else if constexpr (K == op_kind::ppermute) {
      if (o.in_place) {
        const std::vector<T> copy(o.send, o.send + o.count);
        do_ppermute<T>(copy.data(), o.recv, o.count, o.pairs);
      } else {
        do_ppermute<T>(o.send, o.recv, o.count, o.pairs);
      }
    } else if constexpr (K == op_kind::send) {
      do_send<T>(o);
    } else if constexpr (K == op_kind::recv) {
      do_recv<T>(o);
    } else {
      static_assert(K == op_kind::barrier);
      progress_sends();
      agree(K, datatype::float32, 0, reduce_op::sum, 0);  // the fingerprint exchange is a barrier
    }
    return {};
  }

  template <class T>
  void do_all_to_all_v(const detail::operation<T>& o) {
    constexpr auto k = op_kind::all_to_all_v;
    const auto sc = ints(k, "send_counts", o.v[0]);
    const auto sd = ints(k, "send_displs", o.v[1]);
    const auto rc = ints(k, "recv_counts", o.v[2]);
    const auto rd = ints(k, "recv_displs", o.v[3]);
    agree(k, datatype_of<T>, 0, reduce_op::sum, 0);
    {
      // Every rank's recv_counts[j] must be rank j's send_counts[rank()]; all ranks learn whether
      // any rank disagrees, so that all throw (never MPI_ERR_TRUNCATE or a hang).
      std::vector<int> their(static_cast<std::size_t>(size()));
      timed("all_to_all_v", sizeof(int) * their.size(),
            [&](MPI_Request* r) { return MPI_Ialltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm, r); },
            [&] { return MPI_Alltoall(sc.data(), 1, MPI_INT, their.data(), 1, MPI_INT, state_->comm); });
      std::string mine;
      for (int j = 0; j < size() && mine.empty(); ++j)
        if (their[static_cast<std::size_t>(j)] != rc[static_cast<std::size_t>(j)])
          mine = detail::describe_counts_disagreement("rank " + std::to_string(j), "rank " + std::to_string(rank()),
                                                      their[static_cast<std::size_t>(j)], rc[static_cast<std::size_t>(j)]);
      int bad = mine.empty() ? -1 : rank();
      int first_bad = -1;
      timed("all_to_all_v", 0,
            [&](MPI_Request* r) { return MPI_Iallreduce(&bad, &first_bad, 1, MPI_INT, MPI_MAX, state_->comm, r); },
            [&] { return MPI_Allreduce(&bad, &first_bad, 1, MPI_INT, MPI_MAX, state_->comm); });
      if (first_bad >= 0) {
        state_->failed = true;
        state_->failed_by_mismatch = true;
        state_->failure = "meshlib: collective mismatch in all_to_all_v on an MPI communicator of " +
                          std::to_string(size()) + " ranks: the counts disagree" +
                          (mine.empty() ? " (rank " + std::to_string(first_bad) + " saw it)" : ": " + mine);
        throw collective_mismatch(state_->failure);
      }
    }
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    std::size_t bytes = 0;
    for (int c : sc) bytes += static_cast<std::size_t>(c) * sizeof(T);
    timed("all_to_all_v", bytes,
          [&](MPI_Request* r) {
            return MPI_Ialltoallv(o.send, sc.data(), sd.data(), t, o.recv, rc.data(), rd.data(), t, state_->comm, r);
          },
          [&] { return MPI_Alltoallv(o.send, sc.data(), sd.data(), t, o.recv, rc.data(), rd.data(), t, state_->comm); });
  }

  /// Buffered: the data is copied and sent in the background (progressed by later calls).
  template <class T>
  void do_send(const detail::operation<T>& o) {
    check_tag_bound(op_kind::send, o.tag);
    check_count(op_kind::send, o.count);
    progress_sends();
    detail::mpi_comm_state::pending_send p;
    p.data.resize(o.count * sizeof(T));
    if (o.count != 0) std::memcpy(p.data.data(), o.send, o.count * sizeof(T));
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(o.count), detail::mpi_datatype<T>(), o.peer, o.tag, state_->comm,
                       &p.request),
             "MPI_Isend");
    state_->sends.push_back(std::move(p));
  }

  template <class T>
  void do_recv(const detail::operation<T>& o) {
    check_tag_bound(op_kind::recv, o.tag);
    check_count(op_kind::recv, o.count);
    const int source = o.peer;
    const int tag = o.tag;
    // Probe first (matched probe: safe when other threads use the communicator), so that a
    // message of another length is reported instead of truncated.
    MPI_Status st;
    MPI_Message msg = MPI_MESSAGE_NULL;
    poll("recv", [&](int* done) {
      progress_sends();
      return MPI_Improbe(source, tag, state_->comm, done, &msg, &st);
    }, /*interruptible=*/true);  // a probe leaves nothing pending; a failed sender never sends
    int got = 0;
    MPI_Get_count(&st, detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(o.count)) {
      // Consume the message so the stream stays in order, then report.
      std::vector<unsigned char> sink;
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      sink.resize(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on MPI rank " + std::to_string(rank()) + " of " + std::to_string(size()) +
                                " expected " + std::to_string(o.count) + " elements of " +
                                std::string(to_string(datatype_of<T>)) + " from rank " + std::to_string(source) +
                                " (tag " + std::to_string(tag) + ") but the message holds " +
                                (got == MPI_UNDEFINED ? std::to_string(bytes) + " bytes" : std::to_string(got)));
    }
    check_rc(MPI_Mrecv(o.recv, got, detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
  }

  // ---- waiting ---------------------------------------------------------------------------------

  bool has_deadline() const noexcept { return state_->options.timeout.count() > 0; }

  /// Polls `test(&done)` (an MPI call returning its error code) until done or the deadline.
  /// `interruptible`: whether a failure elsewhere (`check_interrupt`) may end the wait. Only waits
  /// that leave nothing pending may be (a matched probe); a data transfer posted after the
  /// fingerprint exchange completes on every rank without help (every rank has posted it), and
  /// abandoning it would leave MPI writing into the caller's buffers after the throw.
  template <class Test>
  void poll(std::string_view k, Test&& test, bool interruptible = false) {
    const auto start = std::chrono::steady_clock::now();
    const auto deadline = has_deadline() ? start + state_->options.timeout : std::chrono::steady_clock::time_point::max();
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      check_rc(test(&done), "MPI_Test");
      if (done) return;
      if (spins > 256) std::this_thread::yield();  // oversubscribed ranks must let their peers run
      if ((spins & 63) != 0) continue;
      if (interruptible && state_->check_interrupt) state_->check_interrupt();
      if (std::chrono::steady_clock::now() > deadline) {
        state_->missing.clear();  // a data transfer after every rank arrived: nobody to name
        fail_timeout(k);
      }
    }
  }
  void wait(std::string_view k, MPI_Request& r) {
    poll(k, [&](int* done) { return MPI_Test(&r, done, MPI_STATUS_IGNORE); });
  }

  /// `who`: who is late. Only the arrival check (`wait_arrival`) knows which ranks never arrived
  /// (`state_->missing`, which `root_cause_rank` reads); every other wait empties it.
  [[noreturn]] void fail_timeout(std::string_view k, const std::string& who = "a peer never called it") {
    const double secs = std::chrono::duration<double>(state_->options.timeout).count();
    state_->failed = true;
    state_->failure = "meshlib: " + where(k) + " did not complete within " + std::to_string(secs) + " s: " + who +
                      " (it failed, is still busy, or called another operation); MPI cannot cancel a "
                      "collective, so this communicator refuses further operations; end the run";
    throw comm_timeout(state_->failure);
  }

  static constexpr int arrival_tag = detail::mpi_comm_state::arrival_tag;

  /// Reads the arrival notes peers have sent so far (`peer_waits_in`).
  void drain_arrival_notes() {
    for (;;) {
      int found = 0;
      MPI_Status st;
      check_rc(MPI_Iprobe(MPI_ANY_SOURCE, arrival_tag, state_->side, &found, &st), "MPI_Iprobe");
      if (!found) return;
      std::uint64_t call = 0;
      check_rc(MPI_Recv(&call, 1, MPI_UINT64_T, st.MPI_SOURCE, arrival_tag, state_->side, MPI_STATUS_IGNORE), "MPI_Recv");
      state_->peer_waits_in[static_cast<std::size_t>(st.MPI_SOURCE)] = call + 1;
      ++state_->notes_received[static_cast<std::size_t>(st.MPI_SOURCE)];
    }
  }

  /// Waits for the fingerprint exchange of call `call` (every rank has arrived once it completes).
  /// After 10 ms it tells the peers that it waits in this call (so nothing is sent on the fast
  /// path); at the deadline it reads the peers' notes for a short grace and names the ranks that
  /// never said they arrived.
  void wait_arrival(std::string_view k, MPI_Request& r, std::uint64_t call) {
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    const auto deadline = start + state_->options.timeout;
    bool noted = false;
    for (unsigned spins = 0;; ++spins) {
      int done = 0;
      check_rc(MPI_Test(&r, &done, MPI_STATUS_IGNORE), "MPI_Test");
      if (done) return;
      if (spins > 256) std::this_thread::yield();
      if ((spins & 63) != 0) continue;
      if (state_->check_interrupt) state_->check_interrupt();
      const auto now = clock::now();
      if (!noted && now - start > std::chrono::milliseconds(10)) {
        noted = true;
        drain_arrival_notes();
        for (int peer = 0; peer < size(); ++peer) {
          if (peer == rank()) continue;
          detail::mpi_comm_state::pending_send p;
          p.data.resize(sizeof(call));
          std::memcpy(p.data.data(), &call, sizeof(call));
          check_rc(MPI_Isend(p.data.data(), 1, MPI_UINT64_T, peer, arrival_tag, state_->side, &p.request), "MPI_Isend");
          state_->sends.push_back(std::move(p));
          ++state_->notes_sent[static_cast<std::size_t>(peer)];
        }
      }
      if (now > deadline) {
        // Peers that arrived at about the same time send their notes within 10 ms of arriving.
        const auto grace_end = clock::now() + std::chrono::milliseconds(50);
        while (clock::now() < grace_end) {
          drain_arrival_notes();
          progress_sends();
          std::this_thread::yield();
        }
        std::string missing;
        int count = 0;
        state_->missing.clear();
        for (int peer = 0; peer < size(); ++peer)
          if (peer != rank() && state_->peer_waits_in[static_cast<std::size_t>(peer)] != call + 1) {
            missing += (count++ ? ", " : "") + std::to_string(peer);
            state_->missing.push_back(peer);
          }
        fail_timeout(k, count ? "rank(s) " + missing + " never arrived" : "every rank arrived, but not in time");
      }
    }
  }

  /// Runs one collective under the timeout: see the file comment.
  template <class NonBlocking, class Blocking>
  void timed(std::string_view k, std::size_t bytes, NonBlocking&& nb, Blocking&& bl) {
    if (!has_deadline()) {
      check_rc(bl(), k);
      return;
    }
    MPI_Request r = MPI_REQUEST_NULL;
    using mode = mpi_comm_options::large_payload_mode;
    const mode m = state_->options.large_payloads;
    const bool barrier_first = m == mode::barrier_then_blocking || (m == mode::automatic && !state_->oversubscribed);
    if (bytes >= state_->options.blocking_min_bytes && barrier_first) {
      // Every rank has arrived: the fingerprint exchange (agree) that precedes every data
      // collective completed, so MPI's blocking collective cannot wait unboundedly.
      check_rc(bl(), k);
    } else {
      check_rc(nb(&r), k);
      wait(k, r);
    }
  }

  void progress_sends() {
    auto& v = state_->sends;
    v.erase(std::remove_if(v.begin(), v.end(),
                           [&](detail::mpi_comm_state::pending_send& s) {
                             int done = 0;
                             check_rc(MPI_Test(&s.request, &done, MPI_STATUS_IGNORE), "MPI_Test");
                             return done != 0;
                           }),
            v.end());
  }

  /// Always-on mismatch detection. Before the data moves, every rank contributes a fingerprint of
  /// its call (call number on this communicator, operation, element type, count, reduce op, root,
  /// ppermute pairs) to one polled 16-byte all-reduce (max of the fingerprint and of its
  /// complement: all ranks agree exactly when both maxima are this rank's own values, so every
  /// rank reaches the same verdict). It doubles as the arrival check of the blocking large-payload
  /// path (see `timed`). On disagreement the ranks exchange their full calls, the communicator is
  /// failed, and every rank throws `collective_mismatch` naming each rank's call: a mismatched
  /// count, type, op, root or order never reaches MPI's data collectives (no MPI_ERR_TRUNCATE, no
  /// garbage, no hang).
  void agree(op_kind k, datatype dt, std::size_t count, reduce_op op, int root, std::uint64_t extra = 0) {
    const bool has_op = detail::uses_op(k);
    const bool has_root = detail::uses_root(k);
    const std::uint64_t rec[call_fields] = {state_->calls++,
                                            static_cast<std::uint64_t>(k),
                                            k == op_kind::barrier || k == op_kind::split ? 0 : static_cast<std::uint64_t>(dt) + 1,
                                            static_cast<std::uint64_t>(count),
                                            has_op ? static_cast<std::uint64_t>(op) : 0,
                                            has_root ? static_cast<std::uint64_t>(root) : 0,
                                            extra};
    meshlib::detail::fnv1a fingerprint;  // over the record's words
    for (std::uint64_t w : rec) fingerprint.add(w);
    const std::uint64_t h = fingerprint.value;
    // {mine[2], most[2]} on the heap: a wait that ends early (timeout, or a failure elsewhere)
    // leaves the all-reduce pending, and MPI may still read and write them; they are then leaked.
    auto fp = std::make_unique<std::array<std::uint64_t, 4>>(std::array<std::uint64_t, 4>{h, ~h, 0, 0});
    const std::uint64_t* mine = fp->data();
    std::uint64_t* most = fp->data() + 2;
    const std::string_view name = detail::op_name(k);
    if (!has_deadline()) {
      check_rc(MPI_Allreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, state_->comm), name);
    } else {
      MPI_Request r = MPI_REQUEST_NULL;
      check_rc(MPI_Iallreduce(mine, most, 2, MPI_UINT64_T, MPI_MAX, state_->comm, &r), name);
      try {
        wait_arrival(name, r, rec[0]);
      } catch (...) {
        (void)fp.release();  // still MPI's: see above
        throw;
      }
    }
    if (most[0] == mine[0] && most[1] == mine[1]) return;
    std::vector<std::uint64_t> all(call_fields * static_cast<std::size_t>(size()));
    timed(name, 0, [&](MPI_Request* r) {
            return MPI_Iallgather(rec, call_fields, MPI_UINT64_T, all.data(), call_fields, MPI_UINT64_T, state_->comm, r);
          },
          [&] { return MPI_Allgather(rec, call_fields, MPI_UINT64_T, all.data(), call_fields, MPI_UINT64_T, state_->comm); });
    std::string msg = "meshlib: collective mismatch on an MPI communicator of " + std::to_string(size()) +
                      " ranks: the ranks called different collectives";
    for (int r = 0; r < size(); ++r)
      msg += (r ? "; " : ": ") + detail::describe_record("rank " + std::to_string(r), all.data() + call_fields * r);
    state_->failed = true;
    state_->failed_by_mismatch = true;
    state_->failure = msg;
    throw collective_mismatch(msg + " (seen by MPI rank " + std::to_string(rank()) + ")");
  }

  static constexpr int call_fields = 7;


  template <class T>
  void maybe_verify(op_kind k, std::size_t count, reduce_op op, int root, std::uint64_t extra = 0) {
    agree(k, datatype_of<T>, count, op, root, extra);
  }

  static std::uint64_t pairs_hash(std::span<const permute_pair> pairs) noexcept { return detail::pairs_hash(pairs); }

  // ---- operations ------------------------------------------------------------------------------

  static const void* in_place(const void* p) noexcept { return p ? p : MPI_IN_PLACE; }

  /// send == nullptr: in place.
  template <class T>
  void do_all_reduce(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>(op_kind::all_reduce, count, op, 0);
    check_count(op_kind::all_reduce, count);
    progress_sends();
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        std::vector<float> w(count);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < count; ++i) w[i] = src[i];
        all_reduce_raw<float>(nullptr, w.data(), count, op);
        for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    all_reduce_raw<T>(send, recv, count, op);
  }

  template <class T>
  void all_reduce_raw(const T* send, T* recv, std::size_t count, reduce_op op) {
    if (detail::needs_rank_order<T>(op, size())) {
      ordered_all_reduce<T>(send ? send : recv, recv, count, op);
      return;
    }
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("all_reduce", count * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallreduce(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Allreduce(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  /// On root, send == nullptr means in place; elsewhere send is read.
  template <class T>
  void do_reduce(const T* send, T* recv, std::size_t count, reduce_op op, int root) {
    maybe_verify<T>(op_kind::reduce, count, op, root);
    check_count(op_kind::reduce, count);
    progress_sends();
    const bool is_root = rank() == root;
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        std::vector<float> w(count);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < count; ++i) w[i] = src[i];
        std::vector<float> res(is_root ? count : 0);
        do_reduce<float>(is_root ? nullptr : w.data(), is_root ? w.data() : res.data(), count, op, root);
        if (is_root)
          for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    if (detail::needs_rank_order<T>(op, size())) {
      ordered_reduce<T>(is_root && !send ? recv : send, recv, count, op, root);
      return;
    }
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    const void* s = is_root ? in_place(send) : static_cast<const void*>(send);
    void* rb = is_root ? static_cast<void*>(recv) : nullptr;
    timed("reduce", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ireduce(s, rb, n, t, o, root, state_->comm, r); },
          [&] { return MPI_Reduce(s, rb, n, t, o, root, state_->comm); });
    if (is_root && op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  /// send == nullptr: in place, the result at the start of recv (MPI's convention).
  template <class T>
  void do_reduce_scatter(const T* send, T* recv, std::size_t count, reduce_op op) {
    maybe_verify<T>(op_kind::reduce_scatter, count, op, 0);
    check_count(op_kind::reduce_scatter, count * static_cast<std::size_t>(size()));
    progress_sends();
    if constexpr (std::is_same_v<T, bfloat16>) {
      if (!state_->options.bfloat16_on_wire) {
        const std::size_t total = count * static_cast<std::size_t>(size());
        std::vector<float> w(total);
        const T* src = send ? send : recv;
        for (std::size_t i = 0; i < total; ++i) w[i] = src[i];
        do_reduce_scatter<float>(nullptr, w.data(), count, op);
        for (std::size_t i = 0; i < count; ++i) recv[i] = bfloat16(w[i]);
        return;
      }
    }
    if (detail::needs_rank_order<T>(op, size())) {
      ordered_reduce_scatter<T>(send ? send : recv, recv, count, op);
      return;
    }
    const MPI_Datatype t = detail::mpi_datatype<T>(detail::wraps(op));
    const MPI_Op o = reduce_mpi_op<T>(op);
    const int n = static_cast<int>(count);
    timed("reduce_scatter", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ireduce_scatter_block(in_place(send), recv, n, t, o, state_->comm, r); },
          [&] { return MPI_Reduce_scatter_block(in_place(send), recv, n, t, o, state_->comm); });
    if (op == reduce_op::mean) detail::finish_avg(recv, count, size());
  }

  // Float sum, prod and mean over more than two ranks, in rank order (detail/ordered_reduce.hpp):
  // the inputs move, and the thread backend's kernel reduces them, so the bits are the thread
  // backend's. `src` may be `recv` (in place): every input is copied out before a result is written.

  /// Rank me's result block: block me of every rank, reduced in rank order.
  template <class T>
  void ordered_reduce_scatter(const T* src, T* recv, std::size_t count, reduce_op op) {
    const auto n = static_cast<std::size_t>(size());
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int c = static_cast<int>(count);
    std::vector<T> blocks(count * n);
    timed("reduce_scatter", count * n * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ialltoall(src, c, t, blocks.data(), c, t, state_->comm, r); },
          [&] { return MPI_Alltoall(src, c, t, blocks.data(), c, t, state_->comm); });
    detail::reduce_blocks_in_order(op, blocks.data(), size(), count, recv, count);
  }

  /// A reduce-scatter of blocks of ceil(count / n) elements (the input padded), then an all-gather.
  template <class T>
  void ordered_all_reduce(const T* src, T* recv, std::size_t count, reduce_op op) {
    if (count == 0) return;
    const auto n = static_cast<std::size_t>(size());
    const std::size_t c = (count + n - 1) / n;
    std::vector<T> padded(c * n), mine(c), all(c * n);
    std::copy_n(src, count, padded.begin());
    ordered_reduce_scatter<T>(padded.data(), mine.data(), c, op);
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int ci = static_cast<int>(c);
    timed("all_reduce", c * n * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallgather(mine.data(), ci, t, all.data(), ci, t, state_->comm, r); },
          [&] { return MPI_Allgather(mine.data(), ci, t, all.data(), ci, t, state_->comm); });
    std::copy_n(all.begin(), count, recv);
  }

  /// Every rank's input gathered on the root, reduced there in rank order.
  template <class T>
  void ordered_reduce(const T* src, T* recv, std::size_t count, reduce_op op, int root) {
    const auto n = static_cast<std::size_t>(size());
    const bool is_root = rank() == root;
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int c = static_cast<int>(count);
    std::vector<T> all(is_root ? count * n : 0);
    timed("reduce", count * sizeof(T),
          [&](MPI_Request* r) { return MPI_Igather(src, c, t, all.data(), c, t, root, state_->comm, r); },
          [&] { return MPI_Gather(src, c, t, all.data(), c, t, root, state_->comm); });
    if (is_root) detail::reduce_blocks_in_order(op, all.data(), size(), count, recv, count);
  }

  template <class T>
  void do_broadcast(T* buf, std::size_t count, int root) {
    maybe_verify<T>(op_kind::broadcast, count, reduce_op::sum, root);
    check_count(op_kind::broadcast, count);
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("broadcast", count * sizeof(T), [&](MPI_Request* r) { return MPI_Ibcast(buf, n, t, root, state_->comm, r); },
          [&] { return MPI_Bcast(buf, n, t, root, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_gather(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>(op_kind::all_gather, count, reduce_op::sum, 0);
    check_count(op_kind::all_gather, count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    // MPI_IN_PLACE ignores the send count and type.
    timed("all_gather", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Iallgather(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Allgather(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  /// send == nullptr: in place.
  template <class T>
  void do_all_to_all(const T* send, T* recv, std::size_t count) {
    maybe_verify<T>(op_kind::all_to_all, count, reduce_op::sum, 0);
    check_count(op_kind::all_to_all, count * static_cast<std::size_t>(size()));
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    timed("all_to_all", count * static_cast<std::size_t>(size()) * sizeof(T),
          [&](MPI_Request* r) { return MPI_Ialltoall(in_place(send), n, t, recv, n, t, state_->comm, r); },
          [&] { return MPI_Alltoall(in_place(send), n, t, recv, n, t, state_->comm); });
  }

  template <class T>
  void do_ppermute(const T* send, T* recv, std::size_t count, std::span<const permute_pair> pairs) {
    maybe_verify<T>(op_kind::ppermute, count, reduce_op::sum, 0, pairs_hash(pairs));
    check_count(op_kind::ppermute, count);
    progress_sends();
    const MPI_Datatype t = detail::mpi_datatype<T>();
    const int n = static_cast<int>(count);
    const int tag = state_->tag_ub;  // meshlib's own tag: never a user's
    MPI_Request reqs[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
    bool receives = false;
    for (const auto& p : pairs) {
      if (p.dest == rank()) {
        check_rc(MPI_Irecv(recv, n, t, p.source, tag, state_->comm, &reqs[0]), "MPI_Irecv");
        receives = true;
      }
      if (p.source == rank()) check_rc(MPI_Isend(send, n, t, p.dest, tag, state_->comm, &reqs[1]), "MPI_Isend");
    }
    if (!receives && count != 0) std::fill(recv, recv + count, T{});
    poll("ppermute", [&](int* done) { return MPI_Testall(2, reqs, done, MPI_STATUSES_IGNORE); });
  }

  template <class T>
  static MPI_Op reduce_mpi_op(reduce_op op) {
    if constexpr (std::is_same_v<T, bfloat16>) return detail::bf16_mpi_op(op);
    else return detail::mpi_op<T>(op);
  }

  void finish(detail::mpi_comm_state& s) {
    check_rc(MPI_Comm_set_errhandler(s.comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    MPI_Comm_rank(s.comm, &s.rank);
    MPI_Comm_size(s.comm, &s.size);
    check_rc(MPI_Comm_dup(s.comm, &s.side), "MPI_Comm_dup");
    check_rc(MPI_Comm_set_errhandler(s.side, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
    s.peer_waits_in.assign(static_cast<std::size_t>(s.size), 0);
    s.notes_sent.assign(static_cast<std::size_t>(s.size), 0);
    s.notes_received.assign(static_cast<std::size_t>(s.size), 0);
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(s.comm, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) s.tag_ub = *ub;
  }

  /// See the destructor.
  void fail_for_unwind() const noexcept {
    fail_unless_failed("an exception left the scope of its communicator there (that rank's handler has its message)");
  }
  /// `fail(reason)` for an exception that unwinds a handle or a `fail_guard`: only the
  /// application's communicators (a hybrid world's own is failed by the world, which knows the
  /// device and the message), and never over a failure already known here (a timeout, mismatch or
  /// another rank's failure is not this rank's fault).
  void fail_unless_failed(const char* reason) const noexcept {
    if (!state_) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    const auto& s = *state_;
    if (finalized || !s.fail_on_unwind || s.failed || !s.channel || s.channel->interrupted.load(std::memory_order_acquire))
      return;
    try {
      fail(reason);
    } catch (...) {  // called from destructors, which must not throw; the peers then time out
    }
  }

  std::shared_ptr<detail::mpi_comm_state> state_;
  /// `std::uncaught_exceptions()` when this handle was made: a larger count at its destruction
  /// means that an exception is unwinding it.
  int exceptions_at_birth_ = std::uncaught_exceptions();
  /// Whether an exception that unwinds this handle fails the communicator (`set_fail_on_unwind`).
  bool fail_on_unwind_ = true;
};

static_assert(communicator<mpi_communicator>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/mpi_communicator.hpp

namespace meshlib {

namespace detail {

/// One hybrid group as seen from one process: shared by that process's members of the group.
struct hybrid_group {
  int n = 0;                            ///< members
  int threads_per_process = 1;          ///< T of the world the group was split from
  std::vector<int> member_device;       ///< device of each group rank
  std::vector<int> member_proc_pos;     ///< position (in `counts`) of each member's process
  std::vector<int> member_local;        ///< rank of each member in its process's thread group
  std::vector<int> counts;              ///< members in each hosting process, processes ascending
  std::vector<int> gathered_to_rank;    ///< group rank of each position of the gathered order
  bool identity = true;                 ///< gathered order is group-rank order
  int my_proc_pos = 0;
  std::chrono::nanoseconds timeout{};
  /// How much longer than a local step a member waits for its leader's exchange between processes
  /// (`thread_communicator::patience_`); the leaders' own MPI waits get half of it. So a device
  /// that never arrives is detected first in its own process, by the peers that wait for it
  /// locally, and their report naming it reaches every process before anyone blames a leader.
  std::chrono::nanoseconds patience{};
  mpi_communicator mpi;                 ///< over the hosting processes; used by the leader only
  std::shared_ptr<abort_channel> channel;  ///< the world's (shared by every group split from it)
  MPI_Comm p2p = MPI_COMM_NULL;         ///< meshlib's duplicate for point-to-point between processes
  int tag_ub = 32767;

  std::mutex handoff_mutex;             ///< split results, from the leader to the other members
  std::map<std::uint64_t, std::pair<std::map<int, std::shared_ptr<hybrid_group>>, int>> handoff;

  hybrid_group() = default;
  hybrid_group(const hybrid_group&) = delete;
  hybrid_group& operator=(const hybrid_group&) = delete;
  ~hybrid_group();

  /// Fills the derived fields from the member devices (in group-rank order).
  void layout(int my_process) {
    n = static_cast<int>(member_device.size());
    std::vector<int> procs;
    for (int d : member_device) procs.push_back(d / threads_per_process);
    std::vector<int> sorted = procs;
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    counts.assign(sorted.size(), 0);
    member_proc_pos.resize(static_cast<std::size_t>(n));
    member_local.resize(static_cast<std::size_t>(n));
    for (int r = 0; r < n; ++r) {
      const int pos = static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), procs[static_cast<std::size_t>(r)]) - sorted.begin());
      member_proc_pos[static_cast<std::size_t>(r)] = pos;
      member_local[static_cast<std::size_t>(r)] = counts[static_cast<std::size_t>(pos)]++;
    }
    my_proc_pos = static_cast<int>(std::lower_bound(sorted.begin(), sorted.end(), my_process) - sorted.begin());
    // Gathered order: processes ascending, members of one process in group-rank order.
    std::vector<int> order(static_cast<std::size_t>(n));
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return member_proc_pos[static_cast<std::size_t>(a)] < member_proc_pos[static_cast<std::size_t>(b)];
    });
    gathered_to_rank = order;
    identity = true;
    for (int i = 0; i < n; ++i) identity = identity && order[static_cast<std::size_t>(i)] == i;
  }
  [[nodiscard]] bool spans_processes() const noexcept { return counts.size() > 1; }
  [[nodiscard]] bool uniform() const noexcept {
    return std::all_of(counts.begin(), counts.end(), [&](int c) { return c == counts.front(); });
  }
};

inline hybrid_group::~hybrid_group() {
  int fin = 0;
  MPI_Finalized(&fin);
  // After a failure, point-to-point messages of the abandoned operations may still be in flight
  // to this process: the duplicate stays allocated so that no later communicator inherits them
  // with its context id (detail/settle.hpp).
  // A group that an exception unwinds (a device thread leaving fn, with the sub-communicators it
  // split) is dying before run_hybrid's handler records the failure in the channel, so
  // `interrupted` may still be false although the run is failing and a peer's send may still be
  // on its way: treat it as failed. Defensive (no crash was traced to it): it costs one
  // communicator left allocated on a failing run.
  const bool failed = (channel && channel->interrupted.load()) || std::uncaught_exceptions() > 0;
  if (!fin && !failed && p2p != MPI_COMM_NULL) MPI_Comm_free(&p2p);
}

}  // namespace detail

/// @brief One device's handle on a hybrid group (P processes x T threads). Move-only, as the
/// thread communicator it contains.
class hybrid_communicator : public communicator_frontend<hybrid_communicator> {
  friend class communicator_frontend<hybrid_communicator>;
  using op_kind = detail::op_kind;

 public:

  hybrid_communicator() = default;
  /// Movable: the moved-from communicator is no longer valid.
  hybrid_communicator(hybrid_communicator&&) noexcept = default;
  /// Move assignment: the moved-from communicator is no longer valid.
  hybrid_communicator& operator=(hybrid_communicator&&) noexcept = default;
  ~hybrid_communicator() { drain_sends(); }

  /// This participant's rank over all processes and threads.
  [[nodiscard]] int rank() const noexcept { return rank_; }
  /// The number of participants: processes times threads per process (0 when moved from).
  [[nodiscard]] int size() const noexcept { return group_ ? group_->n : 0; }
  /// This device's handle on the members of its group in its own process.
  [[nodiscard]] thread_communicator& local() noexcept { return local_; }
  /// Whether the group spans more than one process.
  [[nodiscard]] bool spans_processes() const noexcept { return group_ && group_->spans_processes(); }

  // The collectives, point to point and barrier: communicator_frontend; the transport is below.

  // ---- groups ----------------------------------------------------------------------------------

  /// Collective over the group: members with the same `color` form a new hybrid group, ordered by
  /// (key, rank). The processes hosting a new group that spans several get an MPI communicator
  /// split from this group's (one `MPI_Comm_split` per such color).
  hybrid_communicator split(int color, int key) {
    check_split(color);
    auto& g = *group_;
    const std::int64_t mine[3] = {color, key, g.member_device[static_cast<std::size_t>(rank_)]};
    const auto info = gather_all(std::span<const std::int64_t>(mine, 3));
    const int n = size();
    // Members of each color, in new-rank order.
    std::map<int, std::vector<int>> by_color;  // color -> old ranks
    for (int r = 0; r < n; ++r) by_color[static_cast<int>(info[static_cast<std::size_t>(3 * r)])].push_back(r);
    for (auto& [c, members] : by_color)
      std::stable_sort(members.begin(), members.end(), [&](int a, int b) {
        return info[static_cast<std::size_t>(3 * a + 1)] < info[static_cast<std::size_t>(3 * b + 1)];
      });
    const auto& mine_members = by_color[color];
    const int new_rank = static_cast<int>(std::find(mine_members.begin(), mine_members.end(), rank_) - mine_members.begin());
    thread_communicator sub_local = local_.split(color, new_rank);

    const std::uint64_t seq = split_seq_++;
    const int my_process = g.member_device[static_cast<std::size_t>(rank_)] / g.threads_per_process;
    if (local_.rank() == 0) {
      try {
        std::map<int, std::shared_ptr<detail::hybrid_group>> made;
        for (const auto& [c, members] : by_color) {
          auto ng = std::make_shared<detail::hybrid_group>();
          ng->threads_per_process = g.threads_per_process;
          ng->timeout = g.timeout;
          ng->patience = g.patience;
          ng->channel = g.channel;
          for (int r : members) ng->member_device.push_back(static_cast<int>(info[static_cast<std::size_t>(3 * r + 2)]));
          ng->layout(my_process);
          bool hosts = false;
          for (int d : ng->member_device) hosts = hosts || d / g.threads_per_process == my_process;
          if (ng->spans_processes()) {
            // Every process of this group takes part; only the hosts keep the result.
            mpi_communicator sub = g.mpi.split(hosts ? 1 : 0, my_process);
            if (hosts) {
              ng->mpi = std::move(sub);
              check_rc(MPI_Comm_dup(ng->mpi.native(), &ng->p2p), "MPI_Comm_dup");
              MPI_Comm_set_errhandler(ng->p2p, MPI_ERRORS_RETURN);
              set_tag_ub(*ng);
            }
          }
          if (hosts) made.emplace(c, std::move(ng));
        }
        std::lock_guard lk(g.handoff_mutex);
        g.handoff[seq] = {std::move(made), local_.size()};
      } catch (const std::exception& e) {
        local_.abort(std::string("hybrid split failed on the process leader: ") + e.what());
        throw;
      }
    }
    local_.barrier();  // the leader has published
    std::shared_ptr<detail::hybrid_group> ng;
    {
      std::lock_guard lk(g.handoff_mutex);
      auto it = g.handoff.find(seq);
      ng = it->second.first.at(color);
      if (--it->second.second == 0) g.handoff.erase(it);
    }
    hybrid_communicator out;
    out.group_ = std::move(ng);
    out.local_ = std::move(sub_local);
    out.rank_ = new_rank;
    return out;
  }

 private:
  friend class hybrid_world;

  struct pending {
    MPI_Request request = MPI_REQUEST_NULL;
    std::vector<unsigned char> data;
  };

  static void set_tag_ub(detail::hybrid_group& g) {
    int* ub = nullptr;
    int flag = 0;
    MPI_Comm_get_attr(g.p2p, MPI_TAG_UB, &ub, &flag);
    if (flag && ub) g.tag_ub = *ub;
  }

  int my_local() const noexcept { return group_->member_local[static_cast<std::size_t>(rank_)]; }

  int wire_tag(int tag, int src_local, int dst_local) const {
    const auto l = static_cast<std::int64_t>(*std::max_element(group_->counts.begin(), group_->counts.end()));
    const std::int64_t t = (static_cast<std::int64_t>(tag) * l + src_local) * l + dst_local;
    if (t > group_->tag_ub)
      bad_argument(op_kind::send, "tag " + std::to_string(tag) + " is too large for a hybrid group with " + std::to_string(l) +
                               " threads per process (MPI's tag bound is " + std::to_string(group_->tag_ub) + ")");
    return static_cast<int>(t);
  }

  // ---- the front end's hooks -------------------------------------------------------------------

  std::string label() const { return "hybrid device " + std::to_string(rank_); }
  void check_usable(std::string_view k) const {
    if (!group_)
      throw comm_error("meshlib: " + std::string(k) + " called on an empty hybrid_communicator handle");
  }
  void ensure_usable(op_kind k) const;

  /// Runs `f` (a transport), rethrowing a failure of the internal steps with the same type and
  /// root-cause message but naming the operation the user called and the global device.
  template <class F>
  request_type guarded(op_kind k, F&& f) {
    auto context = [&](const std::exception& e) {
      std::string m = e.what();
      if (const auto at = m.rfind(" ["); at != std::string::npos && m.back() == ']') m.erase(at);
      return m + " [seen by " + std::string(detail::op_name(k)) + " on " + label() + " of " + std::to_string(size()) + "]";
    };
    current_ = k;
    try {
      return f();
    } catch (const comm_argument_error&) {
      throw;
    } catch (const comm_aborted& e) {
      throw comm_aborted(context(e));
    } catch (const comm_timeout& e) {
      throw comm_timeout(context(comm_timeout(restate_timeout(k, e))));
    } catch (const collective_mismatch& e) {
      throw collective_mismatch(context(e));
    }
  }
  void check_rc(int rc, std::string_view call) const {
    if (rc != MPI_SUCCESS)
      throw comm_error("meshlib: " + std::string(call) + " failed on hybrid device " + std::to_string(rank_) + ": " +
                       detail::mpi_error_string(rc));
  }

  // ---- failures seen by one process, told to all ------------------------------------------------

  /// Global device of local thread `t` of this process.
  int device_of_thread(int t) const {
    const auto& g = *group_;
    return g.member_device[static_cast<std::size_t>(rank_)] / g.threads_per_process * g.threads_per_process + t;
  }

  /// Records failure `msg` of kind `k` for every device of every process: the abort channel, whose
  /// report the other processes' watchers turn into the same error, then this process's thread
  /// world (unless it failed already, as it has when it detected the failure itself).
  /// `culprit`: the global device at fault, -1 when unknown.
  void tell_everyone(detail::failure_kind k, int culprit, const std::string& msg) {
    auto& ch = *group_->channel;
    const bool remote = culprit >= 0 && culprit / group_->threads_per_process !=
                                            device_of_thread(0) / group_->threads_per_process;
    int none = -1;
    if (remote) ch.remote_device.compare_exchange_strong(none, culprit);  // run_hybrid blames it
    // The channel first (see the watcher in hybrid_world): a device released by the thread world
    // that leaves run_hybrid must find this root cause there, not record its own abort.
    ch.interrupt(msg, culprit, k);
    ch.notify(culprit, msg, k);
    local_.state_->world->fail(k, -1, msg);
  }

  /// A timeout in terms of the user's call: when this process's thread world detected it (a local
  /// peer never arrived at an internal step), the message names the operation the user called and
  /// the global devices that never arrived, never an internal step or a local thread, and every
  /// process is told; a timeout from elsewhere (another process's report, or the leader's exchange,
  /// `leader_failed`) is already in those terms.
  std::string restate_timeout(op_kind k, const comm_timeout& e) {
    detail::missing_report facts;
    if (!local_.valid() || !local_.state_->world->timeout_facts(facts)) return e.what();
    const std::string msg = detail::timeout_message(
        detail::op_name(k), "hybrid device " + std::to_string(device_of_thread(facts.waiter)), size(),
        local_.state_->policy.timeout,
        detail::list_participants("hybrid device", facts.missing,
                                  [&](int t) { return std::to_string(device_of_thread(t)); }),
        "thread_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
    tell_everyone(detail::failure_kind::timeout,
                  device_of_thread(facts.missing.empty() ? facts.waiter : facts.missing.front()), msg);
    return msg;
  }

  /// The leader's exchange between processes failed with `e` (rethrown by the caller). Its own
  /// timeout means whole processes never reached the exchange (their devices were not even
  /// missing locally, or their report would have come first): named by their devices, with the
  /// operation the user called, and told to every process. Any other failure aborts this
  /// process's thread world, so that the members waiting for the leader are released.
  void leader_failed(const std::exception& e) {
    auto& g = *group_;
    if (g.channel->interrupted.load()) {
      // Released by the root cause the channel holds (from another process, or from a device
      // here): the members waiting for this leader get the same error.
      std::string msg;
      const auto kind = g.channel->recorded(msg);
      local_.state_->world->fail(kind, -1, msg);
      return;
    }
    if (dynamic_cast<const comm_timeout*>(&e) == nullptr) {
      local_.abort(std::string("the process leader's MPI exchange failed: ") + e.what());
      return;
    }
    std::vector<int> devices;
    for (int pos : g.mpi.state_->missing)
      for (int r = 0; r < g.n; ++r)
        if (g.member_proc_pos[static_cast<std::size_t>(r)] == pos) devices.push_back(g.member_device[static_cast<std::size_t>(r)]);
    std::sort(devices.begin(), devices.end());
    const std::string who = detail::list_participants("hybrid device", devices, [](int d) { return std::to_string(d); });
    const std::string msg = detail::timeout_message(
        detail::op_name(current_), "hybrid device " + std::to_string(g.member_device[static_cast<std::size_t>(rank_)]),
        size(), g.mpi.state_->options.timeout, who.empty() ? who : who + " (whole processes)",
        "thread_comm_options::timeout, mpi_comm_options::timeout or MESHLIB_COMM_TIMEOUT");
    tell_everyone(detail::failure_kind::timeout, devices.empty() ? -1 : devices.front(), msg);
    throw comm_timeout(msg);
  }

  /// While a member waits for its leader's exchange between processes (see `hybrid_group::patience`).
  struct patient {
    thread_communicator& c;
    patient(thread_communicator& comm, std::chrono::nanoseconds extra) : c(comm) { c.patience_ = extra; }
    patient(const patient&) = delete;
    patient& operator=(const patient&) = delete;
    ~patient() { c.patience_ = std::chrono::nanoseconds(0); }
  };

  /// The transport of operation K (the front end has checked its arguments). Every collective
  /// gathers its inputs before it writes an output, so in-place calls need no copies.
  template <op_kind K, class T>
  request_type transport(const detail::operation<T>& o, context_type ctx) {
    return guarded(K, [&] {
      if constexpr (K != op_kind::send && K != op_kind::recv) {
        agree(K, o);
        if constexpr (K == op_kind::barrier) return request_type{};  // the fingerprint exchange is a barrier
      }
      return transport_steps<K, T>(o, ctx);
    });
  }

  /// Always-on mismatch detection across every device of every process. Before the data moves,
  /// the members gather a fingerprint of their calls (call number on this group, operation,
  /// element type, count, reduce op, root, ppermute pairs) with the same internal exchange every
  /// call shares, so that all members see every call and every member of every process throws
  /// `collective_mismatch` naming the operation it called and each device's call (global device
  /// ids), instead of an internal step failing on one process leader.
  template <class T>
  void agree(op_kind k, const detail::operation<T>& o) {
    const bool has_op = detail::uses_op(k);
    const bool has_root = detail::uses_root(k);
    const std::uint64_t rec[call_fields] = {calls_++,
                                            static_cast<std::uint64_t>(k),
                                            k == op_kind::barrier ? 0 : static_cast<std::uint64_t>(datatype_of<T>) + 1,
                                            static_cast<std::uint64_t>(o.count),
                                            has_op ? static_cast<std::uint64_t>(o.op) : 0,
                                            has_root ? static_cast<std::uint64_t>(o.root) : 0,
                                            k == op_kind::ppermute ? detail::pairs_hash(o.pairs) : 0};
    // int64 on the wire (a communicator element type); the bits are the record's.
    std::int64_t wire[call_fields];
    std::memcpy(wire, rec, sizeof(rec));
    const auto got = gather_all(std::span<const std::int64_t>(wire, call_fields));
    std::vector<std::uint64_t> all(got.size());
    std::memcpy(all.data(), got.data(), got.size() * sizeof(std::uint64_t));
    bool same = true;
    for (std::size_t i = 0; i < all.size(); ++i) same = same && all[i] == rec[i % call_fields];
    if (same) return;
    const auto& g = *group_;
    // Blame the device whose call differed (see `odd_member`), computed from every member's call
    // as every member has them: every process blames the same device, whichever saw it first.
    if (g.channel) g.channel->blame_mismatch(g.member_device[odd_member(all, static_cast<std::size_t>(size()))]);
    std::string msg = "meshlib: collective mismatch on a hybrid communicator of " + std::to_string(size()) +
                      " devices: the devices called different collectives";
    for (int r = 0; r < size(); ++r)
      msg += (r ? "; " : ": ") +
             detail::describe_record("hybrid device " + std::to_string(g.member_device[static_cast<std::size_t>(r)]),
                                   all.data() + call_fields * static_cast<std::size_t>(r));
    throw collective_mismatch(msg);
  }
  static constexpr std::size_t call_fields = 7;

  /// The member whose call differs from the most common call among `n` members' records (`all`,
  /// `call_fields` words each; ties between equally common calls go to the one of the lowest
  /// member), the lowest such member when several differ. With two members that disagree, member
  /// 1. A pure function of the records, so every member computes the same.
  static std::size_t odd_member(const std::vector<std::uint64_t>& all, std::size_t n) {
    auto same = [&](std::size_t a, std::size_t b) {
      return std::equal(all.begin() + static_cast<std::ptrdiff_t>(a * call_fields),
                        all.begin() + static_cast<std::ptrdiff_t>((a + 1) * call_fields),
                        all.begin() + static_cast<std::ptrdiff_t>(b * call_fields));
    };
    std::size_t common = 0, most = 0;
    for (std::size_t a = 0; a < n; ++a) {
      std::size_t count = 0;
      for (std::size_t b = 0; b < n; ++b) count += same(a, b) ? 1 : 0;
      if (count > most) {
        most = count;
        common = a;
      }
    }
    for (std::size_t a = 0; a < n; ++a)
      if (!same(a, common)) return a;
    return 0;
  }

  template <op_kind K, class T>
  request_type transport_steps(const detail::operation<T>& o, context_type) {
    const auto n = static_cast<std::size_t>(size());
    if constexpr (K == op_kind::all_reduce) {
      reduce_to(std::span<const T>(o.send, o.count), o.recv, o.op, o.count, 0);
    } else if constexpr (K == op_kind::reduce) {
      reduce_to(std::span<const T>(o.send, o.count), rank_ == o.root ? o.recv : nullptr, o.op, o.count, 0);
    } else if constexpr (K == op_kind::reduce_scatter) {
      reduce_to(std::span<const T>(o.send, o.count * n), o.recv, o.op, o.count,
                static_cast<std::size_t>(rank_) * o.count);
    } else if constexpr (K == op_kind::broadcast) {
      if (rank_ == o.root && !o.in_place && o.count != 0) std::memcpy(o.recv, o.send, o.count * sizeof(T));
      do_broadcast(std::span<T>(o.recv, o.count), o.root);
    } else if constexpr (K == op_kind::all_gather) {
      const auto all = gather_all(std::span<const T>(o.send, o.count));
      std::copy(all.begin(), all.end(), o.recv);
    } else if constexpr (K == op_kind::all_to_all) {
      transpose(std::span<const T>(o.send, o.count * n), o.recv, o.count);
    } else if constexpr (K == op_kind::all_to_all_v) {
      do_all_to_all_v<T>(o);
    } else if constexpr (K == op_kind::ppermute) {
      permute(std::span<const T>(o.send, o.count), o.recv, o.pairs);
    } else if constexpr (K == op_kind::send) {
      return do_send<T>(o);
    } else if constexpr (K == op_kind::recv) {
      return do_recv<T>(o);
    } else {
      static_assert(K == op_kind::barrier);
      const std::int32_t token = 0;
      (void)gather_all(std::span<const std::int32_t>(&token, 1));
    }
    return {};
  }

  template <class T>
  void do_all_to_all_v(const detail::operation<T>& o) {
    const auto n = static_cast<std::size_t>(size());
    const std::int64_t* sc = o.v[0];
    const std::int64_t* sd = o.v[1];
    const std::int64_t* rcounts = o.v[2];
    const std::int64_t* rd = o.v[3];
    std::size_t send_len = 0;  // the send buffer as far as the blocks reach
    for (std::size_t j = 0; j < n; ++j) send_len = std::max(send_len, static_cast<std::size_t>(sc[j] + sd[j]));
    // Every member's send counts, send displacements and receive counts, then every member's send
    // blocks. With every member's counts, every device checks every (sender, receiver) pair in the
    // same order and names the same first disagreement: the devices whose own counts agree fail
    // too, instead of returning as if the call had worked (as on the thread and MPI backends).
    std::vector<std::int64_t> meta(3 * n);
    std::copy(sc, sc + n, meta.begin());
    std::copy(sd, sd + n, meta.begin() + static_cast<std::ptrdiff_t>(n));
    std::copy(rcounts, rcounts + n, meta.begin() + static_cast<std::ptrdiff_t>(2 * n));
    const auto metas = gather_all(std::span<const std::int64_t>(meta));
    if (const auto bad = detail::first_counts_disagreement(
            n, [&](std::size_t i, std::size_t j) { return metas[i * 3 * n + j]; },
            [&](std::size_t j, std::size_t i) { return metas[j * 3 * n + 2 * n + i]; })) {
      // Blamed on the receiver, whose expected count is the one that disagrees with what was sent
      // (every member names the same pair, so every process blames the same device).
      if (group_->channel) group_->channel->blame_mismatch(group_->member_device[bad->receiver]);
      throw collective_mismatch(
          "meshlib: collective mismatch in all_to_all_v on a hybrid communicator of " + std::to_string(size()) +
          " devices: the counts disagree: " +
          detail::describe_counts_disagreement("hybrid device " + std::to_string(group_->member_device[bad->sender]),
                                               "hybrid device " + std::to_string(group_->member_device[bad->receiver]),
                                               bad->sent, bad->expected));
    }
    std::vector<std::size_t> offsets;
    const auto data = gather_var(std::span<const T>(o.send, send_len), offsets);
    for (std::size_t j = 0; j < n; ++j) {
      const std::int64_t c = metas[j * 3 * n + static_cast<std::size_t>(rank_)];
      const std::int64_t d = metas[j * 3 * n + n + static_cast<std::size_t>(rank_)];
      std::copy_n(data.begin() + static_cast<std::ptrdiff_t>(offsets[j] + static_cast<std::size_t>(d)), c,
                  o.recv + rd[j]);
    }
  }

  /// Buffered, as on the other backends: within a process through the thread communicator,
  /// between processes with `MPI_Isend` from this thread.
  template <class T>
  request_type do_send(const detail::operation<T>& o) {
    const auto& g = *group_;
    const auto d = static_cast<std::size_t>(o.peer);
    if (g.member_proc_pos[d] == g.my_proc_pos)
      return local_.send(std::span<const T>(o.send, o.count), g.member_local[d], o.tag);
    progress_sends();
    pending p;
    p.data.resize(o.count * sizeof(T));
    if (o.count != 0) std::memcpy(p.data.data(), o.send, o.count * sizeof(T));
    check_rc(MPI_Isend(p.data.data(), static_cast<int>(o.count), detail::mpi_datatype<T>(), g.member_proc_pos[d],
                       wire_tag(o.tag, my_local(), g.member_local[d]), g.p2p, &p.request),
             "MPI_Isend");
    sends_.push_back(std::move(p));
    return {};
  }

  template <class T>
  request_type do_recv(const detail::operation<T>& o) {
    const auto& g = *group_;
    const int source = o.peer;
    const int tag = o.tag;
    const auto s = static_cast<std::size_t>(source);
    if (g.member_proc_pos[s] == g.my_proc_pos)
      return local_.recv(std::span<T>(o.recv, o.count), g.member_local[s], tag);
    MPI_Status st;
    MPI_Message msg = MPI_MESSAGE_NULL;
    const int wtag = wire_tag(tag, g.member_local[s], my_local());
    const auto deadline = std::chrono::steady_clock::now() + g.timeout;
    for (unsigned spins = 0;; ++spins) {
      progress_sends();
      int found = 0;
      check_rc(MPI_Improbe(g.member_proc_pos[s], wtag, g.p2p, &found, &msg, &st), "MPI_Improbe");
      if (found) break;
      if (spins > 256) std::this_thread::yield();
      if (g.timeout.count() > 0 && (spins & 63) == 0 && std::chrono::steady_clock::now() > deadline)
        throw comm_timeout("meshlib: recv on hybrid device " + std::to_string(rank_) + " from device " +
                           std::to_string(source) + " (tag " + std::to_string(tag) + ") timed out");
    }
    int got = 0;
    MPI_Get_count(&st, detail::mpi_datatype<T>(), &got);
    if (got != static_cast<int>(o.count)) {
      int bytes = 0;
      MPI_Get_count(&st, MPI_BYTE, &bytes);
      std::vector<unsigned char> sink(static_cast<std::size_t>(bytes > 0 ? bytes : 0));
      MPI_Mrecv(sink.data(), bytes, MPI_BYTE, &msg, MPI_STATUS_IGNORE);
      throw collective_mismatch("meshlib: recv on hybrid device " + std::to_string(rank_) + " expected " +
                                std::to_string(o.count) + " elements from device " + std::to_string(source) +
                                " but the message holds " + std::to_string(got));
    }
    check_rc(MPI_Mrecv(o.recv, got, detail::mpi_datatype<T>(), &msg, MPI_STATUS_IGNORE), "MPI_Mrecv");
    return {};
  }

  // ---- the three-step exchange -----------------------------------------------------------------

  /// Every member's `mine` (all the same length), in group-rank order.
  template <class T>
  std::vector<T> gather_all(std::span<const T> mine) {
    check_usable("collective");
    auto& g = *group_;
    const std::size_t c = mine.size();
    std::vector<T> local_all(static_cast<std::size_t>(local_.size()) * c);
    local_.all_gather(mine, std::span(local_all));
    if (!g.spans_processes()) return reorder(std::move(local_all), c);
    std::vector<T> all(static_cast<std::size_t>(g.n) * c);
    if (local_.rank() == 0) {
      try {
        if (g.uniform()) {
          g.mpi.all_gather(std::span<const T>(local_all), std::span(all));
        } else {
          const std::size_t np = g.counts.size();
          std::vector<std::int64_t> sc(np, static_cast<std::int64_t>(local_all.size())), sd(np, 0), rc(np), rd(np);
          std::int64_t off = 0;
          for (std::size_t j = 0; j < np; ++j) {
            rc[j] = static_cast<std::int64_t>(static_cast<std::size_t>(g.counts[j]) * c);
            rd[j] = off;
            off += rc[j];
          }
          g.mpi.all_to_all_v(std::span<const T>(local_all), std::span<const std::int64_t>(sc),
                             std::span<const std::int64_t>(sd), std::span(all), std::span<const std::int64_t>(rc),
                             std::span<const std::int64_t>(rd));
        }
      } catch (const std::exception& e) {
        leader_failed(e);
        throw;
      }
    }
    {
      patient wait_for_leader(local_, g.patience);
      local_.broadcast(std::span(all), 0);
    }
    return reorder(std::move(all), c);
  }

  /// Every member's `mine` (lengths may differ), concatenated in group-rank order; offsets[r] is
  /// where member r's part starts.
  template <class T>
  std::vector<T> gather_var(std::span<const T> mine, std::vector<std::size_t>& offsets) {
    const std::int64_t len = static_cast<std::int64_t>(mine.size());
    const auto lens = gather_all(std::span<const std::int64_t>(&len, 1));
    const auto longest = static_cast<std::size_t>(*std::max_element(lens.begin(), lens.end()));
    std::vector<T> padded(longest);
    std::copy(mine.begin(), mine.end(), padded.begin());
    const auto all = gather_all(std::span<const T>(padded));
    std::vector<T> out;
    offsets.assign(lens.size(), 0);
    for (std::size_t r = 0; r < lens.size(); ++r) {
      offsets[r] = out.size();
      out.insert(out.end(), all.begin() + static_cast<std::ptrdiff_t>(r * longest),
                 all.begin() + static_cast<std::ptrdiff_t>(r * longest + static_cast<std::size_t>(lens[r])));
    }
    return out;
  }

  template <class T>
  std::vector<T> reorder(std::vector<T> gathered, std::size_t c) const {
    const auto& g = *group_;
    if (g.identity) return gathered;
    std::vector<T> out(gathered.size());
    for (std::size_t pos = 0; pos < g.gathered_to_rank.size(); ++pos)
      std::copy_n(gathered.begin() + static_cast<std::ptrdiff_t>(pos * c), c,
                  out.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(g.gathered_to_rank[pos]) * c));
    return out;
  }

  /// out[i] = op over members of their input[offset + i], i < count (out == nullptr: nothing written).
  template <class T>
  void reduce_to(std::span<const T> input, T* out, reduce_op op, std::size_t count, std::size_t offset) {
    check_usable("reduce");
    const auto all = gather_all(input);
    if (!out || count == 0) return;
    const std::size_t per = input.size();
    std::vector<const T*> ptrs(static_cast<std::size_t>(size()));
    for (std::size_t r = 0; r < ptrs.size(); ++r) ptrs[r] = all.data() + r * per + offset;
    T* outs[1] = {out};
    detail::reduce_into<T>(op, ptrs.data(), size(), outs, 1, count);
  }

  template <class T>
  void transpose(std::span<const T> send, T* recv, std::size_t count) {
    const auto all = gather_all(send);
    const std::size_t per = send.size();
    for (std::size_t j = 0; j < static_cast<std::size_t>(size()); ++j)
      std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(j * per + static_cast<std::size_t>(rank_) * count), count,
                  recv + j * count);
  }

  template <class T>
  void permute(std::span<const T> send, T* recv, std::span<const permute_pair> pairs) {
    const auto all = gather_all(send);
    const std::size_t c = send.size();
    std::fill(recv, recv + c, T{});
    for (const auto& p : pairs)
      if (p.dest == rank_)
        std::copy_n(all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(p.source) * c), c, recv);
  }

  template <class T>
  void do_broadcast(std::span<T> buf, int root) {
    auto& g = *group_;
    const auto r = static_cast<std::size_t>(root);
    const int root_pos = g.member_proc_pos[r];
    if (!g.spans_processes()) {
      local_.broadcast(buf, g.member_local[r]);
      return;
    }
    if (g.my_proc_pos == root_pos) local_.broadcast(buf, g.member_local[r]);
    if (local_.rank() == 0) {
      try {
        g.mpi.broadcast(buf, root_pos);
      } catch (const std::exception& e) {
        leader_failed(e);
        throw;
      }
    }
    if (g.my_proc_pos != root_pos) {
      patient wait_for_leader(local_, g.patience);
      local_.broadcast(buf, 0);
    }
  }

  void progress_sends() {
    sends_.erase(std::remove_if(sends_.begin(), sends_.end(),
                                [](pending& p) {
                                  int done = 0;
                                  MPI_Test(&p.request, &done, MPI_STATUS_IGNORE);
                                  return done != 0;
                                }),
                 sends_.end());
  }
  void drain_sends() noexcept {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin) return;
    for (auto& p : sends_) {
      if (p.request == MPI_REQUEST_NULL) continue;
      MPI_Request_free(&p.request);
      (void)new std::vector<unsigned char>(std::move(p.data));  // MPI may still read it
    }
    sends_.clear();
  }

  std::shared_ptr<detail::hybrid_group> group_;
  thread_communicator local_;
  int rank_ = 0;
  std::uint64_t split_seq_ = 0;
  std::uint64_t calls_ = 0;  ///< collectives called on this handle's group (the fingerprint's sequence number)
  op_kind current_ = op_kind::barrier;  ///< the operation the user called last (named by a leader's timeout)
  std::vector<pending> sends_;
};

/// Refuses calls on an empty handle, and every call once the world has failed (here or in another
/// process), with the root cause's message.
inline void hybrid_communicator::ensure_usable(op_kind k) const {
  check_usable(detail::op_name(k));
  if (group_->channel && group_->channel->interrupted.load(std::memory_order_acquire))
    group_->channel->rethrow(" [refused " + std::string(detail::op_name(k)) + " on " + label() + " of " +
                             std::to_string(size()) + ": the communicator has failed]");
}

static_assert(communicator<hybrid_communicator>);

}  // namespace meshlib

// The world and run_hybrid, which every user of the communicator needs (after the class: they use it).
// begin meshlib/comm/mpi/hybrid_world.hpp
/// @file
/// @brief `hybrid_world`, one process's part of a hybrid group (its thread world, the leaders'
/// MPI communicator, the duplicate for point-to-point, and the abort channel with its watcher
/// thread), and `run_hybrid`, which runs the devices of this process on it. Apart from
/// `hybrid_communicator` because the world's wiring (what each process owns, how a failure
/// travels between processes) is a subject of its own; the communicator is the device's handle.
/// `<meshlib/comm/mpi/hybrid_communicator.hpp>` includes this header, so either gives both.

#if MESHLIB_ENABLE_MPI

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>


namespace meshlib {

/// @brief One process's part of a hybrid group of `procs.size()` processes x `threads` threads.
/// Construction is collective over `procs` (it duplicates it for point-to-point traffic).
class hybrid_world {
 public:
  /// @throws comm_error when T > 1 and MPI does not provide `MPI_THREAD_MULTIPLE`;
  /// comm_argument_error when threads < 1.
  hybrid_world(const mpi_communicator& procs, int threads, thread_comm_options options = {})
      : threads_(threads), local_(threads > 0 ? threads : 1, options) {
    if (threads < 1)
      throw comm_argument_error("meshlib: a hybrid_world needs at least 1 thread per process, got " +
                                std::to_string(threads));
    int level = 0;
    MPI_Query_thread(&level);
    if (threads > 1 && level < MPI_THREAD_MULTIPLE)
      throw comm_error("meshlib: a hybrid mesh with " + std::to_string(threads) +
                       " threads per process needs MPI_THREAD_MULTIPLE, but MPI was initialised with a lower thread "
                       "level; initialise it with MPI_Init_thread(..., MPI_THREAD_MULTIPLE, ...) or meshlib::mpi::initialize");
    group_ = std::make_shared<detail::hybrid_group>();
    group_->threads_per_process = threads;
    group_->timeout = procs.options().timeout;
    // The leaders' exchange waits longer than a local step, and the members waiting for it longer
    // still (hybrid_group::patience): a device that never arrives is named by its own process.
    const auto local_timeout = options.timeout;
    const auto grace = local_timeout.count() > 0
                           ? std::min<std::chrono::nanoseconds>(local_timeout / 2, std::chrono::seconds(2))
                           : std::chrono::nanoseconds(0);
    group_->patience = 2 * grace;
    mpi_comm_options leaders = procs.options();
    if (leaders.timeout.count() > 0) leaders.timeout = std::max(leaders.timeout, local_timeout) + grace;
    for (int d = 0; d < procs.size() * threads; ++d) group_->member_device.push_back(d);
    group_->layout(procs.rank());
    // meshlib's own duplicate (collective), so that the interrupt hook is never the application's.
    group_->mpi = mpi_communicator(procs.native(), leaders, false);  // open_channel installs the world's
    if (MPI_Comm_dup(procs.native(), &group_->p2p) != MPI_SUCCESS)
      throw comm_error("meshlib: hybrid_world: MPI_Comm_dup failed");
    MPI_Comm_set_errhandler(group_->p2p, MPI_ERRORS_RETURN);
    hybrid_communicator::set_tag_ub(*group_);
    process_ = procs.rank();
    group_->channel = channel_;
    open_channel(procs, level);
  }
  hybrid_world(const hybrid_world&) = delete;
  hybrid_world& operator=(const hybrid_world&) = delete;
  ~hybrid_world() { channel_->close(std::chrono::milliseconds(1000)); }

  /// Devices in the world: processes x threads.
  [[nodiscard]] int size() const noexcept { return group_->n; }
  /// How many threads (devices) each process runs.
  [[nodiscard]] int threads_per_process() const noexcept { return threads_; }

  /// The handle of local thread `t` (device `process * T + t`); each once.
  [[nodiscard]] hybrid_communicator communicator(int t) {
    hybrid_communicator c;
    c.local_ = local_.communicator(t);
    c.group_ = group_;
    c.rank_ = process_ * threads_ + t;
    return c;
  }

  /// @brief Fails the hybrid world with local thread `t` (global device `process * T + t`) as the
  /// root cause: this process's devices get `comm_aborted` at once, and so (through the abort
  /// channel) do the devices of every other process, all naming "hybrid device D of N".
  bool abort(int t, std::string_view reason) {
    const int device = process_ * threads_ + t;
    const std::string who = "hybrid device " + std::to_string(device) + " of " + std::to_string(size());
    const bool first = local_.abort(t, reason, who);
    channel_->interrupt("meshlib: communicator aborted: " + who + " failed: " + std::string(reason), device);
    // A failure that came from another process is not sent back; any other (a throw, or a local
    // timeout or mismatch that the devices rethrow) is told to every process.
    if (channel_->remote_device.load() < 0) {
      const int root = local_.root_cause_rank();
      const int blamed = first || root < 0 ? device : process_ * threads_ + root;
      channel_->notify(blamed, std::string(reason));
    }
    return first;
  }
  /// @brief Local thread `t` left with `collective_mismatch` (`message`): fails the hybrid world as
  /// that mismatch, so that every device of every process that still waits (for the verdict of
  /// that collective, or in any other) gets `collective_mismatch` with the same message, never
  /// `comm_aborted`. Every member of the mismatched collective detects it on its own; this only
  /// keeps the error's type when another device's failure would otherwise overtake it.
  bool fail_mismatch(int t, std::string_view message) {
    const bool first = local_.fail_as_mismatch(message);
    channel_->interrupt(std::string(message), -1, detail::failure_kind::mismatch);
    // The report names the device whose call differed (every member of the mismatched collective
    // computed it), so that processes that were not members blame it too; else this device.
    const int culprit = channel_->mismatch_culprit.load();
    if (channel_->remote_device.load() < 0)
      channel_->notify(culprit >= 0 ? culprit : process_ * threads_ + t, std::string(message),
                       detail::failure_kind::mismatch);
    return first;
  }
  /// Global device whose call differed in a collective mismatch of this world (the same on every
  /// process), -1 when there was none or it is not known.
  [[nodiscard]] int mismatch_culprit() const noexcept { return channel_->mismatch_culprit.load(); }
  /// True once a participant of this process failed; the others then stop waiting.
  [[nodiscard]] bool failed() const noexcept { return local_.failed(); }
  /// Local thread of the root cause of a failure, -1 when none (or when it was another process's).
  [[nodiscard]] int root_cause_thread() const { return local_.root_cause_rank(); }
  /// Global device of a failure that another process reported through the abort channel, -1 if none.
  [[nodiscard]] int remote_root_cause_device() const noexcept { return channel_->remote_device.load(); }

 private:
  void open_channel(const mpi_communicator& procs, int level) {
    auto& ch = *channel_;
    auto* channel = channel_.get();
    group_->mpi.state_->check_interrupt = [channel] { channel->check(); };
    // Also tells the leaders' communicator, when it is freed, that the world failed (its abandoned
    // collectives must keep it allocated); splits of it inherit both.
    group_->mpi.state_->channel = channel_;
    // The watcher calls MPI beside the devices: only with MPI_THREAD_MULTIPLE.
    ch.open(procs.native(), level >= MPI_THREAD_MULTIPLE);
    if (!ch.enabled) return;
    const int devices = size();
    // On a parked thread: starting one per call cost a fifth of an empty call (watcher_threads.hpp).
    ch.watcher = detail::watcher_threads::get().run([this, channel, devices] {
      while (!channel->stop.load()) {
        int device = -1;
        std::string what;
        detail::failure_kind kind{};
        if (channel->poll(device, what, kind)) {
          // The channel first, then the thread world: a device that the thread world releases
          // and that leaves run_hybrid reports its error to the channel, which must already hold
          // the root cause (a leader released by the channel records the same in the thread world).
          if (kind != detail::failure_kind::aborted) {
            // A timeout or mismatch another process saw: the same error and message here, not an
            // abort (the message already names global devices and the user's operation).
            channel->interrupt(what, device, kind);
            if (kind == detail::failure_kind::mismatch) channel->blame_mismatch(device);  // fail_mismatch names it
            local_.fail_as(kind, what);
            return;
          }
          const std::string who = "hybrid device " + std::to_string(device) + " of " + std::to_string(devices);
          channel->interrupt("meshlib: communicator aborted: " + who + " failed: " + what, device);
          local_.abort(-1, what, who);
          return;
        }
        channel->nap(std::chrono::milliseconds(1));
      }
    });
  }

  int threads_;
  int process_ = 0;
  thread_world local_;
  std::shared_ptr<detail::hybrid_group> group_;
  std::shared_ptr<detail::abort_channel> channel_ = std::make_shared<detail::abort_channel>();
};

namespace detail {
/// How `run_hybrid` runs its threads by default: `threads - 1` started for the call (thread 0 is
/// the caller's), joined before it returns. A launcher `launch(threads, body)` must call
/// `body(t)` for every `t` in `[0, threads)` at once and return when all have returned; `body`
/// does not throw. The persistent runners pass their device threads instead (exec/mpi_runner.hpp).
struct start_hybrid_threads {
  template <class Body>
  void operator()(int threads, Body& body) const {
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back(body, t);
    body(0);
    for (auto& th : pool) th.join();
  }
};
}  // namespace detail

/// @brief Runs `fn(hybrid_communicator&)` on `threads` threads of this process, as device
/// `process * threads + t` of a hybrid world over `procs`; joins them and rethrows the first
/// failure as `participant_error` (with the device; for a collective mismatch, the device whose
/// call differed, the same on every process). Collective over `procs`. `launch` runs the
/// threads (default: started for this call; see `detail::start_hybrid_threads`).
template <class F, class Launch = detail::start_hybrid_threads>
  requires std::is_invocable_v<F&, hybrid_communicator&>
void run_hybrid(const mpi_communicator& procs, int threads, F&& fn, thread_comm_options options = {},
                Launch launch = {}) {
  hybrid_world world(procs, threads, std::move(options));
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(threads));
  auto body = [&](int t) {
    try {
      hybrid_communicator comm = world.communicator(t);
      fn(comm);
    } catch (const collective_mismatch& e) {
      errors[static_cast<std::size_t>(t)] = std::current_exception();
      world.fail_mismatch(t, e.what());
    } catch (...) {
      errors[static_cast<std::size_t>(t)] = std::current_exception();
      world.abort(t, detail::what_of(errors[static_cast<std::size_t>(t)]));
    }
  };
  launch(threads, body);
  // The rule every runner shares (detail::find_root_cause); a mismatch is blamed on the device
  // whose call differed, which every process computed from every member's call (or learnt from the
  // report), and a failure another process reported on its device.
  detail::rethrow_root_cause({.errors = errors,
                              .first = procs.rank() * threads,
                              .size = world.size(),
                              .local_root = world.root_cause_thread(),
                              .remote_root = world.remote_root_cause_device(),
                              .mismatch_culprit = world.mismatch_culprit(),
                              .noun = "hybrid device"});
}

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/hybrid_world.hpp

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/hybrid_communicator.hpp

namespace meshlib {

/// @brief One device per MPI rank of `comm`: `run(n, body)` runs `body` once, as this rank's
/// device; a mesh of n devices needs a communicator of n ranks. It has no threads to keep: the
/// device is the process.
///
/// Faults: a device that throws makes `run` throw `participant_error` on its own process (with
/// its device id). `mpi_runner` also fails its communicator with that rank as the root cause
/// (`mpi_communicator::fail`): the ranks that wait for it in a collective or a receive are released
/// within milliseconds, and their `run` throws `participant_error` naming the failed rank (not
/// themselves) with its message. The communicator then refuses every later call on every rank
/// (an abandoned collective may still be pending on it): continue with a new one. When the
/// exception is not caught the whole run ends through `MPI_Abort` (the terminate handler of
/// `mpi::initialize`).
/// @code
/// meshlib::mpi::guard run;
/// meshlib::mesh<meshlib::axis<"data">> m{meshlib::mpi::world().size()};
/// auto sums = meshlib::spmd(m, [] { ... meshlib::psum<"data">(x) ... }, meshlib::mpi_runner{meshlib::mpi::world()});
/// @endcode
struct mpi_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator whose ranks are the devices (one device per rank).
  mpi_communicator comm;

  /// @brief Runs `body(device, communicator)` once, as this rank's device; `n` must equal the number of ranks.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    check(n);
    // The body's handles leave the report of its exception to the catch below, which sends the
    // exception's own message (an unwound handle could only say that an exception left its scope).
    mpi_communicator device = comm;
    device.set_fail_on_unwind(false);
    try {
      body(static_cast<std::size_t>(comm.rank()), std::as_const(device));
    } catch (...) {
      const auto e = std::current_exception();
      int remote = -1;
      try {
        std::rethrow_exception(e);
      } catch (const comm_aborted&) {
        // Released by another rank's failure: that rank is the root cause.
        remote = comm.root_cause_rank();
      } catch (const comm_timeout&) {
        // Every waiting rank times out on its own; the message names the ranks that never arrived.
      } catch (const collective_mismatch&) {
        // Every rank of the collective throws it.
      } catch (...) {
        comm.fail(detail::what_of(e));  // the rank's own failure: release its peers at once
      }
      detail::rethrow_root_cause({.errors = std::span(&e, 1),
                                  .first = comm.rank(),
                                  .size = comm.size(),
                                  .remote_root = remote,
                                  .noun = "MPI rank"});
      throw;  // not reached: a non-null exception always has a root cause
    }
  }

  /// The device this process runs: its own rank.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    check(n);
    return {static_cast<std::size_t>(comm.rank())};
  }

 private:
  void check(std::size_t n) const {
    if (n != static_cast<std::size_t>(comm.size()))
      throw comm_argument_error("meshlib: mpi_runner runs one device per MPI rank, but the mesh has " +
                                std::to_string(n) + " devices and the communicator " + std::to_string(comm.size()) +
                                " ranks; use a mesh of " + std::to_string(comm.size()) +
                                " devices, or hybrid_runner for several devices (threads) per rank");
  }
};

/// @brief Deprecated name of `mpi_runner`; removed in the next release.
using mpi_backend [[deprecated("use meshlib::mpi_runner")]] = mpi_runner;

namespace detail {
/// The process-wide device threads of hybrid meshes (not pinned: see the file comment). Apart
/// from the process-wide threads of `thread_runner`, so that a hybrid mesh's devices never wait
/// for, or pin, the threads that global-view operations use.
inline device_workers& hybrid_device_workers() {
  static device_workers w(false);
  return w;
}

/// Runs a hybrid world's threads on `pool` (the launcher of `run_hybrid`); a call the pool cannot
/// take (nested in a device, or while another thread's call holds it) starts threads of its own.
struct pool_launch {
  device_workers* pool;
  template <class Body>
  void operator()(int threads, Body& body) const {
    auto task = [&body](std::size_t t) { body(static_cast<int>(t)); };
    if (!pool->try_run(static_cast<std::size_t>(threads), task)) start_hybrid_threads{}(threads, body);
  }
};
}  // namespace detail

/// @brief `threads` devices (threads) per MPI rank of `comm`: device `rank * threads + t`, run by
/// device threads of its own (they start on the first call, threads - 1 of them; the calling
/// thread runs local thread 0, and they are joined when the last copy of the runner is destroyed),
/// or, made with `detail::process_wide_threads` (the default runner's), by the process-wide hybrid
/// device threads. Each call is collective over `comm` and builds a new hybrid world (see the file
/// comment): a failure fails that call on every process, not the next one.
struct hybrid_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;
  /// The MPI communicator over the processes.
  mpi_communicator comm;
  /// Threads (devices) per process; the mesh has ranks times threads devices.
  int threads = 1;
  /// Options of each process's thread world.
  thread_comm_options options{};
  /// The device threads, shared by every copy of this runner; null: the process-wide ones.
  std::shared_ptr<detail::device_workers> workers{};

  /// `threads` devices per rank of `comm`, on device threads of its own; each call's thread world
  /// gets `options`.
  hybrid_runner(mpi_communicator comm, int threads, thread_comm_options options = {})
      : comm(std::move(comm)),
        threads(threads),
        options(std::move(options)),
        workers(std::make_shared<detail::device_workers>(false)) {
    this->comm.set_fail_on_unwind(false);  // a failure of a call fails that call's hybrid world, not comm
  }
  /// The same on the process-wide hybrid device threads.
  hybrid_runner(detail::process_wide_threads_t, mpi_communicator comm, int threads, thread_comm_options options = {})
      : comm(std::move(comm)), threads(threads), options(std::move(options)) {
    this->comm.set_fail_on_unwind(false);
  }

  /// @brief Runs `body(device, communicator)` on this process's threads, one per local device.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
    check(n);
    run_hybrid(
        comm, threads,
        [&](hybrid_communicator& c) {
          const auto device = static_cast<std::size_t>(c.rank());
          body(device, std::move(c));
        },
        options, detail::pool_launch{workers ? workers.get() : &detail::hybrid_device_workers()});
  }

  /// The devices this process runs: `rank * threads` up to `(rank + 1) * threads - 1`.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
    check(n);
    std::vector<std::size_t> d;
    for (int t = 0; t < threads; ++t) d.push_back(static_cast<std::size_t>(comm.rank() * threads + t));
    return d;
  }

 private:
  void check(std::size_t n) const {
    const auto have = static_cast<std::size_t>(comm.size()) * static_cast<std::size_t>(threads);
    if (n != have)
      throw comm_argument_error("meshlib: hybrid_runner runs " + std::to_string(comm.size()) + " ranks x " +
                                std::to_string(threads) + " threads = " + std::to_string(have) +
                                " devices, but the mesh has " + std::to_string(n));
  }
};

/// @brief Deprecated name of a `hybrid_runner` on the process-wide hybrid device threads (what it
/// was before runners had one name each); removed in the next release.
struct [[deprecated("use meshlib::hybrid_runner")]] hybrid_backend : hybrid_runner {
  /// `threads` devices per rank of `comm`.
  hybrid_backend(mpi_communicator comm, int threads = 1, thread_comm_options options = {})
      : hybrid_runner(detail::process_wide_threads, std::move(comm), threads, std::move(options)) {}
};

static_assert(runner<mpi_runner>);
static_assert(runner<hybrid_runner>);

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/exec/mpi_runner.hpp
// begin meshlib/runtime/mpi_runtime.hpp
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
  meshlib::detail::write_stderr_line("meshlib: MPI rank " + std::to_string(rank) + " of " + std::to_string(size) +
                            " aborts the run: " + std::string(reason));
  if (init && !fin) MPI_Abort(MPI_COMM_WORLD, 1);
  std::abort();
}

}  // namespace detail

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
// end meshlib/runtime/mpi_runtime.hpp
#endif

namespace meshlib {

namespace detail {

/// The multi-process part of the default runner: the processes' communicator and how many of
/// an `n`-device mesh's devices each runs; empty when the default is the thread runner.
#if MESHLIB_ENABLE_MPI
inline std::optional<hybrid_runner> default_process_runner(std::size_t n) {
#else
inline std::optional<int> default_process_runner([[maybe_unused]] std::size_t n) {
#endif
  if (current_device_slot() != nullptr) return std::nullopt;  // nested in a device: local threads
  const auto launch = distributed::launch();
  const std::size_t procs = launch.process_count;
  if (procs <= 1) return std::nullopt;
  const std::string run = "the run has " + std::to_string(procs) + " processes (" +
                          std::string(distributed::to_string(launch.source)) + ")";
#if MESHLIB_ENABLE_MPI
  if (!mpi::detail::mpi_state().ex)
#endif
    throw distributed_error("meshlib: spmd / shard_map on the default runner: " + run +
                            ", but no MPI communicator joins them to run a mesh over them: start the run with "
                            "meshlib::mpi::initialize() (or a meshlib::mpi::guard; link meshlib::mpi), or pass a "
                            "runner explicitly (thread_runner{} runs every device in this process)");
#if MESHLIB_ENABLE_MPI
  if (n == 0 || n % procs != 0)
    throw mesh_error("meshlib: spmd / shard_map on the default runner: " + run +
                     ", which run a mesh's devices in equal shares, but the mesh has " + std::to_string(n) +
                     " devices; use a multiple of " + std::to_string(procs) +
                     " (distributed::device_count() is " + std::to_string(distributed::device_count()) +
                     "), or pass a runner explicitly (thread_runner{} runs every device in this process)");
  return hybrid_runner(process_wide_threads, mpi::world(), static_cast<int>(n / procs));
#endif
}

#if MESHLIB_HAS_GPU_RUNNER
/// Whether the default runner runs on the GPUs now: a GPU build with a visible GPU, outside a
/// running device (`choose_default_runner`). The GPU count is read once per process.
inline bool default_runs_on_gpus() {
  static const int gpus = visible_gpu_count();
  return choose_default_runner(true, gpus, current_device_slot() != nullptr, distributed::launch().process_count) ==
         default_runner_kind::gpus;
}
#endif

}  // namespace detail

/// @brief The runner of `spmd` and `shard_map` when none is passed (see the file comment): the
/// process-wide device threads, or, in a run of several processes started with
/// `mpi::initialize`, those processes' device threads (a `hybrid_runner`). Decided at each call.
/// @throws distributed_error when `distributed::initialize` found several processes but MPI does
/// not join them; mesh_error when the mesh's devices do not split evenly over the processes.
struct default_runner {
  /// Marks a runner (exec/runner.hpp).
  using is_runner = void;

  /// @brief Runs `body(device, communicator)` for this process's devices of an `n`-device mesh.
  template <class Body>
  void run(std::size_t n, Body&& body) const {
#if MESHLIB_HAS_GPU_RUNNER
    if (detail::default_runs_on_gpus()) {
      gpu_runner().run(n, body);
      return;
    }
#endif
#if MESHLIB_ENABLE_MPI
    if (const auto procs = detail::default_process_runner(n)) {
      procs->run(n, body);
      return;
    }
#else
    (void)detail::default_process_runner(n);
#endif
    thread_runner(detail::process_wide_threads).run(n, body);
  }

  /// The devices this process runs of an `n`-device mesh: all of them in one process, else its
  /// `n / P` consecutive ones.
  [[nodiscard]] std::vector<std::size_t> local_devices(std::size_t n) const {
#if MESHLIB_HAS_GPU_RUNNER
    if (detail::default_runs_on_gpus()) return gpu_runner().local_devices(n);
#endif
#if MESHLIB_ENABLE_MPI
    if (const auto procs = detail::default_process_runner(n)) return procs->local_devices(n);
#else
    (void)detail::default_process_runner(n);
#endif
    return thread_runner(detail::process_wide_threads).local_devices(n);
  }
};

static_assert(runner<default_runner>);

}  // namespace meshlib
// end meshlib/exec/default_runner.hpp
// begin meshlib/exec/spmd.hpp
/// @file
/// @brief `spmd(mesh, fn)`: runs `fn` once per device of `mesh`, as a multi-controller JAX program
/// runs once per process: the program owns its data, builds its `local_tensor`s, and talks to its
/// peers through the typed collectives. Inside, `axis_index<"a">()`, `axis_size<"a">()` and
/// `device_index()` say where it runs.
/// @code
/// meshlib::mesh<meshlib::axis<"x">> m{4};
/// auto ids = meshlib::spmd(m, [] { return meshlib::axis_index<"x">(); });   // {0, 1, 2, 3}
/// @endcode

#include <cstddef>
#include <type_traits>
#include <vector>

// begin meshlib/exec/detail/run_devices.hpp
/// @file
/// @brief `detail::run_devices(mesh, runner, body)`: what `spmd`, `shard_map` and `reshard` with a
/// runner run each device through. It is here, in the exec layer, because it joins the layers
/// below: the runner (exec/runner.hpp) runs the devices, the collectives' device context
/// (collectives/device_context.hpp) is installed on each, and the debug layer's observer
/// (debug/observe.hpp), which implements the collectives' observer interface
/// (collectives/observer.hpp), is created for the run and handed to every device's context. The
/// collectives layer declares that interface and never includes the debug layer.

#include <algorithm>
#include <cstddef>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// begin meshlib/debug/observe.hpp
/// @file
/// @brief The debug layer's observer: `run_observer` implements the collectives layer's
/// `comm_observer` (collectives/observer.hpp). The exec layer creates one per run (`shard_map`,
/// `spmd`, `reshard`: exec/detail/run_devices.hpp); when tracing, debug mode or a Kokkos tool is on,
/// every device's communicators are wrapped in the collectives' forwarding decorator
/// (`observed_comm`), which forwards every operation to the real one and reports it here around
/// it: this observer records the collective in the trace (`trace.hpp`), reports it to Kokkos tools
/// as a profiling region, checks its input and output for NaN/Inf, and marks the device's arrival
/// on the run's board so that a watchdog can warn about a device that keeps the others waiting.
/// When all three are off nothing is wrapped: the cost is one predictable branch per collective
/// (on the observer pointer, in `device_context_for::comm`).
///
/// Debug mode: `MESHLIB_DEBUG=1` in the environment, or `enable_debug_mode(options)`.
/// @code
/// meshlib::enable_debug_mode({.slow_warning_fraction = 0.1, .timeout = std::chrono::seconds(5)});
/// auto y = f(x);   // NaN/Inf in a collective -> nonfinite_error; a device 0.5 s late -> one warning
/// @endcode

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <mutex>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

// begin meshlib/debug/errors.hpp
/// @file
/// @brief The errors of debug mode's checks: `debug_check_error` and its two kinds.

#include <string>


namespace meshlib {

/// @brief A debug-mode check failed (see docs/debugging.md).
class debug_check_error : public error {
 public:
  using error::error;
};

/// @brief A value whose type says it is replicated over some axes differs between the devices of
/// one of those groups (`check_replicated`; debug mode checks `shard_map` outputs).
/// `what()` names the first differing device, the element index and both values.
class replica_mismatch : public debug_check_error {
 public:
  using debug_check_error::debug_check_error;
};

/// @brief A collective's input or output holds a NaN or an infinity (debug mode). `what()` names
/// the device, the operation and the element.
class nonfinite_error : public debug_check_error {
 public:
  using debug_check_error::debug_check_error;
};

}  // namespace meshlib
// end meshlib/debug/errors.hpp
// begin meshlib/debug/trace.hpp
/// @file
/// @brief The trace recorder: a timeline of every collective and every user region, per device,
/// written as Chrome trace event JSON (Perfetto's UI and chrome://tracing open it), and a summary
/// per collective type, axis and device. Off by default; on through `start_trace(path)` /
/// `stop_trace()` (as `jax.profiler.start_trace` / `stop_trace`), the RAII `scoped_trace`, or the
/// environment: `MESHLIB_TRACE=trace.json` traces the whole program and writes the file (and prints
/// the summary to stderr) at exit. The file is opened when tracing starts: a path that cannot be
/// written throws `error` then (for the variable: from the program's first traced call, or from
/// `tracing()`), not at the end of the run.
///
/// The recorder only stores events; the runners feed it through the debug layer's one decorator
/// point (`observe.hpp`), and `trace_region` adds the user's regions.
/// @code
/// meshlib::start_trace("step.json");
/// auto y = f(x);                                    // a shard_map: its collectives are recorded
/// std::cerr << meshlib::stop_trace();               // writes step.json; prints the summary
/// @endcode
///
/// File layout (one JSON object): `traceEvents` holds, per device, a `thread_name` metadata record
/// ("device 3 (data=1, model=1)") and a `thread_sort_index`; one complete event (`ph: "X"`) per
/// collective with `args` {axes, dtype, bytes, wait_us, group}; one per region (`cat: "region"`);
/// and flow events (`ph: "s"/"t"/"f"`) that join the devices of each collective at the moment the
/// last of them arrived. `pid` is the process index (one file per process in multi-process runs:
/// `trace.json` becomes `trace.p1.json` for process 1), `tid` the device id; regions run outside
/// any device go to the `host` track.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <utility>
#include <vector>


namespace meshlib {

namespace detail {
/// `std::setw` without <iomanip>, which pulls <locale> into every translation unit that includes
/// meshlib (exec installs the tracer, so this header is in the umbrella; docs/benchmarks.md).
struct column_width {
  std::streamsize n;
  friend std::ostream& operator<<(std::ostream& os, column_width w) {
    os.width(w.n);
    return os;
  }
};
}  // namespace detail

/// @brief One row of a `trace_summary`: one collective type over one set of axes on one device.
struct trace_summary_row {
  std::string op;    ///< as the user called it: psum, pmean, all_gather, psum_scatter, ...
  std::string axes;  ///< "model", "data,model"
  /// The device this row counts.
  std::size_t device = 0;
  /// How many calls of the collective this device made.
  std::size_t count = 0;
  std::size_t bytes = 0;  ///< bytes this device contributed (its send buffers)
  double time_s = 0;      ///< time inside the collective, waiting included
  double wait_s = 0;      ///< time spent waiting for the last device of the group to arrive
};

/// @brief What `stop_trace()` returns: per collective type, axes and device, count, bytes, time and
/// wait time; and the slowest device (the one its peers waited for longest). Printable.
struct trace_summary {
  /// One row per collective type, axes and device.
  std::vector<trace_summary_row> rows;
  /// The number of devices traced.
  std::size_t devices = 0;
  /// Seconds from start to stop of the trace.
  double traced_s = 0;
  /// The device the others waited for longest, when any waited at all.
  std::optional<std::size_t> slowest_device;
  /// How long, summed over collectives, the others waited for `slowest_device` after their first arrival.
  double slowest_lateness_s = 0;
  /// The file written (empty when none was).
  std::string path;

  /// Prints the table: one line per row, then the slowest device.
  friend std::ostream& operator<<(std::ostream& os, const trace_summary& s) {
    os.precision(3);
    os << "meshlib trace summary: " << s.devices << " device(s), " << std::fixed
       << s.traced_s * 1e3 << " ms traced" << (s.path.empty() ? "" : ", written to " + s.path) << '\n';
    os << std::left << detail::column_width{14} << "op" << detail::column_width{14} << "axes" << std::right << detail::column_width{7} << "device"
       << detail::column_width{8} << "count" << detail::column_width{12} << "bytes" << detail::column_width{12} << "time ms" << detail::column_width{12}
       << "wait ms" << '\n';
    for (const auto& r : s.rows)
      os << std::left << detail::column_width{14} << r.op << detail::column_width{14} << r.axes << std::right << detail::column_width{7} << r.device
         << detail::column_width{8} << r.count << detail::column_width{12} << r.bytes << detail::column_width{12} << r.time_s * 1e3 << detail::column_width{12}
         << r.wait_s * 1e3 << '\n';
    if (s.slowest_device)
      os << "slowest device: " << *s.slowest_device << " (its peers waited " << s.slowest_lateness_s * 1e3
         << " ms for it in all)\n";
    else
      os << "slowest device: none (no collective waited for a late device)\n";
    os.unsetf(std::ios::floatfield);
    return os;
  }
  /// The table as `operator<<` prints it.
  [[nodiscard]] std::string to_string() const {
    std::ostringstream os;
    os << *this;
    return os.str();
  }
};

namespace detail {

/// One recorded event (a collective or a region) on one track.
struct trace_event {
  std::string name;
  std::string axes;   // collectives: the axes, comma separated
  std::string dtype;  // collectives: float32, ...
  std::size_t bytes = 0;
  std::int64_t start_ns = 0;
  std::int64_t end_ns = 0;
  bool collective = false;
  // Identifies one collective across its devices: the run, the group (axes and color) and the
  // position of the collective in that group's sequence.
  std::uint64_t run = 0;
  std::uint64_t mask = 0;
  std::size_t color = 0;
  std::uint64_t seq = 0;
  std::string group;  // the group's device ids, "0,1"
};

/// The track of regions that run outside any device (on the host thread).
inline constexpr std::size_t host_track = static_cast<std::size_t>(-1);

/// Process-wide recorder (see the file comment). Appends are per track under the track's own
/// mutex, so device threads do not contend with each other.
///
/// A class template used through one alias (`trace_recorder`), as `std::string` is: its members
/// (maps, sorts, the JSON writer) are then compiled only in a translation unit that traces or runs
/// devices, not in every one that includes meshlib (docs/benchmarks.md, "Include cost"). The same
/// holds for every entry point to it below: none is an ordinary inline function, whose body the
/// compiler would check, with everything it calls, in every translation unit.
template <class Tag = void>
class basic_trace_recorder {
 public:
  struct track {
    std::mutex m;
    std::string name;
    std::vector<trace_event> events;
    std::uint64_t session = 0;  // the last trace session that used it
  };

  static basic_trace_recorder& get() {
    static basic_trace_recorder r;
    return r;
  }

  [[nodiscard]] bool on() const noexcept { return on_.load(std::memory_order_relaxed); }

  [[nodiscard]] std::int64_t now_ns() const noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - origin_).count();
  }

  /// @throws error when `path` (its per-process name) cannot be opened for writing: a trace the
  /// program cannot write is reported now, not after the run at `stop()`.
  void start(std::string path) {
    if (!path.empty()) check_writable(file_for_process(path), "start_trace");
    std::lock_guard lk(m_);
    // Tracks live as long as the program (a running device may hold one): restarting empties them.
    ++session_;
    for (auto& [id, t] : tracks_) {
      std::lock_guard tl(t->m);
      t->events.clear();
    }
    path_ = std::move(path);
    started_ns_ = now_ns();
    on_.store(true, std::memory_order_release);
  }

  /// A fresh id for one shard_map / spmd / reshard run.
  std::uint64_t next_run() noexcept { return runs_.fetch_add(1) + 1; }

  /// The track of `id` (a device id or `host_track`), created on first use.
  track& track_of(std::size_t id) {
    std::lock_guard lk(m_);
    auto& t = tracks_[id];
    if (!t) {
      t = std::make_unique<track>();
      t->name = id == host_track ? "host" : "device " + std::to_string(id);
    }
    t->session = session_;
    return *t;
  }

  void name_track(std::size_t id, std::string name) {
    track& t = track_of(id);
    std::lock_guard lk(t.m);
    t.name = std::move(name);
  }

  void record(track& t, trace_event e) {
    std::lock_guard lk(t.m);
    t.events.push_back(std::move(e));
  }

  /// Stops recording, writes the file (when a path was given) and returns the summary.
  trace_summary stop() {
    std::lock_guard lk(m_);
    on_.store(false, std::memory_order_release);
    // Devices of a run still going may append while this runs: take each track's events under its lock.
    snapshot_.clear();
    for (auto& [id, t] : tracks_) {
      std::lock_guard tl(t->m);
      if (t->session != session_ && t->events.empty()) continue;
      snapshot_.push_back({id, t->name, std::move(t->events)});
      t->events.clear();
    }
    trace_summary s = summarize();
    if (!path_.empty()) {
      s.path = file_for_process(path_);
      write(s.path);
    }
    snapshot_.clear();
    path_.clear();
    return s;
  }

  /// Stops at exit when MESHLIB_TRACE started the trace: writes the file, prints the summary.
  ~basic_trace_recorder() {
    if (from_env_ && on()) {
      try {
        std::cerr << stop();
      } catch (const std::exception& e) {
        std::cerr << e.what() << '\n';
      }
    }
  }

  basic_trace_recorder(const basic_trace_recorder&) = delete;
  basic_trace_recorder& operator=(const basic_trace_recorder&) = delete;

 private:
  // Throws (from `get()`, so from the program's first traced call, and again from every later one)
  // when MESHLIB_TRACE names a file that cannot be written: the user asked for a trace and would
  // otherwise learn only at exit, after the whole run, that there is none.
  basic_trace_recorder() : origin_(std::chrono::steady_clock::now()) {
    const char* env = std::getenv("MESHLIB_TRACE");  // NOLINT(concurrency-mt-unsafe): read once
    if (env != nullptr && *env != '\0') {
      check_writable(file_for_process(env), "MESHLIB_TRACE=" + std::string(env));
      from_env_ = true;
      start(env);
    }
  }

  /// Opens `file` for writing (creating or emptying it; the trace replaces it at stop) and throws
  /// `error` naming `what`, the file and the system's reason when it cannot.
  static void check_writable(const std::string& file, const std::string& what) {
    std::FILE* f = std::fopen(file.c_str(), "w");
    if (f == nullptr) {
      const int e = errno;
      throw error("meshlib: " + what + ": cannot open '" + file + "' for writing the trace (" + std::strerror(e) +
                  "); give a file in an existing, writable directory");
    }
    std::fclose(f);
  }

  /// `trace.json` for a single-process run; `trace.p<index>.json` for process `index` of several.
  static std::string file_for_process(const std::string& path) {
    std::size_t index = 0, count = 1;
    try {
      const auto l = distributed::detect_launch(distributed::process_env());
      index = l.process_index;
      count = l.process_count;
    } catch (const std::exception&) {
      // An inconsistent launcher environment is reported by distributed::initialize; here one file.
    }
    if (count <= 1) return path;
    const std::size_t dot = path.rfind('.');
    const std::size_t slash = path.rfind('/');
    const std::string suffix = ".p" + std::to_string(index);
    if (dot == std::string::npos || (slash != std::string::npos && dot < slash)) return path + suffix;
    return path.substr(0, dot) + suffix + path.substr(dot);
  }

  static std::size_t process_index() {
    try {
      return distributed::detect_launch(distributed::process_env()).process_index;
    } catch (const std::exception&) {
      return 0;
    }
  }

  using key_t = std::tuple<std::uint64_t, std::uint64_t, std::size_t, std::uint64_t>;
  struct instance {
    std::int64_t first = INT64_MAX, last = INT64_MIN;
    std::vector<std::pair<std::size_t, const trace_event*>> members;  // (track, event)
  };

  std::map<key_t, instance> instances() const {
    std::map<key_t, instance> out;
    for (const auto& t : snapshot_)
      for (const auto& e : t.events) {
        if (!e.collective) continue;
        auto& in = out[key_t{e.run, e.mask, e.color, e.seq}];
        in.first = std::min(in.first, e.start_ns);
        in.last = std::max(in.last, e.start_ns);
        in.members.emplace_back(t.id, &e);
      }
    return out;
  }

  static std::int64_t wait_of(const instance& in, const trace_event& e) {
    return std::clamp<std::int64_t>(in.last - e.start_ns, 0, e.end_ns - e.start_ns);
  }

  trace_summary summarize() const {
    trace_summary s;
    const auto inst = instances();
    deferred_t<std::map<std::tuple<std::string, std::string, std::size_t>, trace_summary_row>, Tag> rows;
    deferred_t<std::map<std::size_t, double>, Tag> lateness;
    std::int64_t lo = started_ns_, hi = started_ns_;
    for (const auto& t : snapshot_) {
      if (t.id != host_track) ++s.devices;
      for (const auto& e : t.events) hi = std::max(hi, e.end_ns);
    }
    for (const auto& [key, in] : inst) {
      const trace_event* late = nullptr;
      std::size_t late_dev = 0;
      for (const auto& [dev, e] : in.members) {
        auto& r = rows[{e->name, e->axes, dev}];
        r.op = e->name;
        r.axes = e->axes;
        r.device = dev;
        ++r.count;
        r.bytes += e->bytes;
        r.time_s += static_cast<double>(e->end_ns - e->start_ns) * 1e-9;
        r.wait_s += static_cast<double>(wait_of(in, *e)) * 1e-9;
        if (!late || e->start_ns > late->start_ns) {
          late = e;
          late_dev = dev;
        }
      }
      if (late && in.members.size() > 1 && in.last > in.first)
        lateness[late_dev] += static_cast<double>(in.last - in.first) * 1e-9;
    }
    for (auto& [k, r] : rows) s.rows.push_back(r);
    for (const auto& [dev, l] : lateness)
      if (l > s.slowest_lateness_s) {
        s.slowest_lateness_s = l;
        s.slowest_device = dev;
      }
    s.traced_s = static_cast<double>(hi - lo) * 1e-9;
    return s;
  }

  static void json_string(std::ostream& os, std::string_view s) {
    os << '"';
    for (char c : s) {
      switch (c) {
        case '"': os << "\\\""; break;
        case '\\': os << "\\\\"; break;
        case '\n': os << "\\n"; break;
        case '\t': os << "\\t"; break;
        default:
          if (static_cast<unsigned char>(c) < 0x20) {
            char buf[8];
            std::snprintf(buf, sizeof buf, "\\u%04x", static_cast<unsigned>(static_cast<unsigned char>(c)));
            os << buf;
          } else {
            os << c;
          }
      }
    }
    os << '"';
  }

  // As std::fixed with precision 3 prints it, whatever the locale (JSON needs the '.').
  static std::string fixed3(double v) {
    char buf[400];  // the longest finite double in fixed notation with 3 decimals fits
    const auto r = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::fixed, 3);
    return std::string(buf, r.ptr);
  }

  // The file is written through <cstdio>: <fstream> would cost every translation unit that includes
  // meshlib its parse time for this one function (docs/benchmarks.md, include cost).
  void write(const std::string& path) const {
    struct file_closer {
      void operator()(std::FILE* p) const noexcept { std::fclose(p); }
    };
    std::unique_ptr<std::FILE, file_closer> file(std::fopen(path.c_str(), "w"));
    if (!file) throw error("meshlib: stop_trace: cannot open '" + path + "' for writing the trace");
    std::ostringstream f;
    const std::size_t pid = process_index();
    // Microseconds with nanosecond digits: the unit of the Chrome trace format.
    auto us = [this](std::int64_t ns) {
      return fixed3(static_cast<double>(ns - started_ns_) * 1e-3);
    };
    auto dur = [](std::int64_t ns) { return fixed3(static_cast<double>(ns) * 1e-3); };
    auto tid = [](std::size_t id) { return id == host_track ? std::string("1000000") : std::to_string(id); };
    const auto inst = instances();
    f << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n";
    f << R"({"ph":"M","name":"process_name","pid":)" << pid << R"(,"tid":0,"args":{"name":"meshlib process )" << pid
      << "\"}}";
    for (const auto& t : snapshot_) {
      f << ",\n" << R"({"ph":"M","name":"thread_name","pid":)" << pid << ",\"tid\":" << tid(t.id) << ",\"args\":{\"name\":";
      json_string(f, t.name);
      f << "}}";
      f << ",\n" << R"({"ph":"M","name":"thread_sort_index","pid":)" << pid << ",\"tid\":" << tid(t.id)
        << ",\"args\":{\"sort_index\":" << (t.id == host_track ? std::string("-1") : std::to_string(t.id)) << "}}";
    }
    for (const auto& t : snapshot_)
      for (const auto& e : t.events) {
        const std::size_t id = t.id;
        f << ",\n{\"ph\":\"X\",\"name\":";
        json_string(f, e.name);
        f << ",\"cat\":\"" << (e.collective ? "collective" : "region") << "\",\"pid\":" << pid << ",\"tid\":" << tid(id)
          << ",\"ts\":" << us(e.start_ns) << ",\"dur\":" << dur(e.end_ns - e.start_ns);
        if (e.collective) {
          const auto& in = inst.at(key_t{e.run, e.mask, e.color, e.seq});
          f << ",\"args\":{\"axes\":";
          json_string(f, e.axes);
          f << ",\"dtype\":\"" << e.dtype << "\",\"bytes\":" << e.bytes << ",\"wait_us\":" << dur(wait_of(in, e))
            << ",\"group\":\"" << e.group << "\",\"seq\":" << e.seq << "}";
        }
        f << "}";
      }
    // Flow arrows: one chain per collective through its devices in id order, at the moment the
    // last of them arrived (a moment inside every member's slice).
    std::uint64_t flow = 0;
    for (const auto& [key, in] : inst) {
      if (in.members.size() < 2) continue;
      auto members = in.members;
      std::sort(members.begin(), members.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
      ++flow;
      for (std::size_t i = 0; i < members.size(); ++i) {
        const auto& [id, e] = members[i];
        const char* ph = i == 0 ? "s" : (i + 1 == members.size() ? "f" : "t");
        const std::int64_t at = std::clamp(in.last, e->start_ns, e->end_ns);
        f << ",\n{\"ph\":\"" << ph << "\",\"name\":";
        json_string(f, e->name);
        f << ",\"cat\":\"collective\",\"id\":" << flow << ",\"pid\":" << pid << ",\"tid\":" << tid(id)
          << ",\"ts\":" << us(at) << (i + 1 == members.size() ? ",\"bp\":\"e\"" : "") << "}";
      }
    }
    f << "\n]}\n";
    const std::string text = std::move(f).str();
    if (std::fwrite(text.data(), 1, text.size(), file.get()) != text.size() || std::fclose(file.release()) != 0)
      throw error("meshlib: stop_trace: writing '" + path + "' failed");
  }

  std::atomic<bool> on_{false};
  std::atomic<std::uint64_t> runs_{0};
  std::mutex m_;
  std::map<std::size_t, std::unique_ptr<track>> tracks_;
  // What stop() took from the tracks (in id order, the host track last): summarised and written.
  struct taken {
    std::size_t id;
    std::string name;
    std::vector<trace_event> events;
  };
  std::vector<taken> snapshot_;
  std::uint64_t session_ = 0;
  std::string path_;
  std::chrono::steady_clock::time_point origin_;
  std::int64_t started_ns_ = 0;
  bool from_env_ = false;
};

/// The recorder (see `basic_trace_recorder`).
using trace_recorder = basic_trace_recorder<>;

}  // namespace detail

/// @brief Starts recording a trace (as `jax.profiler.start_trace`); `stop_trace()` writes it to
/// `path` (Chrome trace event JSON). An empty path records without writing (the summary only).
/// Restarting discards what was recorded. Runs that are already going keep their state: tracing
/// is read when a `shard_map`, `spmd` or `reshard` starts.
/// @throws error when `path` cannot be opened for writing (naming it), before anything is recorded.
template <class Tag = void>
void start_trace(std::string path) {
  detail::basic_trace_recorder<Tag>::get().start(std::move(path));
}

/// @brief Stops the trace, writes the file given to `start_trace` and returns the summary.
/// @throws error when the file cannot be written (naming it).
template <class Tag = void>
trace_summary stop_trace() {
  return detail::basic_trace_recorder<Tag>::get().stop();
}

/// @brief True while a trace is being recorded.
/// @throws error when `MESHLIB_TRACE` names a file that cannot be written (as every traced call
/// does): a program can call it first to report that at start.
template <class Tag = void>
[[nodiscard]] bool tracing() {
  return detail::basic_trace_recorder<Tag>::get().on();
}

/// @brief Traces its scope (as `with jax.profiler.trace(dir):`): starts in the constructor; the
/// destructor writes the file. Call `stop()` to get the summary earlier. Used as `scoped_trace`
/// (a template only so that its code is compiled where it is used: see `basic_trace_recorder`).
template <class Tag = void>
class basic_scoped_trace {
 public:
  /// Starts tracing; the trace file goes to `path` when the scope ends or at `stop()`.
  explicit basic_scoped_trace(std::string path) { start_trace<Tag>(std::move(path)); }
  ~basic_scoped_trace() {
    if (!stopped_) {
      try {
        (void)stop_trace<Tag>();
      } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
      }
    }
  }
  /// Stops tracing now, writes the file and returns the summary; the destructor then does nothing.
  trace_summary stop() {
    stopped_ = true;
    return stop_trace<Tag>();
  }
  basic_scoped_trace(const basic_scoped_trace&) = delete;
  basic_scoped_trace& operator=(const basic_scoped_trace&) = delete;

 private:
  bool stopped_ = false;
};

/// @brief Traces its scope (see `basic_scoped_trace`).
using scoped_trace = basic_scoped_trace<>;

}  // namespace meshlib
// end meshlib/debug/trace.hpp

// Kokkos' profiling interface (Kokkos 3.4 and 4.x both have Kokkos::Profiling::pushRegion /
// popRegion / profileLibraryLoaded). The comm layer builds without Kokkos; so does this header.
#if __has_include(<Kokkos_Core.hpp>)
#include <Kokkos_Core.hpp>
/// 1 when Kokkos' headers are on the include path (this header then uses Kokkos' profiling hooks).
#define MESHLIB_DEBUG_HAS_KOKKOS 1
#else
/// 0 when Kokkos' headers are not on the include path (the header builds without Kokkos).
#define MESHLIB_DEBUG_HAS_KOKKOS 0
#endif

namespace meshlib {

/// @brief What debug mode checks.
struct debug_options {
  /// Check every collective's input and output for NaN and infinity (floating-point types).
  bool check_nonfinite = true;
  /// Check that `shard_map` outputs are identical over the axes their type says they are replicated over.
  bool check_replicas = true;
  /// Warn once about a collective whose devices have waited this fraction of `timeout` for a late
  /// peer. 0 disables the warning.
  double slow_warning_fraction = 0.25;
  /// The communicators' timeout that the fraction is of (the backend's own setting is not visible
  /// here; default: `MESHLIB_COMM_TIMEOUT` or 60 s, the communicators' default too).
  std::chrono::nanoseconds timeout = [] {
    try {
      return default_comm_timeout();
    } catch (const std::exception&) {
      return std::chrono::nanoseconds(default_comm_timeout_fallback);
    }
  }();
  /// Where warnings go (default: one line on std::cerr).
  std::function<void(const std::string&)> on_warning;
};

namespace detail {

struct debug_state {
  std::mutex m;
  std::atomic<bool> on{false};
  debug_options options;

  static debug_state& get() {
    static debug_state s;
    return s;
  }

 private:
  debug_state() {
    const char* env = std::getenv("MESHLIB_DEBUG");  // NOLINT(concurrency-mt-unsafe): read once
    on.store(env != nullptr && *env != '\0' && std::string_view(env) != "0");
  }
};

}  // namespace detail

/// @brief Turns debug mode on (see the file comment); later runs check as `options` says.
inline void enable_debug_mode(debug_options options = {}) {
  auto& s = detail::debug_state::get();
  std::lock_guard lk(s.m);
  s.options = std::move(options);
  s.on.store(true);
}

/// @brief Turns debug mode off.
inline void disable_debug_mode() { detail::debug_state::get().on.store(false); }

/// @brief True while debug mode is on (`MESHLIB_DEBUG=1` or `enable_debug_mode`).
[[nodiscard]] inline bool debug_mode() noexcept { return detail::debug_state::get().on.load(std::memory_order_relaxed); }

/// @brief Debug mode for a scope; restores the previous state.
class scoped_debug_mode {
 public:
  /// Turns debug mode on with `options` until the scope ends.
  explicit scoped_debug_mode(debug_options options = {}) : was_(debug_mode()) {
    auto& s = detail::debug_state::get();
    std::lock_guard lk(s.m);
    previous_ = s.options;
    s.options = std::move(options);
    s.on.store(true);
  }
  ~scoped_debug_mode() {
    auto& s = detail::debug_state::get();
    std::lock_guard lk(s.m);
    s.options = std::move(previous_);
    s.on.store(was_);
  }
  scoped_debug_mode(const scoped_debug_mode&) = delete;
  scoped_debug_mode& operator=(const scoped_debug_mode&) = delete;

 private:
  bool was_;
  debug_options previous_;
};

namespace detail {

/// The first non-finite element of `n` elements of `dt` at `p`, or -1.
inline std::ptrdiff_t first_nonfinite(const void* p, std::size_t n, datatype dt, double& value) {
  auto scan = [&](auto tag) -> std::ptrdiff_t {
    using T = decltype(tag);
    const T* x = static_cast<const T*>(p);
    for (std::size_t i = 0; i < n; ++i) {
      const double v = static_cast<double>(static_cast<float>(x[i]));
      if (!std::isfinite(v)) {
        value = v;
        return static_cast<std::ptrdiff_t>(i);
      }
    }
    return -1;
  };
  switch (dt) {
    case datatype::float32: return scan(float{});
    case datatype::bfloat16: return scan(bfloat16{});
    case datatype::float64: {
      const double* x = static_cast<const double*>(p);
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(x[i])) {
          value = x[i];
          return static_cast<std::ptrdiff_t>(i);
        }
      return -1;
    }
    default: return -1;
  }
}

/// Shared state of one run (see the file comment). A template used through one alias
/// (`run_observer`), so that its code is compiled only where a runner is (see
/// `basic_trace_recorder`).
template <class Tag = void>
class basic_run_observer final : public experimental::comm_observer {
  using recorder = basic_trace_recorder<Tag>;

 public:
  /// Decides whether the run is observed; when it is, names the trace tracks of `local` devices
  /// and, in debug mode with slow warnings on, starts the watchdog.
  template <mesh_type Mesh>
  basic_run_observer(const Mesh& m, const std::vector<std::size_t>& local) {
    auto& rec = recorder::get();
    tracing_ = rec.on();
    auto& dbg = debug_state::get();
    debug_ = dbg.on.load();
#if MESHLIB_DEBUG_HAS_KOKKOS
    kokkos_ = Kokkos::Profiling::profileLibraryLoaded();
#endif
    if (!(tracing_ || debug_ || kokkos_)) return;
    if (debug_) {
      std::lock_guard lk(dbg.m);
      options_ = dbg.options;
    }
    run_ = rec.next_run();
    local_.assign(m.size(), false);
    for (auto d : local) local_[d] = true;
    if (tracing_)
      for (auto d : local) rec.name_track(d, device_label(m, d));
    if (debug_ && options_.slow_warning_fraction > 0) {
      threshold_ = std::chrono::duration_cast<std::chrono::nanoseconds>(options_.timeout * options_.slow_warning_fraction);
      watchdog_ = std::thread([this] { watch(); });
    }
  }
  ~basic_run_observer() {
    if (watchdog_.joinable()) {
      {
        std::lock_guard lk(m_);
        stop_ = true;
      }
      cv_.notify_all();
      watchdog_.join();
    }
  }
  basic_run_observer(const basic_run_observer&) = delete;
  basic_run_observer& operator=(const basic_run_observer&) = delete;

  [[nodiscard]] bool active() const noexcept override { return tracing_ || debug_ || kokkos_; }
  [[nodiscard]] bool tracing() const noexcept { return tracing_; }
  [[nodiscard]] bool kokkos() const noexcept { return kokkos_; }
  [[nodiscard]] bool check_nonfinite() const noexcept { return debug_ && options_.check_nonfinite; }
  [[nodiscard]] std::uint64_t run() const noexcept { return run_; }

  /// A device's communicator on a group is decorated: its trace track, looked up once.
  void open(experimental::comm_site& site) override {
    if (tracing_) site.data = &recorder::get().track_of(site.device);
  }

  /// Before a collective: checks its input, opens its Kokkos region, marks the device's arrival.
  void enter(const experimental::comm_site& site, experimental::comm_call& call) override {
    if (check_nonfinite()) check_finite(site, call.name, "input", call.in, call.in_count, call.dt);
    const std::string what = std::string(call.name) + " over '" + site.axes + "'";
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::pushRegion("meshlib::" + what);
#endif
    call.start_ns = recorder::get().now_ns();
    arrive(site, call.seq, what);
  }

  /// After it, returned or not: the device's departure, the end of its Kokkos region.
  void leave(const experimental::comm_site& site, const experimental::comm_call& call) noexcept override {
    try {
      depart(site, call.seq);
    } catch (...) {  // only an allocation of the board's map can fail: the watchdog misses one exit
    }
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::popRegion();
#endif
  }

  /// After it returned: the trace event, the check of its output.
  void done(const experimental::comm_site& site, const experimental::comm_call& call) override {
    if (site.data != nullptr) {
      auto& rec = recorder::get();
      trace_event e;
      e.name = call.name;
      e.axes = site.axes;
      e.dtype = std::string(to_string(call.dt));
      e.bytes = call.send_count * size_of(call.dt);
      e.start_ns = call.start_ns;
      e.end_ns = rec.now_ns();
      e.collective = true;
      e.run = run_;
      e.mask = site.mask;
      e.color = site.color;
      e.seq = call.seq;
      e.group = join_ids(site.group);
      rec.record(*static_cast<typename recorder::track*>(site.data), std::move(e));
    }
    if (check_nonfinite()) check_finite(site, call.name, "output", call.out, call.out_count, call.dt);
  }

  /// The device of `site` entered its `seq`-th collective `what` on its group.
  void arrive(const experimental::comm_site& site, std::uint64_t seq, const std::string& what) {
    if (!watchdog_.joinable()) return;
    std::lock_guard lk(m_);
    auto& p = board_[key_t{site.mask, site.color, seq}];
    if (p.arrived.empty()) {
      p.what = what;
      p.group = site.group;
      p.arrived.assign(site.group.size(), false);
      p.first_ns = now_ns();
      for (auto d : site.group) p.local += d < local_.size() && local_[d] ? 1 : 0;
    }
    p.arrived[site.group_rank] = true;
  }
  /// The device of `site` left it (returned or threw).
  void depart(const experimental::comm_site& site, std::uint64_t seq) {
    if (!watchdog_.joinable()) return;
    std::lock_guard lk(m_);
    auto it = board_.find(key_t{site.mask, site.color, seq});
    if (it != board_.end() && ++it->second.departed >= it->second.local) board_.erase(it);
  }

  void warn(const std::string& message) const {
    if (options_.on_warning) options_.on_warning(message);
    else std::cerr << message << '\n' << std::flush;
  }

  /// Throws nonfinite_error when `n` elements of `dt` at `p` hold a NaN or an infinity.
  void check_finite(const experimental::comm_site& site, const char* op, const char* which, const void* p, std::size_t n,
                    datatype dt) const {
    double v = 0;
    const std::ptrdiff_t i = first_nonfinite(p, n, dt, v);
    if (i < 0) return;
    std::ostringstream os;
    os << "meshlib: debug mode: " << op << " over '" << site.axes << "' on " << site.device_label << ": " << which
       << " element " << i << " is " << v << " (" << to_string(dt) << ")";
    throw nonfinite_error(os.str());
  }

 private:
  using key_t = std::tuple<axis_mask, std::size_t, std::uint64_t>;
  struct pending {
    std::string what;
    std::vector<std::size_t> group;
    std::vector<bool> arrived;
    std::size_t local = 0;
    std::size_t departed = 0;
    std::int64_t first_ns = 0;
    bool warned = false;
  };

  static std::int64_t now_ns() noexcept {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  void watch() {
    const auto poll = std::clamp<std::chrono::nanoseconds>(threshold_ / 8, std::chrono::milliseconds(1),
                                                           std::chrono::milliseconds(100));
    std::unique_lock lk(m_);
    while (!stop_) {
      cv_.wait_for(lk, poll);
      const std::int64_t now = now_ns();
      for (auto& [key, p] : board_) {
        if (p.warned || now - p.first_ns < threshold_.count()) continue;
        std::vector<std::size_t> missing, here, elsewhere;
        for (std::size_t r = 0; r < p.group.size(); ++r) {
          const std::size_t d = p.group[r];
          if (p.arrived[r]) here.push_back(d);
          else if (d < local_.size() && local_[d]) missing.push_back(d);
          else elsewhere.push_back(d);
        }
        if (missing.empty() && elsewhere.empty()) continue;
        p.warned = true;
        std::ostringstream os;
        os.precision(2);  // not std::setprecision: <iomanip> pulls <locale> into every TU
        os << std::fixed << "meshlib: warning: " << p.what << " (devices " << join_ids(p.group)
           << ") has waited " << static_cast<double>(now - p.first_ns) * 1e-9 << " s for device"
           << (missing.size() == 1 ? " " : "s ") << join_ids(missing);
        if (!elsewhere.empty()) os << (missing.empty() ? "" : " and") << " devices " << join_ids(elsewhere)
                                   << " of other processes";
        os << " (not yet arrived; devices " << join_ids(here) << " are waiting; the timeout is " << std::defaultfloat
           << std::chrono::duration<double>(options_.timeout).count() << " s); carrying on";
        warn(os.str());
      }
    }
  }

  bool tracing_ = false, debug_ = false, kokkos_ = false;
  debug_options options_;
  std::uint64_t run_ = 0;
  std::vector<bool> local_;
  std::chrono::nanoseconds threshold_{0};
  std::mutex m_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::map<key_t, pending> board_;
  std::thread watchdog_;
};

/// The debug layer's observer of one run (see `basic_run_observer`).
using run_observer = basic_run_observer<>;

}  // namespace detail
}  // namespace meshlib
// end meshlib/debug/observe.hpp

namespace meshlib::detail {

/// The cores each device of `runner` computes on: its `threads_per_device` where it has one, else 1.
template <class Runner>
std::size_t threads_per_device_of(const Runner& runner) {
  if constexpr (requires { runner.threads_per_device; })
    return static_cast<std::size_t>(runner.threads_per_device);
  else
    return 1;
}

/// Throws unless devices computing on `Exec` can have `threads` threads each.
template <class Exec>
void require_thread_teams(std::size_t threads) {
  if (threads == 1) return;
  if (threads == 0)
    throw error("meshlib: threads_per_device is 0; a device computes on at least one thread (1, the default, is one "
                "core per device)");
  if constexpr (!has_thread_teams_v<Exec>)
    throw error("meshlib: threads_per_device = " + std::to_string(threads) + " needs Kokkos 4 with the OpenMP "
                "backend (a team of threads per device), but devices here compute on Kokkos::" +
                std::string(Exec::name()) + " (Kokkos " + std::to_string(KOKKOS_VERSION) +
                "), one thread each; build Kokkos 4 with -DKokkos_ENABLE_OPENMP=ON, or leave threads_per_device at 1");
}

/// Whether `Runner` always installs each device's execution-space instance itself (`gpu_runner`: a
/// Kokkos CUDA instance on the stream of the device's communicator, so that kernels and collectives
/// are ordered on one stream; it also sets `runner_installed_exec()` for each call); otherwise
/// `run_devices` installs `device_instance`'s, unless the runner set that flag for the call.
template <class Runner>
inline constexpr bool runner_installs_instances_v = requires { typename Runner::installs_exec_instances; };

/// Runs `body(device)` on every device of `m` that `backend` runs, each with its `device_context`
/// (observed by the debug layer's `run_observer`) and its execution-space instance
/// (`device_instance`) installed, and turns a device's failure into `device_error`: the one place
/// where every runner's root cause (`participant_error`, whatever the runner) becomes the user's
/// error, with the same message for every runner.
template <mesh_type Mesh, class Backend, class Body>
void run_devices(const Mesh& m, const Backend& backend, Body&& body) {
  require_runnable(m, "spmd / shard_map / reshard");  // before anything is sized by the device count
  const std::vector<std::size_t> local = backend.local_devices(m.size());
  const std::size_t team = threads_per_device_of(backend);
  require_thread_teams<exec_space_for_t<default_memory_space>>(team);
  run_observer observer(m, local);  // installed: the debug layer's observer
  // Instances per local device: a process running devices 4..7 of 8 makes 4, not 8.
  constexpr bool own_instances = !runner_installs_instances_v<Backend>;
  if constexpr (own_instances)
    (void)device_instance<default_memory_space>(0, local.size(), team);  // made here, not in the device threads
  workspace_registry::get().hook();  // likewise (Kokkos' hook stack has no lock)
  try {
    backend.run(m.size(), [&]<class C>(std::size_t device, C world) {
      device_context_for<C, Mesh> ctx(m, device, std::move(world), &observer);
      scoped_device installed(ctx);
      std::optional<scoped_exec_space<default_memory_space>> on;
      // A runner chosen at run time (default_runner picking gpu_runner) says so per call.
      const bool runner_instance = std::exchange(runner_installed_exec(), false);
      if (own_instances && !runner_instance) {
        const auto index = static_cast<std::size_t>(std::lower_bound(local.begin(), local.end(), device) - local.begin());
        on.emplace(device_instance<default_memory_space>(index, local.size(), team));
      }
      body(device);
      // A stream backend's collectives may still be enqueued: the call ends when they are
      // complete (or with their error, bounded by the communicator's timeout).
      if constexpr (stream_ordered_v<C>) ctx.synchronize();
    });
  } catch (const participant_error& e) {
    const auto device = static_cast<std::size_t>(e.rank());
    const std::exception_ptr cause = e.nested_ptr();
    const std::string what = cause ? what_of(cause) : std::string(e.what());
    throw device_error(device, cause, "meshlib: device " + std::to_string(device) + " of " + m.to_string() +
                                          " failed: " + what);
  }
}

}  // namespace meshlib::detail
// end meshlib/exec/detail/run_devices.hpp

namespace meshlib {

namespace detail {
template <class Fn>
decltype(auto) call_on_device(Fn& fn, std::size_t device) {
  if constexpr (std::is_invocable_v<Fn&, std::size_t>) return fn(device);
  else return fn();
}
template <class Fn>
using spmd_result_t = decltype(call_on_device(std::declval<Fn&>(), std::size_t{}));
}  // namespace detail

/// @brief Runs `fn()` (or `fn(device)`) once per device of `m` on `backend`, a `runner` (default:
/// `default_runner`, the process-wide persistent device threads, or the processes' device threads
/// once `mpi::initialize` has started several; a `thread_runner` owns threads of its own).
/// @returns nothing when `fn` returns nothing; otherwise one result per device, indexed by device
/// id (entries of devices another process runs are value-initialised).
/// @throws device_error when a device throws: the first device that failed, its exception nested;
/// every other device is released from its collectives (no hang).
/// @throws kokkos_lifecycle_error when Kokkos is not initialised (before any device thread starts).
/// @throws mesh_error when the mesh has more devices than an `int` counts (naming the axis).
template <mesh_type Mesh, class Fn, runner Backend = default_runner>
  requires(std::is_invocable_v<Fn&> || std::is_invocable_v<Fn&, std::size_t>)
auto spmd(const Mesh& m, Fn&& fn, const Backend& backend = {}) {
  using result_t = std::remove_cvref_t<detail::spmd_result_t<Fn>>;
  detail::require_kokkos("spmd");
  detail::require_runnable(m, "spmd");  // before the per-device results are allocated
  if constexpr (std::is_void_v<result_t>) {
    detail::run_devices(m, backend, [&](std::size_t device) { detail::call_on_device(fn, device); });
  } else {
    std::vector<result_t> out(m.size());
    detail::run_devices(m, backend, [&](std::size_t device) { out[device] = detail::call_on_device(fn, device); });
    return out;
  }
}

}  // namespace meshlib
// end meshlib/exec/spmd.hpp
// begin meshlib/exec/shard_map.hpp
/// @file
/// @brief `shard_map(fn, mesh, in_specs, out_specs)`: global sharded arrays in, `fn` once per device
/// on its blocks, global sharded arrays out, as `jax.shard_map`.
///
/// Entering, each input is laid out by its in-spec (resharded first when it is not already; even
/// rule, as JAX requires) and each device's block becomes a `local_tensor` that varies over the
/// spec's axes. Leaving, each output is checked at compile time as JAX's `check_vma` does: it must
/// be invariant over every axis its out-spec does not shard it over, and partial over none; the
/// blocks are then assembled by the out-spec. Like every `sharded_tensor`, the result is a handle:
/// an output that is an input block returned unchanged shares that block's memory.
/// @code
/// using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
/// mesh_t m{4};
/// auto f = meshlib::shard_map([](auto b) { return meshlib::psum<"x">(b); }, m,
///                             meshlib::P<"x">{}, meshlib::P<>{});
/// auto total = f(x);   // x: a P<"x"> array of shape (8,); total: replicated (2,), the sum of the blocks
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// begin meshlib/debug/check_replicated.hpp
/// @file
/// @brief `check_replicated(x)`: meshlib's `checkify` for sharding. A `local_tensor` whose type says
/// it is invariant over some mesh axes must hold the same bits on every device of each group along
/// those axes; this gathers the copies and compares them, naming the first differing device, the
/// element and both values. Debug mode runs it on every `shard_map` output.
/// @code
/// meshlib::spmd(m, [&] {
///   auto w = meshlib::psum<"data">(g);     // invariant over 'data'
///   meshlib::check_replicated(w);          // throws replica_mismatch if a kernel made copies diverge
/// });
/// @endcode

#include <array>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>


namespace meshlib {

namespace detail {

template <local_tensor_type L>
void check_replicated_over(const L& x, axis_mask mask, std::string_view what) {
  using T = typename L::value_type;
  using Mesh = typename L::mesh_type;
  mask &= Mesh::all_axes;
  if (mask == 0) return;
  device_context& ctx = current_device(what);
  const std::size_t count = x.size();
  std::vector<T> mine(count);
  const auto shape = x.shape();
  {
    // Copy out in row-major order (the block may be a strided view).
    std::array<std::size_t, L::rank> idx{};
    for (std::size_t k = 0; k < count; ++k) {
      mine[k] = std::apply([&](auto... i) { return x.view()(i...); }, idx);
      for (std::size_t d = L::rank; d-- > 0;) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
      }
    }
  }
  unobserved_scope quiet;
  auto& comm = ctx.comm(mask);
  const auto n = static_cast<std::size_t>(comm.size());
  std::vector<T> all(count * n);
  comm.all_gather(mine.data(), all.data(), count, datatype_of<T>);
  const std::vector<std::size_t> group = x.mesh().group(ctx.device(), mask);
  for (std::size_t r = 1; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) {
      const T& a = all[i];
      const T& b = all[r * count + i];
      if (std::memcmp(&a, &b, sizeof(T)) == 0) continue;
      std::ostringstream os;
      os << "meshlib: " << what << ": the value is replicated over " << describe_axes<Mesh>(mask) << " (devices ";
      for (std::size_t g = 0; g < group.size(); ++g) os << (g ? ", " : "") << group[g];
      os << ") but device " << group[r] << " differs from device " << group[0] << " at element " << i << " (index (";
      std::size_t rest = i;
      std::array<std::size_t, L::rank> idx{};
      for (std::size_t d = L::rank; d-- > 0;) {
        idx[d] = shape[d] ? rest % shape[d] : 0;
        rest = shape[d] ? rest / shape[d] : 0;
      }
      for (std::size_t d = 0; d < L::rank; ++d) os << (d ? ", " : "") << idx[d];
      os << ")): " << b << " on device " << group[r] << " vs " << a << " on device " << group[0]
         << "; a kernel computed different values on replicas";
      throw replica_mismatch(os.str());
    }
}

}  // namespace detail

/// @brief Checks, inside `shard_map` / `spmd`, that `x` is bitwise identical on every device of its
/// groups along the axes its type says it is invariant over (all mesh axes it neither varies over
/// nor is partial over). Collective over those groups: every device must call it.
/// @throws replica_mismatch naming the first differing device (in group order), the element and both values.
template <local_tensor_type L>
void check_replicated(const L& x) {
  detail::check_replicated_over(x, L::mesh_type::all_axes & ~L::vary & ~L::partial, "check_replicated");
}

/// @brief `check_replicated` over the axes `Names...` only; `x` must be invariant over each.
template <fixed_string... Names, local_tensor_type L>
  requires(sizeof...(Names) > 0)
void check_replicated(const L& x) {
  using Mesh = typename L::mesh_type;
  static_assert((Mesh::template has_axis<Names> && ...), "meshlib: check_replicated<...>: the mesh has no such axis");
  constexpr axis_mask mask = Mesh::template mask_of<Names...>();
  static_assert((mask & (L::vary | L::partial)) == 0,
                "meshlib: check_replicated<...>: the value varies over (or is a pending sum over) one of these axes, "
                "so its copies are not expected to agree; check only axes its type is invariant over");
  detail::check_replicated_over(x, mask, "check_replicated");
}

namespace detail {

/// Debug mode's check of `shard_map` outputs (a tuple of local tensors), called on every device.
template <class Tuple>
void debug_check_outputs(const Tuple& outputs) {
  if (!debug_mode()) [[likely]]
    return;
  {
    auto& s = debug_state::get();
    std::lock_guard lk(s.m);
    if (!s.options.check_replicas) return;
  }
  std::apply(
      [](const auto&... o) {
        (check_replicated_over(o, std::remove_cvref_t<decltype(o)>::mesh_type::all_axes &
                                      ~std::remove_cvref_t<decltype(o)>::vary & ~std::remove_cvref_t<decltype(o)>::partial,
                               "shard_map output (debug mode)"),
         ...);
      },
      outputs);
}

}  // namespace detail
}  // namespace meshlib
// end meshlib/debug/check_replicated.hpp

namespace meshlib {

/// @brief A list of partition specs: the in_specs (or out_specs) of a `shard_map` with several
/// inputs (outputs). A single `P<...>` stands for a list of one.
template <partition_spec_type... Specs>
struct specs {
  /// Tag that marks the type as a list of specs, one per argument or result.
  using is_spec_list = void;
  /// How many specs the list holds (one per argument or result).
  static constexpr std::size_t size = sizeof...(Specs);
};

namespace detail {

template <class S>
struct spec_list {
  static_assert(partition_spec_type<S>, "meshlib: shard_map: in_specs / out_specs must be a P<...> or a specs<P<...>, ...>");
  using type = specs<S>;
  static constexpr bool single = true;
};
template <class... S>
struct spec_list<specs<S...>> {
  using type = specs<S...>;
  static constexpr bool single = false;
};

template <std::size_t I, class List>
struct spec_at;
template <std::size_t I, class... S>
struct spec_at<I, specs<S...>> {
  using type = std::tuple_element_t<I, std::tuple<S...>>;
};

// The diagnostics below name the output, the axis, the out_spec and the value's layout in their
// failing condition (see core/diagnostics.hpp): one error on GCC and Clang.

template <class Output, class Value>
consteval bool shard_map_output_is_not_a_local_tensor() {
  static_assert(always_false<Output, Value>,
                "meshlib: shard_map: the function must return a local_tensor (or a std::tuple of them, one per "
                "out_spec)");
  return false;
}

template <class Output, class Axes, class OutSpec, class Value>
consteval bool shard_map_output_is_partial() {
  static_assert(always_false<Output, Axes, OutSpec, Value>,
                "meshlib: shard_map: an output is a pending sum (partial) over a mesh axis; complete it with psum, or "
                "psum_scatter, over that axis before returning it");
  return false;
}

template <class Output, class Axes, class OutSpec, class Value>
consteval bool shard_map_output_varies_over_unsharded_axis() {
  static_assert(always_false<Output, Axes, OutSpec, Value>,
                "meshlib: shard_map: an output varies over a mesh axis that its out_spec does not shard it over: its "
                "blocks differ along that axis, so no one global array holds them; psum / pmean / all_gather over the "
                "axis, or shard the output over it in out_specs");
  return false;
}

template <class Output, class Value>
consteval bool shard_map_output_on_another_mesh() {
  static_assert(always_false<Output, Value>,
                "meshlib: shard_map: an output lives on another mesh type than the shard_map's");
  return false;
}

/// JAX's check_vma for output `Output`, one static_assert on the first unmet requirement.
template <std::size_t Output, class Mesh, class OutSpec, class L>
consteval bool check_output() {
  using out_t = diagnostic::dim<Output>;
  if constexpr (!local_tensor_type<L>) {
    return shard_map_output_is_not_a_local_tensor<out_t, L>();
  } else if constexpr (!std::is_same_v<typename L::mesh_type, Mesh>) {
    return shard_map_output_on_another_mesh<out_t, L>();
  } else if constexpr (!diagnose_sharding<Mesh, OutSpec>() || !named_sharding<Mesh, OutSpec>::template check_rank<L::rank>()) {
    return false;
  } else if constexpr (OutSpec::size > L::rank) {
    return false;  // check_rank fired the diagnostic
  } else {
    using S = named_sharding<Mesh, OutSpec>;
    constexpr axis_mask unsharded_vary = L::vary & ~S::sharded_axes;
    if constexpr (L::partial != 0)
      return shard_map_output_is_partial<out_t, diag_axes_t<Mesh, L::partial>, diag_spec_t<OutSpec>, diag_value_t<L>>();
    else if constexpr (unsharded_vary != 0)
      return shard_map_output_varies_over_unsharded_axis<out_t, diag_axes_t<Mesh, unsharded_vary>, diag_spec_t<OutSpec>,
                                                         diag_value_t<L>>();
    else return true;
  }
}

template <class R>
struct as_tuple {
  using type = std::tuple<R>;
  static std::tuple<R> wrap(R r) { return std::tuple<R>(std::move(r)); }
};
template <class... R>
struct as_tuple<std::tuple<R...>> {
  using type = std::tuple<R...>;
  static std::tuple<R...> wrap(std::tuple<R...> r) { return r; }
};

/// The global type an output of local type `L` assembles into under `OutSpec`.
template <class Mesh, class OutSpec, class L>
using global_of_t = sharded_tensor<typename L::value_type, L::rank, named_sharding<Mesh, OutSpec>, typename L::memory_space>;

}  // namespace detail

/// @brief The function `shard_map` returns: call it with the global inputs.
template <class Fn, mesh_type Mesh, class InSpecs, class OutSpecs, class Backend>
class shard_map_fn {
  using in_list = typename detail::spec_list<InSpecs>::type;
  using out_list = typename detail::spec_list<OutSpecs>::type;
  static constexpr bool single_output = detail::spec_list<OutSpecs>::single;

 public:
  /// Wraps `fn` to run on every device of `mesh` through `backend`.
  shard_map_fn(Fn fn, const Mesh& mesh, Backend backend) : fn_(std::move(fn)), mesh_(mesh), backend_(std::move(backend)) {}

  /// Runs the function on every device. `xs` are global `sharded_tensor`s on this mesh, one per in-spec.
  /// @returns one global `sharded_tensor` (or a `std::tuple` of them, for `specs<...>` out_specs).
  /// @throws device_error when a device throws; sharding_error when an input does not fit its in-spec.
  template <sharded_tensor_type... Xs>
  auto operator()(const Xs&... xs) const {
    static_assert(sizeof...(Xs) == in_list::size,
                  "meshlib: shard_map: the number of arguments differs from the number of in_specs");
    static_assert((std::is_same_v<typename Xs::mesh_type, Mesh> && ...),
                  "meshlib: shard_map: every input must be sharded over the shard_map's mesh type");
    // A bad in_spec fires its one diagnostic here and stops: the body is not instantiated on a
    // local type that cannot exist, which would add a screenful of follow-on errors.
    constexpr bool specs_ok = check_in_specs(std::index_sequence_for<Xs...>{});
    if constexpr (!specs_ok) return;
    else return call(std::index_sequence_for<Xs...>{}, xs...);
  }

 private:
  template <std::size_t I, class X>
  auto prepare(const X& x) const {
    using spec_t = typename detail::spec_at<I, in_list>::type;
    using sharding_t = named_sharding<Mesh, spec_t>;
    if (!(x.mesh() == mesh_))
      throw sharding_error("meshlib: shard_map: input " + std::to_string(I) + " lives on mesh " + x.mesh().to_string() +
                           " but the shard_map runs on " + mesh_.to_string());
    if constexpr (std::is_same_v<typename X::sharding_type, sharding_t>) {
      if (x.sharding().rule() == shard_rule::even) return x;
    }
    // shard_map gives every device a block of one shape (as JAX's), so an input must split evenly
    // under its in_spec; say so in shard_map's words (the layout's own advice, shard_rule::uneven,
    // is what this input may already use).
    const sharding_t even(mesh_, shard_rule::even);
    for (std::size_t d = 0; d < X::rank; ++d)
      if (x.global_shape()[d] % even.num_shards(d) != 0)
        throw sharding_error("meshlib: shard_map: input " + std::to_string(I) + " has global shape " +
                             detail::describe_shape(x.global_shape()) + ", whose dimension " + std::to_string(d) +
                             " (size " + std::to_string(x.global_shape()[d]) + ") does not split evenly into the " +
                             std::to_string(even.num_shards(d)) + " shards of " + detail::describe_dim_axes(even, d) +
                             " in its in_spec " + spec_t::to_string() +
                             "; shard_map needs equal blocks on every device (as JAX's): pad the dimension to a "
                             "multiple of " + std::to_string(even.num_shards(d)) + ", or shard it over fewer devices");
    return reshard(x, even, backend_);
  }

  template <std::size_t... I, class... Xs>
  auto call(std::index_sequence<I...>, const Xs&... xs) const {
    detail::require_kokkos("shard_map");
    auto inputs = std::make_tuple(prepare<I>(xs)...);
    using result_t = std::invoke_result_t<const Fn&, typename std::tuple_element_t<I, decltype(inputs)>::local_type...>;
    using results_t = typename detail::as_tuple<std::remove_cvref_t<result_t>>::type;
    constexpr std::size_t n_out = std::tuple_size_v<results_t>;
    static_assert(n_out == out_list::size,
                  "meshlib: shard_map: the function returns a different number of outputs than out_specs has specs");
    constexpr bool ok = check_outputs<results_t>(std::make_index_sequence<n_out>{});
    if constexpr (!ok) {
      return;
    } else {
      const std::size_t n = mesh_.size();
      std::vector<results_t> per_device(n);
      detail::run_devices(mesh_, backend_, [&](std::size_t dev) {
        per_device[dev] = detail::as_tuple<std::remove_cvref_t<result_t>>::wrap(fn_(std::get<I>(inputs).local_value(dev)...));
        detail::debug_check_outputs(per_device[dev]);  // debug mode: replicated outputs must agree
      });
      auto outs = assemble<results_t>(per_device, std::make_index_sequence<n_out>{});
      if constexpr (single_output) return std::get<0>(std::move(outs));
      else return outs;
    }
  }

  template <std::size_t... I>
  static consteval bool check_in_specs(std::index_sequence<I...>) {
    return (detail::diagnose_sharding<Mesh, typename detail::spec_at<I, in_list>::type>() && ...);
  }

  template <class Results, std::size_t... O>
  static consteval bool check_outputs(std::index_sequence<O...>) {
    return (detail::check_output<O, Mesh, typename detail::spec_at<O, out_list>::type, std::tuple_element_t<O, Results>>() &&
            ...);
  }

  template <class Results, std::size_t... O>
  auto assemble(std::vector<Results>& per_device, std::index_sequence<O...>) const {
    return std::make_tuple(assemble_one<O, Results>(per_device)...);
  }

  template <std::size_t O, class Results>
  auto assemble_one(std::vector<Results>& per_device) const {
    using local_t = std::tuple_element_t<O, Results>;
    using spec_t = typename detail::spec_at<O, out_list>::type;
    using global_t = detail::global_of_t<Mesh, spec_t, local_t>;
    using sharding_t = typename global_t::sharding_type;
    const sharding_t sharding(mesh_, shard_rule::even);
    const std::size_t n = mesh_.size();
    std::vector<typename global_t::view_type> blocks(n);
    std::vector<bool> local(n, false);
    std::vector<std::array<std::size_t, local_t::rank>> shapes(n);
    for (std::size_t dev : backend_.local_devices(n)) {
      const local_t& v = std::get<O>(per_device[dev]);
      blocks[dev] = v.view();
      local[dev] = true;
      shapes[dev] = v.shape();
    }
    // Devices another process runs (MPI backends): under the even rule every block has the shape
    // of this process's blocks.
    const std::size_t first_local = backend_.local_devices(n).front();
    for (std::size_t dev = 0; dev < n; ++dev)
      if (!local[dev]) shapes[dev] = shapes[first_local];
    const auto global = global_shape_from_locals(sharding, std::span<const std::array<std::size_t, local_t::rank>>(shapes));
    return global_t(sharding, global, std::move(blocks), std::move(local));
  }

  Fn fn_;
  Mesh mesh_;
  Backend backend_;
};

/// @brief `fn` mapped over the blocks of its inputs on `mesh` (JAX `shard_map(fn, mesh=, in_specs=,
/// out_specs=)`). `in_specs` / `out_specs`: a `P<...>{}` for one input / output, or
/// `specs<P<...>, ...>{}` for several (then `fn` returns a `std::tuple`). `fn` is called once per
/// device with that device's `local_tensor` blocks, on `backend`, a `runner` (default:
/// `default_runner`: this process's device threads, or the processes' once `mpi::initialize` has
/// started several; exec/default_runner.hpp).
template <class Fn, mesh_type Mesh, class InSpecs, class OutSpecs, runner Backend = default_runner>
[[nodiscard]] auto shard_map(Fn fn, const Mesh& mesh, InSpecs, OutSpecs, Backend backend = {}) {
  return shard_map_fn<Fn, Mesh, InSpecs, OutSpecs, Backend>(std::move(fn), mesh, std::move(backend));
}

}  // namespace meshlib
// end meshlib/exec/shard_map.hpp
// begin meshlib/exec/global_reshard.hpp
/// @file
/// @brief `reshard(x, to, runner)` and `reshard<ToSpec>(x, runner)`: the plan of
/// collectives/reshard.hpp run on a runner's devices; and without a runner, on `default_runner`, as
/// `spmd` and `shard_map` without one. In one process that is every device on the process-wide
/// device threads; after `mpi::initialize` in a run of several processes, each process runs the
/// devices whose blocks it holds and the steps of the plan go between the processes, so the same
/// line reshards a tensor on threads and under `mpirun` (a thread default there would run devices
/// whose blocks the process does not hold).
///
/// Why here and not in collectives/reshard.hpp: running a plan runs devices (a runner, with the
/// device context and the debug layer's observer installed: exec/detail/run_devices.hpp), and the
/// default runner chooses between the thread and the multi-process runners, which live in this
/// layer; the collectives layer below holds the plan and each device's steps.
/// @code
/// meshlib::mpi::guard run;                                            // mpirun -np 2
/// auto x = meshlib::from_host(meshlib::named_sharding<mesh_t, meshlib::P<"x">>{m}, shape, host);
/// auto y = meshlib::reshard<meshlib::P<>>(x);   // every process holds its devices' full copies
/// @endcode

#include <algorithm>
#include <cstddef>
#include <span>
#include <string>
#include <vector>


namespace meshlib {

/// @brief `x` laid out by sharding `to` (same mesh; the rule may differ). Runs `plan_reshard(x, to)`
/// on every device that `backend` runs in this process. Without a runner, `reshard(x, to)` runs
/// on `default_runner` (below), as `spmd` and `shard_map` do.
/// @throws sharding_error when the shape does not fit `to` (even rule and a size that does not
/// divide), or when `backend` runs a device whose block `x` does not hold in this process.
template <sharded_tensor_type X, sharding_type To, class Backend>
[[nodiscard]] auto reshard(const X& x, const To& to, const Backend& backend) {
  using T = typename X::value_type;
  constexpr std::size_t Rank = X::rank;
  using result_t = sharded_tensor<T, Rank, To, typename X::memory_space>;
  const reshard_plan plan = plan_reshard(x, to);
  const std::vector<std::size_t> run = backend.local_devices(x.mesh().size());
  for (std::size_t dev : run)
    if (!x.is_local(dev))
      throw sharding_error("meshlib: reshard: the runner runs device " + std::to_string(dev) +
                           " in this process, but the tensor holds no block of it here (it holds devices " +
                           detail::describe_devices(x.local_devices()) +
                           "); pass the runner that runs the tensor's devices");
  result_t out(to, x.global_shape(), std::span<const std::size_t>(run));
  if (plan.empty()) {
    // Same blocks: copy them (the result owns its memory, as after any reshard).
    for (auto dev : out.local_devices())
      std::copy_n(x.local(dev).data(), x.local(dev).size(), out.local(dev).data());
    return out;
  }
  const auto from = detail::to_dyn_spec<typename X::sharding_type>(Rank);
  detail::run_devices(x.mesh(), backend, [&](std::size_t dev) {
    detail::run_reshard_plan<T, typename X::memory_space>(plan, x.mesh(), dev, from, x.sharding().rule(), to.rule(), x.global_shape(),
                                x.local(dev).data(), out.local(dev).data());
  });
  return out;
}

/// @brief `x` laid out by `ToSpec` on the same mesh, with the same shard rule, on `backend`'s
/// devices (without a runner: `default_runner`, below).
template <partition_spec_type ToSpec, sharded_tensor_type X, class Backend>
[[nodiscard]] auto reshard(const X& x, const Backend& backend) {
  return reshard(x, named_sharding<typename X::mesh_type, ToSpec>(x.mesh(), x.sharding().rule()), backend);
}

/// @brief `x` laid out by sharding `to` (same mesh; the rule may differ), on `default_runner`.
/// @throws sharding_error as `reshard(x, to, runner)`; the default runner's errors (a mesh that
/// does not split over the processes, several processes without MPI).
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto reshard(const X& x, const To& to) {
  return reshard(x, to, default_runner{});
}

/// @brief `x` laid out by `ToSpec` on the same mesh, with the same shard rule, on `default_runner`.
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] auto reshard(const X& x) {
  return reshard<ToSpec>(x, default_runner{});
}

}  // namespace meshlib
// end meshlib/exec/global_reshard.hpp
// begin meshlib/exec/device_put.hpp
/// @file
/// @brief JAX's names for placing an array in a sharding, for users translating JAX programs:
/// `device_put` (`jax.device_put(x, sharding)`) and `with_sharding_constraint`
/// (`jax.lax.with_sharding_constraint(x, sharding)` inside global-view code). They are thin
/// aliases: `device_put` of a host array is `from_host`, of a sharded tensor `reshard`;
/// `with_sharding_constraint` is `reshard`.
///
/// Why aliases and not new operations: JAX has two names because under `jit` a constraint is a hint
/// to the compiler and `device_put` a transfer. meshlib's global-view ops run eagerly, so both
/// mean "this array, laid out by that sharding", which `reshard` already does (a copy with the
/// same blocks when the layout already matches, as `reshard` always returns an owning result).
/// Inside `shard_map` / `spmd` a value is a per-device `local_tensor` and has no global sharding to
/// constrain; these functions take only `sharded_tensor`s and host arrays.
/// @code
/// const meshlib::named_sharding<mesh_t, meshlib::P<"data", meshlib::none>> rows{m};
/// auto x = meshlib::device_put(host, std::array<std::size_t, 2>{8, 4}, rows);  // jax.device_put(x, rows)
/// auto y = meshlib::with_sharding_constraint<meshlib::P<meshlib::none, "data">>(meshlib::map(f, x));
/// @endcode

#include <array>
#include <cstddef>
#include <span>
#include <type_traits>
#include <vector>


namespace meshlib {

/// @brief `jax.device_put(x, sharding)` for a host array: the global row-major array `host` of
/// shape `shape`, scattered into the blocks of `sharding`. Same as `from_host(sharding, shape, host)`
/// (the shape comes second because a C++ span does not carry one).
/// @throws sharding_error as `from_host`: `host.size()` is not the product of `shape`, or the shape
/// does not fit the sharding.
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
[[nodiscard]] auto device_put(std::span<T> host, const std::array<std::size_t, Rank>& shape, const S& sharding) {
  return from_host<Space>(sharding, shape, host);
}

/// @brief `device_put` of a `std::vector` (see the span overload).
template <class Space = default_memory_space, class T, std::size_t Rank, sharding_type S>
[[nodiscard]] auto device_put(const std::vector<T>& host, const std::array<std::size_t, Rank>& shape,
                              const S& sharding) {
  return from_host<Space>(sharding, shape, std::span<const T>(host));
}

/// @brief `jax.device_put(x, sharding)` for an array that is already sharded: `reshard(x, sharding)`
/// (same mesh; the shard rule may differ), on `default_runner`.
/// @throws sharding_error as `reshard`.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto device_put(const X& x, const To& sharding) {
  return reshard(x, sharding);
}

/// @brief `jax.lax.with_sharding_constraint(x, sharding)` in global-view code: `x` laid out by
/// `sharding` (`reshard(x, sharding)`), so the code that follows sees that layout in its type.
/// @throws sharding_error as `reshard`.
template <sharded_tensor_type X, sharding_type To>
[[nodiscard]] auto with_sharding_constraint(const X& x, const To& sharding) {
  return reshard(x, sharding);
}

/// @brief `with_sharding_constraint(x, P(...))` with the spec only: `reshard<ToSpec>(x)` (same mesh
/// and shard rule).
template <partition_spec_type ToSpec, sharded_tensor_type X>
[[nodiscard]] auto with_sharding_constraint(const X& x) {
  return reshard<ToSpec>(x);
}

}  // namespace meshlib
// end meshlib/exec/device_put.hpp
// end meshlib/exec.hpp
// begin meshlib/runtime.hpp
/// @file
/// @brief The runtime layer: the processes of a run (`distributed::initialize`, launcher
/// detection, process index and count, local devices, global mesh checks), per-process data
/// loading, and Kokkos initialisation. Depends on core and comm; the MPI transport comes in through
/// <meshlib/mpi.hpp>.

// begin meshlib/runtime/process_data.hpp
/// @file
/// @brief Per-process data loading: which rows of a global batch this process's devices own under
/// a sharding, so a data pipeline reads only its share (JAX's `ds.shard(num_shards=process_count(),
/// index=process_index())`), and how the rows a process read split into its devices' shards
/// (`jax.make_array_from_process_local_data`).
///
/// @code
/// meshlib::shard_layout layout{sharding, std::array<std::size_t, 2>{global_batch, features}};
/// auto rows = meshlib::distributed::process_rows(layout);             // e.g. {[64, 128)}
/// std::vector<float> mine = read_rows(rows);                          // rows x features, row-major
/// auto shards = meshlib::distributed::split_process_local_data<float>(layout, mine);
/// // shards[i]: the row-major block of local device i (local_devices()[i])
/// @endcode
///
/// The process-local data is the concatenation, in `process_rows` order, of the global rows this
/// process's devices hold, each row complete in the other dimensions (a process reads whole
/// examples; devices that split the other dimensions take their columns from them).

#include <algorithm>
#include <array>
#include <cstddef>
#include <ostream>
#include <span>
#include <string>
#include <vector>


namespace meshlib::distributed {

/// @brief Rows `[begin, end)` of dimension 0 of a global array.
struct row_range {
  /// The first row.
  std::size_t begin = 0;
  /// One past the last row.
  std::size_t end = 0;
  /// The number of rows, `end - begin`.
  [[nodiscard]] constexpr std::size_t size() const noexcept { return end - begin; }
  /// Equal when begin and end are.
  friend constexpr bool operator==(const row_range&, const row_range&) = default;
  /// Prints `[begin, end)`.
  friend std::ostream& operator<<(std::ostream& os, const row_range& r) { return os << '[' << r.begin << ", " << r.end << ')'; }
};

/// @brief The rows of dimension 0 that the devices of process `process` (each process owning
/// `local_devices` consecutive global devices) hold under `layout`: sorted, disjoint, adjacent
/// ranges merged, empty blocks skipped. Defaults: this process, `local_device_count()`.
/// @post The ranges of all processes cover every row; processes that hold replicas of one block
/// (the batch is replicated over an axis that spans processes) get the same rows.
template <sharding_type S, std::size_t Rank>
std::vector<row_range> process_rows(const shard_layout<S, Rank>& layout, std::size_t process,
                                    std::size_t local_devices) {
  static_assert(Rank >= 1, "meshlib: process_rows needs an array of rank at least 1");
  if (local_devices == 0 || (process + 1) * local_devices > layout.num_devices())
    throw mesh_error("meshlib: process_rows: process " + std::to_string(process) + " with " +
                     std::to_string(local_devices) + " local devices lies outside the mesh " +
                     layout.sharding().mesh().to_string() + " of " + std::to_string(layout.num_devices()) +
                     " devices");
  std::vector<row_range> r;
  for (std::size_t i = 0; i < local_devices; ++i) {
    const auto b = layout.block_of(process * local_devices + i);
    if (b.extent[0] > 0) r.push_back({b.offset[0], b.offset[0] + b.extent[0]});
  }
  std::sort(r.begin(), r.end(), [](const row_range& a, const row_range& b) { return a.begin < b.begin; });
  std::vector<row_range> merged;
  for (const auto& x : r) {
    if (!merged.empty() && x.begin <= merged.back().end)
      merged.back().end = std::max(merged.back().end, x.end);
    else
      merged.push_back(x);
  }
  return merged;
}

/// @brief The global rows (dimension 0) this process's devices hold, merged into ranges: what it must load.
template <sharding_type S, std::size_t Rank>
std::vector<row_range> process_rows(const shard_layout<S, Rank>& layout) {
  return process_rows(layout, process_index(), local_device_count());
}

/// @brief Number of rows in `ranges`: the rows of the process-local data.
[[nodiscard]] inline std::size_t row_count(const std::vector<row_range>& ranges) noexcept {
  std::size_t n = 0;
  for (const auto& r : ranges) n += r.size();
  return n;
}

/// @brief Splits the process-local data (the rows of `process_rows`, concatenated, row-major over
/// the global shape's other dimensions) into the row-major block of each of the process's devices.
/// Defaults: this process, `local_device_count()`.
/// @throws sharding_error when `local` has another number of elements than the process's rows.
template <class T, sharding_type S, std::size_t Rank>
std::vector<std::vector<T>> split_process_local_data(const shard_layout<S, Rank>& layout, std::span<const T> local,
                                                     std::size_t process, std::size_t local_devices) {
  const auto rows = process_rows(layout, process, local_devices);
  const auto& g = layout.global_shape();
  std::size_t row_elems = 1;
  for (std::size_t d = 1; d < Rank; ++d) row_elems *= g[d];
  if (local.size() != row_count(rows) * row_elems)
    throw sharding_error("meshlib: split_process_local_data: process " + std::to_string(process) + " holds rows " +
                         std::to_string(row_count(rows)) + " x " + std::to_string(row_elems) + " = " +
                         std::to_string(row_count(rows) * row_elems) + " elements under " +
                         layout.sharding().to_string() + ", but " + std::to_string(local.size()) + " were given");
  // Local row of global row `gr`: its position within the concatenated ranges.
  auto local_row = [&](std::size_t gr) {
    std::size_t base = 0;
    for (const auto& r : rows) {
      if (gr < r.end) return base + (gr - r.begin);
      base += r.size();
    }
    return base;  // unreachable for rows the process holds
  };
  std::vector<std::vector<T>> out;
  out.reserve(local_devices);
  for (std::size_t i = 0; i < local_devices; ++i) {
    const auto b = layout.block_of(process * local_devices + i);
    std::vector<T> shard;
    shard.reserve(b.size());
    std::array<std::size_t, Rank> idx{};
    for (std::size_t k = 0; k < b.size(); ++k) {
      // idx runs row-major over the block; the source is row-major over (local rows, g[1..]).
      std::size_t src = local_row(b.offset[0] + idx[0]);
      for (std::size_t d = 1; d < Rank; ++d) src = src * g[d] + b.offset[d] + idx[d];
      shard.push_back(local[src]);
      for (std::size_t d = Rank; d-- > 0;) {
        if (++idx[d] < b.extent[d]) break;
        idx[d] = 0;
      }
    }
    out.push_back(std::move(shard));
  }
  return out;
}

/// @brief Splits the rows this process loaded (`process_rows`, row-major) into one block per local device.
template <class T, sharding_type S, std::size_t Rank>
std::vector<std::vector<T>> split_process_local_data(const shard_layout<S, Rank>& layout, std::span<const T> local) {
  return split_process_local_data<T>(layout, local, process_index(), local_device_count());
}

}  // namespace meshlib::distributed
// end meshlib/runtime/process_data.hpp
// end meshlib/runtime.hpp
// begin meshlib/debug.hpp
/// @file
/// @brief The debug layer: traces (Chrome trace JSON, Kokkos profiling regions, a summary),
/// launch counts, per-device printing, sharding pictures and descriptions, and debug mode's checks (replicas,
/// NaN/Inf, late devices). See docs/debugging.md.

// begin meshlib/debug/trace_region.hpp
/// @file
/// @brief `trace_region`: a named span of the program, as `jax.profiler.TraceAnnotation`. It shows
/// on the running device's track of the trace (or the host track outside `shard_map` / `spmd`),
/// and Kokkos tools see it as a profiling region (`Kokkos::Profiling::pushRegion`/`popRegion`)
/// next to the kernels. `scoped_region` is another name for it.
/// @code
/// meshlib::spmd(m, [&] {
///   meshlib::trace_region r("forward");
///   auto h = meshlib::psum<"model">(matmul(x, w));
/// });
/// @endcode

#include <cstddef>
#include <string>
#include <utility>


namespace meshlib {

/// @brief Marks its scope as a region named `name` (see the file comment). Costs one check of a
/// flag when neither tracing nor a Kokkos tool is on. Used as `trace_region` (a template only so
/// that the recorder's code is compiled where it is used: see `detail::basic_trace_recorder`).
template <class Tag = void>
class basic_trace_region {
  using recorder = detail::basic_trace_recorder<Tag>;

 public:
  /// Opens the region `name`; it closes when the object is destroyed.
  explicit basic_trace_region(std::string name) {
    auto& rec = recorder::get();
#if MESHLIB_DEBUG_HAS_KOKKOS
    kokkos_ = Kokkos::Profiling::profileLibraryLoaded();
    if (kokkos_) Kokkos::Profiling::pushRegion(name);
#endif
    if (!rec.on()) return;
    const detail::device_context* ctx = detail::current_device_slot();
    track_ = &rec.track_of(ctx ? ctx->device() : detail::host_track);
    name_ = std::move(name);
    start_ = rec.now_ns();
  }
  ~basic_trace_region() {
#if MESHLIB_DEBUG_HAS_KOKKOS
    if (kokkos_) Kokkos::Profiling::popRegion();
#endif
    if (track_ == nullptr) return;
    auto& rec = recorder::get();
    detail::trace_event e;
    e.name = std::move(name_);
    e.start_ns = start_;
    e.end_ns = rec.now_ns();
    try {
      rec.record(*track_, std::move(e));
    } catch (...) {  // NOLINT(bugprone-empty-catch): out of memory while tracing: lose the event, not the program
    }
  }
  basic_trace_region(const basic_trace_region&) = delete;
  basic_trace_region& operator=(const basic_trace_region&) = delete;

 private:
  typename recorder::track* track_ = nullptr;
  std::string name_;
  std::int64_t start_ = 0;
  bool kokkos_ = false;
};

/// @brief A named span of the program (see `basic_trace_region`).
using trace_region = basic_trace_region<>;

/// @brief Another name for `trace_region`.
using scoped_region = trace_region;

}  // namespace meshlib
// end meshlib/debug/trace_region.hpp
// begin meshlib/debug/launch_counter.hpp
/// @file
/// @brief `launch_counter`: how many kernels a piece of the program launches, by name, as Kokkos
/// tools see them, plus the matrix products the BLAS makes (which Kokkos does not see).
///
/// Why count launches: on a GPU every launch costs a few microseconds whatever its size, so a
/// training step of small layers is bound by how many kernels it launches, not by their work
/// (issue 38: at most 30 per step of the flagship's MLP). The count does not depend on the backend,
/// so it is measured and tested on the CPU: a change that adds a kernel to the step shows here.
///
/// How: while a counter lives it installs Kokkos Tools callbacks (`begin_parallel_for`,
/// `begin_parallel_reduce`, `begin_parallel_scan`, and `push_region` for the products: each product
/// the BLAS makes is the profiling region `meshlib::blas_product_region`, see tensor/matmul_into.hpp)
/// and puts the previous ones back when it ends. A tool loaded through `KOKKOS_TOOLS_LIBS` keeps
/// receiving every event: the counter forwards to it. Counters nest (each counts what happens while
/// it lives); they must end in the reverse order of their start, as scopes do.
///
/// Counting takes a lock per launch: measure times without a counter, and counts with one.
/// @code
/// nn::train_step(state, x, y);                // warm-up: buffers allocated on the first steps
/// meshlib::launch_counter count;
/// nn::train_step(state, x, y);
/// std::cout << count.kernels() << " kernels + " << count.products() << " products\n" << count;
/// @endcode

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <ostream>
#include <string>

#include <Kokkos_Core.hpp>

#if __has_include(<cxxabi.h>)
#include <cxxabi.h>
#endif


namespace meshlib {

/// @brief Counts the kernel launches (Kokkos `parallel_for`, `parallel_reduce`, `parallel_scan`) and
/// the BLAS's matrix products of every device while it lives (see the file comment).
class launch_counter {
 public:
  /// Starts counting: installs the Kokkos Tools callbacks (after `Kokkos::initialize`).
  launch_counter() : previous_(Kokkos::Tools::Experimental::get_callbacks()), outer_(active()) {
    active() = this;
    auto events = previous_;
    using events_t = Kokkos::Tools::Experimental::EventSet;
    events.begin_parallel_for = &on_begin<&events_t::begin_parallel_for>;
    events.begin_parallel_reduce = &on_begin<&events_t::begin_parallel_reduce>;
    events.begin_parallel_scan = &on_begin<&events_t::begin_parallel_scan>;
    events.push_region = &on_push;
    Kokkos::Tools::Experimental::set_callbacks(events);
  }
  /// Stops counting: puts the callbacks that were installed at the start back.
  ~launch_counter() {
    Kokkos::Tools::Experimental::set_callbacks(previous_);
    active() = outer_;
  }
  launch_counter(const launch_counter&) = delete;
  launch_counter& operator=(const launch_counter&) = delete;

  /// @returns the Kokkos kernels launched so far, on every device (a product run as meshlib's own
  /// kernel, when no BLAS is used, is one of them).
  [[nodiscard]] std::size_t kernels() const noexcept { return kernels_.load(); }
  /// @returns the matrix products the BLAS made so far, on every device (not Kokkos kernels).
  [[nodiscard]] std::size_t products() const noexcept { return products_.load(); }
  /// @returns `kernels() + products()`: what a GPU would launch (a product is one cuBLAS call).
  [[nodiscard]] std::size_t launches() const noexcept { return kernels() + products(); }
  /// @returns the count of each kernel name (Kokkos' label, or the functor's type name where the
  /// launch gave none, demangled where the compiler can) and of `blas_product_region`, in name order.
  [[nodiscard]] std::map<std::string, std::size_t> by_name() const {
    std::map<std::string, std::size_t> raw;
    {
      std::lock_guard lock(mutex_);
      raw = names_;
    }
    std::map<std::string, std::size_t> out;
    for (const auto& [name, n] : raw) out[demangled(name)] += n;
    return out;
  }
  /// Starts again from zero.
  void reset() {
    std::lock_guard lock(mutex_);
    names_.clear();
    kernels_ = 0;
    products_ = 0;
  }
  /// Prints the totals, then one line per name: `count  name`.
  friend std::ostream& operator<<(std::ostream& os, const launch_counter& c) {
    os << c.launches() << " launches: " << c.kernels() << " Kokkos kernels, " << c.products() << " BLAS products\n";
    for (const auto& [name, n] : c.by_name()) os << "  " << n << "  " << name << '\n';
    return os;
  }

 private:
  /// Kokkos names an unlabelled launch by `typeid(functor).name()`: mangled on GCC and Clang, and
  /// without the `_Z` a demangler wants for a lambda's local name. Demangled when read, not per launch.
  static std::string demangled(const std::string& name) {
#if __has_include(<cxxabi.h>)
    if (name.find_first_of(" :<[") != std::string::npos) return name;  // a label, not a mangled name
    for (const std::string& candidate : {"_Z" + name, name}) {
      int status = 0;
      char* d = abi::__cxa_demangle(candidate.c_str(), nullptr, nullptr, &status);
      if (status == 0 && d != nullptr) {
        std::string out(d);
        std::free(d);
        return out;
      }
      std::free(d);
    }
#endif
    return name;
  }
  static launch_counter*& active() noexcept {
    static launch_counter* a = nullptr;
    return a;
  }
  /// The callbacks of the tool under every counter (the outermost counter's `previous_`).
  static const Kokkos::Tools::Experimental::EventSet& tool() noexcept {
    const launch_counter* c = active();
    while (c->outer_ != nullptr) c = c->outer_;
    return c->previous_;
  }
  void count(const char* name, bool product) {
    (product ? products_ : kernels_).fetch_add(1);
    std::lock_guard lock(mutex_);
    ++names_[name];
  }
  /// The callback for one kind of launch (`Begin`: its field of the event set), so that a tool
  /// under the counter gets each launch as the kind it was.
  template <auto Begin>
  static void on_begin(const char* name, std::uint32_t device, std::uint64_t* id) {
    for (launch_counter* c = active(); c != nullptr; c = c->outer_) c->count(name, false);
    if (auto f = tool().*Begin) f(name, device, id);
  }
  static void on_push(const char* name) {
    if (std::strcmp(name, blas_product_region) == 0)
      for (launch_counter* c = active(); c != nullptr; c = c->outer_) c->count(name, true);
    if (auto f = tool().push_region) f(name);
  }

  Kokkos::Tools::Experimental::EventSet previous_;
  launch_counter* outer_;
  std::atomic<std::size_t> kernels_{0};
  std::atomic<std::size_t> products_{0};
  mutable std::mutex mutex_;
  std::map<std::string, std::size_t> names_;
};

}  // namespace meshlib
// end meshlib/debug/launch_counter.hpp
// begin meshlib/debug/debug_print.hpp
/// @file
/// @brief `debug_print(format, values...)` inside `shard_map` / `spmd`, as `jax.debug.print`: every
/// device prints one line, prefixed with its id and mesh coordinates, in device order, each line
/// whole. `{}` in the format stands for the next value; a `local_tensor` prints its elements.
/// @code
/// meshlib::spmd(m, [&] { meshlib::debug_print("x = {}, step {}", x, step); });
/// // [device 0 (data=0, model=0)] x = [1, 2], step 3
/// // [device 1 (data=0, model=1)] x = [3, 4], step 3
/// @endcode
///
/// Every device of the mesh must call it (it is collective, as every SPMD statement): the devices
/// take turns in id order, one whole-mesh barrier per turn, so lines never interleave and come in
/// order whatever the thread timing. Outside `shard_map` / `spmd` it prints the line once, unprefixed.
/// In multi-process runs each process prints its own devices' lines in turn; how the launcher
/// merges the processes' outputs is up to it.

#include <cstddef>
#include <cstdint>
#include <iostream>
#include <sstream>
#include <string>
#include <string_view>


namespace meshlib {

namespace detail {

template <class T>
void print_value(std::ostream& os, const T& v) {
  if constexpr (local_tensor_type<T>) {
    // Elements in row-major order, nested by dimension: [[1, 2], [3, 4]].
    const auto shape = v.shape();
    std::array<std::size_t, T::rank> idx{};
    const std::size_t n = v.size();
    if (n == 0) {
      os << "[]";
      return;
    }
    for (std::size_t k = 0; k < n; ++k) {
      std::size_t open = 0;
      for (std::size_t d = T::rank; d-- > 0 && idx[d] == 0;) ++open;
      if (k != 0) os << ", ";
      for (std::size_t i = 0; i < open; ++i) os << '[';
      const auto& x = std::apply([&](auto... i) -> decltype(auto) { return v.view()(i...); }, idx);
      if constexpr (sizeof(x) == 1) os << +x;
      else os << x;
      std::size_t close = 0;
      for (std::size_t d = T::rank; d-- > 0;) {
        if (++idx[d] < shape[d]) break;
        idx[d] = 0;
        ++close;
      }
      for (std::size_t i = 0; i < close; ++i) os << ']';
    }
  } else {
    os << v;
  }
}

inline void format_into(std::ostream& os, std::string_view fmt) { os << fmt; }

template <class A, class... Rest>
void format_into(std::ostream& os, std::string_view fmt, const A& a, const Rest&... rest) {
  const std::size_t at = fmt.find("{}");
  if (at == std::string_view::npos) {
    os << fmt;
    return;
  }
  os << fmt.substr(0, at);
  print_value(os, a);
  format_into(os, fmt.substr(at + 2), rest...);
}

/// Where `debug_print` writes (std::cout unless a test redirects it).
inline std::ostream*& debug_print_stream() noexcept {
  static std::ostream* s = &std::cout;
  return s;
}

}  // namespace detail

/// @brief Prints `format` with each `{}` replaced by the next value, once per device in device
/// order (see the file comment). Values: anything with `operator<<`, and `local_tensor`s.
template <class... Args>
void debug_print(std::string_view format, const Args&... values) {
  std::ostringstream line;
  detail::device_context* ctx = detail::current_device_slot();
  std::ostream& out = *detail::debug_print_stream();
  if (ctx == nullptr) {
    detail::format_into(line, format, values...);
    line << '\n';
    out << line.str() << std::flush;
    return;
  }
  std::size_t n = 1;
  for (std::size_t a = 0; a < ctx->axis_count(); ++a) n *= ctx->axis_size(a);
  line << "[device " << ctx->device() << " (";
  for (std::size_t a = 0; a < ctx->axis_count(); ++a) line << (a ? ", " : "") << ctx->axis_name(a) << '=' << ctx->coord(a);
  line << ")] ";
  detail::format_into(line, format, values...);
  line << '\n';
  const axis_mask all = (axis_mask{1} << ctx->axis_count()) - 1;  // every axis: the whole mesh
  detail::unobserved_scope quiet;
  auto& world = ctx->comm(all);
  for (std::size_t d = 0; d < n; ++d) {
    if (d == ctx->device()) out << line.str() << std::flush;
    std::int32_t turn = 0;
    world.all_reduce(&turn, 1, datatype::int32, reduce_op::sum);
  }
}

}  // namespace meshlib
// end meshlib/debug/debug_print.hpp
// begin meshlib/debug/visualize_sharding.hpp
/// @file
/// @brief A text picture of which devices hold which block of a global array, in the spirit of
/// `jax.debug.visualize_array_sharding`: 1-D and 2-D arrays as a grid of blocks, arrays of higher
/// rank as a table with one row per device (its coordinates and its block).
///
/// @code
/// std::cout << meshlib::visualize_sharding(sharding, std::array<std::size_t, 2>{4, 8});
/// // +-------------+-------------+
/// // |  dev 0,1    |  dev 2,3    |   <- devices that hold the block (replicas)
/// // | [0:4, 0:4]  | [0:4, 4:8]  |   <- the block, in NumPy slice notation
/// // +-------------+-------------+
/// @endcode

#include <algorithm>
#include <array>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>


namespace meshlib {

namespace detail {

/// Rank 3 and up: one row per device, `device | coordinates | block`.
template <sharding_type S, std::size_t Rank>
std::string block_table(const S& sharding, const shard_layout<S, Rank>& layout) {
  using Mesh = typename S::mesh_type;
  const auto& m = sharding.mesh();
  std::vector<std::array<std::string, 3>> rows{{"device", "coords", "block"}};
  for (std::size_t dev = 0; dev < m.size(); ++dev) {
    std::string coords;
    const auto c = m.coords(dev);
    for (std::size_t a = 0; a < Mesh::ndim; ++a)
      coords += (a ? ", " : "") + std::string(Mesh::axis_names[a]) + "=" + std::to_string(c[a]);
    std::ostringstream os;
    os << layout.block_of(dev);
    rows.push_back({std::to_string(dev), coords, os.str()});
  }
  std::array<std::size_t, 3> w{};
  for (const auto& r : rows)
    for (std::size_t k = 0; k < 3; ++k) w[k] = std::max(w[k], r[k].size());
  std::string out;
  for (const auto& r : rows) {
    std::string line;
    for (std::size_t k = 0; k < 3; ++k) line += (k ? " | " : "") + r[k] + std::string(w[k] - r[k].size(), ' ');
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + "\n";
  }
  return out;
}

}  // namespace detail

/// @brief Renders the blocks of a global array of shape `global_shape` under `sharding`. 1-D and
/// 2-D: one cell per block (rows: blocks of dimension 0; columns: blocks of dimension 1), each
/// naming the devices that hold it and its slice of the global array. Rank 3 and up: one row per
/// device with its mesh coordinates and its block.
/// @throws sharding_error as `shard_layout` does for a shape the sharding's rule cannot split.
template <sharding_type S, std::size_t Rank>
std::string visualize_sharding(const S& sharding, const std::array<std::size_t, Rank>& global_shape) {
  static_assert(Rank >= 1, "meshlib: visualize_sharding draws arrays of rank 1 and up");
  const shard_layout<S, Rank> layout(sharding, global_shape);
  if constexpr (Rank > 2) {
    return detail::block_table(sharding, layout);
  } else {
  const std::size_t rows = Rank == 2 ? sharding.num_shards(0) : 1;
  const std::size_t cols = sharding.num_shards(Rank - 1);

  std::vector<std::vector<std::string>> devs(rows, std::vector<std::string>(cols));
  std::vector<std::vector<std::string>> slices(rows, std::vector<std::string>(cols));
  for (std::size_t dev = 0; dev < sharding.mesh().size(); ++dev) {
    const std::size_t r = Rank == 2 ? sharding.shard_index(dev, 0) : 0;
    const std::size_t c = sharding.shard_index(dev, Rank - 1);
    devs[r][c] += (devs[r][c].empty() ? "dev " : ",") + std::to_string(dev);
    if (slices[r][c].empty()) {
      const auto b = layout.block_of(dev);
      std::ostringstream os;
      os << b;
      slices[r][c] = b.size() == 0 && global_shape[Rank - 1] != 0 ? "(empty)" : os.str();
    }
  }
  std::size_t width = 0;
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t c = 0; c < cols; ++c) width = std::max({width, devs[r][c].size(), slices[r][c].size()});
  width += 2;

  std::string rule = "+";
  for (std::size_t c = 0; c < cols; ++c) rule += std::string(width, '-') + "+";
  rule += '\n';
  auto cell = [width](const std::string& s) { return " " + s + std::string(width - 1 - s.size(), ' ') + "|"; };
  std::string out = rule;
  for (std::size_t r = 0; r < rows; ++r) {
    std::string a = "|", b = "|";
    for (std::size_t c = 0; c < cols; ++c) {
      a += cell(devs[r][c]);
      b += cell(slices[r][c]);
    }
    out += a + "\n" + b + "\n" + rule;
  }
  return out;
  }
}

}  // namespace meshlib
// end meshlib/debug/visualize_sharding.hpp
// begin meshlib/debug/describe.hpp
/// @file
/// @brief One-line type descriptions and plan descriptions, as JAX prints avals
/// (`f32[8@data,4@model]`), and `visualize` for any sharded tensor.
/// @code
/// meshlib::describe(x);      // "f32[8@data,4]": dim 0 split over 'data', dim 1 replicated
/// meshlib::visualize(x);     // that line, then the picture of the blocks (visualize_sharding)
/// meshlib::describe(meshlib::plan_reshard<meshlib::P<meshlib::none, "data">>(x));
/// // reshard P<"data", none> -> P<none, "data">: 1 step(s), 48 bytes in all
/// //   1. all_to_all over 'data' along dims 1 <-> 0 -> P<none, "data">
/// //      bytes sent: device 0: 24, device 1: 24
/// @endcode

#include <array>
#include <cstddef>
#include <cstdint>
#include <sstream>
#include <string>
#include <type_traits>


namespace meshlib {

namespace detail {

/// JAX's short dtype names.
template <class T>
constexpr const char* short_dtype_name() noexcept {
  if constexpr (std::is_same_v<T, float>) return "f32";
  else if constexpr (std::is_same_v<T, double>) return "f64";
  else if constexpr (std::is_same_v<T, bfloat16>) return "bf16";
  else if constexpr (std::is_same_v<T, std::int32_t>) return "i32";
  else if constexpr (std::is_same_v<T, std::int64_t>) return "i64";
  else if constexpr (std::is_same_v<T, std::int16_t>) return "i16";
  else if constexpr (std::is_same_v<T, std::int8_t>) return "i8";
  else if constexpr (std::is_same_v<T, std::uint32_t>) return "u32";
  else if constexpr (std::is_same_v<T, std::uint8_t>) return "u8";
  else if constexpr (std::is_same_v<T, bool>) return "bool";
  else return "?";
}

}  // namespace detail

/// @brief `f32[8@data,4@model]`: element type, then each global dimension with the mesh axes that
/// split it (`@(data,model)` for several; nothing for a replicated dimension).
template <sharded_tensor_type X>
[[nodiscard]] std::string describe(const X& x) {
  using S = typename X::sharding_type;
  using Mesh = typename X::mesh_type;
  std::string s = std::string(detail::short_dtype_name<typename X::value_type>()) + "[";
  for (std::size_t d = 0; d < X::rank; ++d) {
    s += (d ? "," : "") + std::to_string(x.global_shape()[d]);
    const std::size_t k = S::dim_axis_count(d);
    const auto axes = S::dim_axes(d);
    if (k == 0) continue;
    s += k == 1 ? "@" : "@(";
    for (std::size_t j = 0; j < k; ++j) s += (j ? "," : "") + std::string(Mesh::axis_names[axes[j]]);
    if (k > 1) s += ")";
  }
  return s + "]";
}

/// @brief Every step of a reshard plan and the bytes each device sends in it.
[[nodiscard]] inline std::string describe(const reshard_plan& plan) {
  std::ostringstream os;
  std::size_t devices = 0;
  for (const auto& st : plan.steps()) devices = std::max(devices, st.bytes_sent.size());
  const std::string head = plan.to_string();
  os << head.substr(0, head.find('\n')) << ' ' << plan.steps().size() << " step(s), " << plan.total_bytes_sent()
     << " bytes sent in all\n";
  std::size_t i = 0;
  for (const auto& st : plan.steps()) {
    os << "  " << ++i << ". " << st.description << "\n     bytes sent:";
    for (std::size_t d = 0; d < st.bytes_sent.size(); ++d) os << (d ? "," : "") << " device " << d << ": " << st.bytes_sent[d];
    if (st.bytes_sent.empty()) os << " none";
    os << '\n';
  }
  return os.str();
}

/// @brief `describe(x)` on one line, then the blocks of `x` (`visualize_sharding`): a grid for 1-D
/// and 2-D arrays, one row per device for higher ranks.
template <sharded_tensor_type X>
[[nodiscard]] std::string visualize(const X& x) {
  return describe(x) + "\n" + visualize_sharding(x.sharding(), x.global_shape());
}

}  // namespace meshlib
// end meshlib/debug/describe.hpp
// end meshlib/debug.hpp
// end meshlib.hpp
#if defined(MESHLIB_ENABLE_MPI) && MESHLIB_ENABLE_MPI
// begin meshlib/mpi.hpp
/// @file
/// @brief meshlib over MPI: the MPI communicator, hybrid process x thread meshes, and the runtime
/// over MPI (`meshlib::mpi::initialize`). Needs the `meshlib::mpi` CMake target, which defines
/// `MESHLIB_ENABLE_MPI` and links MPI.

#if !MESHLIB_ENABLE_MPI
#error "meshlib: <meshlib/mpi.hpp> needs MPI; link the meshlib::mpi CMake target (it defines MESHLIB_ENABLE_MPI=1), or configure with MPI found"
#else

// begin meshlib/comm/mpi/fail_guard.hpp
/// @file
/// @brief `fail_guard`: fails an MPI communicator when an exception leaves the guard's scope, so
/// that a rank that throws releases its peers within milliseconds instead of leaving them to wait
/// for the whole timeout. Apart from the communicator because it is a policy of the program (which
/// scope is "the step"), not of the handle.
///
/// When it is needed: any handle of a communicator that an exception unwinds fails it on its own
/// (`~mpi_communicator`), a copy of `meshlib::mpi::world()` included; but a handle whose scope is
/// wider than the step (made before the loop, the exception caught inside it) is not unwound, and
/// meshlib never sees the exception. One line in the rank's step makes the failure propagate:
///
/// @code
/// auto comm = meshlib::mpi::world();
/// for (int step = 0; step < steps; ++step) {
///   try {
///     meshlib::fail_guard on_throw(comm);  // a throw below fails comm: its peers get comm_aborted at once
///     train_step(comm);
///   } catch (const bad_batch&) { log_and_stop(); break; }
/// }
/// @endcode
///
/// The peers' waits on `comm` (and on its splits) then end with `comm_aborted` "meshlib:
/// communicator aborted: MPI rank R of N failed: an exception left the scope of a fail_guard
/// there (that rank's handler has its message)", and `root_cause_rank()` is R on every rank.

#if MESHLIB_ENABLE_MPI

#include <exception>


namespace meshlib {

/// @brief Fails `comm` (as `comm.fail(reason)`) when an exception unwinds the guard. Does nothing
/// when the scope ends normally, when the exception was caught within the scope, or when the
/// communicator has already failed (a timeout, mismatch or another rank's failure seen here is
/// not blamed on this rank). Not copyable: one guard, one scope.
class fail_guard {
 public:
  /// Guards `comm` (a handle on the same communicator is kept until the guard ends).
  explicit fail_guard(const mpi_communicator& comm) : comm_(comm) {}
  fail_guard(const fail_guard&) = delete;
  fail_guard& operator=(const fail_guard&) = delete;
  ~fail_guard() {
    if (std::uncaught_exceptions() > exceptions_at_birth_)
      comm_.fail_unless_failed("an exception left the scope of a fail_guard there (that rank's handler has its message)");
  }

 private:
  mpi_communicator comm_;
  int exceptions_at_birth_ = std::uncaught_exceptions();
};

}  // namespace meshlib

#endif  // MESHLIB_ENABLE_MPI
// end meshlib/comm/mpi/fail_guard.hpp

#endif
// end meshlib/mpi.hpp
#endif  // MESHLIB_ENABLE_MPI
#if defined(MESHLIB_ENABLE_NCCL) && MESHLIB_ENABLE_NCCL
// begin meshlib/nccl.hpp
/// @file
/// @brief meshlib on GPUs over NCCL: the NCCL communicator (one GPU per participant, collectives
/// on device buffers ordered on CUDA streams), one process driving several GPUs (`run_on_gpus`),
/// several mesh devices sharing one GPU (`shared_gpu_communicator`, `run_on_shared_gpu`),
/// one process per GPU through MPI (`nccl_communicator_from_mpi`, when `meshlib::mpi` is linked
/// too) or through the launcher's environment (`nccl::connect_from_environment`). Needs the
/// `meshlib::nccl` CMake target, which defines `MESHLIB_ENABLE_NCCL` and links NCCL and CUDA's
/// runtime. See docs/gpu.md.

#if !MESHLIB_ENABLE_NCCL
#error "meshlib: <meshlib/nccl.hpp> needs CUDA and NCCL; link the meshlib::nccl CMake target (it defines MESHLIB_ENABLE_NCCL=1), or configure with CUDA and NCCL found"
#else


#endif
// end meshlib/nccl.hpp
#endif  // MESHLIB_ENABLE_NCCL
#endif  // MESHLIB_SINGLE_INCLUDE_MESHLIB_HPP

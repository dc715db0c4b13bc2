// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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
///   static_assert(meshlib::diagnostic::always_false<Op, Axis>, "meshlib: psum over an axis ...; pvary first");
///   return false;
/// }
/// // in the check: psum_over_invariant_axis<diag_op_t<"psum">, diag_axis_t<"model">>()
/// @endcode

#include <cstddef>
#include <string_view>
#include <utility>

#include "meshlib/core/fixed_string.hpp"

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

namespace meshlib::core::detail {

/// False for every argument list, but only once the arguments are known: the condition of every
/// diagnostic, so that the compiler prints the arguments next to the message.
template <class... T>
inline constexpr bool always_false = false;

/// Marks a check whose diagnostic has already fired inside: always true, so that the
/// `static_assert` around a class-level check never adds a second error.
constexpr bool diagnosed(bool) noexcept { return true; }

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

}  // namespace meshlib::core::detail

/// What a layer written outside core (nn's, or a user's) spells its own compile-time errors with.
namespace meshlib::diagnostic {
/// False for every argument list, once the arguments are known: a diagnostic's condition.
using core::detail::always_false;
/// Always true: wraps a check whose diagnostic has already fired inside, so that the
/// `static_assert` around a class-level check adds no second error.
using core::detail::diagnosed;
/// `op` for the name `"conv2d"`: how a layer names itself in errors (its
/// `diagnostic_name`).
template <fixed_string Name>
using op_t = core::detail::diag_op_t<Name>;
/// The axes of `Mesh` in `Mask`, spelled out: `axes<axis<..."data"...>>`.
template <class Mesh, unsigned Mask>
using axes_t = core::detail::diag_axes_t<Mesh, Mask>;
/// `axis` for the name `"model"`: how a layer names an axis in its errors.
template <fixed_string Name>
using axis_t = core::detail::diag_axis_t<Name>;
/// `axis` for the name `Name::value` (a `std::string_view` static member): an axis name held by a
/// type, as a policy's `axis` (a class, not a reference template argument: see `diag_name`).
template <class Name>
using axis_named_t = typename core::detail::diag_name<Name>::axis;
}  // namespace meshlib::diagnostic

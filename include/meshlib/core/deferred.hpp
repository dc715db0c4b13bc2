// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

namespace meshlib::core::detail {

/// Holds `T` as `type`; a class template, so that `deferred<T, Tag>::type` depends on `Tag`.
template <class T, class Tag>
struct deferred {
  using type = T;
};

/// `T`, dependent on `Tag` (see the file comment).
template <class T, class Tag>
using deferred_t = typename deferred<T, Tag>::type;

}  // namespace meshlib::core::detail

namespace meshlib::experimental {
/// `X`, but dependent on `T`: see `deferred`.
using core::detail::deferred_t;

/// A type made dependent on `T` (`deferred_t<X, T>` is `X`): delays lookup to instantiation, so a header may name a type completed by a later include.
using core::detail::deferred;
}  // namespace meshlib::experimental

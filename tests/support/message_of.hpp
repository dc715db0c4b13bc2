// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The what() of the exception a callable throws, for exact checks of error messages that read the
// same with Catch2 v2 and v3 (whose string matchers are spelled differently).
#pragma once
#include <exception>
#include <string>

namespace meshlib_test {

/// Runs `f` and returns the message of the `E` it throws; an exception of another type escapes
/// (the test then fails on the type), and no exception gives "(no exception)".
template <class E = std::exception, class F>
std::string message_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "(no exception)";
}

}  // namespace meshlib_test

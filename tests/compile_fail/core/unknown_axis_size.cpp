// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Asking a mesh for an axis it does not have is a compile-time error, not a run-time lookup.
#include <meshlib/core.hpp>
int main() { meshlib::mesh<meshlib::axis<"data">> m{2}; return static_cast<int>(m.axis_size<"model">()); }

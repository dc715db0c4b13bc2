// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// Axis names identify axes: a mesh cannot have two of the same name.
#include <meshlib/core.hpp>
int main() { meshlib::mesh<meshlib::axis<"x">, meshlib::axis<"x">> m{2, 2}; (void)m; }

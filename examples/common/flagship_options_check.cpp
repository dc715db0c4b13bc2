// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The flagships' host logic that needs no data (flagship_options.hpp), checked: the mesh
// each flagship picks for a machine's cores when --mesh is not given, the parsers'
// spellings, and numbers as printed. Exits non-zero naming each failed check (ctest: example_flagship_options).
#include "flagship_options.hpp"

#include <cstdio>
#include <string>

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "flagship_options_check: FAILED: %s\n", what.c_str());
    ++failures;
  }
}

/// default_mesh(cores, full_data, full_model) == (data, model, why).
void expect_mesh(std::size_t cores, std::size_t full_data, std::size_t full_model, std::size_t data, std::size_t model,
                 const std::string& why) {
  const auto c = flagship::default_mesh(cores, full_data, full_model);
  const std::string at = "(" + std::to_string(full_data) + ", " + std::to_string(full_model) + ") on " +
                         std::to_string(cores) + " cores: ";
  check(c.data == data, at + "data " + std::to_string(c.data) + ", want " + std::to_string(data));
  check(c.model == model, at + "model " + std::to_string(c.model) + ", want " + std::to_string(model));
  check(c.why == why, at + "'" + c.why + "', want '" + why + "'");
}

}  // namespace

int main() {
  // Every core count up to 64: one thread device per core at most, (4, 2) from 8 cores on, and a
  // data axis dividing the default batch of 256.
  for (std::size_t cores = 1; cores <= 64; ++cores) {
    const auto c = flagship::default_mesh(cores);
    check(c.data * c.model <= cores, std::to_string(cores) + " cores: more devices than cores");
    check(256 % c.data == 0, std::to_string(cores) + " cores: the data axis does not divide 256");
    if (cores >= 8) check(c.data == 4 && c.model == 2, std::to_string(cores) + " cores: not 4x2");
  }
  // train_fashion_mnist: (4, 2).
  expect_mesh(0, 4, 2, 1, 1, "--mesh 1x1: chosen for 1 core; pass --mesh to choose");  // unknown: one core
  expect_mesh(1, 4, 2, 1, 1, "--mesh 1x1: chosen for 1 core; pass --mesh to choose");
  expect_mesh(2, 4, 2, 2, 1, "--mesh 2x1: chosen for 2 cores; pass --mesh to choose");
  expect_mesh(3, 4, 2, 2, 1, "--mesh 2x1: chosen for 3 cores; pass --mesh to choose");
  expect_mesh(4, 4, 2, 4, 1, "--mesh 4x1: chosen for 4 cores; pass --mesh to choose");
  expect_mesh(7, 4, 2, 4, 1, "--mesh 4x1: chosen for 7 cores; pass --mesh to choose");
  expect_mesh(8, 4, 2, 4, 2, "--mesh 4x2: chosen for 8 cores; pass --mesh to choose");
  expect_mesh(96, 4, 2, 4, 2, "--mesh 4x2: chosen for 96 cores; pass --mesh to choose");
  // train_resnet_fashion_mnist: (4, 1); train_gpt_chars: (2, 2), the model (tensor) axis halved first.
  expect_mesh(1, 4, 1, 1, 1, "--mesh 1x1: chosen for 1 core; pass --mesh to choose");
  expect_mesh(2, 4, 1, 2, 1, "--mesh 2x1: chosen for 2 cores; pass --mesh to choose");
  expect_mesh(3, 4, 1, 2, 1, "--mesh 2x1: chosen for 3 cores; pass --mesh to choose");
  expect_mesh(4, 4, 1, 4, 1, "--mesh 4x1: chosen for 4 cores; pass --mesh to choose");
  expect_mesh(1, 2, 2, 1, 1, "--mesh 1x1: chosen for 1 core; pass --mesh to choose");
  expect_mesh(2, 2, 2, 2, 1, "--mesh 2x1: chosen for 2 cores; pass --mesh to choose");
  expect_mesh(3, 2, 2, 2, 1, "--mesh 2x1: chosen for 3 cores; pass --mesh to choose");
  expect_mesh(4, 2, 2, 2, 2, "--mesh 2x2: chosen for 4 cores; pass --mesh to choose");
  expect_mesh(64, 2, 2, 2, 2, "--mesh 2x2: chosen for 64 cores; pass --mesh to choose");
  // The mesh parser names the program's second axis.
  try {
    (void)flagship::mesh_shape("2x", "2x2", "tensor");
    check(false, "mesh_shape(\"2x\") did not throw");
  } catch (const flagship::usage_error& e) {
    check(std::string(e.what()) == "--mesh wants DxM, two positive integers (data x tensor devices) such as 2x2, not '2x'",
          std::string("mesh_shape message: ") + e.what());
  }
  check(flagship::mesh_shape("3x5", "4x2") == std::pair<std::size_t, std::size_t>{3, 5}, "mesh_shape(\"3x5\")");
  // Numbers as the user wrote them (the library's formatter): --lr 1e-5 prints "lr 1e-5".
  check(flagship::number_text(1e-5f) == "1e-5", "number_text(1e-5f) == " + flagship::number_text(1e-5f));
  check(flagship::number_text(3e-3f) == "0.003", "number_text(3e-3f) == " + flagship::number_text(3e-3f));
  check(flagship::number_text(0.8f) == "0.8", "number_text(0.8f) == " + flagship::number_text(0.8f));
  check(flagship::number_text(0.01f) == "0.01", "number_text(0.01f) == " + flagship::number_text(0.01f));
  if (failures == 0) std::printf("flagship_options_check: all checks passed\n");
  return failures == 0 ? 0 : 1;
}

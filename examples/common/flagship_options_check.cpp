// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The flagships' host logic that needs no data (flagship_options.hpp), checked: the mesh
// each flagship picks for a machine's cores when --mesh is not given, the threads per device it
// picks (or refuses) for --threads-per-device, the parsers' spellings, and numbers as printed.
// Exits non-zero naming each failed check (ctest: example_flagship_options).
#include "flagship_options.hpp"

#include <cstdio>
#include <optional>
#include <string>
#include <thread>

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

/// threads_per_device(given, cores, devices, shared) == (threads, why).
void expect_threads(std::optional<std::size_t> given, std::size_t cores, std::size_t devices, bool shared,
                    std::size_t threads, const std::string& why) {
  const auto c = flagship::threads_per_device(given, cores, devices, shared);
  const std::string at = "threads_per_device(" + (given ? std::to_string(*given) : std::string("none")) + ", " +
                         std::to_string(cores) + " cores, " + std::to_string(devices) + " devices" +
                         (shared ? ", shared" : "") + "): ";
  check(c.threads == threads, at + std::to_string(c.threads) + " threads, want " + std::to_string(threads));
  check(c.why == why, at + "'" + c.why + "', want '" + why + "'");
}

/// threads_per_device(given, cores, devices) throws usage_error(message).
void expect_threads_refused(std::size_t given, std::size_t cores, std::size_t devices, const std::string& message) {
  try {
    (void)flagship::threads_per_device(given, cores, devices);
    check(false, "threads_per_device(" + std::to_string(given) + ", " + std::to_string(cores) + " cores) did not throw");
  } catch (const flagship::usage_error& e) {
    check(std::string(e.what()) == message, std::string("threads_per_device message: ") + e.what());
  }
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
  // --threads-per-device's default over every (cores, devices) up to 64: at least 1, and threads
  // beyond one per device only where every device's threads have cores of their own.
  for (std::size_t cores = 1; cores <= 64; ++cores)
    for (std::size_t devices = 1; devices <= 64; ++devices) {
      const auto t = flagship::threads_per_device(std::nullopt, cores, devices);
      const std::string at = std::to_string(cores) + " cores, " + std::to_string(devices) + " devices: ";
      check(t.threads >= 1, at + "no thread");
      check(t.threads == 1 || devices * t.threads <= cores, at + "oversubscribed by default");
      check(devices * (t.threads + 1) > cores, at + "a core left idle by default");
    }
  const std::string pass = "; pass --threads-per-device to choose";
  expect_threads(std::nullopt, 16, 4, false, 4, "--threads-per-device 4: chosen for 16 cores / 4 devices" + pass);
  expect_threads(std::nullopt, 16, 3, false, 5, "--threads-per-device 5: chosen for 16 cores / 3 devices" + pass);
  expect_threads(std::nullopt, 2, 2, false, 1, "--threads-per-device 1: chosen for 2 cores / 2 devices" + pass);
  expect_threads(std::nullopt, 3, 2, false, 1, "--threads-per-device 1: chosen for 3 cores / 2 devices" + pass);
  expect_threads(std::nullopt, 2, 8, false, 1, "--threads-per-device 1: chosen for 2 cores / 8 devices" + pass);
  expect_threads(std::nullopt, 1, 1, false, 1, "--threads-per-device 1: chosen for 1 core / 1 device" + pass);
  expect_threads(std::nullopt, 0, 4, false, 1, "--threads-per-device 1: chosen for 1 core / 4 devices" + pass);  // unknown
  expect_threads(std::nullopt, 16, 2, true, 1, "--threads-per-device 1: the default under a launcher" + pass);
  // Given: run as asked, the oversubscription said; above the cores: refused.
  expect_threads(2, 16, 4, false, 2, "--threads-per-device 2: as given");
  expect_threads(2, 16, 8, false, 2, "--threads-per-device 2: as given");
  expect_threads(2, 2, 2, false, 2, "--threads-per-device 2: as given (2 devices x 2 threads on 2 cores: oversubscribed)");
  expect_threads(4, 16, 8, false, 4, "--threads-per-device 4: as given (8 devices x 4 threads on 16 cores: oversubscribed)");
  expect_threads(4, 16, 8, true, 4, "--threads-per-device 4: as given");  // other processes' cores: not counted
  expect_threads(1, 2, 8, false, 1, "--threads-per-device 1: as given");
  expect_threads_refused(3, 2, 1, "--threads-per-device 3 is more than the 2 cores this process may run on; use at most 2");
  expect_threads_refused(2, 1, 1, "--threads-per-device 2 is more than the 1 core this process may run on; use at most 1");
  expect_threads_refused(4096, 64, 1, "--threads-per-device 4096 is more than the 64 cores this process may run on; use at most 64");
  // The cores counted are this process's (its affinity mask), never more than the machine's.
  const std::size_t cores = flagship::available_cores(), machine = std::thread::hardware_concurrency();
  check(cores >= 1, "available_cores() is 0");
  check(machine == 0 || cores <= machine, "available_cores() " + std::to_string(cores) + " > hardware_concurrency() " +
                                              std::to_string(machine));
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

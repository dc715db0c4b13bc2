// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The GPU runner's host-side decisions (exec/gpu_runner.hpp), which every build compiles and runs
// without a GPU: the layout of a mesh on the visible GPUs and the launch (one process per GPU, one
// GPU per device, devices sharing one GPU), every refusal with its message, and default_runner's
// choice of runner. The runner itself needs CUDA and NCCL (tests/cuda/gpu_runner.cpp compiles it,
// scripts/gpu-check.sh runs it).
#include <cstddef>
#include <string>
#include <vector>

#include "meshlib/exec.hpp"
#include "meshlib_catch.hpp"
#include "message_of.hpp"

namespace MESHLIB_TEST_UNIT {  // this file's own scope in a unity batch (cmake/meshlib_testing.cmake)

using namespace meshlib;
using meshlib::exec::detail::plan_gpu_mesh;

namespace {
distributed::launch_info one_process() { return {}; }
distributed::launch_info process_of(std::size_t index, std::size_t count, std::optional<std::size_t> local) {
  return {index, count, local, distributed::launcher::openmpi};
}
}  // namespace

TEST_CASE("gpu_runner plan: one process, at most as many devices as GPUs: one GPU per device") {
  const gpu_plan p = plan_gpu_mesh(4, 8, one_process());
  CHECK(p.layout == gpu_layout::gpu_per_device);
  CHECK(p.local_devices == std::vector<std::size_t>{0, 1, 2, 3});
  CHECK(p.gpus == std::vector<int>{0, 1, 2, 3});
  const std::vector<int> chosen{5, 2};
  const gpu_plan q = plan_gpu_mesh(2, 8, one_process(), chosen);
  CHECK(q.layout == gpu_layout::gpu_per_device);
  CHECK(q.gpus == std::vector<int>{5, 2});
  CHECK(plan_gpu_mesh(1, 1, one_process()).gpus == std::vector<int>{0});
  CHECK(to_string(gpu_layout::gpu_per_device) == "one GPU per device");
}

TEST_CASE("gpu_runner plan: more devices than the one GPU used: the devices share it") {
  const gpu_plan p = plan_gpu_mesh(4, 1, one_process());
  CHECK(p.layout == gpu_layout::devices_share_gpu);
  CHECK(p.local_devices == std::vector<std::size_t>{0, 1, 2, 3});
  CHECK(p.gpus == std::vector<int>{0, 0, 0, 0});
  const std::vector<int> third{3};
  const gpu_plan q = plan_gpu_mesh(3, 4, one_process(), third);
  CHECK(q.layout == gpu_layout::devices_share_gpu);
  CHECK(q.gpus == std::vector<int>{3, 3, 3});
  CHECK(meshlib_test::message_of<mesh_error>([] { (void)plan_gpu_mesh(33, 1, one_process()); }) ==
        "meshlib: gpu_runner: the mesh has 33 devices on one GPU; at most 32 mesh devices share a GPU");
}

TEST_CASE("gpu_runner plan: several processes: one device and one GPU each, by local rank") {
  const gpu_plan p = plan_gpu_mesh(4, 2, process_of(3, 4, 1));
  CHECK(p.layout == gpu_layout::process_per_gpu);
  CHECK(p.local_devices == std::vector<std::size_t>{3});
  CHECK(p.gpus == std::vector<int>{1});
  // No local rank from the launcher: the process index, modulo the GPUs.
  CHECK(plan_gpu_mesh(4, 2, process_of(2, 4, std::nullopt)).gpus == std::vector<int>{0});
  CHECK(meshlib_test::message_of<mesh_error>([] { (void)plan_gpu_mesh(8, 2, process_of(0, 4, 0)); }) ==
        "meshlib: gpu_runner: the run has 4 processes (OpenMPI), one GPU each, but the mesh has 8 devices; use a "
        "mesh of 4 devices (one per process), or start one process per mesh device");
}

TEST_CASE("gpu_runner plan: refusals name what is wrong and the fix") {
  CHECK(meshlib_test::message_of<error>([] { (void)plan_gpu_mesh(2, 0, one_process()); }) ==
        "meshlib: gpu_runner: no CUDA device is visible (cudaGetDeviceCount found none; check the driver and "
        "CUDA_VISIBLE_DEVICES); run on the CPU (thread_runner) instead");
  CHECK(meshlib_test::message_of<mesh_error>([] { (void)plan_gpu_mesh(0, 2, one_process()); }) ==
        "meshlib: gpu_runner: the mesh has no devices");
  const std::vector<int> missing{0, 4};
  CHECK(meshlib_test::message_of<error>([&] { (void)plan_gpu_mesh(2, 4, one_process(), missing); }) ==
        "meshlib: gpu_runner: GPU 4 does not exist: 4 are visible (0 .. 3)");
  const std::vector<int> negative{-1};
  CHECK(meshlib_test::message_of<error>([&] { (void)plan_gpu_mesh(1, 4, one_process(), negative); }) ==
        "meshlib: gpu_runner: GPU -1 does not exist: 4 are visible (0 .. 3)");
  const std::vector<int> twice{1, 1};
  CHECK(meshlib_test::message_of<error>([&] { (void)plan_gpu_mesh(2, 4, one_process(), twice); }) ==
        "meshlib: gpu_runner: GPU 1 is listed twice in gpu_runner_options::gpus; list each GPU once (several mesh "
        "devices share a GPU when the mesh has more devices than the GPUs listed)");
  CHECK(meshlib_test::message_of<mesh_error>([] { (void)plan_gpu_mesh(4, 2, one_process()); }) ==
        "meshlib: gpu_runner: the mesh has 4 devices but 2 GPUs are used; devices share a GPU only when one GPU is "
        "used (no communicator spans NCCL ranks and shared GPUs): use a mesh of at most 2 devices, or "
        "gpu_runner_options{.gpus = {0}} to run all 4 on GPU 0");
}

TEST_CASE("default_runner's choice: the GPUs in a GPU build with a GPU, else processes or threads") {
  using meshlib::exec::detail::choose_default_runner;
  using meshlib::exec::detail::default_runner_kind;
  CHECK(choose_default_runner(true, 1, false, 1) == default_runner_kind::gpus);
  CHECK(choose_default_runner(true, 8, false, 4) == default_runner_kind::gpus);  // gpu_runner runs the processes
  CHECK(choose_default_runner(true, 0, false, 1) == default_runner_kind::threads);
  CHECK(choose_default_runner(true, 0, false, 2) == default_runner_kind::processes);
  CHECK(choose_default_runner(false, 4, false, 1) == default_runner_kind::threads);
  CHECK(choose_default_runner(false, 4, false, 2) == default_runner_kind::processes);
  CHECK(choose_default_runner(true, 4, true, 1) == default_runner_kind::threads);  // nested in a device
  // This build: no GPU runner on the host test build, so the default runs every device on threads.
#if !MESHLIB_HAS_GPU_RUNNER
  CHECK(default_runner{}.local_devices(3) == std::vector<std::size_t>{0, 1, 2});
#endif
}

}  // namespace MESHLIB_TEST_UNIT

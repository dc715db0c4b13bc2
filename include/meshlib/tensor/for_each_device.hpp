// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

#include "meshlib/tensor/view.hpp"

namespace meshlib::tensor::detail {

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

}  // namespace meshlib::tensor::detail

namespace meshlib::experimental {
/// The dispatcher `for_each_device` calls: a runner installs its own.
using tensor::detail::device_dispatcher;

/// Runs a function once per device of a mesh, through the installed dispatcher (a runner installs one).
using tensor::detail::for_each_device;
}  // namespace meshlib::experimental

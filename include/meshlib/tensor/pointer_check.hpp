// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
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

#include "meshlib/core/diagnostics.hpp"
#include "meshlib/core/errors.hpp"
#include "meshlib/tensor/view.hpp"

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
    return is_device_readable<Space>(p, tensor::detail::current_device_id<Space>());
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

namespace tensor::detail {
/// The diagnostic of `require_accessible` (core/diagnostics.hpp: a function, so one error).
template <class Entry, class Argument, class Exec, class Space>
consteval bool argument_memory_is_not_accessible_from_kernel_space() {
  static_assert(diagnostic::always_false<Entry, Argument, Exec, Space>,
                "meshlib: an argument's memory space cannot be read by the execution space its kernel runs on "
                "(the note names the call, the argument, the execution space and the memory space); copy it there "
                "first with meshlib::nn::device_put (a batch), meshlib::device_put (an array) or Kokkos::deep_copy");
  return false;
}
}  // namespace tensor::detail

/// @brief Compile-time half of the check: `true` when execution space `Exec` can access memory
/// space `Space`; otherwise one compile error that spells the call `Entry` and the `Argument`
/// (`diagnostic::op_t<"matmul_into">`, `diagnostic::op_t<"A">`).
template <class Entry, class Argument, class Exec, class Space>
consteval bool require_accessible() {
  if constexpr (Kokkos::SpaceAccessibility<Exec, Space>::accessible) return true;
  else return tensor::detail::argument_memory_is_not_accessible_from_kernel_space<Entry, Argument, Exec, Space>();
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
  return require_accessible<diagnostic::op_t<Entry>, diagnostic::op_t<Argument>,
                            typename KernelSpace::execution_space, typename L::memory_space>();
}

}  // namespace meshlib

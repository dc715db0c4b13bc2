// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
#pragma once
/// @file
/// @brief The reduction kernel of several mesh devices on one GPU, compiled at run time with NVRTC
/// (CUDA's run-time compiler, part of every CUDA toolkit) and launched through the CUDA runtime's
/// library API. Why at run time: meshlib is header-only and its users compile with g++ or clang,
/// not nvcc; a kernel in a `__CUDACC__` header would exist only in nvcc-compiled programs, and one
/// through Kokkos only where Kokkos has CUDA. NVRTC keeps the kernel in this header, for every
/// compiler, at the cost of one compilation per process (about 0.1-0.3 s, on first use).
///
/// The kernel reduces element i of n inputs in rank order (((x0 op x1) op x2) ...), as the thread
/// backend does, so results are bitwise those of the thread communicator: integer sums and products
/// wrap (computed unsigned), integer mean is the wrapped sum divided by n toward zero, bfloat16 is
/// combined in float and rounded once (nearest even, NaNs stay NaN), and float min/max follow
/// meshlib's semantics on every backend: a NaN anywhere gives NaN, and -0 < +0 (`reduce_min`,
/// `reduce_max`, which the host compiles too, so that nccl_host_tests checks them without a GPU).
/// It writes the result to every output pointer, so that one launch per participant both reduces
/// its block and distributes it.

#if MESHLIB_ENABLE_NCCL

#include <cuda_runtime_api.h>
#include <nvrtc.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "meshlib/comm/datatype.hpp"
#include "meshlib/comm/errors.hpp"
#include "meshlib/comm/nccl/detail/nccl_types.hpp"
#include "meshlib/comm/reduce_op.hpp"

namespace meshlib::comm::detail {

/// Most participants one launch reduces (the pointer tables go by value in the kernel arguments).
inline constexpr int max_local_devices = 32;

/// Pointer tables passed by value: inputs and outputs of one launch.
struct reduce_pointers {
  const void* in[max_local_devices];
  void* out[max_local_devices];
};

// min and max of the kernel, written once for the kernel and the host. `a` is the running result
// of the lower ranks. NaN: `b < a ? b : a` would keep `a` whenever `b` is NaN, losing it (and
// the result would depend on which rank held the NaN). Equal zeros: +0 and -0 compare equal, so
// the sign is chosen by IEEE addition, which needs no signbit() (NVRTC has no <cmath>):
// +0 + -0 = +0 (max), and -(-a - b) is -0 when either is -0 (min). Integers never take those
// branches with different values (x != x is false, and equal integers are the same value).
#define MESHLIB_DETAIL_REDUCE_MINMAX(QUALIFIER)                  \
  template <class V>                                             \
  QUALIFIER V reduce_max(V a, V b) {                             \
    if (a != a) return a;                                        \
    if (b != b) return b;                                        \
    if (a == b) return a == V(0) ? a + b : a;                    \
    return a < b ? b : a;                                        \
  }                                                              \
  template <class V>                                             \
  QUALIFIER V reduce_min(V a, V b) {                             \
    if (a != a) return a;                                        \
    if (b != b) return b;                                        \
    if (a == b) return a == V(0) ? -(-a - b) : a;                \
    return b < a ? b : a;                                        \
  }
#define MESHLIB_DETAIL_REDUCE_STR(...) #__VA_ARGS__
#define MESHLIB_DETAIL_REDUCE_XSTR(...) MESHLIB_DETAIL_REDUCE_STR(__VA_ARGS__)

/// @brief The kernel's min and max of two elements, compiled for the host (the kernel gets the same
/// text, see `reduce_minmax_source`): NaN anywhere gives NaN, -0 < +0, else the usual order.
MESHLIB_DETAIL_REDUCE_MINMAX(constexpr)

/// The kernel's `reduce_min` and `reduce_max`, as text for NVRTC (`meshlib_device_function` is
/// defined by the kernel source; a placeholder, not `__device__`, because nvcc defines that as a
/// macro and would expand it here).
inline constexpr std::string_view reduce_minmax_source =
    MESHLIB_DETAIL_REDUCE_XSTR(MESHLIB_DETAIL_REDUCE_MINMAX(meshlib_device_function));

#undef MESHLIB_DETAIL_REDUCE_XSTR
#undef MESHLIB_DETAIL_REDUCE_STR
#undef MESHLIB_DETAIL_REDUCE_MINMAX

/// The kernels' source after `reduce_minmax_source`: one `extern "C"` kernel per element type, named
/// `meshlib_reduce_<type>`.
inline constexpr std::string_view reduce_kernel_source = R"(
struct reduce_pointers { const void* in[32]; void* out[32]; };
__device__ inline float bf16_to_float(unsigned short b) { return __uint_as_float(((unsigned)b) << 16); }
__device__ inline unsigned short float_to_bf16(float f) {
  unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
  unsigned rounding = 0x7fffu + ((u >> 16) & 1u);
  return (unsigned short)((u + rounding) >> 16);
}
// op: 0 sum, 1 prod, 2 min, 3 max, 4 mean (meshlib::reduce_op's order)
#define MESHLIB_REDUCE_KERNEL(NAME, T, ACC, UACC, LOAD, STORE, DIVIDE)                                   \
extern "C" __global__ void NAME(reduce_pointers p, int n_in, int n_out, unsigned long long count, int op) { \
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;                        \
  for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) { \
    ACC a = LOAD(((const T*)p.in[0])[i]);                                                               \
    for (int k = 1; k < n_in; ++k) {                                                                    \
      const ACC b = LOAD(((const T*)p.in[k])[i]);                                                       \
      switch (op) {                                                                                     \
        case 0: case 4: a = (ACC)((UACC)a + (UACC)b); break;                                            \
        case 1: a = (ACC)((UACC)a * (UACC)b); break;                                                    \
        case 2: a = reduce_min(a, b); break;                                                            \
        default: a = reduce_max(a, b); break;                                                           \
      }                                                                                                 \
    }                                                                                                   \
    if (op == 4) a = DIVIDE(a, n_in);                                                                   \
    const T r = STORE(a);                                                                               \
    for (int k = 0; k < n_out; ++k) ((T*)p.out[k])[i] = r;                                              \
  }                                                                                                     \
}
#define MESHLIB_SAME(x) (x)
#define MESHLIB_DIV(a, n) ((a) / (n))
MESHLIB_REDUCE_KERNEL(meshlib_reduce_float32, float, float, float, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_float64, double, double, double, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_int32, int, int, unsigned int, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_int64, long long, long long, unsigned long long, MESHLIB_SAME, MESHLIB_SAME, MESHLIB_DIV)
MESHLIB_REDUCE_KERNEL(meshlib_reduce_bfloat16, unsigned short, float, float, bf16_to_float, float_to_bf16, MESHLIB_DIV)
)";

/// The kernel name for element type `t`.
[[nodiscard]] inline std::string reduce_kernel_name(datatype t) { return "meshlib_reduce_" + std::string(to_string(t)); }

/// Compiles the kernels for `arch` (e.g. "compute_90") to PTX.
/// @throws comm_error with NVRTC's log when compilation fails.
[[nodiscard]] inline std::string compile_reduce_kernels(const std::string& arch) {
  nvrtcProgram prog = nullptr;
  auto check = [&](nvrtcResult rc, const char* call) {
    if (rc == NVRTC_SUCCESS) return;
    std::string log;
    std::size_t size = 0;
    if (prog != nullptr && nvrtcGetProgramLogSize(prog, &size) == NVRTC_SUCCESS && size > 1) {
      log.resize(size);
      (void)nvrtcGetProgramLog(prog, log.data());
    }
    if (prog != nullptr) (void)nvrtcDestroyProgram(&prog);
    throw comm_error("meshlib: compiling the device reduction kernel: " + std::string(call) + " failed: " +
                     nvrtcGetErrorString(rc) + (log.empty() ? "" : "\n" + log));
  };
  const std::string source = "#define meshlib_device_function __device__ inline\n" + std::string(reduce_minmax_source) +
                             "\n" + std::string(reduce_kernel_source);
  check(nvrtcCreateProgram(&prog, source.c_str(), "meshlib_reduce.cu", 0, nullptr, nullptr), "nvrtcCreateProgram");
  const std::string arch_opt = "--gpu-architecture=" + arch;
  const char* opts[] = {arch_opt.c_str(), "--std=c++17"};
  check(nvrtcCompileProgram(prog, 2, opts), "nvrtcCompileProgram");
  std::size_t size = 0;
  check(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize");
  std::string ptx(size, '\0');
  check(nvrtcGetPTX(prog, ptx.data()), "nvrtcGetPTX");
  (void)nvrtcDestroyProgram(&prog);
  return ptx;
}

/// The loaded kernels of the current device's architecture, compiled once per process and
/// architecture.
class reduce_kernels {
 public:
  /// The kernel for `t` on the current device.
  static cudaKernel_t get(datatype t, std::string_view what) {
    int device = 0;
    check_cuda(cudaGetDevice(&device), what, "cudaGetDevice");
    int major = 0;
    int minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), what, "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), what, "cudaDeviceGetAttribute");
    const std::string arch = "compute_" + std::to_string(major * 10 + minor);
    static std::mutex mutex;
    static std::map<std::string, cudaLibrary_t> libraries;  // never unloaded: lives as long as the process
    std::lock_guard lock(mutex);
    auto it = libraries.find(arch);
    if (it == libraries.end()) {
      const std::string ptx = compile_reduce_kernels(arch);
      cudaLibrary_t lib = nullptr;
      check_cuda(cudaLibraryLoadData(&lib, ptx.c_str(), nullptr, nullptr, 0, nullptr, nullptr, 0), what,
                 "cudaLibraryLoadData");
      it = libraries.emplace(arch, lib).first;
    }
    cudaKernel_t k = nullptr;
    check_cuda(cudaLibraryGetKernel(&k, it->second, reduce_kernel_name(t).c_str()), what, "cudaLibraryGetKernel");
    return k;
  }
};

/// Enqueues on `stream`: out[j][i] = op over in[0..n_in)[i], for i < count and every output j.
inline void launch_reduce(datatype t, reduce_op op, const std::vector<const void*>& in, const std::vector<void*>& out,
                          std::size_t count, cudaStream_t stream, std::string_view what) {
  if (count == 0) return;
  reduce_pointers p{};
  for (std::size_t i = 0; i < in.size(); ++i) p.in[i] = in[i];
  for (std::size_t i = 0; i < out.size(); ++i) p.out[i] = out[i];
  int n_in = static_cast<int>(in.size());
  int n_out = static_cast<int>(out.size());
  unsigned long long n = count;
  int o = static_cast<int>(op);
  void* args[] = {&p, &n_in, &n_out, &n, &o};
  const unsigned threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<std::size_t>((count + threads - 1) / threads, 4096));
  const cudaKernel_t k = reduce_kernels::get(t, what);
  check_cuda(cudaLaunchKernel(reinterpret_cast<const void*>(k), dim3(blocks), dim3(threads), args, 0, stream), what,
             "cudaLaunchKernel");
}

}  // namespace meshlib::comm::detail

#endif  // MESHLIB_ENABLE_NCCL

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// A minimal Kokkos tool (loaded through KOKKOS_TOOLS_LIBS / KOKKOS_PROFILE_LIBRARY) that appends the
// name of every profiling region pushed to the file named by MESHLIB_TEST_TOOL_OUT: the proof that
// meshlib's regions and collectives reach Kokkos tools.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace {
std::mutex m;
std::FILE* out = nullptr;
}  // namespace

extern "C" void kokkosp_init_library(int, std::uint64_t, std::uint32_t, void*) {
  const char* path = std::getenv("MESHLIB_TEST_TOOL_OUT");
  if (path) out = std::fopen(path, "w");
}
extern "C" void kokkosp_finalize_library() {
  if (out) std::fclose(out);
  out = nullptr;
}
extern "C" void kokkosp_push_profile_region(const char* name) {
  std::lock_guard lk(m);
  if (out) {
    std::fprintf(out, "%s\n", name);
    std::fflush(out);
  }
}
extern "C" void kokkosp_pop_profile_region() {}

// SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
// The program every package recipe (Conan, vcpkg) builds against an installed meshlib: one
// #include <meshlib.hpp>, a psum over 4 thread devices checked against the sum worked out by
// hand, and the optional parts this build chose (meshlib::config).
#include <meshlib.hpp>

#include <array>
#include <cstdio>

namespace {
int run() {
  using mesh_t = meshlib::mesh<meshlib::axis<"x">>;
  const mesh_t m{4};
  using block_t = meshlib::local_tensor<float, 1, mesh_t, mesh_t::all_axes, 0,
                                        meshlib::dim_masks<mesh_t::mask_of<"x">()>>;
  auto sums = meshlib::spmd(m, [&] {
    // Device d holds {d + 1, 10 * (d + 1)}.
    const auto d = static_cast<float>(meshlib::device_index());
    block_t v(std::array<std::size_t, 1>{2}, m, meshlib::device_index());
    v(0) = d + 1.0f;
    v(1) = 10.0f * (d + 1.0f);
    auto s = meshlib::psum<"x">(v);
    return std::array<float, 2>{s(0), s(1)};
  });
  // 1 + 2 + 3 + 4 = 10 and 10 + 20 + 30 + 40 = 100 on every device.
  for (const auto& s : sums) {
    if (s[0] != 10.0f || s[1] != 100.0f) {
      std::printf("meshlib test_package: psum gave {%g, %g}, expected {10, 100}\n",
                  static_cast<double>(s[0]), static_cast<double>(s[1]));
      return 1;
    }
  }
  std::printf("meshlib %s test_package OK: psum over 4 thread devices = {10, 100}; matmul kernel: %s, mpi: %d, tbb: %d\n",
              meshlib::version_string.data(), meshlib::config::matmul_kernel.data(),
              static_cast<int>(meshlib::config::mpi), static_cast<int>(meshlib::config::tbb));
  return 0;
}
}  // namespace

int main(int argc, char* argv[]) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  return run();
}

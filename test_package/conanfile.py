# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Conan's test of the meshlib package: build test_package.cpp against it and run it."""

import os

from conan import ConanFile
from conan.tools.build import can_run
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout


class MeshlibTestConan(ConanFile):
    settings = "os", "arch", "compiler", "build_type"
    generators = "CMakeDeps"

    def requirements(self):
        self.requires(self.tested_reference_str)

    def layout(self):
        cmake_layout(self)

    def generate(self):
        tc = CMakeToolchain(self)
        meshlib = self.dependencies["meshlib"]
        components = [c for c in ("kokkos_kernels", "mpi", "nccl", "tbb", "zlib") if meshlib.options.get_safe(c)]
        tc.cache_variables["MESHLIB_COMPONENTS"] = ";".join(components)
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()
        cmake.build()

    def test(self):
        if can_run(self):
            self.run(os.path.join(self.cpp.build.bindir, "test_package"), env="conanrun")

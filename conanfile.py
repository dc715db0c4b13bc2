# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Conan 2 recipe of meshlib: a header-only library; the optional parts are options.

    conan create . -pr:a default -pr:a packaging/conan/debian12 [-o "meshlib/*:mpi=True"] ...

Options (all off by default; each brings its dependency and the CMake component of the same name):
    kokkos_kernels  matmul through KokkosBlas::gemm   (requires kokkos-kernels)
    mpi             the MPI communicators             (requires openmpi)
    nccl            the NCCL communicator             (needs CUDA's toolkit and NCCL from the system)
    tbb             the oneTBB-backed parts           (requires onetbb)
    zlib            .gz files in the IDX reader       (requires zlib)

The package is meshlib's own CMake install (its config repairs Debian's Kokkos and offers the
components), so consumers write find_package(meshlib CONFIG REQUIRED [COMPONENTS ...]) as with any
install; Conan's CMakeDeps generates nothing for it. The version comes from the file VERSION.
"""

import os

from conan import ConanFile
from conan.tools.cmake import CMake, CMakeToolchain, cmake_layout
from conan.tools.files import copy, load


class MeshlibConan(ConanFile):
    name = "meshlib"
    description = "JAX-style SPMD sharding for C++: meshes, partition specs, sharded tensors, collectives"
    license = "Apache-2.0 WITH LLVM-exception"
    url = "https://github.com/meshlib-org/meshlib"
    homepage = "https://github.com/meshlib-org/meshlib"
    topics = ("spmd", "sharding", "hpc", "mpi", "nccl", "kokkos", "header-only")
    package_type = "header-library"
    settings = "os", "arch", "compiler", "build_type"
    options = {
        "kokkos_kernels": [True, False],
        "mpi": [True, False],
        "nccl": [True, False],
        "tbb": [True, False],
        "zlib": [True, False],
    }
    default_options = {"kokkos_kernels": False, "mpi": False, "nccl": False, "tbb": False, "zlib": False}
    exports_sources = "VERSION", "LICENSE", "CMakeLists.txt", "cmake/*", "include/*"
    no_copy_source = True

    def set_version(self):
        self.version = load(self, os.path.join(self.recipe_folder, "VERSION")).strip()

    def layout(self):
        cmake_layout(self)

    def requirements(self):
        # Kokkos 3.4 (Debian) to 4.x; a profile's [platform_requires] may take any of them from
        # the system (packaging/conan/debian12 does, see docs/install.md).
        self.requires("kokkos/[>=3.4 <5]")
        if self.options.kokkos_kernels:
            self.requires("kokkos-kernels/[>=3.4 <5]")
        if self.options.mpi:
            self.requires("openmpi/[>=4.1 <6]")
        if self.options.tbb:
            self.requires("onetbb/[>=2021.5 <2023]")
        if self.options.zlib:
            self.requires("zlib/[>=1.2.11 <2]")

    def package_id(self):
        # Header-only: the same package for every compiler and build type; the options stay,
        # because they decide which components the installed config offers.
        self.info.settings.clear()

    def generate(self):
        tc = CMakeToolchain(self)
        tc.cache_variables.update({
            "MESHLIB_INSTALL": True,
            "MESHLIB_BUILD_TESTS": False,
            "MESHLIB_BUILD_EXAMPLES": False,
            "MESHLIB_BUILD_BENCHMARKS": False,
            "MESHLIB_SANITIZE_THREAD": False,
            "MESHLIB_WITH_KOKKOS_KERNELS": bool(self.options.kokkos_kernels),
            "MESHLIB_WITH_MPI": bool(self.options.mpi),
            "MESHLIB_WITH_NCCL": bool(self.options.nccl),
            "MESHLIB_WITH_TBB": bool(self.options.tbb),
            "MESHLIB_WITH_ZLIB": bool(self.options.zlib),
        })
        tc.generate()

    def build(self):
        cmake = CMake(self)
        cmake.configure()

    def package(self):
        CMake(self).install()
        copy(self, "LICENSE", self.source_folder, os.path.join(self.package_folder, "licenses"))

    def package_info(self):
        self.cpp_info.bindirs = []
        self.cpp_info.libdirs = []
        # Consumers use meshlib's own config (share/cmake/meshlib), which the toolchain finds
        # through builddirs; CMakeDeps must not write a second, different one.
        self.cpp_info.set_property("cmake_find_mode", "none")
        self.cpp_info.builddirs = [os.path.join("share", "cmake", "meshlib")]
        self.cpp_info.set_property("pkg_config_name", "meshlib")
        if self.options.kokkos_kernels:
            self.cpp_info.defines.append("MESHLIB_ENABLE_KOKKOS_KERNELS=1")
        if self.options.mpi:
            self.cpp_info.defines.append("MESHLIB_ENABLE_MPI=1")
        if self.options.nccl:
            self.cpp_info.defines.append("MESHLIB_ENABLE_NCCL=1")
        if self.options.tbb:
            self.cpp_info.defines.append("MESHLIB_ENABLE_TBB=1")
        if self.options.zlib:
            self.cpp_info.defines.append("MESHLIB_ENABLE_ZLIB=1")

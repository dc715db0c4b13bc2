# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
"""Spack package of meshlib, for HPC sites. Use it from a repository of your own:

    spack repo create myrepo && cp packaging/spack/package.py myrepo/packages/meshlib/
    spack install meshlib +mpi +tbb

The variants are the Conan options and the CMake components of the same names
(tests/package/check_packaging.py checks that they agree, and that the version is VERSION's).
"""

from spack.package import *  # noqa: F401,F403  (Spack's package DSL)


class Meshlib(CMakePackage):
    """JAX-style SPMD sharding for C++20 (header-only): device meshes with named axes, partition
    specs, sharded tensors in Kokkos views, typed collectives, thread/MPI/NCCL communicators."""

    homepage = "https://github.com/meshlib-org/meshlib"
    url = "https://github.com/meshlib-org/meshlib/archive/refs/tags/v0.1.0.tar.gz"
    git = "https://github.com/meshlib-org/meshlib.git"

    license("Apache-2.0 WITH LLVM-exception")

    version("main", branch="main")
    # The release's sha256 is added when the tag is published.
    version("0.1.0", tag="v0.1.0")

    variant("kokkos_kernels", default=False, description="matmul through KokkosBlas::gemm")
    variant("mpi", default=False, description="The MPI and hybrid process x thread communicators")
    variant("nccl", default=False, description="The NCCL communicator for CUDA devices")
    variant("tbb", default=False, description="The oneTBB-backed parts")
    variant("zlib", default=False, description=".gz files in the IDX reader of the data pipeline")

    depends_on("cxx", type="build")
    depends_on("cmake@3.20:", type="build")
    depends_on("kokkos@3.4:")
    depends_on("kokkos-kernels@3.4:", when="+kokkos_kernels")
    depends_on("mpi", when="+mpi")
    depends_on("nccl", when="+nccl")
    depends_on("cuda", when="+nccl")
    depends_on("intel-oneapi-tbb", when="+tbb")
    depends_on("zlib-api", when="+zlib")

    def cmake_args(self):
        return [
            self.define("MESHLIB_INSTALL", True),
            self.define("MESHLIB_BUILD_TESTS", False),
            self.define("MESHLIB_BUILD_EXAMPLES", False),
            self.define("MESHLIB_BUILD_BENCHMARKS", False),
            self.define("MESHLIB_SANITIZE_THREAD", False),
            self.define_from_variant("MESHLIB_WITH_KOKKOS_KERNELS", "kokkos_kernels"),
            self.define_from_variant("MESHLIB_WITH_MPI", "mpi"),
            self.define_from_variant("MESHLIB_WITH_NCCL", "nccl"),
            self.define_from_variant("MESHLIB_WITH_TBB", "tbb"),
            self.define_from_variant("MESHLIB_WITH_ZLIB", "zlib"),
        ]

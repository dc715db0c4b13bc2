# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Finds CUDA's runtime, NVRTC (the run-time compiler of the shared-GPU reduction kernel) and NCCL;
# sets MESHLIB_HAVE_NCCL and makes meshlib::nccl_dep.
include_guard(GLOBAL)
macro(meshlib_find_nccl)
  set(MESHLIB_HAVE_NCCL FALSE)
  find_package(CUDAToolkit QUIET)
  if(CUDAToolkit_FOUND)
    find_path(MESHLIB_NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} ENV NCCL_HOME PATH_SUFFIXES include)
    find_library(MESHLIB_NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} ENV NCCL_HOME PATH_SUFFIXES lib lib64)
    if(MESHLIB_NCCL_INCLUDE_DIR AND MESHLIB_NCCL_LIBRARY AND TARGET CUDA::nvrtc)
      if(NOT TARGET meshlib::nccl_dep)
        add_library(meshlib::nccl_dep INTERFACE IMPORTED GLOBAL)
        set_target_properties(meshlib::nccl_dep PROPERTIES
          INTERFACE_INCLUDE_DIRECTORIES "${MESHLIB_NCCL_INCLUDE_DIR}"
          INTERFACE_LINK_LIBRARIES "${MESHLIB_NCCL_LIBRARY}")
      endif()
      set(MESHLIB_HAVE_NCCL TRUE)
    endif()
  endif()
endmacro()

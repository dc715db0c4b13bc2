# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# meshlib_write_pkgconfig(<file>): writes meshlib.pc for non-CMake builds. It carries meshlib's
# include directory (relative to the .pc file, so the install stays relocatable) and the flags of
# the Kokkos this build found: Kokkos is part of <meshlib.hpp>, and Kokkos 3.x/Debian and Kokkos 4
# ship no .pc. Those flags are read from the very target the CMake package links (meshlib::kokkos
# and everything it links, transitively: include directories, compile options such as Kokkos 4's
# -fopenmp, definitions, libraries, link options), so pkg-config and find_package give a consumer
# the same Kokkos with the same flags; the .pc also records that Kokkos' version, as the CMake
# package does. Kokkos comes in with -isystem, as CMake makes imported include directories system
# ones: its headers warn under -Wall -Wextra in C++20.
# The optional parts (MPI, NCCL, oneTBB, Kokkos Kernels) are not in it: define their
# MESHLIB_ENABLE_<X>=1 and add their own flags (docs/install.md shows how).

include_guard(GLOBAL)

# One entry of a usage requirement, with the generator expressions a C++ consumer of an installed
# package would see evaluated: C++-only options kept, build-tree-only ones and other languages'
# dropped, $<LINK_ONLY:x> is x. Anything else that is a generator expression is dropped (empty).
function(_meshlib_pc_plain item out)
  set(value "${item}")
  # One test per form: a failed MATCHES in an OR would clear CMAKE_MATCH_1 of a successful one.
  foreach(form "^\\$<\\$<COMPILE_LANGUAGE:CXX>:(.*)>$" "^\\$<\\$<COMPILE_LANG_AND_ID:CXX,[^>]*>:(.*)>$"
               "^\\$<LINK_ONLY:(.*)>$" "^\\$<INSTALL_INTERFACE:(.*)>$"
               "^\\$<\\$<NOT:\\$<COMPILE_LANG_AND_ID:CUDA,[^>]*>>:(.*)>$")
    if(value MATCHES "${form}")
      set(value "${CMAKE_MATCH_1}")
      break()
    endif()
  endforeach()
  if(value MATCHES "\\$<")
    set(value "")
  endif()
  set(${out} "${value}" PARENT_SCOPE)
endfunction()

# Appends the usage requirements of TARGET and of what it links, transitively, to the global
# properties _meshlib_pc_cflags and _meshlib_pc_libs (a recursion cannot return lists otherwise).
function(_meshlib_pc_collect target)
  get_property(seen GLOBAL PROPERTY _meshlib_pc_seen)
  if(target IN_LIST seen)
    return()
  endif()
  set_property(GLOBAL APPEND PROPERTY _meshlib_pc_seen "${target}")
  if(target STREQUAL "Threads::Threads")
    set_property(GLOBAL APPEND PROPERTY _meshlib_pc_libs "-pthread")
    return()
  endif()
  get_target_property(type ${target} TYPE)
  get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
  foreach(dir IN LISTS dirs)
    _meshlib_pc_plain("${dir}" dir)
    if(dir)
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_cflags "-isystem ${dir}")
    endif()
  endforeach()
  get_target_property(options ${target} INTERFACE_COMPILE_OPTIONS)
  foreach(option IN LISTS options)
    _meshlib_pc_plain("${option}" option)
    if(option)
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_cflags "${option}")
    endif()
  endforeach()
  get_target_property(definitions ${target} INTERFACE_COMPILE_DEFINITIONS)
  foreach(definition IN LISTS definitions)
    _meshlib_pc_plain("${definition}" definition)
    if(definition)
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_cflags "-D${definition}")
    endif()
  endforeach()
  # The library file of an imported library target (its configuration, or any).
  if(type MATCHES "SHARED_LIBRARY|STATIC_LIBRARY|UNKNOWN_LIBRARY")
    set(location "")
    foreach(config "_${CMAKE_BUILD_TYPE}" _RELEASE _NOCONFIG _RELWITHDEBINFO _DEBUG "")
      string(TOUPPER "${config}" config)
      get_target_property(location ${target} IMPORTED_LOCATION${config})
      if(location)
        break()
      endif()
    endforeach()
    if(location)
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_libs "${location}")
    endif()
  endif()
  get_target_property(links ${target} INTERFACE_LINK_LIBRARIES)
  foreach(link IN LISTS links)
    _meshlib_pc_plain("${link}" link)
    if(NOT link)
      continue()
    elseif(TARGET "${link}")
      _meshlib_pc_collect("${link}")
    else()
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_libs "${link}")
    endif()
  endforeach()
  get_target_property(link_options ${target} INTERFACE_LINK_OPTIONS)
  foreach(option IN LISTS link_options)
    _meshlib_pc_plain("${option}" option)
    if(option)
      set_property(GLOBAL APPEND PROPERTY _meshlib_pc_libs "${option}")
    endif()
  endforeach()
endfunction()

# A link item as a linker flag: a library file as -L<dir> -l<name> (no -L for the system's
# default folders), a bare name as -l<name>, a flag as it is.
function(_meshlib_pc_link_flag item out)
  if(item MATCHES "^-")
    set(flag "${item}")
  elseif(IS_ABSOLUTE "${item}")
    get_filename_component(dir "${item}" DIRECTORY)
    get_filename_component(name "${item}" NAME_WE)
    string(REGEX REPLACE "^lib" "" name "${name}")
    if(dir MATCHES "^/usr/lib(64|/[a-z0-9_]+-linux-gnu)?$" OR dir MATCHES "^/lib(64)?$")
      set(flag "-l${name}")
    else()
      set(flag "-L${dir} -l${name}")
    endif()
  else()
    set(flag "-l${item}")
  endif()
  set(${out} "${flag}" PARENT_SCOPE)
endfunction()

function(meshlib_write_pkgconfig file)
  set_property(GLOBAL PROPERTY _meshlib_pc_seen "")
  set_property(GLOBAL PROPERTY _meshlib_pc_cflags "")
  set_property(GLOBAL PROPERTY _meshlib_pc_libs "")
  _meshlib_pc_collect(meshlib::kokkos)
  get_property(cflags GLOBAL PROPERTY _meshlib_pc_cflags)
  get_property(libs GLOBAL PROPERTY _meshlib_pc_libs)
  list(REMOVE_DUPLICATES cflags)
  set(flags "")
  foreach(lib IN LISTS libs)
    _meshlib_pc_link_flag("${lib}" flag)
    list(APPEND flags "${flag}")
  endforeach()
  list(REMOVE_ITEM flags "-pthread") # once, at the end (the .pc always needs it: threads)
  list(REMOVE_DUPLICATES flags)
  string(JOIN " " MESHLIB_PC_KOKKOS_CFLAGS ${cflags})
  string(JOIN " " MESHLIB_PC_KOKKOS_LIBS ${flags})
  set(MESHLIB_PC_KOKKOS_VERSION "${MESHLIB_KOKKOS_VERSION}")
  configure_file("${PROJECT_SOURCE_DIR}/cmake/meshlib.pc.in" "${file}" @ONLY)
endfunction()

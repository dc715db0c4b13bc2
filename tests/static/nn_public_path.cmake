# SPDX-License-Identifier: Apache-2.0 WITH LLVM-exception
# Fails when a header under DIR (include/meshlib/nn) reaches the collectives' internals: the
# training layer communicates only through the public typed collectives (psum, psum_scatter_into,
# all_gather_into, ...), as a user's shard_map does (issue 23). `current_device` is the entry to
# a device's raw communicator; a call of it in nn/ is the bypass this test keeps out.
# Usage: cmake -DDIR=<folder> -P nn_public_path.cmake
if(NOT DIR OR NOT IS_DIRECTORY "${DIR}")
  message(FATAL_ERROR "nn_public_path: pass -DDIR=<folder of headers>, got '${DIR}'")
endif()
file(GLOB_RECURSE headers "${DIR}/*.hpp")
list(LENGTH headers count)
if(count EQUAL 0)
  message(FATAL_ERROR "nn_public_path: no headers under ${DIR}")
endif()
set(found "")
foreach(h IN LISTS headers)
  file(STRINGS "${h}" hits REGEX "current_device")
  foreach(line IN LISTS hits)
    string(STRIP "${line}" line)
    string(APPEND found "\n  ${h}: ${line}")
  endforeach()
endforeach()
if(found)
  message(FATAL_ERROR "meshlib: include/meshlib/nn calls the collectives' internals (detail::current_device):"
                      "${found}\nuse the public typed collectives (psum with donation, psum_scatter_into, "
                      "all_gather_into, pmax) on a local_tensor over the buffer instead")
endif()
message(STATUS "nn_public_path: ${count} headers under ${DIR} use only the public collectives")

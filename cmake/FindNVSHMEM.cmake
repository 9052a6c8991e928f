# Finds NVSHMEM's host library: NVSHMEM_ROOT, NVSHMEM_HOME, or the nvidia-nvshmem-cu* wheel of the
# Python on PATH (which ships libnvshmem_host.so.3 without an unversioned link). Defines
# NVSHMEM::host and NVSHMEM_VERSION.
include(${CMAKE_CURRENT_LIST_DIR}/NvidiaWheel.cmake)
reshard_nvidia_wheel(nvshmem _nvshmem_wheel)
set(_nvshmem_hints ${NVSHMEM_ROOT} $ENV{NVSHMEM_ROOT} $ENV{NVSHMEM_HOME} ${_nvshmem_wheel})
find_path(NVSHMEM_INCLUDE_DIR nvshmem_host.h HINTS ${_nvshmem_hints} PATH_SUFFIXES include)
find_library(NVSHMEM_HOST_LIBRARY NAMES nvshmem_host libnvshmem_host.so.3
             HINTS ${_nvshmem_hints} PATH_SUFFIXES lib lib64)
if(NVSHMEM_INCLUDE_DIR AND EXISTS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h")
  file(STRINGS "${NVSHMEM_INCLUDE_DIR}/non_abi/nvshmem_version.h" _nvshmem_version_lines
       REGEX "#define NVSHMEM_VENDOR_(MAJOR|MINOR|PATCH)_VERSION")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX REPLACE ".*NVSHMEM_VENDOR_${_part}_VERSION +([0-9]+).*" "\\1" _v_${_part}
                         "${_nvshmem_version_lines}")
  endforeach()
  set(NVSHMEM_VERSION "${_v_MAJOR}.${_v_MINOR}.${_v_PATCH}")
endif()
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NVSHMEM REQUIRED_VARS NVSHMEM_INCLUDE_DIR NVSHMEM_HOST_LIBRARY
                                  VERSION_VAR NVSHMEM_VERSION)
if(NVSHMEM_FOUND AND NOT TARGET NVSHMEM::host)
  add_library(NVSHMEM::host UNKNOWN IMPORTED)
  set_target_properties(NVSHMEM::host PROPERTIES IMPORTED_LOCATION ${NVSHMEM_HOST_LIBRARY}
                                                 INTERFACE_INCLUDE_DIRECTORIES ${NVSHMEM_INCLUDE_DIR})
endif()

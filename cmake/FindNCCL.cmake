# Finds NCCL: NCCL_ROOT, the system (/usr), or the nvidia-nccl-cu* wheel of the Python on PATH.
# Defines NCCL::NCCL.
include(${CMAKE_CURRENT_LIST_DIR}/NvidiaWheel.cmake)
reshard_nvidia_wheel(nccl _nccl_wheel)
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_nccl_wheel})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                                              INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()

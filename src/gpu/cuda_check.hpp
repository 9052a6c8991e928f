// Turns CUDA runtime failures into reshard errors that name the call that failed.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "reshard/error.hpp"

namespace reshard::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* call) {
  throw_error(ErrorCode::kSystem, std::string(call) + " failed: " + cudaGetErrorName(status) +
                                      " (" + cudaGetErrorString(status) + ")");
}

}  // namespace reshard::cuda

#define RESHARD_CUDA_CHECK(call)                                      \
  do {                                                                \
    const cudaError_t reshard_cuda_status_ = (call);                  \
    if (reshard_cuda_status_ != cudaSuccess)                          \
      ::reshard::cuda::throw_cuda_error(reshard_cuda_status_, #call); \
  } while (0)

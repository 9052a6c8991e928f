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

namespace reshard::cuda {

// Loads `kernel` on the current device now rather than at its first launch (CUDA's lazy
// loading), which waits for the device's work: see load_copy_kernels.
template <typename... Args>
void load_kernel(void (*kernel)(Args...)) {
  cudaFuncAttributes attributes{};
  RESHARD_CUDA_CHECK(cudaFuncGetAttributes(&attributes, kernel));
}

}  // namespace reshard::cuda

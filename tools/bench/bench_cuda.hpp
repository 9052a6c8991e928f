// CUDA error checks for the GPU benchmarks: a failed call throws reshard's error naming the call.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "reshard/error.hpp"

#define BENCH_CUDA(call)                                                             \
  do {                                                                               \
    const cudaError_t status_ = (call);                                              \
    if (status_ != cudaSuccess)                                                      \
      reshard::throw_error(reshard::ErrorCode::kSystem,                              \
                           std::string(#call) + ": " + cudaGetErrorString(status_)); \
  } while (0)

// main() of the GoogleTest binaries that run in one process on one GPU: without a CUDA device
// they exit 77, which ctest reports as skipped.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>

namespace reshard::testing_support {

inline int run_single_gpu_tests(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;  // ctest: skipped
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

}  // namespace reshard::testing_support

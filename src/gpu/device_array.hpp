// Device memory holding a copy of a host vector (kernel inputs built once at schedule()).
#pragma once

#include <cuda_runtime_api.h>

#include <vector>

#include "gpu/cuda_check.hpp"

namespace reshard::cuda {

template <typename T>
class DeviceArray {
 public:
  DeviceArray() = default;
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  ~DeviceArray() { reset(); }
  // Replaces the contents; null for an empty vector.
  T* upload(const std::vector<T>& values) {
    reset();
    if (values.empty()) return nullptr;
    RESHARD_CUDA_CHECK(cudaMalloc(&data_, values.size() * sizeof(T)));
    RESHARD_CUDA_CHECK(
        cudaMemcpy(data_, values.data(), values.size() * sizeof(T), cudaMemcpyHostToDevice));
    return data_;
  }
  T* get() const { return data_; }
  void reset() noexcept {
    if (data_ != nullptr) cudaFree(data_);
    data_ = nullptr;
  }

 private:
  T* data_ = nullptr;
};

}  // namespace reshard::cuda

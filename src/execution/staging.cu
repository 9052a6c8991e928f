// GPU side of the executor's staging: allocation on the tensor's device and block copies.
#include "execution/staging.hpp"
#include "transports/cuda/cuda_check.hpp"

namespace reshard::exec::cuda {
namespace {

class DeviceScope {
 public:
  explicit DeviceScope(int device) {
    RESHARD_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device >= 0 && device != previous_) RESHARD_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceScope() { cudaSetDevice(previous_); }

 private:
  int previous_ = 0;
};

// One CTA per row (grid-stride); 16-byte vectors when both rows allow it.
__global__ void copy_block_kernel(const std::byte* src, BoxView src_view, std::byte* dst,
                                  BoxView dst_view, unsigned element_bytes) {
  const std::size_t row_bytes = static_cast<std::size_t>(src_view.cols) * element_bytes;
  for (std::int64_t row = blockIdx.x; row < src_view.rows; row += gridDim.x) {
    const std::byte* from = src + src_view.row_start(row) * element_bytes;
    std::byte* to = dst + dst_view.row_start(row) * element_bytes;
    const bool vector = ((reinterpret_cast<std::uintptr_t>(from) |
                          reinterpret_cast<std::uintptr_t>(to) | row_bytes) &
                         15) == 0;
    if (vector) {
      const auto* in = reinterpret_cast<const uint4*>(from);
      auto* out = reinterpret_cast<uint4*>(to);
      for (std::size_t i = threadIdx.x; i < row_bytes / 16; i += blockDim.x) out[i] = in[i];
    } else {
      for (std::size_t i = threadIdx.x; i < row_bytes; i += blockDim.x) to[i] = from[i];
    }
  }
}

}  // namespace

void* allocate(int device, std::size_t bytes) {
  DeviceScope scope(device);
  void* pointer = nullptr;
  RESHARD_CUDA_CHECK(cudaMalloc(&pointer, bytes));
  return pointer;
}

void release(int device, void* pointer) {
  DeviceScope scope(device);
  cudaFree(pointer);
}

void copy_block(const std::byte* src, const BoxView& src_view, std::byte* dst,
                const BoxView& dst_view, std::size_t element_bytes, void* stream) {
  if (src_view.rows == 0 || src_view.cols == 0) return;
  const auto grid = static_cast<unsigned>(std::min<std::int64_t>(src_view.rows, 4096));
  copy_block_kernel<<<grid, 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, src_view, dst, dst_view, static_cast<unsigned>(element_bytes));
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

void* create_stream(int device) {
  DeviceScope scope(device);
  cudaStream_t stream = nullptr;
  RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

void destroy_stream(int device, void* stream) {
  DeviceScope scope(device);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void synchronize_stream(void* stream) {
  RESHARD_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

}  // namespace reshard::exec::cuda

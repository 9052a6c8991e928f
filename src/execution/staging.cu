// GPU side of the executor's staging: allocation on the tensor's device and block copies.
#include <cstring>
#include <vector>

#include "execution/job_upload.cuh"
#include "execution/staging.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"

namespace reshard::execution::cuda {
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

// A warp's share of a copy: up to 4 KiB of one row, or as many whole rows as fit in 4 KiB where
// rows are at most 2 KiB (a 128-byte row would otherwise keep 8 lanes of 32 busy); 8 16-byte
// loads in flight per lane before the stores when both ends allow vectors. Splitting rows into
// chunks keeps a long contiguous slice (one row) spread over the whole GPU.
constexpr std::uint64_t kChunkBytes = 4096;
constexpr int kVectorsPerLane = static_cast<int>(kChunkBytes / 16 / 32);
constexpr int kThreads = 256;

__host__ __device__ std::uint64_t row_bytes_of(const BlockCopy& copy) {
  return static_cast<std::uint64_t>(copy.src_view.cols) * copy.element_bytes;
}

__host__ __device__ std::uint64_t chunks_per_row(const BlockCopy& copy) {
  return (row_bytes_of(copy) + kChunkBytes - 1) / kChunkBytes;
}

// Rows per work item: 1, or several short ones.
__host__ __device__ std::uint64_t rows_per_item(const BlockCopy& copy) {
  const std::uint64_t row_bytes = row_bytes_of(copy);
  return row_bytes == 0 || row_bytes > kChunkBytes / 2 ? 1 : kChunkBytes / row_bytes;
}

__host__ __device__ std::uint64_t items_of(const BlockCopy& copy) {
  const auto rows = static_cast<std::uint64_t>(copy.src_view.rows);
  const std::uint64_t per_item = rows_per_item(copy);
  return per_item > 1 ? (rows + per_item - 1) / per_item : rows * chunks_per_row(copy);
}

__device__ void copy_chunk(const BlockCopy& copy, std::uint64_t item, unsigned lane) {
  const std::uint64_t row_bytes = row_bytes_of(copy);
  const std::uint64_t chunks = chunks_per_row(copy);
  const auto row = static_cast<std::int64_t>(item / chunks);
  const std::uint64_t begin = (item % chunks) * kChunkBytes;
  const std::uint64_t bytes = min(kChunkBytes, row_bytes - begin);
  const std::byte* from = copy.src + copy.src_view.row_start(row) * copy.element_bytes + begin;
  std::byte* to = copy.dst + copy.dst_view.row_start(row) * copy.element_bytes + begin;
  if (((reinterpret_cast<std::uintptr_t>(from) | reinterpret_cast<std::uintptr_t>(to) | bytes) &
       15) == 0) {
    const auto* in = reinterpret_cast<const uint4*>(from);
    auto* out = reinterpret_cast<uint4*>(to);
    const std::uint64_t vectors = bytes / 16;
    uint4 held[kVectorsPerLane];
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      const std::uint64_t at = lane + 32u * i;
      if (at < vectors) held[i] = in[at];
    }
#pragma unroll
    for (int i = 0; i < kVectorsPerLane; ++i) {
      const std::uint64_t at = lane + 32u * i;
      if (at < vectors) out[at] = held[i];
    }
    return;
  }
  for (std::uint64_t i = lane; i < bytes; i += 32) to[i] = from[i];
}

// Several short rows: the lanes walk their 16-byte vectors across the rows.
__device__ void copy_rows(const BlockCopy& copy, std::uint64_t item, unsigned lane) {
  const auto row_bytes = static_cast<std::uint32_t>(row_bytes_of(copy));
  const auto per_item = static_cast<std::int64_t>(rows_per_item(copy));
  const std::int64_t first = static_cast<std::int64_t>(item) * per_item;
  const auto rows = static_cast<std::uint32_t>(min(per_item, copy.src_view.rows - first));
  const auto at = [&](const std::byte* base, const BoxView& view, std::int64_t stride,
                      std::uint32_t row) {
    const std::int64_t r = first + row;
    return base + (stride > 0 ? view.base + r * stride : view.row_start(r)) * copy.element_bytes;
  };
  if (row_bytes % 16 != 0) {
    for (std::uint32_t row = 0; row < rows; ++row) {
      const std::byte* from = at(copy.src, copy.src_view, copy.src_stride, row);
      std::byte* to = const_cast<std::byte*>(at(copy.dst, copy.dst_view, copy.dst_stride, row));
      for (std::uint32_t i = lane; i < row_bytes; i += 32) to[i] = from[i];
    }
    return;
  }
  const std::uint32_t per_row = row_bytes / 16, total = rows * per_row;
  std::uint32_t row = lane / per_row, vector = lane % per_row;
  uint4 held[kVectorsPerLane];
  uint4* out[kVectorsPerLane];
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    out[k] = nullptr;
    if (lane + 32u * k < total) {
      const std::byte* from = at(copy.src, copy.src_view, copy.src_stride, row) + 16u * vector;
      std::byte* to =
          const_cast<std::byte*>(at(copy.dst, copy.dst_view, copy.dst_stride, row)) + 16u * vector;
      if (((reinterpret_cast<std::uintptr_t>(from) | reinterpret_cast<std::uintptr_t>(to)) & 15) ==
          0) {
        held[k] = *reinterpret_cast<const uint4*>(from);
        out[k] = reinterpret_cast<uint4*>(to);
      } else {
        for (int b = 0; b < 16; ++b) to[b] = from[b];
      }
    }
    for (vector += 32; vector >= per_row; vector -= per_row) ++row;
  }
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    if (out[k] != nullptr) *out[k] = held[k];
  }
}

// Work items are numbered across the copies; a warp finds its copy in the list.
__global__ void copy_blocks_kernel(JobList<BlockCopy> list) {
  const std::uint64_t warps = static_cast<std::uint64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::uint64_t item =
           (blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x) / 32;
       item < list.items; item += warps) {
    const std::uint32_t j = list.find(item);
    const BlockCopy& copy = list.jobs[j];
    if (rows_per_item(copy) > 1) {
      copy_rows(copy, item - list.first[j], threadIdx.x % 32);
    } else {
      copy_chunk(copy, item - list.first[j], threadIdx.x % 32);
    }
  }
}

unsigned grid_for_items(std::uint64_t items) {
  const std::uint64_t warps_per_cta = kThreads / 32;
  return static_cast<unsigned>(std::max<std::uint64_t>(
      1, std::min<std::uint64_t>((items + warps_per_cta - 1) / warps_per_cta, 4096)));
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

void* create_copy_upload() { return new JobUpload(); }
void destroy_copy_upload(void* upload) { delete static_cast<JobUpload*>(upload); }

void run_block_copies(const std::vector<BlockCopy>& copies, bool uploaded, void* upload,
                      void* stream) {
  auto& list = *static_cast<JobUpload*>(upload);
  if (!uploaded) {
    job_bytes(copies, items_of, list.items, list.prefix_offset, list.scratch);
    if (list.items > 0) list.upload(list.scratch, static_cast<cudaStream_t>(stream));
  }
  if (list.items == 0) return;
  const std::byte* device_list = list.current();
  copy_blocks_kernel<<<grid_for_items(list.items), kThreads, 0,
                       static_cast<cudaStream_t>(stream)>>>(
      JobList<BlockCopy>{reinterpret_cast<const BlockCopy*>(device_list),
                         reinterpret_cast<const std::uint64_t*>(device_list + list.prefix_offset),
                         static_cast<std::uint32_t>(copies.size()), list.items});
  RESHARD_CUDA_CHECK(cudaGetLastError());
  list.mark_used(static_cast<cudaStream_t>(stream));
}

std::string pci_bus_id(int device) {
  char id[32] = {};
  RESHARD_CUDA_CHECK(cudaDeviceGetPCIBusId(id, sizeof id, device));
  return id;
}

void* create_stream(int device, bool high_priority) {
  DeviceScope scope(device);
  int least = 0, greatest = 0;
  if (high_priority) RESHARD_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
  cudaStream_t stream = nullptr;
  RESHARD_CUDA_CHECK(
      cudaStreamCreateWithPriority(&stream, cudaStreamNonBlocking, high_priority ? greatest : 0));
  return stream;
}

void destroy_stream(int device, void* stream) {
  DeviceScope scope(device);
  cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

void synchronize_stream(void* stream) {
  RESHARD_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(stream)));
}

void wait_for_default_stream(int device, void* own) {
  DeviceScope scope(device);
  ::reshard::cuda::wait_for_default_stream(static_cast<cudaStream_t>(own));
}

void* create_event(int device) {
  DeviceScope scope(device);
  cudaEvent_t event = nullptr;
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  return event;
}

void destroy_event(int device, void* event) {
  DeviceScope scope(device);
  cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

void order_after(void* later, void* earlier, void* event) {
  auto* point = static_cast<cudaEvent_t>(event);
  RESHARD_CUDA_CHECK(cudaEventRecord(point, static_cast<cudaStream_t>(earlier)));
  RESHARD_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(later), point, 0));
}

}  // namespace reshard::execution::cuda

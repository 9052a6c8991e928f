// GPU side of the executor's staging: allocation on the tensor's device and block copies.
#include <cstring>
#include <vector>

#include "execution/job_upload.cuh"
#include "execution/staging.hpp"
#include "gpu/async_copy.cuh"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "transforms/conversions.hpp"

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
// rows are at most 2 KiB (a 128-byte row would otherwise keep 8 lanes of 32 busy). Splitting rows
// into chunks keeps a long contiguous slice (one row) spread over the whole GPU.
//
// Where both ends allow 16-byte vectors, a warp's 4 KiB go to its slots of shared memory through
// cp.async (8 per lane, all in flight at once, holding no registers), then from there to the
// destination. Four CTAs of 8 warps per SM (63 registers, 32 KiB of shared memory each) keep
// 128 KiB per SM in flight. Measured on one H100 (2026-11-25) against a device-to-device copy of
// the same bytes, packs and unpacks: 512 column blocks of 256 x 1024 bf16 0.90-0.92 (0.63 with the
// 8 loads held in registers at 102 registers, 2 CTAs per SM; 0.83 with those at 100 registers but
// no per-vector pointers and no byte fallback among the loads), 65536 x 128 column blocks 0.85-0.86
// (0.69), whole matrices 0.93-0.96, Llama-3-8B's matrices 0.95.
constexpr std::uint64_t kChunkBytes = 4096;
constexpr int kVectorsPerLane = static_cast<int>(kChunkBytes / 16 / 32);
constexpr int kThreads = 256;
constexpr int kCtasPerSm = 4;

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

// BoxView::row_start, as a loop the compiler keeps rolled: it is the rare path (rows not evenly
// spaced), and unrolled over every possible dimension it held about 30 registers more than the
// common path needs, for every copy (82 against 52).
__device__ __forceinline__ std::int64_t uneven_row_start(const BoxView& view, std::int64_t row) {
  std::int64_t offset = view.base;
#pragma unroll 1
  for (int d = view.outer_dims - 1; d >= 0; --d) {
    const std::int64_t extent = view.outer_extent[d];
    offset += (row % extent) * view.outer_stride[d];
    row /= extent;
  }
  return offset;
}

// Where each row of one side of a copy starts, read from the job once per item: by a multiply
// where rows are evenly spaced, else through the view.
struct RowsOf {
  const std::byte* base;
  const BoxView* view;
  std::int64_t first, step;  // bytes: row r at base + first + r * step where step != 0
  std::uint32_t element_bytes;

  __device__ __forceinline__ const std::byte* row(std::int64_t r) const {
    return step != 0 ? base + first + r * step : base + uneven_row_start(*view, r) * element_bytes;
  }
};

__device__ __forceinline__ RowsOf rows_of(const std::byte* base, const BoxView& view,
                                          std::int64_t stride, std::uint32_t element_bytes) {
  return {base, &view, view.base * element_bytes, stride * element_bytes, element_bytes};
}

// `stage`: the warp's slots of shared memory, 32 * kVectorsPerLane vectors; each lane uses only
// its own (lane + 32 k), so no warp synchronisation is needed.
__device__ void copy_chunk(const BlockCopy& copy, std::uint64_t item, unsigned lane, uint4* stage) {
  const std::uint64_t row_bytes = row_bytes_of(copy);
  const std::uint64_t chunks = chunks_per_row(copy);
  const auto row = static_cast<std::int64_t>(item / chunks);
  const std::uint64_t begin = (item % chunks) * kChunkBytes;
  const std::uint64_t bytes = min(kChunkBytes, row_bytes - begin);
  const std::byte* from =
      rows_of(copy.src, copy.src_view, copy.src_stride, copy.element_bytes).row(row) + begin;
  auto* to = const_cast<std::byte*>(
      rows_of(copy.dst, copy.dst_view, copy.dst_stride, copy.element_bytes).row(row) + begin);
  if (((reinterpret_cast<std::uintptr_t>(from) | reinterpret_cast<std::uintptr_t>(to) | bytes) &
       15) != 0) {
    for (std::uint64_t i = lane; i < bytes; i += 32) to[i] = from[i];
    return;
  }
  const auto* in = reinterpret_cast<const uint4*>(from);
  auto* out = reinterpret_cast<uint4*>(to);
  const auto vectors = static_cast<std::uint32_t>(bytes / 16);
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    const std::uint32_t at = lane + 32u * k;
    if (at < vectors) copy_16_bytes_async(&stage[at], &in[at]);
  }
  commit_async_copies();
  wait_async_copies<0>();
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    const std::uint32_t at = lane + 32u * k;
    if (at < vectors) out[at] = stage[at];
  }
}

// Several short rows: the lanes walk their 16-byte vectors across the rows. Vectors serve where
// rows are evenly spaced (found by a multiply) and every row starts 16-byte aligned on both sides,
// decided for the whole item; the stores find their rows again rather than keep a pointer per
// vector (registers).
__device__ void copy_rows(const BlockCopy& copy, std::uint64_t item, unsigned lane, uint4* stage) {
  const auto row_bytes = static_cast<std::uint32_t>(row_bytes_of(copy));
  const auto per_item = static_cast<std::int64_t>(rows_per_item(copy));
  const std::int64_t first = static_cast<std::int64_t>(item) * per_item;
  const auto rows = static_cast<std::uint32_t>(min(per_item, copy.src_view.rows - first));
  const RowsOf src = rows_of(copy.src, copy.src_view, copy.src_stride, copy.element_bytes);
  const RowsOf dst = rows_of(copy.dst, copy.dst_view, copy.dst_stride, copy.element_bytes);
  const std::byte* from = src.base + src.first + first * src.step;
  std::byte* to = const_cast<std::byte*>(dst.base) + dst.first + first * dst.step;
  const bool vectors = src.step != 0 && dst.step != 0 &&
                       ((reinterpret_cast<std::uintptr_t>(from) |
                         reinterpret_cast<std::uintptr_t>(to) | src.step | dst.step | row_bytes) &
                        15) == 0;
  if (!vectors) {
    for (std::uint32_t row = 0; row < rows; ++row) {
      const std::byte* in = src.row(first + row);
      auto* out = const_cast<std::byte*>(dst.row(first + row));
      for (std::uint32_t i = lane; i < row_bytes; i += 32) out[i] = in[i];
    }
    return;
  }
  const std::uint32_t per_row = row_bytes / 16, total = rows * per_row;
  const std::uint32_t first_row = lane / per_row, first_vector = lane % per_row;
  std::uint32_t row = first_row, vector = first_vector;
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    if (lane + 32u * k < total) {
      copy_16_bytes_async(&stage[lane + 32u * k],
                          reinterpret_cast<const uint4*>(from + row * src.step) + vector);
    }
    for (vector += 32; vector >= per_row; vector -= per_row) ++row;
  }
  commit_async_copies();
  wait_async_copies<0>();
  row = first_row;
  vector = first_vector;
#pragma unroll
  for (int k = 0; k < kVectorsPerLane; ++k) {
    if (lane + 32u * k < total)
      reinterpret_cast<uint4*>(to + row * dst.step)[vector] = stage[lane + 32u * k];
    for (vector += 32; vector >= per_row; vector -= per_row) ++row;
  }
}

// Work items are numbered across the copies; a warp finds its copy in the list.
__global__ void __launch_bounds__(kThreads, kCtasPerSm)
    copy_blocks_kernel(JobList<BlockCopy> list) {
  __shared__ uint4 stages[kThreads / 32][32 * kVectorsPerLane];
  uint4* stage = stages[threadIdx.x / 32];
  const std::uint64_t warps = static_cast<std::uint64_t>(gridDim.x) * (blockDim.x / 32);
  for (std::uint64_t item =
           (blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x) / 32;
       item < list.items; item += warps) {
    before_refilling_slots();
    const std::uint32_t j = list.find(item);
    const BlockCopy& copy = list.jobs[j];
    if (rows_per_item(copy) > 1) {
      copy_rows(copy, item - list.first[j], threadIdx.x % 32, stage);
    } else {
      copy_chunk(copy, item - list.first[j], threadIdx.x % 32, stage);
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

void load_kernels(int device) {
  DeviceScope scope(device);
  ::reshard::cuda::load_kernel(copy_blocks_kernel);
  load_conversion_kernels();
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

void record_event(void* event, void* stream) {
  RESHARD_CUDA_CHECK(
      cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream)));
}

void wait_event(void* stream, void* event) {
  RESHARD_CUDA_CHECK(
      cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event), 0));
}

}  // namespace reshard::execution::cuda

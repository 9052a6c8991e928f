// CUDA kernels of the conversions; the arithmetic is number_formats.hpp, shared with the host
// reference, so results match it bit for bit.
#include <cstring>
#include <vector>

#include "execution/job_upload.cuh"
#include "transforms/conversions.hpp"
#include "transforms/element_access.hpp"
#include "transports/cuda/cuda_check.hpp"

namespace reshard::exec::cuda {
namespace {

using namespace formats;

// One CTA per row of a conversion.
__global__ void convert_kernel(JobList<ConvertJob> list) {
  for (std::uint64_t item = blockIdx.x; item < list.items; item += gridDim.x) {
    const std::uint32_t j = list.find(item);
    const BlockRef& src = list.jobs[j].src;
    const BlockRef& dst = list.jobs[j].dst;
    const auto row = static_cast<std::int64_t>(item - list.first[j]);
    const std::int64_t from = src.view.row_start(row);
    const std::int64_t to = dst.view.row_start(row);
    for (std::int64_t col = threadIdx.x; col < src.view.cols; col += blockDim.x) {
      store_float(dst.data, dst.dtype, to + col, load_float(src.data, src.dtype, from + col));
    }
  }
}

// Eight consecutive elements per thread: one 16-byte load for bfloat16 (two for float32) where the
// address allows, element by element otherwise or for the `count` < 8 at a ragged edge.
constexpr int kPerThread = 8;

__device__ __forceinline__ void load_elements(const void* data, DType dtype, std::int64_t index,
                                              int count, float (&v)[kPerThread]) {
  const auto address = [&](std::size_t element) {
    return reinterpret_cast<std::uintptr_t>(data) + static_cast<std::uintptr_t>(index) * element;
  };
  if (count == kPerThread && dtype == DType::kBFloat16 && (address(2) & 15) == 0) {
    const uint4 word = *reinterpret_cast<const uint4*>(address(2));
    const unsigned words[4] = {word.x, word.y, word.z, word.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = bf16_to_float(static_cast<std::uint16_t>(words[i] & 0xffffu));
      v[2 * i + 1] = bf16_to_float(static_cast<std::uint16_t>(words[i] >> 16));
    }
    return;
  }
  if (count == kPerThread && dtype == DType::kFloat32 && (address(4) & 15) == 0) {
    const auto* quads = reinterpret_cast<const float4*>(address(4));
    const float4 a = quads[0], b = quads[1];
    const float values[kPerThread] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) v[i] = values[i];
    return;
  }
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) v[i] = i < count ? load_float(data, dtype, index + i) : 0.0f;
}

// Stores `count` FP8 bytes: one 8-byte store where the address allows.
__device__ __forceinline__ void store_bytes(void* data, std::int64_t index, int count,
                                            const std::uint8_t (&bytes)[kPerThread]) {
  auto* out = static_cast<std::uint8_t*>(data) + index;
  if (count == kPerThread && (reinterpret_cast<std::uintptr_t>(out) & 7) == 0) {
    std::uint64_t word = 0;
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) word |= static_cast<std::uint64_t>(bytes[i]) << (8 * i);
    *reinterpret_cast<std::uint64_t*>(out) = word;
    return;
  }
  for (int i = 0; i < count; ++i) out[i] = bytes[i];
}

// A work item is 256 elements of one row (8 MX blocks, 4 lanes of 8 elements each), so the loads
// are 16-byte vectors and a block's maximum is two shuffles inside each group of 4 lanes (max is
// order-independent, NaN propagates). Each warp takes a contiguous run of items and walks it with
// a cursor, issuing the loads of kMxItemsInFlight items before encoding any. Two items and at most
// 64 registers (4 CTAs per SM) beat four items at 106 registers (2 CTAs): 8 GB of bf16 in 7.2
// instead of 9.5 ms, a Qwen3-30B MXFP8 refit 103 -> 78 ms (2x H200, 2026-11-22). The 64-register
// bound spills ~100 bytes; 3 CTAs per SM at 80 registers spill none and ran the same (Llama
// sender prepare 7.4-7.7 against 7.3 ms, 2x H200, 2026-11-23).
constexpr int kLanesPerMxBlock = kMxBlock / kPerThread;
constexpr int kPerWarp = 32 * kPerThread;
constexpr int kMxItemsInFlight = 2;
constexpr int kMxThreads = 256;

__host__ __device__ std::int64_t mx_tasks_per_row(const MxJob& job) {
  return (job.src.view.cols + kPerWarp - 1) / kPerWarp;
}

// Where a warp is in its run: the job, the row, the 256-element chunk of the row, and the row's
// starts in the three views. The starts are recomputed only when the row changes: the divisions
// behind them, done per item, cost more than the conversion itself.
struct MxCursor {
  std::uint32_t job;
  std::int64_t row, chunk, per_row;
  std::int64_t src_row, data_row, scale_row;

  __device__ void seek_row(const MxJob& current) {
    src_row = current.src.view.row_start(row);
    data_row = current.data.view.row_start(row);
    scale_row = current.scale.view.row_start(row);
  }
  __device__ MxCursor(const JobList<MxJob>& list, std::uint64_t item) : job(list.find(item)) {
    per_row = mx_tasks_per_row(list.jobs[job]);
    const auto t = static_cast<std::int64_t>(item - list.first[job]);
    row = t / per_row;
    chunk = t % per_row;
    seek_row(list.jobs[job]);
  }
  // To the next item; there must be one.
  __device__ void advance(const JobList<MxJob>& list) {
    if (++chunk < per_row) return;
    chunk = 0;
    ++row;
    if (static_cast<std::uint64_t>(row * per_row) >= list.first[job + 1] - list.first[job]) {
      do {
        ++job;
      } while (list.first[job + 1] == list.first[job]);  // jobs without items
      row = 0;
      per_row = mx_tasks_per_row(list.jobs[job]);
    }
    seek_row(list.jobs[job]);
  }
};

__global__ void __launch_bounds__(kMxThreads, 4) mx_quantize_kernel(JobList<MxJob> list) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint64_t warps = static_cast<std::uint64_t>(gridDim.x) * (blockDim.x / 32);
  const std::uint64_t warp =
      (blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x) / 32;
  const std::uint64_t per_warp = (list.items + warps - 1) / warps;
  const std::uint64_t begin = warp * per_warp;
  const std::uint64_t end = min(list.items, begin + per_warp);
  if (begin >= end) return;
  MxCursor cursor(list, begin);
  for (std::uint64_t item = begin; item < end; item += kMxItemsInFlight) {
    float v[kMxItemsInFlight][kPerThread];
    std::uint32_t job[kMxItemsInFlight];
    std::int64_t data_at[kMxItemsInFlight], scale_at[kMxItemsInFlight];
    bool active[kMxItemsInFlight];
#pragma unroll
    for (int u = 0; u < kMxItemsInFlight; ++u) {
      const bool inside = item + u < end;
      const MxJob& current = list.jobs[cursor.job];
      job[u] = cursor.job;
      const std::int64_t col = cursor.chunk * kPerWarp + lane * kPerThread;
      data_at[u] = cursor.data_row + col;
      scale_at[u] = cursor.scale_row + col / kMxBlock;
      // Rows hold whole MX blocks, so the 4 lanes of a block are active together.
      active[u] = inside && col < current.src.view.cols;
      load_elements(current.src.data, current.src.dtype, active[u] ? cursor.src_row + col : 0,
                    active[u] ? kPerThread : 0, v[u]);
      if (item + u + 1 < end) cursor.advance(list);
    }
#pragma unroll
    for (int u = 0; u < kMxItemsInFlight; ++u) {
      float amax = 0.0f;
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) amax = abs_max(amax, v[u][i]);
#pragma unroll
      for (int offset = 1; offset < kLanesPerMxBlock; offset *= 2) {
        amax = abs_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
      }
      if (!active[u]) continue;
      const MxJob& current = list.jobs[job[u]];
      const std::uint8_t bits = mx_scale_bits(amax, current.round_up);
      if (lane % kLanesPerMxBlock == 0) {
        static_cast<std::uint8_t*>(current.scale.data)[scale_at[u]] = bits;
      }
      std::uint8_t encoded[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; i += 2) {
        const std::uint16_t pair = mx_encode_pair(v[u][i], v[u][i + 1], bits);
        encoded[i] = static_cast<std::uint8_t>(pair & 0xffu);
        encoded[i + 1] = static_cast<std::uint8_t>(pair >> 8);
      }
      store_bytes(current.data.data, data_at[u], kPerThread, encoded);
    }
  }
}

// One CTA per 128 x 128 tile: 16 threads of 8 elements span a tile row, 16 rows per pass, 8
// passes; the values stay in registers between the maximum and the encode. A tile's rows lie in
// one matrix, one stride apart, so a thread finds its rows from the tile's first row, before any
// store: the job list is in global memory, and after a byte store the compiler must assume a job
// changed and reload it. Per-row offsets recomputed after the stores had the Llama-3-8B block-FP8
// refit's sender preparing for 34.4 ms instead of 24.8 (2x H200, 2026-11-23).
constexpr int kTileThreads = 256;
constexpr int kThreadsPerTileRow = kFp8Block / kPerThread;
constexpr int kTileRowsPerPass = kTileThreads / kThreadsPerTileRow;
constexpr int kTilePasses = kFp8Block / kTileRowsPerPass;

__host__ __device__ std::int64_t tiles_of(const BlockFp8Job& job) {
  const std::int64_t tile_rows = (job.rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const std::int64_t tile_cols = (job.src.view.cols + kFp8Block - 1) / kFp8Block;
  return job.src.view.rows / job.rows_per_matrix * tile_rows * tile_cols;
}

__global__ void __launch_bounds__(kTileThreads) block_quantize_kernel(JobList<BlockFp8Job> list) {
  __shared__ float warp_amax[kTileThreads / 32];
  const int col = static_cast<int>(threadIdx.x % kThreadsPerTileRow) * kPerThread;
  const int first_row = static_cast<int>(threadIdx.x / kThreadsPerTileRow);
  for (std::uint64_t item = blockIdx.x; item < list.items; item += gridDim.x) {
    const std::uint32_t j = list.find(item);
    const BlockFp8Job& job = list.jobs[j];
    const void* const src = job.src.data;
    const DType src_dtype = job.src.dtype;
    auto* const data = static_cast<std::uint8_t*>(job.data.data);
    const std::int64_t rows_per_matrix = job.rows_per_matrix;
    const std::int64_t tile_rows = (rows_per_matrix + kFp8Block - 1) / kFp8Block;
    const std::int64_t tile_cols = (job.src.view.cols + kFp8Block - 1) / kFp8Block;
    const auto t = static_cast<std::int64_t>(item - list.first[j]);
    const std::int64_t m = t / (tile_rows * tile_cols);
    const std::int64_t tr = (t / tile_cols) % tile_rows;
    const std::int64_t tc = t % tile_cols;
    const std::int64_t row_begin = m * rows_per_matrix + tr * kFp8Block;
    const int rows = static_cast<int>(
        min(static_cast<std::int64_t>(kFp8Block), rows_per_matrix - tr * kFp8Block));
    const std::int64_t c0 = tc * kFp8Block + col;
    const int count =
        static_cast<int>(max(static_cast<std::int64_t>(0),
                             min(static_cast<std::int64_t>(kPerThread), job.src.view.cols - c0)));
    const std::int64_t src_first = job.src.view.row_start(row_begin) + c0;
    const std::int64_t src_stride = job.src.view.row_stride();
    const std::int64_t data_first = job.data.view.row_start(row_begin) + c0;
    const std::int64_t data_stride = job.data.view.row_stride();
    float* const scale_at =
        static_cast<float*>(job.scale.data) + job.scale.view.row_start(m * tile_rows + tr) + tc;
    float v[kTilePasses][kPerThread];
    float amax = 0.0f;
#pragma unroll
    for (int p = 0; p < kTilePasses; ++p) {
      const int r = p * kTileRowsPerPass + first_row;
      const int n = r < rows ? count : 0;
      load_elements(src, src_dtype, n > 0 ? src_first + r * src_stride : 0, n, v[p]);
#pragma unroll
      for (int i = 0; i < kPerThread; ++i) amax = abs_max(amax, v[p][i]);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = abs_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    if (threadIdx.x % 32 == 0) warp_amax[threadIdx.x / 32] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < kTileThreads / 32; ++w) amax = abs_max(amax, warp_amax[w]);
    const float s = block_scale(amax);
    const float reciprocal = __frcp_rn(s);
    if (threadIdx.x == 0) *scale_at = s;
#pragma unroll
    for (int p = 0; p < kTilePasses; ++p) {
      const int r = p * kTileRowsPerPass + first_row;
      if (r >= rows || count == 0) continue;
      std::uint8_t encoded[kPerThread];
#pragma unroll
      for (int i = 0; i < kPerThread; i += 2) {
        const std::uint16_t pair = block_encode_pair(v[p][i], v[p][i + 1], s, reciprocal);
        encoded[i] = static_cast<std::uint8_t>(pair & 0xffu);
        encoded[i + 1] = static_cast<std::uint8_t>(pair >> 8);
      }
      store_bytes(data, data_first + r * data_stride, count, encoded);
    }
    __syncthreads();  // warp_amax is reused by the next tile
  }
}

template <typename Job, typename ItemsOf, typename Launch>
void run_jobs(const std::vector<Job>& jobs, JobUpload& upload, void* stream, ItemsOf items_of,
              Launch launch) {
  if (jobs.empty()) return;
  std::uint64_t items = 0;
  std::size_t prefix_offset = 0;
  job_bytes(jobs, items_of, items, prefix_offset, upload.scratch);
  if (items == 0) return;
  auto cuda_stream = static_cast<cudaStream_t>(stream);
  const std::byte* device_list = upload.upload(upload.scratch, cuda_stream);
  launch(JobList<Job>{reinterpret_cast<const Job*>(device_list),
                      reinterpret_cast<const std::uint64_t*>(device_list + prefix_offset),
                      static_cast<std::uint32_t>(jobs.size()), items},
         cuda_stream);
  RESHARD_CUDA_CHECK(cudaGetLastError());
  upload.mark_used(cuda_stream);
}

unsigned grid_of(std::uint64_t units) {
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min<std::uint64_t>(units, 8192)));
}

}  // namespace

struct ConversionUploads {
  JobUpload convert, mx, block;
};

ConversionUploads* create_uploads() { return new ConversionUploads(); }
void destroy_uploads(ConversionUploads* uploads) { delete uploads; }

void convert(const std::vector<ConvertJob>& jobs, ConversionUploads& uploads, void* stream) {
  run_jobs(
      jobs, uploads.convert, stream,
      [](const ConvertJob& job) {
        return job.src.view.cols == 0 ? 0 : static_cast<std::uint64_t>(job.src.view.rows);
      },
      [](const JobList<ConvertJob>& list, cudaStream_t s) {
        convert_kernel<<<grid_of(list.items), 256, 0, s>>>(list);
      });
}

void mx_quantize(const std::vector<MxJob>& jobs, ConversionUploads& uploads, void* stream) {
  run_jobs(
      jobs, uploads.mx, stream,
      [](const MxJob& job) {
        return static_cast<std::uint64_t>(job.src.view.rows * mx_tasks_per_row(job));
      },
      // Whole warps only (256-thread CTAs), so the shuffles are legal.
      [](const JobList<MxJob>& list, cudaStream_t s) {
        constexpr std::uint64_t kItemsPerCta = kMxThreads / 32 * kMxItemsInFlight;
        mx_quantize_kernel<<<grid_of((list.items + kItemsPerCta - 1) / kItemsPerCta), kMxThreads, 0,
                             s>>>(list);
      });
}

void block_quantize(const std::vector<BlockFp8Job>& jobs, ConversionUploads& uploads,
                    void* stream) {
  run_jobs(
      jobs, uploads.block, stream,
      [](const BlockFp8Job& job) {
        return job.src.view.cols == 0 ? 0 : static_cast<std::uint64_t>(tiles_of(job));
      },
      [](const JobList<BlockFp8Job>& list, cudaStream_t s) {
        block_quantize_kernel<<<grid_of(list.items), kTileThreads, 0, s>>>(list);
      });
}

}  // namespace reshard::exec::cuda

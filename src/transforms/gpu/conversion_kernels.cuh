// What the conversion kernels share: their tasks (one per job, or per piece of a large one),
// a lane's vectors and their loads, stores and staging through shared memory (device), and how
// tasks are uploaded and launched (host). Each kernel family has its file (cast_kernels.cu,
// mx_kernels.cu, block_fp8_kernels.cu) and its entry points below; conversions.cu queues jobs and
// launches them. The arithmetic is number_formats.hpp, shared with the host reference.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>

#include "execution/job_upload.cuh"
#include "execution/row_walk.hpp"
#include "gpu/async_copy.cuh"
#include "gpu/cuda_check.hpp"
#include "reshard/error.hpp"
#include "transforms/conversions.hpp"

namespace reshard::execution::cuda {

using namespace formats;

// The element-wise kernels (casts, MXFP8) give each lane a vector of 8 consecutive elements of a
// row (casts; 16 for MXFP8) and each warp a run of chunks of tiles of 32 vectors, a chunk's tiles
// all loaded before any is converted. A chunk lies in one job, found once per chunk (a search only
// where the run enters the next job); rows are any length: a tile runs on across rows (a row of
// 64 elements is 8 lanes), so skinny tensors keep every lane busy, and a lane finds its row with a
// multiply (FastDivisor), not a division. (Tiles found one by one, each with its own lookup of the
// job, ran MXFP8 at 0.62 of the copy rate on one H100, 2026-11-24.)
//
// A chunk's loads go through cp.async into the warp's slots of shared memory, 4 KiB a warp (half
// that for MXFP8 and float32 casts in launches that leave warps idle: run_chunked), where they wait
// without holding registers: 64 registers, 4 CTAs of 256 threads per SM. (Before, the
// tiles were loaded into registers: 2-4 tiles a warp, 80 registers, 3 CTAs per SM; on one H100,
// 2026-11-25, MXFP8 0.86-0.90 of the copy rate on large matrices against 0.87-0.94 now, casts
// 0.77-0.89 against 0.85-0.95.)
constexpr int kPerLane = 8;
constexpr int kThreads = 256;
constexpr int kStagedCtasPerSm = 4;
template <DType S>
constexpr int kCastVectors = S == DType::kFloat32 ? 2 : 1;  // 16-byte loads of a lane's 8
template <DType S>
constexpr int kCastTiles = 8 / kCastVectors<S>;  // 4 KiB of source a chunk
// The smaller chunks run_chunked takes where a launch would leave warps idle: half for float32
// sources, the same for 16-bit ones (see run_chunked).
template <DType S>
constexpr int kFewerCastTiles = S == DType::kFloat32 ? kCastTiles<S> / 2 : kCastTiles<S>;
// MXFP8 lanes take 16 elements (two 16-byte loads of bfloat16; a block is two lanes, one shuffle):
// half the work per element of finding rows and scales (0.77 -> 0.89 of the copy rate on one
// H100, 2026-11-24).
constexpr int kMxPerLane = 16;
template <DType S>
constexpr int kMxTiles = S == DType::kFloat32 ? 2 : 4;  // 4 KiB of source a chunk
template <DType S>
constexpr int kFewerMxTiles = kMxTiles<S> / 2;
// A job's lane vectors: rows of `per_row.divisor` vectors from `first_row` of its views on. Jobs
// of 2^31 vectors or more are split by rows, so a vector's index fits in 32 bits.
struct VectorSpan {
  FastDivisor per_row;
  std::uint32_t vectors = 0;  // here, not last: no padding (job lists are compared byte for byte)
  std::int64_t first_row = 0;
};

struct MxTask {
  const void* src;
  std::uint8_t* data;
  std::uint8_t* scale;
  // Swizzled scales (col_tiles > 0): scale_rows gives a row's index in the scale matrix (stride
  // 1) and first_col the job's first block column.
  RowWalk src_rows, data_rows, scale_rows;
  VectorSpan span;
  std::int64_t first_col;
  std::uint32_t col_tiles;
  bool round_up;
  std::uint8_t least_bits;
  // Source, data and scale rows all evenly spaced, the row steps in bytes below 2^32 and, for
  // swizzled scales, every scale offset too: the kernel's common path (mx_quantize_even_chunk).
  bool even;
  // Swizzled scales whose span covers whole 128 x 128 tiles of the layout (rows from a multiple of
  // 128, in multiples of 128, and whole groups of 4 block columns from a multiple of 4; at least
  // 256 rows and 256 columns): the chunks take them in bands, each scale sector written whole
  // (mx_quantize_banded_chunk, is_banded).
  bool banded;
};

struct SwizzleTask {
  const std::uint8_t* src;
  std::uint8_t* dst;
  VectorSpan span;  // one scale per lane
  std::int64_t first_row, first_col, col_tiles;
};

struct CastTask {
  const void* src;
  void* dst;
  RowWalk src_rows, dst_rows;
  VectorSpan span;
  std::int64_t cols;
  // A widening cast (16-bit to float32) whose tiles can lie in one run on both sides: rows back
  // to back, or long enough to hold whole tiles (cast_kernel's warp-wide stores).
  std::uint32_t warp_stores;
  std::uint32_t zero;  // where padding would be: job lists are compared byte for byte
};

// Where rows are not evenly spaced (rare), their starts come from a function out of line: inlined,
// its unrolled loop over every dimension made the kernels' code several times longer than their
// common path, and with it the stalls for instructions in short launches.
inline __device__ __noinline__ std::int64_t uneven_row_start(const BoxView* uneven,
                                                             std::int32_t view, std::int64_t row) {
  return uneven[view].row_start(row);
}
__device__ __forceinline__ std::int64_t row_start(const RowWalk& walk, std::int64_t row,
                                                  const BoxView* uneven) {
  return walk.view < 0 ? walk.base + row * walk.stride : uneven_row_start(uneven, walk.view, row);
}

// A lane's vector: its row in the job's views and its first column.
struct LaneVector {
  std::int64_t row = 0, col = 0;
  bool active = false;
};

// The job holding `chunk`: the previous one's (`job`, where the warp's last chunk was) or a later
// one. Warps walk their chunks upwards, one after the other, so the search mostly ends at the
// first comparison.
template <typename Task>
__device__ __forceinline__ std::uint32_t job_of(const JobList<Task>& list, std::uint64_t chunk,
                                                std::uint32_t job) {
  if (list.first[job + 1] > chunk) return job;
  std::uint32_t low = job + 1, high = list.count - 1;
  while (low < high) {
    const std::uint32_t middle = (low + high + 1) / 2;
    if (list.first[middle] <= chunk) {
      low = middle;
    } else {
      high = middle - 1;
    }
  }
  return low;
}

// Calls body(job, first) for each chunk of the calling warp's run (list.per_warp chunks, set with
// the grid by chunked_grid), `first` being the lane's vector in the chunk's first tile. Each warp
// walks consecutive chunks: mostly of one job, whose fields stay cached, so the job is searched
// for only where the run enters the next.
//
// With `per_warp` 0 the warps take every chunk one grid's worth of warps apart instead
// (interleaved): the grid then works through the launch's data together, front to back.
template <int VectorsPerChunk, typename Task, typename Body>
__device__ __forceinline__ void for_each_chunk(const JobList<Task>& list, Body body) {
  const unsigned lane = threadIdx.x % 32;
  const unsigned warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
  const std::uint64_t per_warp = list.per_warp;
  std::uint32_t job = 0;
  if (per_warp == 0) {
    const std::uint64_t warps = std::uint64_t{gridDim.x} * (blockDim.x / 32);
    for (std::uint64_t chunk = warp; chunk < list.items; chunk += warps) {
      job = job_of(list, chunk, job);
      body(list.jobs[job], (chunk - list.first[job]) * VectorsPerChunk + lane);
    }
    return;
  }
  const std::uint64_t end = min(list.items, (warp + 1) * per_warp);
  for (std::uint64_t chunk = warp * per_warp; chunk < end; ++chunk) {
    job = job_of(list, chunk, job);
    body(list.jobs[job], (chunk - list.first[job]) * VectorsPerChunk + lane);
  }
}

// Vector `vector` (of N elements) of a job's span (inactive past its end).
template <int N>
__device__ __forceinline__ LaneVector lane_vector(const VectorSpan& span, std::uint64_t vector) {
  LaneVector at;
  at.active = vector < span.vectors;
  const auto v = static_cast<std::uint32_t>(at.active ? vector : 0);
  const std::uint32_t row = span.per_row.divide(v);
  at.row = span.first_row + row;
  at.col = static_cast<std::int64_t>(v - row * span.per_row.divisor) * N;
  return at;
}

// N (8 or 16) elements of a float32, bfloat16 or float16 tensor as they are stored: two 16-bit
// elements per word (the first in the low half), or one float32 per word.
// Bytes per element of a float32, bfloat16 or float16 tensor.
template <DType D>
constexpr int kElementBytes = D == DType::kFloat32 ? 4 : 2;

template <DType D, int N = kPerLane>
constexpr int kWords = D == DType::kFloat32 ? N : N / 2;

template <DType D, int N = kPerLane>
struct Raw {
  std::uint32_t word[kWords<D, N>];
};

// load_raw's elements one by one (a short or unaligned vector: rare, so out of line).
template <DType D, int N>
__device__ __noinline__ Raw<D, N> load_raw_piecewise(const std::uint8_t* at, int count) {
  constexpr int size = kElementBytes<D>;
  Raw<D, N> raw{};
  // Unrolled with constant indices, so `raw` stays in registers.
#pragma unroll
  for (int i = 0; i < N; ++i) {
    if (i >= count) break;
    if constexpr (size == 4) {
      raw.word[i] = reinterpret_cast<const std::uint32_t*>(at)[i];
    } else {
      raw.word[i / 2] |= static_cast<std::uint32_t>(reinterpret_cast<const std::uint16_t*>(at)[i])
                         << (16 * (i % 2));
    }
  }
  return raw;
}

// Loads the `count` (<= N) elements at `index`; the rest read as zero. 16-byte loads where the
// address allows.
template <DType D, int N = kPerLane>
__device__ __forceinline__ Raw<D, N> load_raw(const void* base, std::int64_t index, int count) {
  const auto* at = static_cast<const std::uint8_t*>(base) + index * kElementBytes<D>;
  if (count != N || (reinterpret_cast<std::uintptr_t>(at) & 15) != 0) {
    return load_raw_piecewise<D, N>(at, count);
  }
  Raw<D, N> raw;
#pragma unroll
  for (int q = 0; q < kWords<D, N> / 4; ++q) {
    const uint4 v = reinterpret_cast<const uint4*>(at)[q];
    raw.word[4 * q] = v.x;
    raw.word[4 * q + 1] = v.y;
    raw.word[4 * q + 2] = v.z;
    raw.word[4 * q + 3] = v.w;
  }
  return raw;
}

template <DType D, int N>
__device__ __forceinline__ float element(const Raw<D, N>& raw, int i) {
  if constexpr (D == DType::kFloat32) {
    return __uint_as_float(raw.word[i]);
  } else {
    const std::uint32_t w = raw.word[i / 2];
    if constexpr (D == DType::kBFloat16) return __uint_as_float(i % 2 ? w & 0xffff0000u : w << 16);
    return fp16_to_float(static_cast<std::uint16_t>(i % 2 ? w >> 16 : w & 0xffffu));
  }
}

// The largest magnitude's bits in the element's own format: magnitudes order as their bit
// patterns, and every NaN lies above infinity, so an integer maximum is abs_max exactly (a NaN
// anywhere gives a NaN, which amax_of turns into a float NaN).
template <DType D, int N>
__device__ __forceinline__ std::uint32_t magnitude_max(const Raw<D, N>& raw) {
  std::uint32_t m = 0;
  if constexpr (D == DType::kFloat32) {
#pragma unroll
    for (int i = 0; i < N; ++i) m = max(m, raw.word[i] & 0x7fffffffu);
  } else {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) m = __vmaxu2(m, raw.word[i] & 0x7fff7fffu);
    m = max(m & 0xffffu, m >> 16);
  }
  return m;
}

template <DType D>
__device__ __forceinline__ float amax_of(std::uint32_t magnitude) {
  if constexpr (D == DType::kFloat32) return __uint_as_float(magnitude);
  if constexpr (D == DType::kBFloat16) return __uint_as_float(magnitude << 16);
  return fp16_to_float(static_cast<std::uint16_t>(magnitude));
}

// mx_scale_bits of a block's largest magnitude (bits as magnitude_max gives them). For bfloat16
// straight from the bits: the exponent field less 8 (plus one where rounding up and the
// significand exceeds 1.75), at least `least_bits` for a maximum that is not zero (0 for zero, and
// for subnormal maxima under least_bits 0: the exponent clamps at -127), NaN for NaN and infinity.
template <DType S>
__device__ __forceinline__ std::uint8_t scale_bits_of(std::uint32_t magnitude, bool round_up,
                                                      std::uint8_t least_bits) {
  if constexpr (S == DType::kBFloat16) {
    const int exponent = static_cast<int>(magnitude >> 7);
    if (exponent == 0xff) return kE8m0Nan;
    const int up = round_up && (magnitude & 0x7fu) > 0x60u ? 1 : 0;
    const int least = magnitude == 0 ? 0 : least_bits;
    return static_cast<std::uint8_t>(max(least, exponent - 8 + up));
  } else {
    return mx_scale_bits(amax_of<S>(magnitude), round_up, least_bits);
  }
}

// Stores 8 bytes, as one word where the address allows.
__device__ __forceinline__ void store_8_bytes(std::uint8_t* at, uint2 bytes) {
  if ((reinterpret_cast<std::uintptr_t>(at) & 7) == 0) {
    *reinterpret_cast<uint2*>(at) = bytes;
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i)
    at[i] = static_cast<std::uint8_t>((i < 4 ? bytes.x : bytes.y) >> (8 * (i % 4)));
}

// store_16_bytes at an address that is not 16-byte aligned (rare, so out of line).
inline __device__ __noinline__ void store_16_bytes_piecewise(std::uint8_t* at, uint4 bytes) {
  store_8_bytes(at, make_uint2(bytes.x, bytes.y));
  store_8_bytes(at + 8, make_uint2(bytes.z, bytes.w));
}

// Stores 16 bytes, as one vector where the address allows.
__device__ __forceinline__ void store_16_bytes(std::uint8_t* at, uint4 bytes) {
  if ((reinterpret_cast<std::uintptr_t>(at) & 15) == 0) {
    *reinterpret_cast<uint4*>(at) = bytes;
  } else {
    store_16_bytes_piecewise(at, bytes);
  }
}

// The elements of a lane's vector: 8, or fewer at the end of a row.
__device__ __forceinline__ int vector_count(const LaneVector& at, std::int64_t cols) {
  return at.active ? static_cast<int>(min(static_cast<std::int64_t>(kPerLane), cols - at.col)) : 0;
}

// Stages a lane's vector of K 16-byte pieces at `from` into its slots (`slots[v][lane]`). Where
// K > 1 the pieces are the parts of 32-byte sectors, so they go through L1 (cp.async.ca): through
// L2 alone each sector came twice (0.63-0.72 of the copy rate on one H100, 2026-11-25). Staging
// whole sectors instead, each copy instruction of a warp taking 512 consecutive bytes, ran at
// 0.60-0.70, and 0.65-0.67 even for jobs whose vectors lie in one run (no row to find): lanes
// whose copies land in slots 512 bytes apart throttle the shared-memory pipe (ncu).
template <int K>
__device__ __forceinline__ void stage_vector(uint4 (&slots)[K][32], unsigned lane,
                                             const std::uint8_t* from) {
#pragma unroll
  for (int v = 0; v < K; ++v) {
    if constexpr (K > 1) {
      copy_16_bytes_async_through_l1(&slots[v][lane], from + 16 * v);
    } else {
      copy_16_bytes_async(&slots[v][lane], from + 16 * v);
    }
  }
}

// The lane's staged vector (its K pieces in `slots`) as the words of its elements.
template <DType S, int N, int K>
__device__ __forceinline__ Raw<S, N> staged_raw(const uint4 (&slots)[K][32], unsigned lane) {
  static_assert(sizeof(Raw<S, N>) == K * sizeof(uint4));
  Raw<S, N> raw;
#pragma unroll
  for (int v = 0; v < K; ++v) {
    const uint4 q = slots[v][lane];
    raw.word[4 * v] = q.x;
    raw.word[4 * v + 1] = q.y;
    raw.word[4 * v + 2] = q.z;
    raw.word[4 * v + 3] = q.w;
  }
  return raw;
}

// Stages the calling lane's vector in each tile of a chunk, one cp.async group per tile, where
// `source(u)` (the vector's first byte in tile u, or null where the lane has none there) is
// 16-byte aligned, and returns which tiles it staged (bit u); the others are read at encoding.
template <int kTiles, int K, typename Source>
__device__ __forceinline__ unsigned stage_tiles(uint4 (&stage)[kTiles][K][32], unsigned lane,
                                                Source source) {
  unsigned staged = 0;
#pragma unroll
  for (int u = 0; u < kTiles; ++u) {
    const std::uint8_t* from = source(u);
    if (from != nullptr && (reinterpret_cast<std::uintptr_t>(from) & 15) == 0) {
      staged |= 1u << u;
      stage_vector(stage[u], lane, from);
    }
    commit_async_copies();
  }
  return staged;
}

// stage_tiles for a chunk whose rows the task's RowWalks find (`first`: the lane's vector of N
// elements in the first tile): the vectors that `whole(at)` says are whole.
template <DType S, int N, int kTiles, int K, typename Task, typename Whole>
__device__ __forceinline__ unsigned stage_chunk(uint4 (&stage)[kTiles][K][32], unsigned lane,
                                                const Task& task, std::uint64_t first,
                                                const BoxView* uneven, Whole whole) {
  return stage_tiles(stage, lane, [&](int u) -> const std::uint8_t* {
    const LaneVector at = lane_vector<N>(task.span, first + 32 * u);
    if (!whole(at)) return nullptr;
    return static_cast<const std::uint8_t*>(task.src) +
           (row_start(task.src_rows, at.row, uneven) + at.col) * kElementBytes<S>;
  });
}

// Block FP8: one CTA per 128 x 128 tile: 16 lanes of 8 elements span a tile row, 16 rows per
// pass, 8 passes. A tile's rows lie in one matrix, one stride apart. Where the tile's values are
// finite and its scale at least 2^-100 (a plain tile), a quotient is value * (1 / scale) and the
// FP8 conversion. bfloat16 tiles need no test per element (block_bf16_reciprocal says why); for
// float32 and float16 the rare quotients that could round either way are settled by one fma
// (settled_quotient). Other tiles take block_encode_pair. (Testing each bfloat16 quotient and
// settling those near a tie, one lane of a warp at a time, held the kernel at 0.78 of the copy
// rate on one H100, 2026-11-25: on weight-like data ties come up in most warps, ncu counted 23
// active threads per warp; without the tests, 0.99 and half the instructions.)
constexpr int kTileThreads = 256;
constexpr int kThreadsPerTileRow = kFp8Block / kPerLane;
constexpr int kTileRowsPerPass = kTileThreads / kThreadsPerTileRow;
constexpr int kTilePasses = kFp8Block / kTileRowsPerPass;

struct BlockTask {
  const void* src;
  std::uint8_t* data;
  float* scale;
  RowWalk src_rows, data_rows, scale_rows;
  std::int64_t cols;                     // of a row
  std::int64_t src_stride, data_stride;  // between rows of one matrix
  std::int64_t rows_per_matrix;
  FastDivisor tiles_per_matrix, tile_cols;
  std::uint32_t tiles;
  std::uint32_t zero;  // where padding would be: job lists are compared byte for byte
};

// CTAs for `units` of work: at most what the GPU holds at once several times over (the kernels
// walk their work in strides of the grid).
inline std::uint64_t multiprocessors() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  return static_cast<std::uint64_t>(sms);
}

inline unsigned grid_for(std::uint64_t units) {
  const std::uint64_t most = multiprocessors() * 16;
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min(units, most)));
}

// Warps of the staged element-wise kernels (casts, MXFP8) the GPU holds at once.
inline std::uint64_t resident_staged_warps() {
  return multiprocessors() * kStagedCtasPerSm * (kThreads / 32);
}

// CTAs for the chunks of the element-wise kernels (a warp's each, 8 warps a CTA), and the chunks
// each warp takes (for_each_chunk; a 64-bit division there cost a launch's every warp ~100
// instructions).
template <typename Task>
unsigned chunked_grid(JobList<Task>& jobs) {
  constexpr std::uint64_t kWarpsPerCta = kThreads / 32;
  const unsigned grid = grid_for((jobs.items + kWarpsPerCta - 1) / kWarpsPerCta);
  const std::uint64_t warps = std::uint64_t{grid} * kWarpsPerCta;
  jobs.per_warp = (jobs.items + warps - 1) / warps;
  return grid;
}

// Uploads `tasks` (with each one's first item) and launches `launch` on them.
template <typename Task, typename ItemsOf, typename Launch>
void run_tasks(const std::vector<Task>& tasks, const std::vector<BoxView>& uneven,
               JobUpload& upload, cudaStream_t stream, ItemsOf items_of, Launch launch) {
  if (tasks.empty()) return;
  std::uint64_t items = 0;
  std::size_t prefix_offset = 0;
  job_bytes(tasks, items_of, items, prefix_offset, upload.scratch, uneven);
  if (items == 0) return;
  const std::byte* device_list = upload.upload(upload.scratch, stream);
  const std::size_t views_offset = prefix_offset + (tasks.size() + 1) * sizeof(std::uint64_t);
  launch(JobList<Task>{reinterpret_cast<const Task*>(device_list),
                       reinterpret_cast<const std::uint64_t*>(device_list + prefix_offset),
                       static_cast<std::uint32_t>(tasks.size()), items,
                       reinterpret_cast<const BoxView*>(device_list + views_offset)},
         stream);
  RESHARD_CUDA_CHECK(cudaGetLastError());
  upload.mark_used(stream);
}

// `d` as a FastDivisor: `last` again where it divides by `d` (the jobs of a refit mostly share
// their shapes, and finding a multiplier takes a loop and a 64-bit division).
inline FastDivisor divisor_of(std::uint32_t d, FastDivisor& last) {
  if (last.divisor != d) last = FastDivisor::of(d);
  return last;
}

// The spans of a job's vectors: rows of `cols` elements, in pieces of fewer than 2^31 vectors.
template <typename Add>
void split_rows(std::int64_t rows, std::int64_t cols, int per_lane, FastDivisor& last, Add add) {
  if (rows <= 0 || cols <= 0) return;
  const std::int64_t per_row = (cols + per_lane - 1) / per_lane;
  constexpr std::int64_t kMostVectors = std::int64_t{1} << 31;
  if (per_row >= kMostVectors) {
    throw_error(ErrorCode::kUnsupported, "a conversion of rows of " + std::to_string(cols) +
                                             " elements (at most " +
                                             std::to_string(kMostVectors * per_lane) + " per row)");
  }
  const FastDivisor divisor = divisor_of(static_cast<std::uint32_t>(per_row), last);
  const std::int64_t rows_per_piece = kMostVectors / per_row;
  for (std::int64_t first = 0; first < rows; first += rows_per_piece) {
    const std::int64_t n = std::min(rows_per_piece, rows - first);
    add(VectorSpan{.per_row = divisor,
                   .vectors = static_cast<std::uint32_t>(n * per_row),
                   .first_row = first});
  }
}

inline std::uint64_t chunks_of(const VectorSpan& span, int vectors_per_chunk) {
  return (span.vectors + vectors_per_chunk - 1) / vectors_per_chunk;
}

// The tasks of one kernel instance, added as jobs are queued, and the views their RowWalks refer
// to.
template <typename Task>
struct TaskList {
  std::vector<Task> tasks;
  std::vector<BoxView> uneven;
  FastDivisor last;  // divisor_of's
};

// The kernels' element types, as an index: float32, bfloat16, float16.
constexpr int kFloatTypes = 3;
constexpr DType kFloatType[kFloatTypes] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
inline int float_index(DType dtype) {
  for (int i = 0; i < kFloatTypes; ++i) {
    if (kFloatType[i] == dtype) return i;
  }
  return -1;
}
template <DType D>
constexpr int kFloatIndex = D == DType::kFloat32    ? 0
                            : D == DType::kBFloat16 ? 1
                                                    : 2;

[[noreturn]] inline void refuse_dtype(const char* conversion, DType dtype) {
  throw_error(ErrorCode::kUnsupported, std::string("a GPU ") + conversion + " from " +
                                           dtype_name(dtype) +
                                           " (float32, bfloat16 or float16 only)");
}

// Launches the tasks of an element-wise kernel, in chunks of kTiles tiles (of 32 lane vectors)
// or, where that leaves warps of the GPU idle, of kFewerTiles: in a launch of one wave each
// warp's work is serial, so more warps, each with less of it, finish sooner. On one H100,
// 2026-11-25, half chunks took MXFP8 on 65536 x 128 from 0.78 to 0.84 of the copy rate (its
// column blocks 0.72 -> 0.78), fp32 -> bf16 on those column blocks 0.80 -> 0.88, but bf16 -> fp32
// there 0.93 -> 0.83: casts from 16-bit types keep their chunks.
//
// Where the jobs are large (on average a quarter as many chunks as the grid has warps, so a step
// of a grid's warps crosses a few jobs at most), the warps take the chunks interleaved
// (for_each_chunk): the grid then works through the data front to back, and what a job writes in
// scattered bytes is written close together in time. On one H200, 2026-11-27, A/B in alternating
// runs: one large matrix, MXFP8 0.90 -> 0.93-0.95, with Megatron-LM's swizzled scales 0.86-0.88 ->
// 0.90-0.91, float32 -> bfloat16 0.94-0.96 -> 0.96-0.98, bfloat16 -> float32 0.80-0.82 ->
// 0.83-0.84; Llama-3-8B's 66 matrices with swizzled scales 0.63 -> 0.76 (the rest of that loss was
// the scales' partial sector writes: mx_quantize_banded_chunk). Small jobs keep the runs: a
// chunk's job is searched for where a warp enters another, which interleaved would be at nearly
// every chunk (512 matrices of 256 x 1024, MXFP8 0.86-0.87 -> 0.79-0.80).
template <int kTiles, int kFewerTiles, typename Task, typename Launch>
void run_chunked(const TaskList<Task>& list, JobUpload& upload, cudaStream_t stream,
                 Launch launch) {
  std::uint64_t chunks = 0;
  for (const Task& task : list.tasks) chunks += chunks_of(task.span, 32 * kTiles);
  const auto run = [&](auto tiles) {
    run_tasks(
        list.tasks, list.uneven, upload, stream,
        [](const Task& task) { return chunks_of(task.span, 32 * decltype(tiles)::value); },
        [&](JobList<Task> jobs, cudaStream_t s) {
          const unsigned grid = chunked_grid(jobs);
          const std::uint64_t warps = std::uint64_t{grid} * (kThreads / 32);
          if (4 * jobs.items >= jobs.count * warps) jobs.per_warp = 0;  // interleaved
          launch(tiles, grid, jobs, s);
        });
  };
  if constexpr (kFewerTiles < kTiles) {
    if (chunks < resident_staged_warps()) return run(std::integral_constant<int, kFewerTiles>{});
  }
  run(std::integral_constant<int, kTiles>{});
}

// Each family's launches of the tasks queued (in a fixed order of dtypes) and the instances it
// loads up front (cast_kernels.cu, mx_kernels.cu, block_fp8_kernels.cu).
void launch_cast_lists(TaskList<CastTask> (&lists)[kFloatTypes][kFloatTypes], JobUpload& upload,
                       cudaStream_t stream);
void launch_mx_lists(TaskList<MxTask> (&lists)[kFloatTypes], JobUpload& upload,
                     cudaStream_t stream);
void launch_swizzles(const TaskList<SwizzleTask>& list, JobUpload& upload, cudaStream_t stream);
void launch_block_lists(TaskList<BlockTask> (&lists)[kFloatTypes], JobUpload& upload,
                        cudaStream_t stream);
void load_cast_kernels();
void load_mx_kernels();
void load_block_kernels();

}  // namespace reshard::execution::cuda

// CUDA kernels of the conversions; the arithmetic is number_formats.hpp, shared with the host
// reference, so results match it bit for bit.
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
namespace {

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
__device__ __noinline__ std::int64_t uneven_row_start(const BoxView* uneven, std::int32_t view,
                                                      std::int64_t row) {
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
__device__ __noinline__ void store_16_bytes_piecewise(std::uint8_t* at, uint4 bytes) {
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

// Scales received dense into their places of a swizzled scale matrix: a byte per lane (scales
// are 1/32 of the data they describe), several in flight.
constexpr int kSwizzlesInFlight = 8;
__global__ void __launch_bounds__(kThreads) swizzle_kernel(JobList<SwizzleTask> list) {
  for_each_chunk<32 * kSwizzlesInFlight>(list, [&](const SwizzleTask& task, std::uint64_t first) {
#pragma unroll
    for (int u = 0; u < kSwizzlesInFlight; ++u) {
      const LaneVector at = lane_vector<1>(task.span, first + 32 * u);
      if (!at.active) continue;
      task.dst[swizzled_scale_offset(task.first_row + at.row, task.first_col + at.col,
                                     task.col_tiles)] =
          task.src[at.row * task.span.per_row.divisor + at.col];
    }
  });
}

// store_cast's first `count` elements one by one: a short or unaligned vector (rare, so out of
// line).
template <DType D>
struct CastWords {
  std::uint32_t word[kWords<D>];
};
template <DType D>
__device__ __noinline__ void store_cast_piecewise(CastWords<D> words, std::uint8_t* out,
                                                  int count) {
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    if (i >= count) break;
    if constexpr (D == DType::kFloat32) {
      reinterpret_cast<std::uint32_t*>(out)[i] = words.word[i];
    } else {
      reinterpret_cast<std::uint16_t*>(out)[i] =
          static_cast<std::uint16_t>(words.word[i / 2] >> (16 * (i % 2)));
    }
  }
}

// A lane's `count` (<= 8) elements converted as store_float(load_float()) does, stored at `out`
// (one or two 16-byte stores where the address allows).
template <DType S, DType D>
__device__ __forceinline__ void store_cast(const Raw<S>& raw, std::uint8_t* out, int count) {
  CastWords<D> words{};
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const float value = element<S>(raw, i);
    if constexpr (D == DType::kFloat32) {
      words.word[i] = __float_as_uint(value);
    } else {
      const std::uint16_t half =
          D == DType::kBFloat16 ? float_to_bf16(value) : float_to_fp16(value);
      words.word[i / 2] |= static_cast<std::uint32_t>(half) << (16 * (i % 2));
    }
  }
  if (count == kPerLane && (reinterpret_cast<std::uintptr_t>(out) & 15) == 0) {
#pragma unroll
    for (int q = 0; q < kWords<D> / 4; ++q) {
      reinterpret_cast<uint4*>(out)[q] = make_uint4(words.word[4 * q], words.word[4 * q + 1],
                                                    words.word[4 * q + 2], words.word[4 * q + 3]);
    }
  } else {
    store_cast_piecewise<D>(words, out, count);
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

// A widening cast's tile (16-bit elements to float32) with warp-wide stores, where the tile's 32
// vectors lie in one run in the source and in the destination and every lane staged its own
// (`mine`); false (nothing done) otherwise. Each lane stored its vector's 32 bytes as two 16-byte
// halves, so each store instruction of the warp covered 1 KiB with a hole in every 32 bytes; here
// lane l takes elements 4l..4l+3 and 128+4l..128+4l+3 of the tile from the warp's staged slots, so
// each of the two store instructions writes 512 consecutive bytes. On one H200, 2026-11-27, A/B
// in alternating runs: bfloat16 -> float32 0.84 -> 0.91 of the copy rate on large matrices, 0.82
// -> 0.87 on their column blocks, 0.75 -> 0.85-0.87 on skinny ones, 0.80 -> 0.85 on 512 small
// ones, 0.81 -> 0.87 on Llama-3-8B's (a plain streaming kernel widening 1 : 2 with each thread's
// stores side by side: 0.51 of the copy rate; with warp-wide stores 0.86;
// tools/probes/uneven_traffic.cu). Only tasks whose rows allow whole runs try (CastTask::
// warp_stores): the test itself cost skinny column blocks 0.86 -> 0.79.
template <DType S>
__device__ __forceinline__ bool widen_tile_warp_wide(const uint4 (&slots)[32], unsigned lane,
                                                     const CastTask& task, const LaneVector& at,
                                                     bool mine, const BoxView* uneven) {
  const auto from = reinterpret_cast<std::uintptr_t>(task.src) +
                    (row_start(task.src_rows, at.row, uneven) + at.col) * kElementBytes<S>;
  const auto to = reinterpret_cast<std::uintptr_t>(task.dst) +
                  (row_start(task.dst_rows, at.row, uneven) + at.col) * 4;
  const auto from0 = __shfl_sync(0xffffffffu, from, 0);
  const auto to0 = __shfl_sync(0xffffffffu, to, 0);
  // (16-byte stores: the destination's run must start 16-byte aligned.)
  if (!__all_sync(0xffffffffu,
                  mine && from == from0 + 16 * lane && to == to0 + 32 * lane && (to0 & 15) == 0)) {
    return false;
  }
  __syncwarp();  // every lane's copies are in (each waited for its own)
  const auto* halves = reinterpret_cast<const uint2*>(&slots[0]);
  const uint2 pieces[2] = {halves[lane], halves[32 + lane]};
  __syncwarp();  // all read before any lane refills the slots
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const Raw<S, 4> raw{{pieces[h].x, pieces[h].y}};
    reinterpret_cast<uint4*>(to0 + 512 * h)[lane] =
        make_uint4(__float_as_uint(element<S, 4>(raw, 0)), __float_as_uint(element<S, 4>(raw, 1)),
                   __float_as_uint(element<S, 4>(raw, 2)), __float_as_uint(element<S, 4>(raw, 3)));
  }
  return true;
}

// Casts: each chunk's source vectors (4 KiB a warp: 8 tiles from 16-bit sources, 4 from float32)
// go through cp.async into the warp's slots of shared memory, all in flight before any is
// converted, each tile converted once its own copies are in (+0.01-0.03 of the copy rate against
// waiting for the whole chunk, one H100, 2026-11-25); a vector that is short or not 16-byte aligned
// is read from global memory at conversion time instead. A float32 lane's two vectors are the
// halves of one 32-byte sector, so they go through L1 (cp.async.ca): through L2 alone (cp.async.cg)
// each sector came twice and the kernel ran at 0.63-0.72 of the copy rate. On one H100, 2026-11-25,
// against the register kernel before: bf16 -> fp32 of skinny column blocks 0.77 -> 0.89-0.94, fp32
// -> bf16 of large matrices 0.88 -> 0.94, of Llama-3-8B's 0.89 -> 0.94.
template <DType S, DType D, int kTiles>
__global__ void __launch_bounds__(kThreads, kStagedCtasPerSm) cast_kernel(JobList<CastTask> list) {
  constexpr int kVectors = kCastVectors<S>;
  constexpr int dst_size = kElementBytes<D>;
  __shared__ uint4 stages[kThreads / 32][kTiles][kVectors][32];
  const unsigned lane = threadIdx.x % 32;
  auto& stage = stages[threadIdx.x / 32];
  for_each_chunk<32 * kTiles>(list, [&](const CastTask& task, std::uint64_t first) {
    before_refilling_slots();
    const unsigned staged = stage_chunk<S, kPerLane>(
        stage, lane, task, first, list.uneven,
        [&](const LaneVector& at) { return vector_count(at, task.cols) == kPerLane; });
#pragma unroll 1
    for (int u = 0; u < kTiles; ++u) {
      wait_async_copies_at_most(kTiles - 1 - u);  // tile u's copies, not the later ones
      const LaneVector at = lane_vector<kPerLane>(task.span, first + 32 * u);
      const int count = vector_count(at, task.cols);
      if constexpr (D == DType::kFloat32 && kVectors == 1) {
        if (task.warp_stores &&
            widen_tile_warp_wide<S>(stage[u][0], lane, task, at,
                                    count == kPerLane && (staged >> u & 1u), list.uneven)) {
          continue;
        }
      }
      if (count == 0) continue;
      const Raw<S> raw =
          staged >> u & 1u
              ? staged_raw<S, kPerLane>(stage[u], lane)
              : load_raw<S>(task.src, row_start(task.src_rows, at.row, list.uneven) + at.col,
                            count);
      store_cast<S, D>(raw,
                       static_cast<std::uint8_t*>(task.dst) +
                           (row_start(task.dst_rows, at.row, list.uneven) + at.col) * dst_size,
                       count);
    }
  });
}

// A lane's vector of an MX block in E4M3, its maximum taken with the block's other lane, the scale
// stored at `scale` by the block's first lane (where `scale` is null, by the caller: it gets the
// scale bits back); `active` false past the job's end (the lane then only takes part in the
// shuffle).
template <DType S>
__device__ __forceinline__ std::uint8_t mx_encode_vector(const Raw<S, kMxPerLane>& raw, bool active,
                                                         unsigned lane, bool round_up,
                                                         std::uint8_t least_bits,
                                                         std::uint8_t* scale, std::uint8_t* out) {
  constexpr int N = kMxPerLane;
  constexpr int kLanesPerMxBlock = kMxBlock / N;
  std::uint32_t m = magnitude_max<S>(raw);
#pragma unroll
  for (int offset = 1; offset < kLanesPerMxBlock; offset *= 2) {
    m = max(m, __shfl_xor_sync(0xffffffffu, m, offset));
  }
  if (!active) return 0;
  const std::uint8_t bits = scale_bits_of<S>(m, round_up, least_bits);
  if (scale != nullptr && lane % kLanesPerMxBlock == 0) *scale = bits;
  std::uint32_t word[N / 4];
#pragma unroll
  for (int w = 0; w < N / 4; ++w) word[w] = 0x7f7f7f7fu;
  if (bits != kE8m0Nan) {
    const float factor = power_of_two(127 - static_cast<int>(bits));
#pragma unroll
    for (int w = 0; w < N / 4; ++w) {
      word[w] = mx_encode_finite_pair(element(raw, 4 * w), element(raw, 4 * w + 1), factor) |
                mx_encode_finite_pair(element(raw, 4 * w + 2), element(raw, 4 * w + 3), factor)
                    << 16;
    }
  }
  store_16_bytes(out, make_uint4(word[0], word[1], word[2], word[3]));
  return bits;
}

// Encodes a chunk's tiles two at a time, each pair after one wait for its copies (+0.01-0.02 of
// the copy rate on skinny matrices against one wait per tile, one H100, 2026-11-25).
template <int kTiles, typename EncodeTile>
__device__ __forceinline__ void encode_tiles(EncodeTile encode_tile) {
  constexpr int kAtOnce = kTiles > 1 ? 2 : 1;
#pragma unroll 1
  for (int u = 0; u < kTiles; u += kAtOnce) {
    wait_async_copies_at_most(kTiles - kAtOnce - u);  // these tiles' copies, not the later ones
    encode_tile(u);
    if constexpr (kAtOnce == 2) encode_tile(u + 1);
  }
}

// A chunk of an MXFP8 task whose rows are evenly spaced on all three sides (MxTask::even): its
// places become byte pointers to the span's first row and 32-bit row steps once per chunk, so a
// lane finds each vector's source, data and scale with a division by multiply and three
// multiply-adds, or for swizzled scales (kSwizzled) the layout's shifts in 32 bits. (Through the
// RowWalks, each tile re-read a dozen of the job's fields and tested which kind of walk each was:
// about 230 instructions a tile, 46 of them the encoding.)
template <DType S, bool kSwizzled, int kTiles, int K>
__device__ __forceinline__ void mx_quantize_even_chunk(uint4 (&stage)[kTiles][K][32], unsigned lane,
                                                       const MxTask& task, std::uint64_t first) {
  constexpr int N = kMxPerLane;
  constexpr int size = kElementBytes<S>;
  const FastDivisor per_row = task.span.per_row;
  const std::uint32_t vectors = task.span.vectors;
  const std::int64_t first_row = task.span.first_row;
  const auto* const src = static_cast<const std::uint8_t*>(task.src) +
                          (task.src_rows.base + first_row * task.src_rows.stride) * size;
  std::uint8_t* const data = task.data + task.data_rows.base + first_row * task.data_rows.stride;
  std::uint8_t* const scale =
      task.scale + (kSwizzled ? 0 : task.scale_rows.base + first_row * task.scale_rows.stride);
  const auto src_step = static_cast<std::uint32_t>(task.src_rows.stride * size);
  const auto data_step = static_cast<std::uint32_t>(task.data_rows.stride);
  const auto scale_step = static_cast<std::uint32_t>(task.scale_rows.stride);
  // Swizzled: the span's first row and the job's first block column in the scale matrix.
  const auto scale_row = static_cast<std::uint32_t>(task.scale_rows.base + first_row);
  const auto scale_col = static_cast<std::uint32_t>(task.first_col);
  const std::uint32_t col_tiles = task.col_tiles;
  const bool round_up = task.round_up;
  const std::uint8_t least_bits = task.least_bits;
  // The lane's vector of tile u: its row of the span and its index in the row (vector 0's past
  // the span's end), and whether it lies in the span.
  const auto place = [&](int u, std::uint32_t& row, std::uint32_t& in_row) {
    const auto v = static_cast<std::uint32_t>(first) + 32 * u;
    const std::uint32_t at = v < vectors ? v : 0;
    row = per_row.divide(at);
    in_row = at - row * per_row.divisor;
    return v < vectors;
  };
  const auto source = [&](std::uint32_t row, std::uint32_t in_row) {
    return src + static_cast<std::uint64_t>(row) * src_step +
           static_cast<std::uint64_t>(in_row) * (N * size);
  };
  const unsigned staged = stage_tiles(stage, lane, [&](int u) -> const std::uint8_t* {
    std::uint32_t row, in_row;
    const bool active = place(u, row, in_row);
    const std::uint8_t* from = source(row, in_row);
    return active ? from : nullptr;
  });
  encode_tiles<kTiles>([&](int u) {
    std::uint32_t row, in_row;
    const bool active = place(u, row, in_row);
    const Raw<S, N> raw = staged >> u & 1u ? staged_raw<S, N>(stage[u], lane)
                                           : load_raw<S, N>(source(row, in_row), 0, active ? N : 0);
    const std::uint32_t block = in_row / (kMxBlock / N);
    mx_encode_vector<S>(raw, active, lane, round_up, least_bits,
                        kSwizzled ? scale + formats::swizzled_scale_offset<std::uint32_t>(
                                                scale_row + row, scale_col + block, col_tiles)
                                  : scale + static_cast<std::uint64_t>(row) * scale_step + block,
                        data + static_cast<std::uint64_t>(row) * data_step +
                            static_cast<std::uint64_t>(in_row) * N);
  });
}

// Swizzled scales (Megatron-LM's MXFP8 buffers) out of line: the common path's code stays short.
template <DType S, int kTiles, int K>
__device__ __noinline__ void mx_quantize_swizzled_chunk(uint4 (&stage)[kTiles][K][32],
                                                        unsigned lane, const MxTask& task,
                                                        std::uint64_t first) {
  mx_quantize_even_chunk<S, true>(stage, lane, task, first);
}

// A chunk of swizzled scales in whole tiles (MxTask::banded). The layout's 32-byte sector holds the
// scales of 4 block columns of rows r, r + 1, r + 32, r + 33, r + 64, r + 65, r + 96 and r + 97;
// a warp walking a row wrote one byte of each of 16 sectors per tile, and the L2 took each sector
// as a partial write that missed, fetched the rest from memory and wrote it back, often twice
// (ncu on one H200, 2026-11-27, Llama-3-8B's 66 matrices in one launch: 8.2 M write misses in L2
// for 3.7 M sectors of scales, +270 MB read and +295 MB written, 4.17 against 3.55 ms for the same
// matrices with plain scales). Here a chunk is whole sectors: its tiles take 4 rows of 128
// columns each, tiles 2s and 2s + 1 the 8 rows of one sector, and once the chunk is encoded the
// lanes gather its scales into words and write the sectors whole, one 32-byte run per 8 lanes.
// The chunks of a span walk its 128-row bands, each band's 128-column groups in turn. On that
// H200, A/B in alternating runs: Llama-3-8B's matrices 0.76 -> 0.87 of the copy rate (column
// blocks 0.83 -> 0.87), large matrices 0.90-0.91 -> 0.93 (column blocks 0.82 -> 0.85-0.86).
template <DType S, int kTiles, int K>
__device__ __noinline__ void mx_quantize_banded_chunk(uint4 (&stage)[kTiles][K][32], unsigned lane,
                                                      const MxTask& task, std::uint64_t first) {
  static_assert(kTiles % 2 == 0, "a chunk holds whole sectors: pairs of tiles");
  constexpr int N = kMxPerLane;  // 8 lanes span a row's 128 columns (4 blocks)
  constexpr int size = kElementBytes<S>;
  constexpr std::uint32_t kChunksPerRegion = 32 / kTiles;  // a region: 128 rows x 128 columns
  const std::uint32_t groups = task.span.per_row.divisor / 8;
  const std::int64_t first_row = task.span.first_row;
  const auto* const src = static_cast<const std::uint8_t*>(task.src) +
                          (task.src_rows.base + first_row * task.src_rows.stride) * size;
  std::uint8_t* const data = task.data + task.data_rows.base + first_row * task.data_rows.stride;
  const auto src_step = static_cast<std::uint64_t>(task.src_rows.stride * size);
  const auto data_step = static_cast<std::uint64_t>(task.data_rows.stride);
  const auto chunk = static_cast<std::uint32_t>(first / (32 * kTiles));
  const std::uint32_t region = chunk / kChunksPerRegion, in_region = chunk % kChunksPerRegion;
  const std::uint32_t band = region / groups, group = region % groups;
  // Tile u's 4 rows: rows 2k and 2k + 1 of the band's first 32, plus 32 g, g = 2 (u % 2) +
  // (lane / 8) / 2 (lanes 0-7 row 2k, 8-15 row 2k + 1, 16-31 the same 32 rows on).
  const auto row_of = [&](int u) {
    const std::uint32_t k = in_region * (kTiles / 2) + u / 2, rho = lane / 8;
    return band * 128 + 2 * k + rho % 2 + 32 * (2 * (u % 2) + rho / 2);
  };
  const std::uint32_t in_row = group * 8 + lane % 8;
  const auto source = [&](std::uint32_t row) {
    return src + row * src_step + static_cast<std::uint64_t>(in_row) * (N * size);
  };
  const unsigned staged = stage_tiles(stage, lane, [&](int u) { return source(row_of(u)); });
  std::uint32_t scales = 0;  // tile u's block scale in byte u (lanes 2c and 2c + 1: block c)
  encode_tiles<kTiles>([&](int u) {
    const std::uint32_t row = row_of(u);
    const Raw<S, N> raw =
        staged >> u & 1u ? staged_raw<S, N>(stage[u], lane) : load_raw<S, N>(source(row), 0, N);
    const std::uint8_t bits = mx_encode_vector<S>(raw, true, lane, task.round_up, task.least_bits,
                                                  nullptr, data + row * data_step + in_row * N);
    scales |= static_cast<std::uint32_t>(bits) << (8 * u);
  });
  // Lane j < 4 kTiles writes word j % 8 of sector j / 8: row 2k + p + 32 g's 4 blocks at byte
  // 16 p + 4 g, p = (j % 8) / 4, g = j % 4; they are tile 2 (j / 8) + g / 2's, in its lanes
  // 8 rho + 2c, rho = 2 (g % 2) + p.
  const unsigned sector = lane / 8, p = lane % 8 / 4, g = lane % 4;
  const unsigned rho = 2 * (g % 2) + p, tile = 2 * sector + g / 2;
  std::uint32_t word = 0;
#pragma unroll
  for (unsigned c = 0; c < 4; ++c) {
    const std::uint32_t theirs = __shfl_sync(0xffffffffu, scales, 8 * rho + 2 * c);
    word |= (theirs >> (8 * tile) & 0xffu) << (8 * c);
  }
  if (sector < kTiles / 2) {
    const std::uint32_t k = in_region * (kTiles / 2) + sector;
    const std::uint32_t at = formats::swizzled_scale_offset<std::uint32_t>(
        static_cast<std::uint32_t>(task.scale_rows.base + first_row) + band * 128 + 2 * k,
        static_cast<std::uint32_t>(task.first_col) + group * 4, task.col_tiles);
    reinterpret_cast<std::uint32_t*>(task.scale + at)[lane % 8] = word;
  }
}

// Any other chunk: rows through the RowWalks (those not evenly spaced through their views),
// scales swizzled or not. Out of line: the common path's code stays short.
template <DType S, int kTiles, int K>
__device__ __noinline__ void mx_quantize_walked_chunk(uint4 (&stage)[kTiles][K][32], unsigned lane,
                                                      const MxTask& task, std::uint64_t first,
                                                      const BoxView* uneven) {
  constexpr int N = kMxPerLane;
  const unsigned staged = stage_chunk<S, N>(stage, lane, task, first, uneven,
                                            [](const LaneVector& at) { return at.active; });
  encode_tiles<kTiles>([&](int u) {
    const LaneVector at = lane_vector<N>(task.span, first + 32 * u);
    const Raw<S, N> raw =
        staged >> u & 1u
            ? staged_raw<S, N>(stage[u], lane)
            : load_raw<S, N>(task.src, row_start(task.src_rows, at.row, uneven) + at.col,
                             at.active ? N : 0);
    const std::int64_t scale_row = row_start(task.scale_rows, at.row, uneven);
    const std::int64_t block = at.col / kMxBlock;
    std::uint8_t* const scale =
        task.scale + (task.col_tiles == 0 ? scale_row + block
                                          : swizzled_scale_offset(scale_row, task.first_col + block,
                                                                  task.col_tiles));
    mx_encode_vector<S>(raw, at.active, lane, task.round_up, task.least_bits, scale,
                        task.data + row_start(task.data_rows, at.row, uneven) + at.col);
  });
}

// MXFP8: each chunk's source vectors (4 KiB a warp: 4 tiles of bf16, 2 of float32; half that in
// launches that leave warps idle) go through cp.async into the warp's slots of shared memory, all
// in flight before any is encoded, tiles encoded as their copies come in; a vector whose address
// is not 16-byte aligned is read from global memory at encoding time instead. A lane's vectors
// are 16-byte halves of 32-byte sectors, so they go through L1 (cp.async.ca): through L2 alone
// each sector came twice and the kernel ran at 0.67-0.71 of the copy rate. On one H100,
// 2026-11-25, against the register kernel before (2 tiles a warp, 80 registers, 3 CTAs per SM):
// large matrices 0.86-0.89 -> 0.87-0.94, Llama-3-8B's 0.88-0.90 -> 0.92-0.93, 512 small matrices
// 0.81 -> 0.88. Lanes of 8 elements (a block on 4 lanes, 16-byte copies through L2) ran skinny
// matrices at 0.61-0.66. The 2 lanes of an MX block (rows hold whole blocks, and a row's first
// vector starts a block) take its maximum with a shuffle, then each encodes its 16 elements. A
// block whose scale is not NaN holds no NaN or infinity, so the encoding needs no special cases.
template <DType S, int kTiles>
__global__ void __launch_bounds__(kThreads, kStagedCtasPerSm)
    mx_quantize_kernel(JobList<MxTask> list) {
  constexpr int kVectors = sizeof(Raw<S, kMxPerLane>) / sizeof(uint4);
  __shared__ uint4 stages[kThreads / 32][kTiles][kVectors][32];
  const unsigned lane = threadIdx.x % 32;
  auto& stage = stages[threadIdx.x / 32];
  for_each_chunk<32 * kTiles>(list, [&](const MxTask& task, std::uint64_t first) {
    before_refilling_slots();
    if (task.even && task.col_tiles == 0) {
      mx_quantize_even_chunk<S, false>(stage, lane, task, first);
    } else if (task.even) {
      if constexpr (kTiles % 2 == 0) {
        if (task.banded) return mx_quantize_banded_chunk<S>(stage, lane, task, first);
      }
      mx_quantize_swizzled_chunk<S>(stage, lane, task, first);
    } else {
      mx_quantize_walked_chunk<S>(stage, lane, task, first, list.uneven);
    }
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

// value / scale as a float that the FP8 conversion (round to nearest even) rounds to the same code
// as block_encode: `quotient` = value * reciprocal where that is plainly decisive (zero, or a
// normal E4M3 value more than 4 ulps from every tie; see quotient_is_decisive), else the tie
// nearest to it itself (a true tie rounds to even in the conversion, as in rint) or its neighbour
// one ulp towards the exact quotient. Which side of the tie the exact quotient lies on is the sign
// of tie * scale - |value|, exact in one fma (scale >= 2^-100, so the product's last bit lies
// above float's smallest subnormal).
__device__ __forceinline__ float settle_at(std::uint32_t tie, float quotient, float value,
                                           float scale) {
  const float side = fmaf(__uint_as_float(tie), scale, -fabsf(value));
  const std::uint32_t settled = tie - (side > 0.0f ? 1u : 0u) + (side < 0.0f ? 1u : 0u);
  return __uint_as_float(settled | (__float_as_uint(quotient) & 0x80000000u));
}

// Below 2^-6, E4M3's subnormals: steps of 2^-9, ties at odd multiples of 2^-10.
__device__ __noinline__ float settle_subnormal(float quotient, float value, float scale) {
  const float half_steps = fabsf(quotient) * 1024.0f;  // exact: a power of two
  const float tie = (2.0f * floorf(half_steps * 0.5f) + 1.0f) * 0.0009765625f;
  return settle_at(__float_as_uint(tie), quotient, value, scale);
}

// Whether each of a lane's quotients is zero or a normal E4M3 value more than 4 ulps from every tie
// (quotient_is_decisive's normal case), so that converting value * reciprocal gives the exactly
// rounded code: two minima over integers made from the quotients' bits, one multiply-add and a
// third of a three-way minimum per quotient (the six operations per quotient of testing each one
// took a fifth of the kernel's instructions). A tie of a normal quotient is its low 20 bits at
// 0x80000: bits * 2^12 + 0x80004000 is (low 20 bits - 0x7fffc) * 2^12 modulo 2^32, below 9 * 2^12
// within 4 ulps of it. A quotient below 2^-6 (E4M3's subnormals) other than zero has twice its
// magnitude's bits (the sign shifted out) less one below 0x78ffffff; zero wraps to 0xffffffff.
__device__ __forceinline__ bool all_plainly_decisive(const float (&quotient)[kPerLane]) {
  std::uint32_t near_tie = 0xffffffffu, subnormal = 0xffffffffu;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const std::uint32_t bits = __float_as_uint(quotient[i]);
    near_tie = min(near_tie, bits * 4096u + 0x80004000u);
    subnormal = min(subnormal, bits * 2u - 1u);
  }
  return near_tie >= 0x9000u && subnormal >= 0x78ffffffu;
}

__device__ __forceinline__ float settled_quotient(float value, float scale, float reciprocal) {
  float quotient;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(quotient) : "f"(value), "f"(reciprocal));
  const std::uint32_t magnitude = __float_as_uint(quotient) & 0x7fffffffu;
  if (magnitude >= 0x3c800000u) {
    if ((magnitude & 0xfffffu) - (0x80000u - 4) > 8) return quotient;
    return settle_at((magnitude & 0xfff00000u) | 0x80000u, quotient, value, scale);
  }
  if (magnitude == 0) return quotient;
  return settle_subnormal(quotient, value, scale);
}

// Where a CTA's thread reads and writes one tile. An even tile (the common case) has all 128 rows,
// this thread's whole 8 columns, 16-byte aligned source rows and 8-byte aligned destination rows:
// its loads and stores need no test per row.
struct TilePlace {
  std::int64_t src_first, src_stride, data_first, data_stride;
  std::uint8_t* data;
  float* scale_at;
  int rows, count;
  bool even;
};

template <DType S>
__device__ __forceinline__ TilePlace place_tile(const JobList<BlockTask>& list, std::uint64_t item,
                                                int col, const BlockTask*& task_out) {
  constexpr int size = kElementBytes<S>;
  const std::uint32_t j = list.find(item);
  const BlockTask& task = list.jobs[j];
  task_out = &task;
  const std::int64_t rows_per_matrix = task.rows_per_matrix;
  const std::int64_t tile_rows = (rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const auto t = static_cast<std::uint32_t>(item - list.first[j]);
  const std::uint32_t m = task.tiles_per_matrix.divide(t);
  const std::uint32_t in_matrix = t - m * task.tiles_per_matrix.divisor;
  const std::uint32_t tr = task.tile_cols.divide(in_matrix);
  const std::uint32_t tc = in_matrix - tr * task.tile_cols.divisor;
  const std::int64_t row_begin =
      static_cast<std::int64_t>(m) * rows_per_matrix + static_cast<std::int64_t>(tr) * kFp8Block;
  const std::int64_t c0 = static_cast<std::int64_t>(tc) * kFp8Block + col;
  TilePlace at;
  at.rows = static_cast<int>(min(static_cast<std::int64_t>(kFp8Block),
                                 rows_per_matrix - static_cast<std::int64_t>(tr) * kFp8Block));
  at.count = static_cast<int>(
      max(static_cast<std::int64_t>(0), min(static_cast<std::int64_t>(kPerLane), task.cols - c0)));
  at.src_first = task.src_rows.row_start(row_begin, list.uneven) + c0;
  at.src_stride = task.src_stride;
  at.data_first = task.data_rows.row_start(row_begin, list.uneven) + c0;
  at.data_stride = task.data_stride;
  at.data = task.data;
  at.scale_at =
      task.scale +
      task.scale_rows.row_start(static_cast<std::int64_t>(m) * tile_rows + tr, list.uneven) + tc;
  const auto src_bits =
      reinterpret_cast<std::uintptr_t>(task.src) + static_cast<std::uintptr_t>(at.src_first * size);
  const auto data_bits = reinterpret_cast<std::uintptr_t>(at.data + at.data_first);
  at.even = at.rows == kFp8Block && at.count == kPerLane &&
            ((src_bits | static_cast<std::uintptr_t>(at.src_stride * size)) & 15) == 0 &&
            ((data_bits | static_cast<std::uintptr_t>(at.data_stride)) & 7) == 0;
  return at;
}

// A lane's 8 elements where some quotient is not plainly decisive, or the tile is not plain: out
// of line, so the rare paths do not crowd the instruction cache in the kernel's unrolled loops.
template <DType S>
__device__ __noinline__ uint2 encode_unplainly(Raw<S> raw, float s, float reciprocal, bool plain) {
  std::uint32_t pair[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float low = element(raw, 2 * i), high = element(raw, 2 * i + 1);
    if (plain) {
      const float q_low = settled_quotient(low, s, reciprocal);
      const float q_high = settled_quotient(high, s, reciprocal);
      pair[i] = formats::e4m3_pair(q_low, q_high);
    } else {
      pair[i] = block_encode_pair(low, high, s, reciprocal);
    }
  }
  return make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
}

// Eight quotients as E4M3 codes (round to nearest even, saturating at 448), the first in the
// lowest byte.
__device__ __forceinline__ uint2 e4m3_codes(const float (&q)[kPerLane]) {
  std::uint32_t pair[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    pair[i] = formats::e4m3_pair(q[2 * i], q[2 * i + 1]);
  }
  return make_uint2(pair[0] | pair[1] << 16, pair[2] | pair[3] << 16);
}

// A lane's 8 elements in E4M3, as block_encode gives them.
template <DType S>
__device__ __forceinline__ uint2 encode_lane(const Raw<S>& raw, float s, float reciprocal,
                                             bool plain) {
  float q[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q[i]) : "f"(element(raw, i)), "f"(reciprocal));
  }
  if (plain && all_plainly_decisive(q)) return e4m3_codes(q);
  return encode_unplainly(raw, s, reciprocal, plain);
}

// A lane's 8 bfloat16 elements of a plain tile in E4M3, each with no test (see
// block_bf16_reciprocal).
template <bool kExactScale>
__device__ __forceinline__ uint2 encode_bf16_lane(const Raw<DType::kBFloat16>& raw, float s,
                                                  float reciprocal) {
  float q[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    q[i] = block_bf16_quotient<kExactScale>(element(raw, i), s, reciprocal);
  }
  return e4m3_codes(q);
}

// Two passes over a tile: the maximum, then (once the CTA has it) the encoding, both from shared
// memory, where each thread's loads land in slots only it uses, so the tile is read from HBM once
// (reading it again from L2 held the kernel at 0.6 of the copy rate, what reading it twice from
// HBM would give). The loads are asynchronous (cp.async), all 32 KiB of a tile in flight at once;
// a CTA converts one tile, and four CTAs per SM (64 registers, 32 KiB of shared memory each) keep
// HBM busy while some of them encode. (Two buffers per CTA, the next tile's loads out while it
// encoded this one, held 3 CTAs per SM and ran at 0.89 of the copy rate against 0.91 on
// 14336 x 4096, at 0.91 against 0.99 on Llama-3-8B's matrices; one H100, 2026-11-25.)
template <DType S>
constexpr int kTileVectorsPerLane = sizeof(Raw<S>) / sizeof(uint4);
template <DType S>
constexpr std::size_t kTileBufferVectors = kTilePasses * kTileVectorsPerLane<S> * kTileThreads;
template <DType S>
constexpr std::size_t kTileSharedBytes = sizeof(uint4) * kTileBufferVectors<S>;
constexpr int kTileCtasPerSm = 4;

template <DType S>
__device__ __forceinline__ uint4* kept_slot(uint4* kept, int p, int q) {
  return &kept[(p * kTileVectorsPerLane<S> + q) * kTileThreads + threadIdx.x];
}

template <DType S>
__device__ __forceinline__ void keep_raw(uint4* kept, int p, const Raw<S>& raw) {
#pragma unroll
  for (int q = 0; q < kTileVectorsPerLane<S>; ++q) {
    *kept_slot<S>(kept, p, q) =
        make_uint4(raw.word[4 * q], raw.word[4 * q + 1], raw.word[4 * q + 2], raw.word[4 * q + 3]);
  }
}

template <DType S>
__device__ __forceinline__ Raw<S> kept_raw(const uint4* kept, int p) {
  Raw<S> raw;
#pragma unroll
  for (int q = 0; q < kTileVectorsPerLane<S>; ++q) {
    const uint4 v = *kept_slot<S>(const_cast<uint4*>(kept), p, q);
    raw.word[4 * q] = v.x;
    raw.word[4 * q + 1] = v.y;
    raw.word[4 * q + 2] = v.z;
    raw.word[4 * q + 3] = v.w;
  }
  return raw;
}

__device__ __forceinline__ int tile_row(const TilePlace& at, int first_row, int p) {
  const int r = p * kTileRowsPerPass + first_row;
  return r < at.rows && at.count > 0 ? r : -1;
}

// An uneven tile's share: whole aligned vectors asynchronously, the rest (a ragged edge, rows past
// the tile's end as zeros) loaded and stored here.
template <DType S>
__device__ __noinline__ void stage_uneven_tile(uint4* buffer, const void* src, TilePlace at,
                                               int first_row) {
  constexpr int size = kElementBytes<S>;
#pragma unroll 1
  for (int p = 0; p < kTilePasses; ++p) {
    const int r = tile_row(at, first_row, p);
    const std::int64_t index = r >= 0 ? at.src_first + r * at.src_stride : 0;
    const auto* from = static_cast<const std::uint8_t*>(src) + index * size;
    if (r >= 0 && at.count == kPerLane && (reinterpret_cast<std::uintptr_t>(from) & 15) == 0) {
#pragma unroll
      for (int q = 0; q < kTileVectorsPerLane<S>; ++q) {
        copy_16_bytes_async(kept_slot<S>(buffer, p, q), from + 16 * q);
      }
    } else {
      keep_raw<S>(buffer, p, load_raw<S>(src, index, r >= 0 ? at.count : 0));
    }
  }
}

// This thread's share of a tile into `buffer`.
template <DType S>
__device__ __forceinline__ void stage_tile(uint4* buffer, const BlockTask& task,
                                           const TilePlace& at, int first_row) {
  constexpr int size = kElementBytes<S>;
  if (!at.even) {
    stage_uneven_tile<S>(buffer, task.src, at, first_row);
    return;
  }
  const auto* from = static_cast<const std::uint8_t*>(task.src) +
                     (at.src_first + first_row * at.src_stride) * size;
  const std::int64_t step = kTileRowsPerPass * at.src_stride * size;
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p) {
#pragma unroll
    for (int q = 0; q < kTileVectorsPerLane<S>; ++q) {
      copy_16_bytes_async(kept_slot<S>(buffer, p, q), from + p * step + 16 * q);
    }
  }
}

// An uneven tile's encoding: rows past its end skipped, a ragged edge stored byte by byte.
template <DType S>
__device__ __noinline__ void encode_uneven_tile(const uint4* buffer, TilePlace at, int first_row,
                                                float s, float reciprocal, bool plain) {
#pragma unroll 1
  for (int p = 0; p < kTilePasses; ++p) {
    const int r = tile_row(at, first_row, p);
    if (r < 0) continue;
    const uint2 encoded = encode_lane<S>(kept_raw<S>(buffer, p), s, reciprocal, plain);
    std::uint8_t* const out = at.data + at.data_first + r * at.data_stride;
    if (at.count == kPerLane) {
      store_8_bytes(out, encoded);
    } else {
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        if (i >= at.count) break;
        out[i] = static_cast<std::uint8_t>((i < 4 ? encoded.x : encoded.y) >> (8 * (i % 4)));
      }
    }
  }
}

// The maximum of a staged tile (the CTA's threads together), its scale, and the encoding.
// warp_max is by the tile's parity, so one barrier per tile serves.
template <DType S>
__device__ __forceinline__ void quantize_staged_tile(const uint4* buffer, const TilePlace& at,
                                                     int first_row, std::uint32_t* warp_max) {
  std::uint32_t magnitude = 0;
#pragma unroll
  for (int p = 0; p < kTilePasses; ++p) {
    magnitude = max(magnitude, magnitude_max<S>(kept_raw<S>(buffer, p)));
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    magnitude = max(magnitude, __shfl_xor_sync(0xffffffffu, magnitude, offset));
  }
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = magnitude;
  __syncthreads();
  magnitude = 0;
#pragma unroll
  for (int w = 0; w < kTileThreads / 32; ++w) magnitude = max(magnitude, warp_max[w]);
  const float amax = amax_of<S>(magnitude);
  const float s = block_scale(amax);
  const float reciprocal = __frcp_rn(s);
  // Finite elements (a finite maximum) and a scale of at least 2^-100.
  const bool plain = amax <= 3.4028234663852886e38f && s >= 7.888609052210118e-31f;
  if (threadIdx.x == 0) *at.scale_at = s;
  if (!at.even) {
    encode_uneven_tile<S>(buffer, at, first_row, s, reciprocal, plain);
    return;
  }
  std::uint8_t* const out = at.data + at.data_first + first_row * at.data_stride;
  const std::int64_t step = kTileRowsPerPass * at.data_stride;
  const auto encode_rows = [&](auto encode) {
#pragma unroll 4
    for (int p = 0; p < kTilePasses; ++p) {
      *reinterpret_cast<uint2*>(out + p * step) = encode(kept_raw<S>(buffer, p));
    }
  };
  if constexpr (S == DType::kBFloat16) {
    if (plain) {
      const float nudged = block_bf16_reciprocal(amax, s, reciprocal);
      if (nudged != 0.0f) {
        encode_rows([&](const Raw<S>& raw) { return encode_bf16_lane<false>(raw, s, nudged); });
      } else {
        encode_rows([&](const Raw<S>& raw) { return encode_bf16_lane<true>(raw, s, reciprocal); });
      }
      return;
    }
  }
  encode_rows([&](const Raw<S>& raw) { return encode_lane<S>(raw, s, reciprocal, plain); });
}

template <DType S>
__global__ void __launch_bounds__(kTileThreads, kTileCtasPerSm)
    block_quantize_kernel(JobList<BlockTask> list) {
  // Each warp's maximum, by the tile's parity: one barrier per tile.
  __shared__ std::uint32_t warp_max[2][kTileThreads / 32];
  extern __shared__ uint4 kept[];  // kTileSharedBytes<S>
  const int col = static_cast<int>(threadIdx.x % kThreadsPerTileRow) * kPerLane;
  const int first_row = static_cast<int>(threadIdx.x / kThreadsPerTileRow);
  int parity = 0;
  for (std::uint64_t item = blockIdx.x; item < list.items; item += gridDim.x, parity ^= 1) {
    const BlockTask* task = nullptr;
    const TilePlace at = place_tile<S>(list, item, col, task);
    // A thread refills only its own slots, which it has finished reading: no barrier before.
    stage_tile<S>(kept, *task, at, first_row);
    commit_async_copies();
    wait_async_copies<0>();
    quantize_staged_tile<S>(kept, at, first_row, warp_max[parity]);
  }
}

// CTAs for `units` of work: at most what the GPU holds at once several times over (the kernels
// walk their work in strides of the grid).
std::uint64_t multiprocessors() {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  }
  return static_cast<std::uint64_t>(sms);
}

unsigned grid_for(std::uint64_t units) {
  const std::uint64_t most = multiprocessors() * 16;
  return static_cast<unsigned>(std::max<std::uint64_t>(1, std::min(units, most)));
}

// Warps of the staged element-wise kernels (casts, MXFP8) the GPU holds at once.
std::uint64_t resident_staged_warps() {
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
FastDivisor divisor_of(std::uint32_t d, FastDivisor& last) {
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

std::uint64_t chunks_of(const VectorSpan& span, int vectors_per_chunk) {
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
int float_index(DType dtype) {
  for (int i = 0; i < kFloatTypes; ++i) {
    if (kFloatType[i] == dtype) return i;
  }
  return -1;
}
template <DType D>
constexpr int kFloatIndex = D == DType::kFloat32    ? 0
                            : D == DType::kBFloat16 ? 1
                                                    : 2;

[[noreturn]] void refuse_dtype(const char* conversion, DType dtype) {
  throw_error(ErrorCode::kUnsupported, std::string("a GPU ") + conversion + " from " +
                                           dtype_name(dtype) +
                                           " (float32, bfloat16 or float16 only)");
}

}  // namespace

// GPU jobs become their kernels' tasks as they are queued, while their views are still in the
// cache: a refit queues thousands, and building the lists at launch time, from jobs kept whole
// (464 bytes an MXFP8 job), took more host time than the GPU took to convert 512 small matrices.
struct ConversionUploads {
  JobUpload convert, mx, block, swizzle;
  TaskList<CastTask> casts[kFloatTypes][kFloatTypes];  // [source][destination]
  TaskList<MxTask> mx_tasks[kFloatTypes];
  TaskList<BlockTask> block_tasks[kFloatTypes];
  TaskList<SwizzleTask> swizzle_tasks;
  std::size_t jobs = 0;  // queued since the last launch
};

ConversionUploads* create_uploads() { return new ConversionUploads(); }
void destroy_uploads(ConversionUploads* uploads) { delete uploads; }
std::size_t queued_jobs(const ConversionUploads& uploads) { return uploads.jobs; }

void queue(ConversionUploads& uploads, const ConvertJob& job) {
  const int from = float_index(job.src.dtype), to = float_index(job.dst.dtype);
  if (from < 0) refuse_dtype("cast", job.src.dtype);
  if (to < 0) refuse_dtype("cast to", job.dst.dtype);
  TaskList<CastTask>& list = uploads.casts[from][to];
  split_rows(job.src.view.rows, job.src.view.cols, kPerLane, list.last,
             [&](const VectorSpan& span) {
               CastTask& task = list.tasks.emplace_back();
               task.src = job.src.data;
               task.dst = job.dst.data;
               task.src_rows = RowWalk::of(job.src.view, list.uneven);
               task.dst_rows = RowWalk::of(job.dst.view, list.uneven);
               task.span = span;
               task.cols = job.src.view.cols;
               const auto dense = [&](const RowWalk& rows) {
                 return rows.view < 0 && rows.stride == task.cols;
               };
               task.warp_stores =
                   to == kFloatIndex<DType::kFloat32> && from != to && task.src_rows.view < 0 &&
                   task.dst_rows.view < 0 &&
                   ((dense(task.src_rows) && dense(task.dst_rows)) || task.cols >= 32 * kPerLane);
             });
  ++uploads.jobs;
}

namespace {

// MxTask::even.
bool is_even(const MxTask& task, std::size_t element_bytes) {
  const auto fits = [](const RowWalk& rows, std::size_t bytes) {
    return rows.view < 0 && rows.stride >= 0 &&
           static_cast<std::uint64_t>(rows.stride) * bytes < (std::uint64_t{1} << 32);
  };
  if (!fits(task.src_rows, element_bytes) || !fits(task.data_rows, 1)) return false;
  if (task.col_tiles == 0) return fits(task.scale_rows, 1);
  // Swizzled: the span's scale rows and block columns inside the layout's col_tiles * 4 columns,
  // and the last tile's end at most 2^32 bytes in.
  const std::uint32_t vectors_per_row = task.span.per_row.divisor;
  const std::int64_t rows =
      (std::int64_t{task.span.vectors} + vectors_per_row - 1) / vectors_per_row;
  const std::int64_t first_row = task.scale_rows.base + task.span.first_row;
  const std::int64_t blocks = std::int64_t{vectors_per_row} * kMxPerLane / kMxBlock;
  if (first_row < 0 || task.first_col < 0 ||
      task.first_col + blocks > 4 * std::int64_t{task.col_tiles})
    return false;
  const std::uint64_t tile_rows = static_cast<std::uint64_t>(first_row + rows + 127) / 128;
  return tile_rows * task.col_tiles * 512 <= (std::uint64_t{1} << 32);
}

// MxTask::banded (of an even task). Skinny spans (one band of rows, or rows of fewer than 256
// columns) keep the row walk: there it was the faster on one H200, 2026-11-27 (65536 x 128 and
// 128 x 65536: 0.83-0.84 of the copy rate against 0.78-0.80 in bands).
bool is_banded(const MxTask& task) {
  const std::uint32_t per_row = task.span.per_row.divisor;
  const std::int64_t first_row = task.scale_rows.base + task.span.first_row;
  return task.col_tiles > 0 && per_row % 8 == 0 && per_row >= 16 &&
         task.span.vectors % (std::uint64_t{128} * per_row) == 0 &&
         task.span.vectors / per_row >= 256 && first_row % 128 == 0 && task.first_col % 4 == 0 &&
         reinterpret_cast<std::uintptr_t>(task.scale) % 4 == 0;
}

}  // namespace

void queue(ConversionUploads& uploads, const MxJob& job) {
  const int from = float_index(job.src.dtype);
  if (from < 0) refuse_dtype("MXFP8 conversion", job.src.dtype);
  TaskList<MxTask>& list = uploads.mx_tasks[from];
  split_rows(job.src.view.rows, job.src.view.cols, kMxPerLane, list.last,
             [&](const VectorSpan& span) {
               MxTask& task = list.tasks.emplace_back();
               task.src = job.src.data;
               task.data = static_cast<std::uint8_t*>(job.data.data);
               task.scale = static_cast<std::uint8_t*>(job.scale.data);
               task.src_rows = RowWalk::of(job.src.view, list.uneven);
               task.data_rows = RowWalk::of(job.data.view, list.uneven);
               if (job.swizzled.col_tiles > 0) {
                 task.scale_rows = RowWalk{job.swizzled.first_row, 1, -1};
                 task.first_col = job.swizzled.first_col;
                 task.col_tiles = static_cast<std::uint32_t>(job.swizzled.col_tiles);
               } else {
                 task.scale_rows = RowWalk::of(job.scale.view, list.uneven);
               }
               task.span = span;
               task.round_up = rounds_up(job.rounding);
               task.least_bits = least_scale_bits(job.rounding);
               task.even = is_even(task, dtype_size(job.src.dtype));
               task.banded = task.even && is_banded(task);
             });
  ++uploads.jobs;
}

void queue(ConversionUploads& uploads, const SwizzleJob& job) {
  TaskList<SwizzleTask>& list = uploads.swizzle_tasks;
  split_rows(job.rows, job.cols, 1, list.last, [&](const VectorSpan& span) {
    list.tasks.push_back(
        {job.src, job.dst, span, job.at.first_row, job.at.first_col, job.at.col_tiles});
  });
  ++uploads.jobs;
}

void queue(ConversionUploads& uploads, const BlockFp8Job& job) {
  const int from = float_index(job.src.dtype);
  if (from < 0) refuse_dtype("block-FP8 conversion", job.src.dtype);
  if (job.src.view.cols == 0 || job.src.view.rows == 0) return;
  const std::int64_t tile_rows = (job.rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const std::int64_t tile_cols = (job.src.view.cols + kFp8Block - 1) / kFp8Block;
  const std::int64_t tiles = job.src.view.rows / job.rows_per_matrix * tile_rows * tile_cols;
  if (tiles >= (std::int64_t{1} << 32)) {
    throw_error(ErrorCode::kUnsupported, "a block-FP8 conversion of " + std::to_string(tiles) +
                                             " tiles (at most 2^32 - 1 in one block)");
  }
  TaskList<BlockTask>& list = uploads.block_tasks[from];
  BlockTask& task = list.tasks.emplace_back();
  task.src = job.src.data;
  task.data = static_cast<std::uint8_t*>(job.data.data);
  task.scale = static_cast<float*>(job.scale.data);
  task.src_rows = RowWalk::of(job.src.view, list.uneven);
  task.data_rows = RowWalk::of(job.data.view, list.uneven);
  task.scale_rows = RowWalk::of(job.scale.view, list.uneven);
  task.cols = job.src.view.cols;
  task.src_stride = job.src.view.row_stride();
  task.data_stride = job.data.view.row_stride();
  task.rows_per_matrix = job.rows_per_matrix;
  task.tiles_per_matrix = FastDivisor::of(static_cast<std::uint32_t>(tile_rows * tile_cols));
  task.tile_cols = divisor_of(static_cast<std::uint32_t>(tile_cols), list.last);
  task.tiles = static_cast<std::uint32_t>(tiles);
  ++uploads.jobs;
}

namespace {

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

// Launches `list`'s tasks: casts from S to D (launch_queued empties the lists after).
template <DType S, DType D>
void launch_casts(const TaskList<CastTask>& list, JobUpload& upload, cudaStream_t stream) {
  run_chunked<kCastTiles<S>, kFewerCastTiles<S>>(
      list, upload, stream, [](auto tiles, unsigned grid, JobList<CastTask> jobs, cudaStream_t s) {
        cast_kernel<S, D, decltype(tiles)::value><<<grid, kThreads, 0, s>>>(jobs);
      });
}

template <DType S>
void launch_mx(const TaskList<MxTask>& list, JobUpload& upload, cudaStream_t stream) {
  // Whole warps only (256-thread CTAs), so the shuffles are legal.
  run_chunked<kMxTiles<S>, kFewerMxTiles<S>>(
      list, upload, stream, [](auto tiles, unsigned grid, JobList<MxTask> jobs, cudaStream_t s) {
        mx_quantize_kernel<S, decltype(tiles)::value><<<grid, kThreads, 0, s>>>(jobs);
      });
}

template <DType S>
void launch_blocks(const TaskList<BlockTask>& list, JobUpload& upload, cudaStream_t stream) {
  run_tasks(
      list.tasks, list.uneven, upload, stream,
      [](const BlockTask& task) { return std::uint64_t{task.tiles}; },
      [](const JobList<BlockTask>& jobs, cudaStream_t s) {
        // Above 48 KiB (float32 sources) the kernel must be allowed the shared memory, on the
        // current device (each launch: a process may convert on several).
        if constexpr (kTileSharedBytes<S> > (48u << 10)) {
          RESHARD_CUDA_CHECK(cudaFuncSetAttribute(block_quantize_kernel<S>,
                                                  cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                  static_cast<int>(kTileSharedBytes<S>)));
        }
        // A CTA per tile (the CTAs walk on past 2^20 tiles).
        const auto grid =
            static_cast<unsigned>(std::min<std::uint64_t>(jobs.items, std::uint64_t{1} << 20));
        block_quantize_kernel<S><<<grid, kTileThreads, kTileSharedBytes<S>, s>>>(jobs);
      });
}

void launch_swizzles(const TaskList<SwizzleTask>& list, JobUpload& upload, cudaStream_t stream) {
  constexpr int kPerChunk = 32 * kSwizzlesInFlight;
  run_tasks(
      list.tasks, list.uneven, upload, stream,
      [](const SwizzleTask& task) { return chunks_of(task.span, kPerChunk); },
      [](JobList<SwizzleTask> jobs, cudaStream_t s) {
        const unsigned grid = chunked_grid(jobs);
        swizzle_kernel<<<grid, kThreads, 0, s>>>(jobs);
      });
}

void clear_queued(ConversionUploads& uploads) {
  for (auto& to : uploads.casts) {
    for (TaskList<CastTask>& list : to) list.tasks.clear(), list.uneven.clear();
  }
  for (TaskList<MxTask>& list : uploads.mx_tasks) list.tasks.clear(), list.uneven.clear();
  for (TaskList<BlockTask>& list : uploads.block_tasks) list.tasks.clear(), list.uneven.clear();
  uploads.swizzle_tasks.tasks.clear();
  uploads.jobs = 0;
}

}  // namespace

namespace {

// The floating-point types a conversion reads or writes.
template <DType... Types>
struct FloatTypes {};
using ConvertedTypes = FloatTypes<DType::kFloat32, DType::kBFloat16, DType::kFloat16>;

// Each instance launch_casts, launch_mx and launch_blocks choose from for sources of type S
// (both chunk sizes; casts to each of `To`).
template <DType S, DType... To>
void load_from(FloatTypes<To...>) {
  (::reshard::cuda::load_kernel(cast_kernel<S, To, kCastTiles<S>>), ...);
  (::reshard::cuda::load_kernel(cast_kernel<S, To, kFewerCastTiles<S>>), ...);
  ::reshard::cuda::load_kernel(mx_quantize_kernel<S, kMxTiles<S>>);
  ::reshard::cuda::load_kernel(mx_quantize_kernel<S, kFewerMxTiles<S>>);
  ::reshard::cuda::load_kernel(block_quantize_kernel<S>);
}

template <DType... From>
void load_all(FloatTypes<From...> types) {
  (load_from<From>(types), ...);
}

}  // namespace

void load_conversion_kernels() {
  load_all(ConvertedTypes{});
  ::reshard::cuda::load_kernel(swizzle_kernel);
}

void launch_queued(ConversionUploads& uploads, void* stream) {
  // One launch per kind and pair of dtypes: casts, MXFP8, block FP8, then the scale swizzles.
  // What a failed launch leaves queued is dropped with it, not launched again by the next flush.
  struct ClearOnExit {
    ConversionUploads& uploads;
    ~ClearOnExit() { clear_queued(uploads); }
  } clear_on_exit{uploads};
  const auto s = static_cast<cudaStream_t>(stream);
  auto casts_to = [&]<DType D>() {
    launch_casts<DType::kFloat32, D>(uploads.casts[0][kFloatIndex<D>], uploads.convert, s);
    launch_casts<DType::kBFloat16, D>(uploads.casts[1][kFloatIndex<D>], uploads.convert, s);
    launch_casts<DType::kFloat16, D>(uploads.casts[2][kFloatIndex<D>], uploads.convert, s);
  };
  casts_to.template operator()<DType::kFloat32>();
  casts_to.template operator()<DType::kBFloat16>();
  casts_to.template operator()<DType::kFloat16>();
  launch_mx<DType::kBFloat16>(uploads.mx_tasks[1], uploads.mx, s);
  launch_mx<DType::kFloat32>(uploads.mx_tasks[0], uploads.mx, s);
  launch_mx<DType::kFloat16>(uploads.mx_tasks[2], uploads.mx, s);
  launch_blocks<DType::kBFloat16>(uploads.block_tasks[1], uploads.block, s);
  launch_blocks<DType::kFloat32>(uploads.block_tasks[0], uploads.block, s);
  launch_blocks<DType::kFloat16>(uploads.block_tasks[2], uploads.block, s);
  launch_swizzles(uploads.swizzle_tasks, uploads.swizzle, s);
}

}  // namespace reshard::execution::cuda

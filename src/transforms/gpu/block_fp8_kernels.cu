// Block FP8 on the GPU: 128 x 128 tiles in E4M3, a float32 scale each (DeepSeek-V3's format);
// the kernel and its launches.
#include "transforms/gpu/conversion_kernels.cuh"

namespace reshard::execution::cuda {
namespace {

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

}  // namespace

void launch_block_lists(TaskList<BlockTask> (&lists)[kFloatTypes], JobUpload& upload,
                        cudaStream_t s) {
  launch_blocks<DType::kBFloat16>(lists[1], upload, s);
  launch_blocks<DType::kFloat32>(lists[0], upload, s);
  launch_blocks<DType::kFloat16>(lists[2], upload, s);
}

void load_block_kernels() {
  ::reshard::cuda::load_kernel(block_quantize_kernel<DType::kFloat32>);
  ::reshard::cuda::load_kernel(block_quantize_kernel<DType::kBFloat16>);
  ::reshard::cuda::load_kernel(block_quantize_kernel<DType::kFloat16>);
}

}  // namespace reshard::execution::cuda

// MXFP8 on the GPU: blocks of 32 elements in E4M3 with an E8M0 scale each, scales dense or in
// the swizzled layout of Megatron-LM and Transformer Engine, and the swizzle of scales received
// dense; the kernels and their launches.
#include "transforms/gpu/conversion_kernels.cuh"

namespace reshard::execution::cuda {
namespace {

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

template <DType S>
void launch_mx(const TaskList<MxTask>& list, JobUpload& upload, cudaStream_t stream) {
  // Whole warps only (256-thread CTAs), so the shuffles are legal.
  run_chunked<kMxTiles<S>, kFewerMxTiles<S>>(
      list, upload, stream, [](auto tiles, unsigned grid, JobList<MxTask> jobs, cudaStream_t s) {
        mx_quantize_kernel<S, decltype(tiles)::value><<<grid, kThreads, 0, s>>>(jobs);
      });
}

}  // namespace

void launch_mx_lists(TaskList<MxTask> (&lists)[kFloatTypes], JobUpload& upload, cudaStream_t s) {
  launch_mx<DType::kBFloat16>(lists[1], upload, s);
  launch_mx<DType::kFloat32>(lists[0], upload, s);
  launch_mx<DType::kFloat16>(lists[2], upload, s);
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

void load_mx_kernels() {
  const auto from = [&]<DType S>() {
    ::reshard::cuda::load_kernel(mx_quantize_kernel<S, kMxTiles<S>>);
    ::reshard::cuda::load_kernel(mx_quantize_kernel<S, kFewerMxTiles<S>>);
  };
  from.template operator()<DType::kFloat32>();
  from.template operator()<DType::kBFloat16>();
  from.template operator()<DType::kFloat16>();
  ::reshard::cuda::load_kernel(swizzle_kernel);
}

}  // namespace reshard::execution::cuda

// Casts between float32, bfloat16 and float16 on the GPU: the kernel and its launches.
#include "transforms/gpu/conversion_kernels.cuh"

namespace reshard::execution::cuda {
namespace {

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

// Launches `list`'s tasks: casts from S to D (launch_queued empties the lists after).
template <DType S, DType D>
void launch_casts(const TaskList<CastTask>& list, JobUpload& upload, cudaStream_t stream) {
  run_chunked<kCastTiles<S>, kFewerCastTiles<S>>(
      list, upload, stream, [](auto tiles, unsigned grid, JobList<CastTask> jobs, cudaStream_t s) {
        cast_kernel<S, D, decltype(tiles)::value><<<grid, kThreads, 0, s>>>(jobs);
      });
}

}  // namespace

void launch_cast_lists(TaskList<CastTask> (&lists)[kFloatTypes][kFloatTypes], JobUpload& upload,
                       cudaStream_t s) {
  auto casts_to = [&]<DType D>() {
    launch_casts<DType::kFloat32, D>(lists[0][kFloatIndex<D>], upload, s);
    launch_casts<DType::kBFloat16, D>(lists[1][kFloatIndex<D>], upload, s);
    launch_casts<DType::kFloat16, D>(lists[2][kFloatIndex<D>], upload, s);
  };
  casts_to.template operator()<DType::kFloat32>();
  casts_to.template operator()<DType::kBFloat16>();
  casts_to.template operator()<DType::kFloat16>();
}

void load_cast_kernels() {
  const auto from = [&]<DType S>() {
    const auto to = [&]<DType D>() {
      ::reshard::cuda::load_kernel(cast_kernel<S, D, kCastTiles<S>>);
      ::reshard::cuda::load_kernel(cast_kernel<S, D, kFewerCastTiles<S>>);
    };
    to.template operator()<DType::kFloat32>();
    to.template operator()<DType::kBFloat16>();
    to.template operator()<DType::kFloat16>();
  };
  from.template operator()<DType::kFloat32>();
  from.template operator()<DType::kBFloat16>();
  from.template operator()<DType::kFloat16>();
}

}  // namespace reshard::execution::cuda

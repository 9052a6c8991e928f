// CUDA kernels of the conversions; the arithmetic is number_formats.hpp, shared with the host
// reference, so results match it bit for bit.
#include "transforms/conversions.hpp"
#include "transforms/element_access.hpp"
#include "transports/cuda/cuda_check.hpp"

namespace reshard::exec::cuda {
namespace {

using namespace formats;

unsigned grid_for(std::int64_t work, int per_block) {
  const std::int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<unsigned>(std::max<std::int64_t>(1, std::min<std::int64_t>(blocks, 65535)));
}

__global__ void convert_kernel(BlockRef src, BlockRef dst) {
  for (std::int64_t row = blockIdx.x; row < src.view.rows; row += gridDim.x) {
    const std::int64_t from = src.view.row_start(row);
    const std::int64_t to = dst.view.row_start(row);
    for (std::int64_t col = threadIdx.x; col < src.view.cols; col += blockDim.x) {
      store_float(dst.data, dst.dtype, to + col, load_float(src.data, src.dtype, from + col));
    }
  }
}

// One warp per 32-element block, one element per lane: loads are coalesced and the block's
// maximum is a butterfly of shuffles (max is order-independent, NaN propagates either way).
__global__ void mx_quantize_kernel(BlockRef src, BlockRef data, BlockRef scale, bool round_up) {
  const std::int64_t per_row = src.view.cols / kMxBlock;
  const std::int64_t blocks = src.view.rows * per_row;
  const unsigned lane = threadIdx.x % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  auto* out = static_cast<std::uint8_t*>(data.data);
  auto* scales = static_cast<std::uint8_t*>(scale.data);
  for (std::int64_t b = (blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x) / 32;
       b < blocks; b += warps) {
    const std::int64_t row = b / per_row;
    const std::int64_t block = b % per_row;
    const float value =
        load_float(src.data, src.dtype, src.view.row_start(row) + block * kMxBlock + lane);
    float amax = abs_max(0.0f, value);
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      amax = abs_max(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const std::uint8_t bits = mx_scale_bits(amax, round_up);
    if (lane == 0) scales[scale.view.row_start(row) + block] = bits;
    out[data.view.row_start(row) + block * kMxBlock + lane] = mx_encode(value, bits);
  }
}

// One CTA per 128 x 128 tile: a NaN-propagating max reduction, then the encode.
__global__ void block_quantize_kernel(BlockRef src, std::int64_t rows_per_matrix, BlockRef data,
                                      BlockRef scale) {
  __shared__ float partial[256];
  const std::int64_t tile_rows = (rows_per_matrix + kFp8Block - 1) / kFp8Block;
  const std::int64_t tile_cols = (src.view.cols + kFp8Block - 1) / kFp8Block;
  const std::int64_t matrices = src.view.rows / rows_per_matrix;
  const std::int64_t tiles = matrices * tile_rows * tile_cols;
  auto* out = static_cast<std::uint8_t*>(data.data);
  auto* scales = static_cast<float*>(scale.data);
  for (std::int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const std::int64_t m = t / (tile_rows * tile_cols);
    const std::int64_t tr = (t / tile_cols) % tile_rows;
    const std::int64_t tc = t % tile_cols;
    const std::int64_t row_begin = m * rows_per_matrix + tr * kFp8Block;
    const std::int64_t rows =
        min(static_cast<std::int64_t>(kFp8Block), rows_per_matrix - tr * kFp8Block);
    const std::int64_t c0 = tc * kFp8Block;
    const std::int64_t cols = min(static_cast<std::int64_t>(kFp8Block), src.view.cols - c0);
    float amax = 0.0f;
    for (std::int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
      const std::int64_t r = row_begin + i / cols;
      amax = abs_max(amax, load_float(src.data, src.dtype, src.view.row_start(r) + c0 + i % cols));
    }
    partial[threadIdx.x] = amax;
    __syncthreads();
    for (unsigned half = blockDim.x / 2; half > 0; half /= 2) {
      if (threadIdx.x < half) {
        partial[threadIdx.x] = abs_max(partial[threadIdx.x], partial[threadIdx.x + half]);
      }
      __syncthreads();
    }
    const float s = block_scale(partial[0]);
    if (threadIdx.x == 0) scales[scale.view.row_start(m * tile_rows + tr) + tc] = s;
    for (std::int64_t i = threadIdx.x; i < rows * cols; i += blockDim.x) {
      const std::int64_t r = row_begin + i / cols;
      const std::int64_t c = c0 + i % cols;
      out[data.view.row_start(r) + c] =
          block_encode(load_float(src.data, src.dtype, src.view.row_start(r) + c), s);
    }
    __syncthreads();  // partial[] is reused by the next tile
  }
}

}  // namespace

void convert_block(const BlockRef& src, const BlockRef& dst, void* stream) {
  if (src.view.rows == 0 || src.view.cols == 0) return;
  convert_kernel<<<grid_for(src.view.rows, 1), 256, 0, static_cast<cudaStream_t>(stream)>>>(src,
                                                                                            dst);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

void mx_quantize(const BlockRef& src, const BlockRef& data, const BlockRef& scale, bool round_up,
                 void* stream) {
  const std::int64_t blocks = src.view.rows * (src.view.cols / kMxBlock);
  if (blocks == 0) return;
  // Every warp stays whole (blocks * 32 threads in 256-thread CTAs), so the shuffles are legal.
  mx_quantize_kernel<<<grid_for(blocks * 32, 256), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, data, scale, round_up);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

void block_quantize(const BlockRef& src, std::int64_t rows_per_matrix, const BlockRef& data,
                    const BlockRef& scale, void* stream) {
  if (src.view.rows == 0 || src.view.cols == 0) return;
  const std::int64_t tiles = (src.view.rows / rows_per_matrix) *
                             ((rows_per_matrix + kFp8Block - 1) / kFp8Block) *
                             ((src.view.cols + kFp8Block - 1) / kFp8Block);
  block_quantize_kernel<<<grid_for(tiles, 1), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      src, rows_per_matrix, data, scale);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace reshard::exec::cuda

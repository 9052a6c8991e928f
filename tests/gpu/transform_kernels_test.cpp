// The conversion kernels against the host reference, bit for bit, on random data salted with
// NaN, infinities, subnormals, zeros and values that saturate, through blocks that are not
// contiguous in their tensors. One process, one GPU; exits 77 (skipped) without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "execution/box_view.hpp"
#include "transforms/conversions.hpp"

namespace reshard::exec {
namespace {

std::vector<std::uint16_t> salted_bf16(std::size_t n, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::uint16_t> out(n);
  const std::uint16_t specials[] = {0x7fc0, 0xffc0, 0x7f80, 0xff80, 0x0000, 0x8000,
                                    0x0001, 0x807f, 0x7f7f, 0xff7f, 0x0080, 0x4400};
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint32_t r = rng();
    if (r % 50 == 0) {
      out[i] = specials[(r >> 8) % std::size(specials)];
    } else {
      // Exponents spread over the whole bf16 range, so blocks need scales far from 1.
      out[i] = static_cast<std::uint16_t>(rng() & 0xffff);
      if ((out[i] & 0x7f80) == 0x7f80) out[i] &= 0xbfff;  // keep most values finite
    }
  }
  return out;
}

struct DeviceCopy {
  void* pointer = nullptr;
  std::size_t bytes;
  explicit DeviceCopy(std::size_t n) : bytes(n) {
    EXPECT_EQ(cudaMalloc(&pointer, n), cudaSuccess);
    cudaMemset(pointer, 0xab, n);
  }
  DeviceCopy(const void* host, std::size_t n) : DeviceCopy(n) {
    cudaMemcpy(pointer, host, n, cudaMemcpyHostToDevice);
  }
  ~DeviceCopy() { cudaFree(pointer); }
  std::vector<std::uint8_t> download() const {
    std::vector<std::uint8_t> out(bytes);
    cudaMemcpy(out.data(), pointer, bytes, cudaMemcpyDeviceToHost);
    return out;
  }
};

// A [2, 300, 384] tensor and a block inside it that cuts every dimension.
const std::vector<std::int64_t> kShape = {2, 300, 384};
const Box kBlock{3, {1, 40, 64}, {1, 257, 256}};

TEST(TransformKernels, MxQuantizeMatchesTheReferenceBitForBit) {
  const auto src = salted_bf16(2 * 300 * 384, 7);
  for (bool round_up : {false, true}) {
    std::vector<std::uint8_t> data(src.size(), 0xab), scales(src.size() / 32, 0xab);
    std::vector<std::int64_t> scale_shape = {2, 300, 384 / 32};
    Box scale_block = kBlock;
    scale_block.offset[2] /= 32;
    scale_block.extent[2] /= 32;
    const BoxView v = view_of(kBlock, kShape, false);
    const BoxView sv = view_of(scale_block, scale_shape, false);
    mx_quantize({const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, v},
                {data.data(), DType::kFloat8E4M3, v}, {scales.data(), DType::kFloat8E8M0, sv},
                round_up, MemoryKind::kHost, nullptr);
    DeviceCopy d_src(src.data(), src.size() * 2), d_data(data.size()), d_scales(scales.size());
    cudaMemset(d_data.pointer, 0xab, data.size());
    cudaMemset(d_scales.pointer, 0xab, scales.size());
    mx_quantize({d_src.pointer, DType::kBFloat16, v}, {d_data.pointer, DType::kFloat8E4M3, v},
                {d_scales.pointer, DType::kFloat8E8M0, sv}, round_up, MemoryKind::kCuda, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_data.download(), data) << "round_up " << round_up;
    EXPECT_EQ(d_scales.download(), scales) << "round_up " << round_up;
  }
}

TEST(TransformKernels, BlockQuantizeMatchesTheReferenceBitForBit) {
  const auto src = salted_bf16(2 * 300 * 384, 11);
  // Whole matrices, so tiles include a partial one at the bottom edge (300 = 2 * 128 + 44).
  const Box block{3, {0, 0, 128}, {2, 300, 256}};
  const std::vector<std::int64_t> tile_shape = {2, 3, 3};
  const Box tiles{3, {0, 0, 1}, {2, 3, 2}};
  const BoxView v = view_of(block, kShape, false);
  const BoxView tv = view_of(tiles, tile_shape, false);
  std::vector<std::uint8_t> data(src.size(), 0xab);
  std::vector<float> scales(2 * 3 * 3, -1.0f);
  block_quantize({const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, v}, 300,
                 {data.data(), DType::kFloat8E4M3, v}, {scales.data(), DType::kFloat32, tv},
                 MemoryKind::kHost, nullptr);
  DeviceCopy d_src(src.data(), src.size() * 2), d_data(data.size()), d_scales(scales.size() * 4);
  cudaMemset(d_data.pointer, 0xab, data.size());
  std::vector<float> minus_one(scales.size(), -1.0f);
  cudaMemcpy(d_scales.pointer, minus_one.data(), scales.size() * 4, cudaMemcpyHostToDevice);
  block_quantize({d_src.pointer, DType::kBFloat16, v}, 300, {d_data.pointer, DType::kFloat8E4M3, v},
                 {d_scales.pointer, DType::kFloat32, tv}, MemoryKind::kCuda, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_data.download(), data);
  std::vector<std::uint8_t> host_scales(scales.size() * 4);
  std::memcpy(host_scales.data(), scales.data(), host_scales.size());
  EXPECT_EQ(d_scales.download(), host_scales);
}

TEST(TransformKernels, CastsMatchTheReferenceBitForBit) {
  const auto src = salted_bf16(2 * 300 * 384, 13);
  const BoxView v = view_of(kBlock, kShape, false);
  for (DType to : {DType::kFloat32, DType::kFloat16}) {
    // bf16 -> `to` -> bf16 through both paths.
    const std::size_t n = src.size(), size = dtype_size(to);
    std::vector<std::uint8_t> mid(n * size, 0xab), back(n * 2, 0xab);
    convert_block({const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, v},
                  {mid.data(), to, v}, MemoryKind::kHost, nullptr);
    convert_block({mid.data(), to, v}, {back.data(), DType::kBFloat16, v}, MemoryKind::kHost,
                  nullptr);
    DeviceCopy d_src(src.data(), n * 2), d_mid(n * size), d_back(n * 2);
    cudaMemset(d_mid.pointer, 0xab, n * size);
    cudaMemset(d_back.pointer, 0xab, n * 2);
    convert_block({d_src.pointer, DType::kBFloat16, v}, {d_mid.pointer, to, v}, MemoryKind::kCuda,
                  nullptr);
    convert_block({d_mid.pointer, to, v}, {d_back.pointer, DType::kBFloat16, v}, MemoryKind::kCuda,
                  nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_mid.download(), mid) << dtype_name(to);
    EXPECT_EQ(d_back.download(), back) << dtype_name(to);
  }
}

}  // namespace
}  // namespace reshard::exec

int main(int argc, char** argv) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("skipped: no CUDA device\n");
    return 77;  // ctest: skipped
  }
  testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}

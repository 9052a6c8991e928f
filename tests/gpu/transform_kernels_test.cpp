// The conversion kernels against the host reference, bit for bit, on random data salted with
// NaN, infinities, subnormals, zeros and values that saturate, through blocks that are not
// contiguous in their tensors. One process, one GPU; exits 77 (skipped) without one.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <string>

#include "execution/box_view.hpp"
#include "reshard/error.hpp"
#include "support/single_gpu_main.hpp"
#include "transforms/conversions.hpp"
#include "transforms/number_formats.hpp"

namespace reshard::execution {
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

// One quantization case: a tensor of `shape` and `dtype`, seen from `shift` elements past a
// 256-byte boundary (so the kernels' vector and element paths both run), and a block of it.
struct QuantizeCase {
  std::vector<std::int64_t> shape;
  Box block;
  DType dtype;
  std::int64_t shift;
};

std::string describe(const QuantizeCase& c) {
  return std::string(dtype_name(c.dtype)) + " block " + c.block.str() + " shift " +
         std::to_string(c.shift);
}

// Salted bf16 values, widened to float32 when asked (then with low mantissa bits set too).
std::vector<std::uint8_t> salted_tensor(std::size_t n, DType dtype, std::uint32_t seed) {
  const auto bf16 = salted_bf16(n, seed);
  std::vector<std::uint8_t> out(n * dtype_size(dtype));
  std::mt19937 rng(seed + 1);
  for (std::size_t i = 0; i < n; ++i) {
    if (dtype != DType::kFloat32) {  // bf16 bit patterns; as float16, other values as salty
      std::memcpy(out.data() + 2 * i, &bf16[i], 2);
    } else {
      std::uint32_t bits = static_cast<std::uint32_t>(bf16[i]) << 16;
      if ((bits & 0x7f800000u) != 0x7f800000u) bits |= rng() & 0xffff;
      std::memcpy(out.data() + 4 * i, &bits, 4);
    }
  }
  return out;
}

std::int64_t elements_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (std::int64_t d : shape) n *= d;
  return n;
}

// The views of an MX block and of its scales (one per 32 elements of the last dimension).
struct MxViews {
  BoxView data, scales;
};

constexpr MxScaleRounding kRoundings[] = {MxScaleRounding::kOcp, MxScaleRounding::kRoundUp,
                                          MxScaleRounding::kMegatron};

MxViews mx_views(const std::vector<std::int64_t>& shape, const Box& block) {
  std::vector<std::int64_t> scale_shape = shape;
  scale_shape.back() /= 32;
  Box scale_block = block;
  scale_block.offset[block.ndim - 1] /= 32;
  scale_block.extent[block.ndim - 1] /= 32;
  return {view_of(block, shape, false), view_of(scale_block, scale_shape, false)};
}

TEST(TransformKernels, MxQuantizeMatchesTheReferenceBitForBit) {
  const std::vector<QuantizeCase> cases = {
      {kShape, kBlock, DType::kBFloat16, 0},
      {kShape, kBlock, DType::kBFloat16, 1},  // no 16-byte loads
      {kShape, kBlock, DType::kFloat32, 0},
      {{3, 5, 96}, Box{3, {0, 1, 32}, {3, 4, 64}}, DType::kFloat32, 3},
      {{7, 608}, Box{2, {2, 64}, {5, 352}}, DType::kBFloat16, 0},  // rows not multiples of 256
      {kShape, kBlock, DType::kFloat16, 0},
      {{300, 32}, Box{2, {0, 0}, {300, 32}}, DType::kBFloat16, 0},  // a warp's tile spans 8 rows
      // Whole tensors, their last tile partly filled, aligned or not.
      {{129, 96}, Box{2, {0, 0}, {129, 96}}, DType::kFloat32, 4},
      {{129, 96}, Box{2, {0, 0}, {129, 96}}, DType::kFloat16, 8},
      {{1000, 64}, Box{2, {0, 0}, {1000, 64}}, DType::kBFloat16, 0},
      {{1000, 64}, Box{2, {0, 0}, {1000, 64}}, DType::kBFloat16, 4},  // 8-byte aligned
      {{4, 9, 160}, Box{3, {1, 0, 0}, {2, 9, 160}}, DType::kBFloat16, 0},
  };
  std::uint32_t seed = 7;
  for (const QuantizeCase& c : cases) {
    const std::size_t n = static_cast<std::size_t>(elements_of(c.shape));
    const std::size_t size = dtype_size(c.dtype);
    const auto src = salted_tensor(n + c.shift, c.dtype, seed++);
    const auto [v, sv] = mx_views(c.shape, c.block);
    DeviceCopy d_src(src.data(), src.size());
    void* shifted = static_cast<std::uint8_t*>(d_src.pointer) + c.shift * size;
    for (MxScaleRounding rounding : kRoundings) {
      std::vector<std::uint8_t> data(n, 0xab), scales(n / 32, 0xab);
      mx_quantize({{const_cast<std::uint8_t*>(src.data()) + c.shift * size, c.dtype, v},
                   {data.data(), DType::kFloat8E4M3, v},
                   {scales.data(), DType::kFloat8E8M0, sv},
                   rounding},
                  MemoryKind::kHost, nullptr);
      DeviceCopy d_data(data.size()), d_scales(scales.size());
      mx_quantize({{shifted, c.dtype, v},
                   {d_data.pointer, DType::kFloat8E4M3, v},
                   {d_scales.pointer, DType::kFloat8E8M0, sv},
                   rounding},
                  MemoryKind::kCuda, nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_EQ(d_data.download(), data) << describe(c) << " rounding " << int(rounding);
      EXPECT_EQ(d_scales.download(), scales) << describe(c) << " rounding " << int(rounding);
    }
  }
}

// Many jobs in one launch, as a refit queues them: random blocks (1-3 outer dimensions, rows of
// 32 to 1,000 elements, some of one row, some cut from a larger tensor) of one shared source, so
// warps walk across rows and jobs in every way the sizes allow.
// Every bf16 value under every scale a block can have (its largest element sets the scale): the
// kernel, which encodes with the GPU's FP8 conversion, against the host's integer arithmetic
// (itself checked against double arithmetic in the unit tests).
TEST(TransformKernels, MxEncodesEveryBf16UnderEveryScaleLikeTheReference) {
  std::vector<std::uint16_t> values;
  for (int e = -133; e <= 127; ++e) {                     // from the smallest subnormal maxima up
    const float amax = std::ldexp(2.0f - 1.0f / 128, e);  // the largest bf16 below 2^(e + 1)
    const std::uint16_t amax_bits = formats::float_to_bf16(amax);
    int in_block = 0;
    auto push = [&](std::uint16_t h) {
      if (in_block == 0) {
        values.push_back(amax_bits);
        in_block = 1;
      }
      values.push_back(h);
      in_block = (in_block + 1) % 32;
    };
    for (std::uint32_t h = 0; h < 0x10000; ++h) {
      const float v = formats::bf16_to_float(static_cast<std::uint16_t>(h));
      if (!std::isnan(v) && std::fabs(v) <= amax) push(static_cast<std::uint16_t>(h));
    }
    while (in_block != 0) push(0);
  }
  while (values.size() % 256 != 0) values.push_back(0);
  const auto rows = static_cast<std::int64_t>(values.size() / 256);
  const BoxView v = view_of(Box::whole({rows, 256}), {rows, 256}, false);
  const BoxView sv = view_of(Box::whole({rows, 8}), {rows, 8}, false);
  DeviceCopy d_src(values.data(), values.size() * 2);
  for (MxScaleRounding rounding : kRoundings) {
    std::vector<std::uint8_t> data(values.size(), 0xab), scales(values.size() / 32, 0xab);
    mx_quantize({{values.data(), DType::kBFloat16, v},
                 {data.data(), DType::kFloat8E4M3, v},
                 {scales.data(), DType::kFloat8E8M0, sv},
                 rounding},
                MemoryKind::kHost, nullptr);
    DeviceCopy d_data(data.size()), d_scales(scales.size());
    mx_quantize({{d_src.pointer, DType::kBFloat16, v},
                 {d_data.pointer, DType::kFloat8E4M3, v},
                 {d_scales.pointer, DType::kFloat8E8M0, sv},
                 rounding},
                MemoryKind::kCuda, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = d_data.download();
    const auto got_scales = d_scales.download();
    ASSERT_EQ(got_scales, scales) << "rounding " << int(rounding);
    for (std::size_t i = 0; i < values.size(); ++i) {
      ASSERT_EQ(got[i], data[i]) << "bf16 0x" << std::hex << values[i] << " in a block of scale 0x"
                                 << int{scales[i / 32]} << std::dec << ", rounding "
                                 << int(rounding);
    }
  }
}

TEST(TransformKernels, MxQueueOfManyJobsMatchesTheReferenceBitForBit) {
  std::mt19937 rng(31);
  struct Block {
    std::vector<std::int64_t> shape;
    Box box;
    std::size_t src_at, out_at, scale_at;  // element offsets in the shared buffers
    MxScaleRounding rounding;
    SwizzledScales swizzled;  // every other 2-D block's scales are swizzled
    std::size_t scale_bytes;
  };
  std::vector<Block> blocks;
  std::size_t src_total = 0, out_total = 0, scale_total = 0;
  for (int b = 0; b < 300; ++b) {
    const int dims = 1 + static_cast<int>(rng() % 3);
    std::vector<std::int64_t> shape(dims);
    Box box{dims, {}, {}};
    for (int d = 0; d < dims; ++d) {
      const bool last = d == dims - 1;
      shape[d] = last ? 32 * (1 + rng() % 32) : 1 + rng() % 6;
      const std::int64_t unit = last ? 32 : 1;
      const std::int64_t units = shape[d] / unit;
      const std::int64_t first = static_cast<std::int64_t>(rng() % units);
      box.offset[d] = first * unit;
      box.extent[d] = (1 + static_cast<std::int64_t>(rng() % (units - first))) * unit;
    }
    if (b % 7 == 0) box.extent[0] = 0;  // an empty block: no work items
    const auto n = static_cast<std::size_t>(elements_of(shape));
    SwizzledScales swizzled{};
    std::size_t scale_bytes = n / 32;
    if (dims == 2 && b % 2 == 0) {
      shape[0] = 1 + rng() % 300;  // more than one tile row
      box.extent[0] = 1 + static_cast<std::int64_t>(rng() % shape[0]);
      box.offset[0] = static_cast<std::int64_t>(rng() % (shape[0] - box.extent[0] + 1));
      swizzled = {box.offset[0], box.offset[1] / 32, (shape[1] / 32 + 3) / 4};
      scale_bytes =
          static_cast<std::size_t>(formats::swizzled_scale_bytes(shape[0], shape[1] / 32));
    }
    const auto elements = static_cast<std::size_t>(elements_of(shape));
    blocks.push_back(
        {shape, box, src_total, out_total, scale_total, kRoundings[b % 3], swizzled, scale_bytes});
    src_total += elements + 8;  // keeps every tensor 16-byte aligned
    out_total += elements;
    scale_total += scale_bytes;
  }
  const auto src = salted_tensor(src_total, DType::kBFloat16, 41);
  std::vector<std::uint8_t> data(out_total, 0xab), scales(scale_total, 0xab);
  DeviceCopy d_src(src.data(), src.size()), d_data(data.size()), d_scales(scales.size());
  ConversionQueue queue;
  for (const Block& block : blocks) {
    const auto [v, sv] = mx_views(block.shape, block.box);
    auto at = [](auto* base, std::size_t offset, std::size_t size) {
      return static_cast<void*>(reinterpret_cast<std::uint8_t*>(base) + offset * size);
    };
    mx_quantize({{at(const_cast<std::uint8_t*>(src.data()), block.src_at, 2), DType::kBFloat16, v},
                 {at(data.data(), block.out_at, 1), DType::kFloat8E4M3, v},
                 {at(scales.data(), block.scale_at, 1), DType::kFloat8E8M0, sv},
                 block.rounding,
                 block.swizzled},
                MemoryKind::kHost, nullptr);
    queue.mx_quantize({{at(d_src.pointer, block.src_at, 2), DType::kBFloat16, v},
                       {at(d_data.pointer, block.out_at, 1), DType::kFloat8E4M3, v},
                       {at(d_scales.pointer, block.scale_at, 1), DType::kFloat8E8M0, sv},
                       block.rounding,
                       block.swizzled},
                      Buffer::cuda(d_src.pointer, d_src.bytes, 0));
  }
  queue.flush(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_data = d_data.download(), got_scales = d_scales.download();
  for (const Block& block : blocks) {
    const auto n = static_cast<std::size_t>(elements_of(block.shape));
    ASSERT_TRUE(std::equal(data.begin() + block.out_at, data.begin() + block.out_at + n,
                           got_data.begin() + block.out_at))
        << "data of block " << block.box.str() << " of a tensor of " << block.shape.size()
        << " dims";
    ASSERT_TRUE(std::equal(scales.begin() + block.scale_at,
                           scales.begin() + block.scale_at + block.scale_bytes,
                           got_scales.begin() + block.scale_at))
        << "scales of block " << block.box.str()
        << (block.swizzled.col_tiles > 0 ? " (swizzled)" : "");
  }
}

// Swizzled scales in whole 128 x 128 tiles of the layout (their chunks write whole sectors) queued
// with blocks that are not (rows from 64, columns from block 2, a ragged last tile), from bfloat16
// and float32, in one launch per source type, against the host. (Full-size bfloat16 launches:
// LaunchesThatFillTheGpuMatchTheReference.)
TEST(TransformKernels, MxWholeTilesOfSwizzledScalesMatchTheReference) {
  struct Case {
    DType dtype;
    std::vector<std::int64_t> shape;
    Box box;
  };
  const std::vector<Case> cases = {
      {DType::kBFloat16, {256, 512}, {2, {0, 0}, {256, 512}}},       // whole tiles
      {DType::kBFloat16, {512, 1024}, {2, {128, 128}, {256, 512}}},  // whole tiles, inside
      {DType::kBFloat16, {384, 640}, {2, {64, 0}, {256, 640}}},      // rows from 64
      {DType::kBFloat16, {256, 1024}, {2, {0, 64}, {256, 512}}},     // columns from block 2
      {DType::kBFloat16, {200, 384}, {2, {0, 0}, {200, 384}}},       // a ragged last tile row
      {DType::kFloat32, {256, 384}, {2, {0, 0}, {256, 384}}},        // whole tiles
      {DType::kFloat32, {384, 512}, {2, {128, 128}, {256, 256}}},    // whole tiles, inside
      {DType::kFloat32, {256, 256}, {2, {0, 32}, {256, 128}}},       // columns from block 1
      // Enough float32 for the launch's full chunks (2 tiles; smaller launches take 1).
      {DType::kFloat32, {4352, 1024}, {2, {0, 0}, {4352, 1024}}},
  };
  for (const MxScaleRounding rounding : kRoundings) {
    for (const DType dtype : {DType::kBFloat16, DType::kFloat32}) {
      ConversionQueue queue;
      std::vector<std::vector<std::uint8_t>> want_data, want_scales;
      std::deque<DeviceCopy> sources, datas, scaleses;  // a deque: they stay where they are
      std::vector<const Case*> used;
      for (const Case& c : cases) {
        if (c.dtype != dtype) continue;
        const auto n = static_cast<std::size_t>(elements_of(c.shape));
        const auto src = salted_tensor(n, dtype, 53 + static_cast<std::uint32_t>(used.size()));
        const auto [v, sv] = mx_views(c.shape, c.box);
        const SwizzledScales swizzled{c.box.offset[0], c.box.offset[1] / 32,
                                      (c.shape[1] / 32 + 3) / 4};
        const auto scale_bytes =
            static_cast<std::size_t>(formats::swizzled_scale_bytes(c.shape[0], c.shape[1] / 32));
        want_data.emplace_back(n, 0xab);
        want_scales.emplace_back(scale_bytes, 0xab);
        mx_quantize({{const_cast<std::uint8_t*>(src.data()), dtype, v},
                     {want_data.back().data(), DType::kFloat8E4M3, v},
                     {want_scales.back().data(), DType::kFloat8E8M0, sv},
                     rounding,
                     swizzled},
                    MemoryKind::kHost, nullptr);
        sources.emplace_back(src.data(), src.size());
        datas.emplace_back(n);
        scaleses.emplace_back(scale_bytes);
        queue.mx_quantize({{sources.back().pointer, dtype, v},
                           {datas.back().pointer, DType::kFloat8E4M3, v},
                           {scaleses.back().pointer, DType::kFloat8E8M0, sv},
                           rounding,
                           swizzled},
                          Buffer::cuda(sources.back().pointer, sources.back().bytes, 0));
        used.push_back(&c);
      }
      queue.flush(nullptr);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      for (std::size_t i = 0; i < used.size(); ++i) {
        EXPECT_TRUE(datas[i].download() == want_data[i])
            << "data of " << used[i]->box.str() << " of " << dtype_name(dtype);
        EXPECT_TRUE(scaleses[i].download() == want_scales[i])
            << "swizzled scales of " << used[i]->box.str() << " of " << dtype_name(dtype);
      }
    }
  }
}

// Dense scale blocks scattered into swizzled scale matrices, many in one launch, against the
// host and against the layout's definition (cuBLAS's 128 x 4 tiles).
TEST(TransformKernels, SwizzleQueueMatchesTheLayoutByteForByte) {
  std::mt19937 rng(5);
  struct Case {
    std::int64_t rows, cols;  // of the scale matrix
    Box box;
    std::size_t src_at, dst_at;
  };
  std::vector<Case> cases;
  std::size_t src_total = 0, dst_total = 0;
  for (int c = 0; c < 200; ++c) {
    const std::int64_t rows = 1 + rng() % 400, cols = 1 + rng() % 40;
    Box box{2, {}, {}};
    box.extent[0] = 1 + static_cast<std::int64_t>(rng() % rows);
    box.extent[1] = 1 + static_cast<std::int64_t>(rng() % cols);
    box.offset[0] = static_cast<std::int64_t>(rng() % (rows - box.extent[0] + 1));
    box.offset[1] = static_cast<std::int64_t>(rng() % (cols - box.extent[1] + 1));
    cases.push_back({rows, cols, box, src_total, dst_total});
    src_total += static_cast<std::size_t>(box.elements());
    dst_total += static_cast<std::size_t>(formats::swizzled_scale_bytes(rows, cols));
  }
  std::vector<std::uint8_t> src(src_total);
  for (auto& byte : src) byte = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> host(dst_total, 0xab);
  DeviceCopy d_src(src.data(), src.size()), d_dst(host.size());
  ConversionQueue host_queue, gpu_queue;
  for (const Case& c : cases) {
    const SwizzledScales at{c.box.offset[0], c.box.offset[1], (c.cols + 3) / 4};
    host_queue.swizzle_scales(
        {src.data() + c.src_at, host.data() + c.dst_at, c.box.extent[0], c.box.extent[1], at},
        Buffer::host(host.data(), host.size()));
    gpu_queue.swizzle_scales({static_cast<const std::uint8_t*>(d_src.pointer) + c.src_at,
                              static_cast<std::uint8_t*>(d_dst.pointer) + c.dst_at, c.box.extent[0],
                              c.box.extent[1], at},
                             Buffer::cuda(d_dst.pointer, d_dst.bytes, 0));
  }
  gpu_queue.flush(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_dst.download(), host);
  for (const Case& c : cases) {  // the definition, written out
    const std::int64_t col_tiles = (c.cols + 3) / 4;
    for (std::int64_t r = 0; r < c.box.extent[0]; ++r) {
      for (std::int64_t k = 0; k < c.box.extent[1]; ++k) {
        const std::int64_t row = c.box.offset[0] + r, col = c.box.offset[1] + k;
        const std::int64_t tile = (row / 128) * col_tiles + col / 4;
        const std::int64_t in_tile = (row % 32) * 16 + (row % 128) / 32 * 4 + col % 4;
        ASSERT_EQ(host[c.dst_at + tile * 512 + in_tile],
                  src[c.src_at + static_cast<std::size_t>(r * c.box.extent[1] + k)]);
      }
    }
  }
}

TEST(TransformKernels, BlockQuantizeMatchesTheReferenceBitForBit) {
  // Whole matrices, so tiles include partial ones at the bottom edge (300 = 2 * 128 + 44) and,
  // in the last cases, at the right edge (300 columns, 44 of them in a ragged tile).
  const std::vector<QuantizeCase> cases = {
      {kShape, Box{3, {0, 0, 128}, {2, 300, 256}}, DType::kBFloat16, 0},
      {kShape, Box{3, {0, 0, 128}, {2, 300, 256}}, DType::kBFloat16, 1},
      {kShape, Box{3, {0, 0, 128}, {2, 300, 256}}, DType::kFloat32, 0},
      {{2, 300, 300}, Box{3, {0, 0, 0}, {2, 300, 300}}, DType::kBFloat16, 0},
      {{1, 200, 428}, Box{3, {0, 0, 128}, {1, 200, 300}}, DType::kFloat32, 2},
      {{2, 300, 300}, Box{3, {0, 0, 0}, {2, 300, 300}}, DType::kFloat16, 0},
      {{1, 130, 4}, Box{3, {0, 0, 0}, {1, 130, 4}}, DType::kBFloat16, 0},  // half-empty lanes
  };
  std::uint32_t seed = 11;
  for (const QuantizeCase& c : cases) {
    const std::size_t n = static_cast<std::size_t>(elements_of(c.shape));
    const std::size_t size = dtype_size(c.dtype);
    const auto src = salted_tensor(n + c.shift, c.dtype, seed++);
    const std::int64_t rows = c.shape[1];
    auto tiles_of = [](std::int64_t e) { return (e + 127) / 128; };
    const std::vector<std::int64_t> tile_shape = {c.shape[0], tiles_of(rows), tiles_of(c.shape[2])};
    const Box tiles{3,
                    {0, 0, c.block.offset[2] / 128},
                    {c.shape[0], tiles_of(rows), tiles_of(c.block.extent[2])}};
    const BoxView v = view_of(c.block, c.shape, false);
    const BoxView tv = view_of(tiles, tile_shape, false);
    const std::size_t tile_count = static_cast<std::size_t>(elements_of(tile_shape));
    std::vector<std::uint8_t> data(n, 0xab);
    std::vector<float> scales(tile_count, -1.0f);
    block_quantize({const_cast<std::uint8_t*>(src.data()) + c.shift * size, c.dtype, v}, rows,
                   {data.data(), DType::kFloat8E4M3, v}, {scales.data(), DType::kFloat32, tv},
                   MemoryKind::kHost, nullptr);
    DeviceCopy d_src(src.data(), src.size()), d_data(data.size()), d_scales(tile_count * 4);
    std::vector<float> minus_one(tile_count, -1.0f);
    cudaMemcpy(d_scales.pointer, minus_one.data(), tile_count * 4, cudaMemcpyHostToDevice);
    block_quantize({static_cast<std::uint8_t*>(d_src.pointer) + c.shift * size, c.dtype, v}, rows,
                   {d_data.pointer, DType::kFloat8E4M3, v}, {d_scales.pointer, DType::kFloat32, tv},
                   MemoryKind::kCuda, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(d_data.download(), data) << describe(c);
    std::vector<std::uint8_t> host_scales(tile_count * 4);
    std::memcpy(host_scales.data(), scales.data(), host_scales.size());
    EXPECT_EQ(d_scales.download(), host_scales) << describe(c);
  }
}

// Every bf16 magnitude from a tile's maximum down 24 binades (E4M3 resolves 17 below it), both
// signs, under tile maxima of every exponent (subnormal ones too, whose scales take the double
// path) with three mantissas each: the kernel multiplies by the scale's reciprocal where that
// rounds like the reference's division, and every rounding tie of E4M3 is among the values.
TEST(TransformKernels, BlockEncodesBf16UnderEveryScaleExponentLikeTheReference) {
  constexpr std::int64_t kCols = 128, kTile = 128 * kCols;
  std::mt19937 rng(59);
  std::vector<std::uint16_t> values;
  for (int e = -133; e <= 127; ++e) {
    for (int variant = 0; variant < 3; ++variant) {
      // The third maximum's significand a multiple of 7: its scale (maximum / 448) is exact,
      // and the kernel's bfloat16 path corrects its quotients instead of nudging them.
      const auto mantissa =
          static_cast<std::uint16_t>(variant == 2 ? 7 * (19 + rng() % 18) - 128 : rng() % 0x80);
      const std::uint16_t amax = e >= -126 ? static_cast<std::uint16_t>(((e + 127) << 7) | mantissa)
                                           : static_cast<std::uint16_t>(1u << (e + 133));
      const std::size_t tile_start = values.size();
      values.push_back(static_cast<std::uint16_t>(amax | (variant == 1 ? 0x8000 : 0)));
      const int lowest = std::max(0, amax - 24 * 128);
      for (int m = lowest; m <= amax; ++m) {
        values.push_back(static_cast<std::uint16_t>(m));
        values.push_back(static_cast<std::uint16_t>(m | 0x8000));
      }
      while (values.size() - tile_start < static_cast<std::size_t>(kTile)) {
        values.push_back(static_cast<std::uint16_t>((rng() % (amax + 1)) | (rng() % 2 << 15)));
      }
    }
  }
  const auto rows = static_cast<std::int64_t>(values.size()) / kCols;
  const std::int64_t tiles = rows / 128;
  const BoxView v = view_of(Box::whole({rows, kCols}), {rows, kCols}, false);
  const BoxView tv = view_of(Box::whole({tiles, 1}), {tiles, 1}, false);
  std::vector<std::uint8_t> data(values.size(), 0xab);
  std::vector<float> scales(static_cast<std::size_t>(tiles), -1.0f);
  block_quantize({values.data(), DType::kBFloat16, v}, rows, {data.data(), DType::kFloat8E4M3, v},
                 {scales.data(), DType::kFloat32, tv}, MemoryKind::kHost, nullptr);
  DeviceCopy d_src(values.data(), values.size() * 2), d_data(data.size()), d_scales(tiles * 4);
  block_quantize({d_src.pointer, DType::kBFloat16, v}, rows,
                 {d_data.pointer, DType::kFloat8E4M3, v}, {d_scales.pointer, DType::kFloat32, tv},
                 MemoryKind::kCuda, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d_data.download();
  for (std::size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(got[i], data[i]) << "bf16 0x" << std::hex << values[i] << " in a tile of scale "
                               << scales[i / kTile];
  }
  std::vector<std::uint8_t> host_scales(scales.size() * 4);
  std::memcpy(host_scales.data(), scales.data(), host_scales.size());
  EXPECT_EQ(d_scales.download(), host_scales);
}

// Quotients within six ulps of E4M3 rounding ties in every tile, where a quotient rounded to float
// (the kernel multiplies by the reciprocal: 2 ulps off at most) and the exact one can part: the
// GPU's codes must be the reference's.
TEST(TransformKernels, BlockQuantizeMatchesTheReferenceNearRoundingTies) {
  constexpr std::int64_t kTiles = 64;
  const std::int64_t rows = 128 * kTiles, cols = 128;
  std::mt19937 rng(53);
  std::uniform_real_distribution<float> unit(0.0f, 1.0f);
  std::vector<float> src(static_cast<std::size_t>(rows * cols));
  for (std::int64_t tile = 0; tile < kTiles; ++tile) {
    const float amax = std::ldexp(1.0f + unit(rng), static_cast<int>(rng() % 41) - 20);
    const double scale = formats::block_scale(amax);
    for (std::int64_t i = 0; i < 128 * cols; ++i) {
      float value = amax;
      if (i > 0) {
        // A tie between two E4M3 codes up to 224 (half the tile's range), subnormal ones too.
        const auto code = static_cast<std::uint8_t>(rng() % 0x76);
        const double tie = (formats::e4m3_to_float(code) + formats::e4m3_to_float(code + 1)) / 2.0;
        value = static_cast<float>(tie * scale);
        for (int step = static_cast<int>(rng() % 13) - 6; step != 0; step += step > 0 ? -1 : 1) {
          value = std::nextafter(value, step > 0 ? 1e30f : -1e30f);
        }
        if (rng() % 2 == 0) value = -value;
        if (rng() % 8 == 0) value = amax * (2.0f * unit(rng) - 1.0f);
      }
      src[static_cast<std::size_t>(tile * 128 * cols + i)] = value;
    }
  }
  const Box whole = Box::whole({rows, cols});
  const BoxView v = view_of(whole, {rows, cols}, false);
  const BoxView tv = view_of(Box::whole({kTiles, 1}), {kTiles, 1}, false);
  std::vector<std::uint8_t> data(src.size(), 0xab);
  std::vector<float> scales(kTiles, -1.0f);
  block_quantize({src.data(), DType::kFloat32, v}, rows, {data.data(), DType::kFloat8E4M3, v},
                 {scales.data(), DType::kFloat32, tv}, MemoryKind::kHost, nullptr);
  DeviceCopy d_src(src.data(), src.size() * 4), d_data(data.size()), d_scales(kTiles * 4);
  block_quantize({d_src.pointer, DType::kFloat32, v}, rows, {d_data.pointer, DType::kFloat8E4M3, v},
                 {d_scales.pointer, DType::kFloat32, tv}, MemoryKind::kCuda, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d_data.download();
  std::size_t wrong = 0;
  for (std::size_t i = 0; i < data.size(); ++i) {
    if (got[i] != data[i] && wrong++ < 5) {
      ADD_FAILURE() << "element " << i << " = " << src[i] << ": GPU 0x" << std::hex << int{got[i]}
                    << ", reference 0x" << int{data[i]};
    }
  }
  EXPECT_EQ(wrong, 0u);
  std::vector<std::uint8_t> host_scales(kTiles * 4);
  std::memcpy(host_scales.data(), scales.data(), host_scales.size());
  EXPECT_EQ(d_scales.download(), host_scales);
}

// Launches large enough to fill the GPU with warps take the kernels' full chunks (smaller MXFP8
// and float32 cast launches take fewer tiles, as every other test here runs them): MXFP8 (scales
// row-major and swizzled) and casts both ways over a column block of a bf16 matrix holding twice
// the chunks the GPU's warps take at once.
TEST(TransformKernels, LaunchesThatFillTheGpuMatchTheReference) {
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  constexpr std::int64_t kCols = 4096, kBlockCols = 3968;           // rows of 7936 bytes, 256 apart
  const std::int64_t elements = 2 * std::int64_t{sms} * 32 * 2048;  // 4 KiB chunks of bf16
  const std::int64_t rows = (elements + kBlockCols - 1) / kBlockCols;
  const std::vector<std::int64_t> shape = {rows, kCols};
  const Box block{2, {0, 64}, {rows, kBlockCols}};
  const auto n = static_cast<std::size_t>(rows * kCols);
  const auto src = salted_bf16(n, 17);
  DeviceCopy d_src(src.data(), n * 2);

  const auto [v, sv] = mx_views(shape, block);
  std::vector<std::uint8_t> data(n, 0xab), scales(n / 32, 0xab);
  mx_quantize({{const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, v},
               {data.data(), DType::kFloat8E4M3, v},
               {scales.data(), DType::kFloat8E8M0, sv},
               MxScaleRounding::kOcp},
              MemoryKind::kHost, nullptr);
  DeviceCopy d_data(data.size()), d_scales(scales.size());
  mx_quantize({{d_src.pointer, DType::kBFloat16, v},
               {d_data.pointer, DType::kFloat8E4M3, v},
               {d_scales.pointer, DType::kFloat8E8M0, sv},
               MxScaleRounding::kOcp},
              MemoryKind::kCuda, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(d_data.download() == data);
  EXPECT_TRUE(d_scales.download() == scales);

  // Again with Megatron-LM's scales: its rounding, swizzled, on the host and on the GPU into
  // scales of the whole matrix.
  const auto swizzled_bytes =
      static_cast<std::size_t>(formats::swizzled_scale_bytes(rows, kCols / 32));
  const auto quantize_swizzled = [&](const Box& box) {
    const auto [bv, bsv] = mx_views(shape, box);
    const SwizzledScales swizzled{box.offset[0], box.offset[1] / 32, (kCols / 32 + 3) / 4};
    std::vector<std::uint8_t> want(swizzled_bytes, 0xab);
    mx_quantize({{const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, bv},
                 {data.data(), DType::kFloat8E4M3, bv},
                 {want.data(), DType::kFloat8E8M0, bsv},
                 MxScaleRounding::kMegatron,
                 swizzled},
                MemoryKind::kHost, nullptr);
    DeviceCopy got(swizzled_bytes);
    mx_quantize({{d_src.pointer, DType::kBFloat16, bv},
                 {d_data.pointer, DType::kFloat8E4M3, bv},
                 {got.pointer, DType::kFloat8E8M0, bsv},
                 MxScaleRounding::kMegatron,
                 swizzled},
                MemoryKind::kCuda, nullptr);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(d_data.download() == data) << box.str();
    EXPECT_TRUE(got.download() == want) << box.str();
  };
  quantize_swizzled(block);  // the block's first scale column is 2
  // A block of whole 128 x 128 tiles of that layout (rows from 0 in 128s, columns from 128): its
  // chunks write whole sectors of scales.
  quantize_swizzled(Box{2, {0, 128}, {rows / 128 * 128, 3840}});

  const BoxView cv = view_of(block, shape, false);
  std::vector<std::uint8_t> wide(n * 4, 0xab), back(n * 2, 0xab);
  convert_block({const_cast<std::uint16_t*>(src.data()), DType::kBFloat16, cv},
                {wide.data(), DType::kFloat32, cv}, MemoryKind::kHost, nullptr);
  convert_block({wide.data(), DType::kFloat32, cv}, {back.data(), DType::kBFloat16, cv},
                MemoryKind::kHost, nullptr);
  DeviceCopy d_wide(n * 4), d_back(n * 2);
  convert_block({d_src.pointer, DType::kBFloat16, cv}, {d_wide.pointer, DType::kFloat32, cv},
                MemoryKind::kCuda, nullptr);
  convert_block({d_wide.pointer, DType::kFloat32, cv}, {d_back.pointer, DType::kBFloat16, cv},
                MemoryKind::kCuda, nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_TRUE(d_wide.download() == wide);
  EXPECT_TRUE(d_back.download() == back);
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

// Widening casts whose rows are long enough for warp-wide stores (256 and more elements), dense
// and as a column block, into float32 destinations 16-byte aligned and 4 bytes past that (the
// warp-wide path must leave those to the lanes' own stores), from bfloat16 and float16.
TEST(TransformKernels, WideningCastsMatchTheReferenceAtAnyDestinationAlignment) {
  const std::vector<std::int64_t> shape = {96, 1024};
  const auto n = static_cast<std::size_t>(elements_of(shape));
  for (const DType from : {DType::kBFloat16, DType::kFloat16}) {
    const auto src = salted_tensor(n, from, 61);
    DeviceCopy d_src(src.data(), src.size());
    for (const Box& box : {Box{2, {0, 0}, {96, 1024}}, Box{2, {8, 256}, {80, 512}}}) {
      const BoxView v = view_of(box, shape, false);
      for (const std::size_t skew : {std::size_t{0}, std::size_t{4}}) {
        std::vector<std::uint8_t> want(n * 4 + skew, 0xab);
        convert_block({const_cast<std::uint8_t*>(src.data()), from, v},
                      {want.data() + skew, DType::kFloat32, v}, MemoryKind::kHost, nullptr);
        DeviceCopy d_out(want.size());
        convert_block({d_src.pointer, from, v},
                      {static_cast<std::uint8_t*>(d_out.pointer) + skew, DType::kFloat32, v},
                      MemoryKind::kCuda, nullptr);
        ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
        EXPECT_TRUE(d_out.download() == want)
            << dtype_name(from) << " -> float32, block " << box.str() << ", destination " << skew
            << " bytes past 16-byte alignment";
      }
    }
  }
}

// Many casts in one flush, as a refit queues them: every pair of float32, bfloat16 and float16,
// blocks of 1-3 dimensions with rows of 1 to 300 elements (most not a multiple of 8) cut from
// larger tensors, sources and destinations at any element offset, so lanes take the vector and
// the element paths and tiles run across rows and jobs.
TEST(TransformKernels, CastQueueOfManyJobsMatchesTheReferenceBitForBit) {
  std::mt19937 rng(57);
  const DType kinds[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16};
  struct Block {
    std::vector<std::int64_t> shape;
    Box box;
    DType from, to;
    std::size_t src_at, dst_at;  // byte offsets in the shared buffers
  };
  std::vector<Block> blocks;
  std::size_t src_total = 0, dst_total = 0;
  for (int b = 0; b < 400; ++b) {
    const int dims = 1 + static_cast<int>(rng() % 3);
    std::vector<std::int64_t> shape(dims);
    Box box{dims, {}, {}};
    for (int d = 0; d < dims; ++d) {
      shape[d] = d == dims - 1 ? 1 + rng() % 300 : 1 + rng() % 6;
      box.offset[d] = static_cast<std::int64_t>(rng() % shape[d]);
      box.extent[d] = 1 + static_cast<std::int64_t>(rng() % (shape[d] - box.offset[d]));
    }
    const DType from = kinds[rng() % 3], to = kinds[rng() % 3];
    const auto n = static_cast<std::size_t>(elements_of(shape));
    blocks.push_back({shape, box, from, to, src_total + (rng() % 4) * dtype_size(from),
                      dst_total + (rng() % 4) * dtype_size(to)});
    src_total += (n + 4) * 4;
    dst_total += (n + 4) * 4;
  }
  // Salted bf16 bit patterns, widened or reinterpreted per block's source type.
  const auto bits = salted_tensor(src_total / 4, DType::kFloat32, 61);
  std::vector<std::uint8_t> want(dst_total, 0xab);
  DeviceCopy d_src(bits.data(), bits.size()), d_dst(dst_total);
  ConversionQueue queue;
  for (const Block& block : blocks) {
    const BoxView v = view_of(block.box, block.shape, false);
    auto* src = const_cast<std::uint8_t*>(bits.data()) + block.src_at;
    convert_block({src, block.from, v}, {want.data() + block.dst_at, block.to, v},
                  MemoryKind::kHost, nullptr);
    queue.convert({{static_cast<std::uint8_t*>(d_src.pointer) + block.src_at, block.from, v},
                   {static_cast<std::uint8_t*>(d_dst.pointer) + block.dst_at, block.to, v}},
                  Buffer::cuda(d_src.pointer, d_src.bytes, 0));
  }
  queue.flush(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = d_dst.download();
  for (const Block& block : blocks) {
    const auto bytes = static_cast<std::size_t>(elements_of(block.shape)) * dtype_size(block.to);
    ASSERT_TRUE(std::equal(want.begin() + block.dst_at, want.begin() + block.dst_at + bytes,
                           got.begin() + block.dst_at))
        << dtype_name(block.from) << " -> " << dtype_name(block.to) << " of block "
        << block.box.str();
  }
}

// A GPU job the kernels cannot take is refused when it is queued, naming the dtype, and leaves
// nothing queued: the flush after it runs the other jobs alone.
TEST(TransformKernels, QueueRefusesAGpuCastOfADtypeTheKernelsLack) {
  const Box box{2, {0, 0}, {4, 64}};
  const std::vector<std::int64_t> shape = {4, 64};
  const BoxView v = view_of(box, shape, false);
  const auto values = salted_bf16(256, 71);
  std::vector<std::uint8_t> want(1024, 0xab);
  convert_block({const_cast<std::uint16_t*>(values.data()), DType::kBFloat16, v},
                {want.data(), DType::kFloat32, v}, MemoryKind::kHost, nullptr);
  DeviceCopy d_src(values.data(), values.size() * 2), d_dst(1024);
  const Buffer memory = Buffer::cuda(d_src.pointer, d_src.bytes, 0);
  ConversionQueue queue;
  for (const DType odd : {DType::kFloat8E4M3, DType::kInt32}) {
    try {
      queue.convert({{d_src.pointer, DType::kBFloat16, v}, {d_dst.pointer, odd, v}}, memory);
      FAIL() << "a GPU cast to " << dtype_name(odd) << " was queued";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kUnsupported);
      EXPECT_NE(std::string(e.what()).find(dtype_name(odd)), std::string::npos) << e.what();
    }
  }
  queue.convert({{d_src.pointer, DType::kBFloat16, v}, {d_dst.pointer, DType::kFloat32, v}},
                memory);
  queue.flush(nullptr);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_dst.download(), want);
}

// Packs (a block of a tensor into a dense buffer) and unpacks, many in one flush as a refit queues
// them: blocks of 1-4 dimensions with rows of 1 to 2,000 bytes (short rows share a warp, long ones
// are split), elements of 1, 2 and 4 bytes, at any byte offset, against the host's copies.
TEST(TransformKernels, PacksAndUnpacksMatchTheHostByteForByte) {
  std::mt19937 rng(71);
  struct Block {
    std::vector<std::int64_t> shape;
    Box box;
    std::size_t element, tensor_at, dense_at;  // byte offsets in the shared buffers
  };
  std::vector<Block> blocks;
  std::size_t tensor_total = 0, dense_total = 0;
  for (int b = 0; b < 600; ++b) {
    const int dims = 1 + static_cast<int>(rng() % 4);
    const std::size_t element = std::size_t{1} << (rng() % 3);
    std::vector<std::int64_t> shape(dims);
    Box box{dims, {}, {}};
    for (int d = 0; d < dims; ++d) {
      shape[d] = d == dims - 1 ? 1 + rng() % (2000 / element) : 1 + rng() % 8;
      box.offset[d] = static_cast<std::int64_t>(rng() % shape[d]);
      box.extent[d] = 1 + static_cast<std::int64_t>(rng() % (shape[d] - box.offset[d]));
      if (rng() % 3 == 0) box.offset[d] = 0, box.extent[d] = shape[d];
    }
    const auto n = static_cast<std::size_t>(elements_of(shape)) * element;
    blocks.push_back({shape, box, element, tensor_total + (rng() % 2 ? 0 : rng() % 16),
                      dense_total + (rng() % 2 ? 0 : rng() % 16)});
    tensor_total += n + 32;
    dense_total += n + 32;
  }
  std::vector<std::uint8_t> tensors(tensor_total), dense(dense_total, 0xab);
  for (auto& byte : tensors) byte = static_cast<std::uint8_t>(rng());
  std::vector<std::uint8_t> unpacked(tensor_total, 0xcd);
  DeviceCopy d_tensors(tensors.data(), tensor_total), d_dense(dense_total),
      d_unpacked(unpacked.data(), tensor_total);
  ConversionQueue host_queue, queue;
  const auto host = [](void* data, std::size_t bytes) { return Buffer::host(data, bytes); };
  const auto gpu = [](void* data, std::size_t bytes) { return Buffer::cuda(data, bytes, 0); };
  // Pack every block into the dense buffer, then unpack it into a second tensor buffer.
  for (bool unpacking : {false, true}) {
    for (const Block& block : blocks) {
      const BoxView v = view_of(block.box, block.shape, true);
      const std::size_t bytes = static_cast<std::size_t>(block.box.elements()) * block.element;
      if (!unpacking) {
        host_queue.pack(host(tensors.data() + block.tensor_at, 1), v, block.element,
                        host(dense.data() + block.dense_at, bytes));
        queue.pack(gpu(static_cast<std::uint8_t*>(d_tensors.pointer) + block.tensor_at, 1), v,
                   block.element,
                   gpu(static_cast<std::uint8_t*>(d_dense.pointer) + block.dense_at, bytes));
      } else {
        host_queue.unpack(host(dense.data() + block.dense_at, bytes),
                          host(unpacked.data() + block.tensor_at, 1), v, block.element);
        queue.unpack(gpu(static_cast<std::uint8_t*>(d_dense.pointer) + block.dense_at, bytes),
                     gpu(static_cast<std::uint8_t*>(d_unpacked.pointer) + block.tensor_at, 1), v,
                     block.element);
      }
    }
    host_queue.flush(nullptr);
    queue.flush(nullptr);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(d_dense.download(), dense);
  EXPECT_EQ(d_unpacked.download(), unpacked);
  EXPECT_NE(std::count(dense.begin(), dense.end(), 0xab), static_cast<long>(dense.size()));
}

}  // namespace
}  // namespace reshard::execution

int main(int argc, char** argv) {
  return reshard::testing_support::run_single_gpu_tests(argc, argv);
}

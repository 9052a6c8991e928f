// What the built-in transforms tell a caller about the destination tensors they write.
#include "reshard/transform.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "reshard/error.hpp"
#include "transforms/number_formats.hpp"

namespace reshard {
namespace {

TEST(TransformScales, Mxfp8NeedsOneE8m0ScalePerThirtyTwoElementsOfTheLastDimension) {
  for (QuantizeSide side : {QuantizeSide::kSender, QuantizeSide::kReceiver}) {
    const auto mx = make_mxfp8_transform(side, MxScaleRounding::kOcp);
    const auto scale = mx->destination_scale({8, 96, 256});
    ASSERT_TRUE(scale.has_value());
    EXPECT_EQ(scale->dtype, DType::kFloat8E8M0);
    EXPECT_EQ(scale->shape, (std::vector<std::int64_t>{8, 96, 8}));
    EXPECT_EQ(scale->bytes(), 8u * 96 * 8);
  }
}

TEST(TransformScales, BlockFp8NeedsOneFloatPerTileOfEachMatrixWithPartialTilesCounted) {
  const auto block = make_fp8_block_transform(QuantizeSide::kSender);
  const auto matrix = block->destination_scale({300, 260});
  ASSERT_TRUE(matrix.has_value());
  EXPECT_EQ(matrix->dtype, DType::kFloat32);
  EXPECT_EQ(matrix->shape, (std::vector<std::int64_t>{3, 3}));
  EXPECT_EQ(matrix->bytes(), 9u * 4);
  const auto experts = block->destination_scale({4, 128, 768});
  ASSERT_TRUE(experts.has_value());
  EXPECT_EQ(experts->shape, (std::vector<std::int64_t>{4, 1, 6}));
  EXPECT_EQ(experts->bytes(), 24u * 4);
}

TEST(TransformScales, CastsNeedNoScales) {
  EXPECT_FALSE(make_cast_transform(DType::kFloat32)->destination_scale({4, 4}).has_value());
}

TEST(TransformScales, ShapesAFormatCannotTakeAreRefusedNamingTheProblem) {
  const auto mx = make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kOcp);
  const auto block = make_fp8_block_transform(QuantizeSide::kSender);
  auto message = [](const auto& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      return e.what();
    }
    return "no error";
  };
  EXPECT_NE(message([&] { mx->destination_scale({4, 48}); }).find("multiple of 32"),
            std::string::npos);
  EXPECT_NE(message([&] { block->destination_scale({256}); }).find("2 or more dimensions"),
            std::string::npos);
  EXPECT_NE(message([&] { block->destination_scale({-1, 128}); }).find("negative"),
            std::string::npos);
}

// A local op (source and destination on this rank) of a [rows, cols] bf16 parameter: the block
// at rows [r0, r0 + nr), cols [c0, c0 + nc), from a source tensor holding the whole parameter to
// a destination tensor holding its columns from `dst_col0` on. Both slices are strided, with
// different row strides.
struct LocalOp {
  ParamSpec param;
  TransferOp op;
  std::vector<std::int64_t> src_shape, dst_shape;
  std::vector<std::uint16_t> src;
  std::vector<std::uint8_t> dst;

  LocalOp(std::int64_t rows, std::int64_t cols, std::int64_t r0, std::int64_t nr, std::int64_t c0,
          std::int64_t nc, std::int64_t dst_col0)
      : param{"w", {rows, cols}, DType::kBFloat16},
        src_shape{rows, cols},
        dst_shape{rows, cols - dst_col0},
        src(rows * cols),
        dst(rows * (cols - dst_col0), 0xcd) {
    op.region = {2, {r0, c0}, {nr, nc}};
    op.src_at = {r0, c0};
    op.dst_at = {r0, c0 - dst_col0};
    op.bytes = static_cast<std::uint64_t>(nr * nc * 2);
    for (std::size_t i = 0; i < src.size(); ++i) {
      const int exponent = static_cast<int>(i * 7 % 23) - 11;
      src[i] =
          formats::float_to_bf16(std::ldexp(static_cast<float>(i % 97) / 50.0f - 0.9f, exponent));
    }
  }
  OpSlice from() const { return {param, op, op.src_box(), src_shape}; }
  OpSlice to() const { return {param, op, op.dst_box(), dst_shape}; }
  LocalTensor source() { return {Buffer::host(src.data(), src.size() * 2), DType::kBFloat16, {}}; }
  LocalTensor destination(std::vector<std::uint8_t>& scale) {
    return {Buffer::host(dst.data(), dst.size()), DType::kFloat8E4M3,
            Buffer::host(scale.data(), scale.size())};
  }
  // The region's elements, dense.
  std::vector<std::uint16_t> region() const {
    std::vector<std::uint16_t> out;
    for (std::int64_t r = 0; r < op.region.extent[0]; ++r) {
      const std::uint16_t* row = src.data() + (op.region.offset[0] + r) * param.shape[1];
      out.insert(out.end(), row + op.region.offset[1],
                 row + op.region.offset[1] + op.region.extent[1]);
    }
    return out;
  }
  // Every destination byte outside the op's block still holds the fill.
  std::size_t written_outside() const {
    std::size_t n = 0;
    for (std::int64_t r = 0; r < dst_shape[0]; ++r) {
      for (std::int64_t c = 0; c < dst_shape[1]; ++c) {
        const bool inside = r >= op.dst_at[0] && r < op.dst_at[0] + op.region.extent[0] &&
                            c >= op.dst_at[1] && c < op.dst_at[1] + op.region.extent[1];
        if (!inside && dst[r * dst_shape[1] + c] != 0xcd) ++n;
      }
    }
    return n;
  }
};

TEST(LocalConversion, Mxfp8OnArrivalQuantizesALocalOpStraightIntoTheDestination) {
  LocalOp local(64, 256, 8, 40, 96, 64, 64);
  std::vector<std::uint8_t> scale(64 * 192 / 32, 0xcd);
  const auto mx = make_mxfp8_transform(QuantizeSide::kReceiver, MxScaleRounding::kOcp);
  LocalTensor src = local.source(), dst = local.destination(scale);
  ASSERT_TRUE(mx->converts_locally(local.from(), src, local.to(), dst));
  mx->convert_local(local.from(), src, local.to(), dst, nullptr);
  mx->flush(nullptr);

  const std::vector<std::uint16_t> region = local.region();
  std::vector<std::uint8_t> want(region.size()), want_scale(region.size() / 32);
  reference_mxfp8_quantize(region.data(), 40, 64, MxScaleRounding::kOcp, want.data(),
                           want_scale.data());
  for (std::int64_t r = 0; r < 40; ++r) {
    for (std::int64_t c = 0; c < 64; ++c) {
      ASSERT_EQ(local.dst[(8 + r) * 192 + 32 + c], want[r * 64 + c]) << r << "," << c;
    }
    for (std::int64_t b = 0; b < 2; ++b) {
      ASSERT_EQ(scale[(8 + r) * 6 + 1 + b], want_scale[r * 2 + b]) << r << "," << b;
    }
  }
  EXPECT_EQ(local.written_outside(), 0u);
  std::size_t scales_written = 0;
  for (std::uint8_t v : scale) scales_written += v != 0xcd;
  EXPECT_LE(scales_written, 40u * 2);
}

TEST(LocalConversion, BlockFp8OnArrivalQuantizesALocalOpStraightIntoTheDestination) {
  LocalOp local(256, 384, 128, 128, 128, 128, 128);
  std::vector<std::uint8_t> scale(2 * 2 * sizeof(float), 0xcd);
  const auto block = make_fp8_block_transform(QuantizeSide::kReceiver);
  LocalTensor src = local.source(), dst = local.destination(scale);
  ASSERT_TRUE(block->converts_locally(local.from(), src, local.to(), dst));
  block->convert_local(local.from(), src, local.to(), dst, nullptr);
  block->flush(nullptr);

  const std::vector<std::uint16_t> region = local.region();
  std::vector<std::uint8_t> want(region.size());
  float want_scale = 0;
  reference_fp8_block_quantize(region.data(), 128, 128, want.data(), &want_scale);
  for (std::int64_t r = 0; r < 128; ++r) {
    for (std::int64_t c = 0; c < 128; ++c) {
      ASSERT_EQ(local.dst[(128 + r) * 256 + c], want[r * 128 + c]) << r << "," << c;
    }
  }
  float got_scale;
  std::memcpy(&got_scale, scale.data() + 2 * sizeof(float), sizeof(float));  // tile (1, 0)
  EXPECT_EQ(got_scale, want_scale);
  EXPECT_EQ(local.written_outside(), 0u);
}

TEST(LocalConversion, CastsConvertALocalOpStraightIntoTheDestinationWhereTheWireCannotRound) {
  LocalOp local(64, 256, 8, 40, 96, 64, 64);
  std::vector<float> wide(64 * 192, -1.0f);
  LocalTensor src = local.source();
  LocalTensor dst{Buffer::host(wide.data(), wide.size() * 4), DType::kFloat32, {}};
  // bf16 -> fp32 with either dtype on the wire: the bits the wire would give.
  for (DType wire : {DType::kBFloat16, DType::kFloat32}) {
    const auto cast = make_cast_transform(wire);
    ASSERT_TRUE(cast->converts_locally(local.from(), src, local.to(), dst)) << cast->name();
    cast->convert_local(local.from(), src, local.to(), dst, nullptr);
    cast->flush(nullptr);
    const std::vector<std::uint16_t> region = local.region();
    for (std::int64_t r = 0; r < 40; ++r) {
      for (std::int64_t c = 0; c < 64; ++c) {
        ASSERT_EQ(wide[(8 + r) * 192 + 32 + c], formats::bf16_to_float(region[r * 64 + c]))
            << cast->name() << " " << r << "," << c;
      }
    }
    std::size_t outside = 0;
    for (std::int64_t r = 0; r < 64; ++r) {
      for (std::int64_t c = 0; c < 192; ++c) {
        const bool inside = r >= 8 && r < 48 && c >= 32 && c < 96;
        if (!inside && wide[r * 192 + c] != -1.0f) ++outside;
      }
    }
    EXPECT_EQ(outside, 0u);
  }
  // fp32 -> bf16 -> fp32 rounds on the wire, and bf16 -> bf16 is a plain copy: both travel.
  LocalTensor fp32_src{Buffer::host(wide.data(), wide.size() * 4), DType::kFloat32, {}};
  EXPECT_FALSE(make_cast_transform(DType::kBFloat16)
                   ->converts_locally(local.from(), fp32_src, local.to(), dst));
  LocalTensor bf16_dst{Buffer::host(local.dst.data(), local.dst.size()), DType::kBFloat16, {}};
  EXPECT_FALSE(make_cast_transform(DType::kFloat32)
                   ->converts_locally(local.from(), src, local.to(), bf16_dst));
}

// The public hook cannot know whether replicas receive the same slice, and answers as if they
// did; the executor asks the built-in transforms knowing it (reshard_plan_tests count the bytes
// converted in place).
TEST(LocalConversion, SenderQuantizationKeepsTheWireAndSoDoOpsAcrossMemories) {
  LocalOp local(64, 256, 0, 64, 0, 64, 0);
  std::vector<std::uint8_t> scale(64 * 256 / 32);
  LocalTensor src = local.source(), dst = local.destination(scale);
  for (const auto& transform : {make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kOcp),
                                make_fp8_block_transform(QuantizeSide::kSender)}) {
    EXPECT_FALSE(transform->converts_locally(local.from(), src, local.to(), dst))
        << transform->name();
  }
  // A destination on a GPU (never dereferenced here) and a source on the host: the op travels.
  LocalTensor gpu_dst = dst;
  gpu_dst.data = Buffer::cuda(dst.data.data, dst.data.bytes, 0);
  gpu_dst.scale = Buffer::cuda(dst.scale.data, dst.scale.bytes, 0);
  EXPECT_FALSE(make_mxfp8_transform(QuantizeSide::kReceiver, MxScaleRounding::kOcp)
                   ->converts_locally(local.from(), src, local.to(), gpu_dst));
  std::vector<float> wide(64 * 256);
  LocalTensor gpu_wide{Buffer::cuda(wide.data(), wide.size() * 4, 0), DType::kFloat32, {}};
  EXPECT_FALSE(make_cast_transform(DType::kBFloat16)
                   ->converts_locally(local.from(), src, local.to(), gpu_wide));
}

TEST(LocalConversion, BadLocalOpsAreRefusedNamingTheProblemBeforeAnyConversion) {
  const auto mx = make_mxfp8_transform(QuantizeSide::kReceiver, MxScaleRounding::kOcp);
  auto refusal = [&](LocalOp& local, LocalTensor src, LocalTensor dst) -> std::string {
    try {
      mx->converts_locally(local.from(), src, local.to(), dst);
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_NE(std::string(e.what()).find("'w'"), std::string::npos) << e.what();
      return e.what();
    }
    return "no error";
  };
  LocalOp local(64, 256, 0, 64, 0, 64, 0);
  std::vector<std::uint8_t> scale(64 * 256 / 32);
  const std::vector<std::uint8_t> untouched = local.dst;

  LocalTensor wrong_dtype = local.destination(scale);
  wrong_dtype.dtype = DType::kBFloat16;
  EXPECT_NE(refusal(local, local.source(), wrong_dtype).find("float8_e4m3fn"), std::string::npos);

  LocalTensor no_scale = local.destination(scale);
  no_scale.scale = {};
  EXPECT_NE(refusal(local, local.source(), no_scale).find("scale buffer"), std::string::npos);

  LocalTensor fp32_source = local.source();
  fp32_source.dtype = DType::kFloat32;
  EXPECT_NE(refusal(local, fp32_source, local.destination(scale)).find("parameter's dtype"),
            std::string::npos);

  LocalOp misaligned(64, 256, 0, 64, 16, 64, 0);
  EXPECT_NE(refusal(misaligned, misaligned.source(), misaligned.destination(scale))
                .find("multiples of 32"),
            std::string::npos);
  EXPECT_EQ(local.dst, untouched);
}

}  // namespace
}  // namespace reshard

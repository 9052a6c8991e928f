// What the built-in transforms tell a caller about the destination tensors they write.
#include "reshard/transform.hpp"

#include <gtest/gtest.h>

#include "reshard/error.hpp"

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
  EXPECT_NE(message([&] {
              mx->destination_scale({4, 48});
            }).find("multiple of 32"),
            std::string::npos);
  EXPECT_NE(message([&] { block->destination_scale({256}); }).find("2 or more dimensions"),
            std::string::npos);
  EXPECT_NE(message([&] {
              block->destination_scale({-1, 128});
            }).find("negative"),
            std::string::npos);
}

}  // namespace
}  // namespace reshard

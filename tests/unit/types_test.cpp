#include "reshard/types.hpp"

#include <gtest/gtest.h>

#include <random>
#include <vector>

#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard {
namespace {

TEST(Types, AnErrorNamesEachTaskOnceInTheOrderGiven) {
  const Error error(ErrorCode::kValidation, "x", {7, 3, 7, 9, 3, 3});
  EXPECT_EQ(error.tasks(), (std::vector<std::uint64_t>{7, 3, 9}));
}

TEST(Types, ParsesByteCounts) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("4KiB"), 4096u);
  EXPECT_EQ(parse_bytes("1.5 MiB"), 1572864u);
  EXPECT_EQ(parse_bytes("2g"), 2147483648u);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("3 parsecs"), Error);
  EXPECT_THROW(parse_bytes("-1"), Error);
}

TEST(Types, FormatsByteCounts) {
  EXPECT_EQ(format_bytes(0), "0 B");
  EXPECT_EQ(format_bytes(4096), "4 KiB");
  EXPECT_EQ(format_bytes(1572864), "1.5 MiB");
}

TEST(Types, ParsesLogLevels) {
  EXPECT_EQ(parse_log_level("trace"), LogLevel::kTrace);
  EXPECT_EQ(parse_log_level("WARN"), LogLevel::kWarn);
  EXPECT_THROW(parse_log_level("LOUD"), Error);
}

// Byte offsets (from pos) of every byte of a strided range, in stream order.
std::vector<std::uint64_t> offsets_of(const StridedRange& range) {
  std::vector<std::uint64_t> out;
  for (std::uint64_t row = 0; row < range.rows(); ++row)
    for (std::uint64_t i = 0; i < range.row_bytes; ++i) out.push_back(range.row_offset(row) + i);
  return out;
}

TEST(StridedRanges, SimplifyMergesAdjacentRowsAndDropsUnitDimensions) {
  // 4 x 3 rows of 8 bytes, rows adjacent and blocks adjacent: one contiguous run of 96 bytes.
  StridedRange whole{16, 8, 2, {4, 3}, {24, 8}};
  const StridedRange one = whole.simplified();
  EXPECT_EQ(one.dims, 0);
  EXPECT_EQ(one.row_bytes, 96u);
  EXPECT_TRUE(whole.is_contiguous());
  // A column block: rows of 8 bytes 32 apart, the outer dimension following on: one dimension.
  StridedRange block{0, 8, 3, {1, 4, 3}, {999, 96, 32}};
  const StridedRange folded = block.simplified();
  EXPECT_EQ(folded.dims, 1);
  EXPECT_EQ(folded.extent[0], 12u);
  EXPECT_EQ(folded.stride[0], 32u);
  EXPECT_EQ(offsets_of(folded), offsets_of(block));
  EXPECT_EQ(block.reach(), 11u * 32 + 8);
  EXPECT_FALSE(block.is_contiguous());
  EXPECT_EQ(StridedRange::matrix(0, 0, 8, 16).bytes(), 0u);
}

TEST(StridedRanges, SimplifyKeepsEveryByteWhereItWas) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 500; ++trial) {
    StridedRange range{rng() % 64, 1 + rng() % 12, static_cast<int>(rng() % 4)};
    std::uint64_t stride = range.row_bytes + (rng() % 2) * (rng() % 5);
    for (int d = range.dims - 1; d >= 0; --d) {
      range.extent[d] = 1 + rng() % 4;
      range.stride[d] = stride;
      stride = stride * range.extent[d] + (rng() % 2) * (rng() % 7);
    }
    const StridedRange simple = range.simplified();
    EXPECT_LE(simple.dims, range.dims);
    EXPECT_EQ(simple.pos, range.pos);
    EXPECT_EQ(offsets_of(simple), offsets_of(range)) << "trial " << trial;
  }
}

}  // namespace
}  // namespace reshard

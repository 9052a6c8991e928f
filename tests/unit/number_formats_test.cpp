// The scalar conversions every transform is built on, against values worked out by hand and
// exhaustive round trips.
#include "transforms/number_formats.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include "reshard/error.hpp"
#include "reshard/transform.hpp"

namespace reshard::formats {
namespace {

TEST(NumberFormats, E4m3RoundTripsEveryCode) {
  for (int code = 0; code < 256; ++code) {
    const auto bits = static_cast<std::uint8_t>(code);
    const float value = e4m3_to_float(bits);
    if ((code & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(value)) << code;
      EXPECT_EQ(double_to_e4m3(value) & 0x7f, 0x7f);
      continue;
    }
    EXPECT_EQ(double_to_e4m3(value), bits) << "code " << code << " value " << value;
  }
}

TEST(NumberFormats, E4m3RoundsToNearestEvenAndSaturates) {
  EXPECT_EQ(e4m3_to_float(0x7e), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(double_to_e4m3(1000.0), 0x7e);
  EXPECT_EQ(double_to_e4m3(-1e30), 0xfe);
  EXPECT_EQ(double_to_e4m3(std::numeric_limits<double>::infinity()), 0x7e);
  EXPECT_EQ(double_to_e4m3(1.0625), 0x38);  // halfway between 1 and 1.125: even (1.0)
  EXPECT_EQ(double_to_e4m3(1.1875), 0x3a);  // halfway between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(double_to_e4m3(std::ldexp(1.0, -10)), 0x00);  // half the smallest subnormal: even
  EXPECT_EQ(double_to_e4m3(std::ldexp(3.0, -10)), 0x02);  // 1.5 steps: even (2)
  EXPECT_EQ(double_to_e4m3(-0.0), 0x80);
}

TEST(NumberFormats, Bf16AndFp16MatchHandWorkedValues) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808000u)), 0x3f80);  // tie: even
  EXPECT_EQ(float_to_bf16(bits_float(0x3f818000u)), 0x3f82);  // tie: even (up)
  EXPECT_EQ(float_to_bf16(bits_float(0x3f808001u)), 0x3f81);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::quiet_NaN()) & 0x7fc0, 0x7fc0);
  EXPECT_EQ(float_to_fp16(1.0f), 0x3c00);
  EXPECT_EQ(float_to_fp16(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7c00);  // rounds past the largest half: infinity
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(float_to_fp16(std::ldexp(1.0f, -25)), 0x0000);  // tie: even
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    if ((h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0) continue;  // NaN payloads
    EXPECT_EQ(float_to_fp16(fp16_to_float(static_cast<std::uint16_t>(h))), h) << h;
    EXPECT_EQ(float_to_bf16(bf16_to_float(static_cast<std::uint16_t>(h))), h & 0xffff)
        << h;  // bf16 NaN codes keep the quiet bit set already for 0x7fc0..
    if (HasFailure()) break;
  }
}

TEST(NumberFormats, MxScaleRulesDifferOnlyWhereOcpWouldSaturate) {
  // 448 = 1.75 * 2^8: both rules give 2^0.
  EXPECT_EQ(mx_scale_bits(448.0f, false), 127);
  EXPECT_EQ(mx_scale_bits(448.0f, true), 127);
  // 500 = 1.95 * 2^8: OCP keeps 2^0 (500 saturates to 448), round-up moves to 2^1.
  EXPECT_EQ(mx_scale_bits(500.0f, false), 127);
  EXPECT_EQ(mx_scale_bits(500.0f, true), 128);
  EXPECT_EQ(mx_encode(500.0f, 127), 0x7e);
  EXPECT_EQ(e4m3_to_float(mx_encode(500.0f, 128)) * 2.0f, 512.0f);  // nearest E4M3 of 250 = 256
  EXPECT_EQ(mx_scale_bits(0.0f, false), 0);
  EXPECT_EQ(mx_scale_bits(std::numeric_limits<float>::infinity(), false), kE8m0Nan);
  EXPECT_EQ(mx_scale_bits(std::numeric_limits<float>::quiet_NaN(), true), kE8m0Nan);
  EXPECT_EQ(mx_scale_bits(1e-40f, false), 0);  // subnormal amax: the smallest scale, clamped
  EXPECT_TRUE(std::isnan(mx_decode(0x10, kE8m0Nan)));
}

// The MX paths work on integer bits; their specification is the arithmetic in double: scaling by a
// power of two is exact there, so double_to_e4m3 rounds the exact product once.
std::uint8_t mx_encode_in_double(float value, std::uint8_t scale_bits) {
  if (scale_bits == kE8m0Nan) return 0x7f;
  return double_to_e4m3(std::ldexp(static_cast<double>(value), 127 - static_cast<int>(scale_bits)));
}

std::uint8_t mx_scale_bits_in_double(float amax, bool round_up) {
  if (std::isnan(amax) || std::isinf(amax)) return kE8m0Nan;
  if (amax == 0.0f) return 0;
  int exponent = std::ilogb(amax) - 8;
  if (round_up && std::ldexp(static_cast<double>(amax), -exponent) > kE4m3Max) exponent += 1;
  return static_cast<std::uint8_t>(std::clamp(exponent, -127, 127) + 127);
}

TEST(NumberFormats, MxEncodingMatchesTheDoubleArithmeticForEveryBf16AndScale) {
  for (std::uint32_t h = 0; h < 0x10000; ++h) {
    const float value = bf16_to_float(static_cast<std::uint16_t>(h));
    for (int scale = 0; scale < 256; ++scale) {
      const auto bits = static_cast<std::uint8_t>(scale);
      ASSERT_EQ(mx_encode(value, bits), mx_encode_in_double(value, bits))
          << "bf16 0x" << std::hex << h << " scale " << std::dec << scale;
    }
    const float magnitude = std::fabs(value);
    for (bool round_up : {false, true}) {
      ASSERT_EQ(mx_scale_bits(magnitude, round_up), mx_scale_bits_in_double(magnitude, round_up))
          << "bf16 0x" << std::hex << h << " round_up " << round_up;
    }
  }
}

// Megatron-LM's quantizer, as its kernel computes a block's scale: amax / 448 in float32, rounded
// up to a power of two by adding the mantissa mask to the bits and keeping the exponent field.
std::uint8_t megatron_scale_bits(float amax) {
  const float quotient = amax / 448.0f;
  return static_cast<std::uint8_t>(((float_bits(quotient) + 0x007fffffu) & 0x7f800000u) >> 23);
}

TEST(NumberFormats, MegatronRoundingGivesMegatronsScaleForEveryFiniteMaximum) {
  // Every bf16 magnitude (what bf16 blocks can have), then random float32 and float16 ones.
  for (std::uint32_t h = 0; h < 0x7f80; ++h) {
    const float amax = bf16_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(mx_scale_bits(amax, true, kMegatronLeastScaleBits), megatron_scale_bits(amax))
        << "bf16 0x" << std::hex << h;
  }
  std::mt19937 rng(11);
  for (int i = 0; i < 4'000'000; ++i) {
    const float amax = bits_float(rng() & 0x7fffffffu);
    if (!std::isfinite(amax)) continue;
    ASSERT_EQ(mx_scale_bits(amax, true, kMegatronLeastScaleBits), megatron_scale_bits(amax))
        << "float 0x" << std::hex << float_bits(amax);
  }
  for (std::uint32_t h = 0; h < 0x7c00; ++h) {
    const float amax = fp16_to_float(static_cast<std::uint16_t>(h));
    ASSERT_EQ(mx_scale_bits(amax, true, kMegatronLeastScaleBits), megatron_scale_bits(amax));
  }
  // Where it parts from round-up: maxima at most 448 * 2^-127 get 2^-126, not 2^-127.
  EXPECT_EQ(mx_scale_bits(std::ldexp(1.0f, -120), true), 0);
  EXPECT_EQ(mx_scale_bits(std::ldexp(1.0f, -120), true, kMegatronLeastScaleBits), 1);
  EXPECT_EQ(mx_scale_bits(0.0f, true, kMegatronLeastScaleBits), 0);  // all zeros: as Megatron
}

// The swizzled layout against its definition: scale (row, col) of an [M, C] matrix sits in tile
// (row / 128, col / 4) of 512 bytes, tiles row-major over ceil(C / 4) columns; in a tile, at
// (row % 32) * 16 + (row % 128) / 32 * 4 + col % 4. Every place is taken once; padding stays.
TEST(NumberFormats, ReferenceMxfp8WritesSwizzledScalesWhereTheLayoutSays) {
  for (auto [rows, cols] :
       {std::pair<std::int64_t, std::int64_t>{1, 32}, {130, 160}, {256, 4096}, {300, 96}}) {
    std::mt19937 rng(static_cast<std::uint32_t>(rows * cols));
    std::vector<std::uint16_t> values(static_cast<std::size_t>(rows * cols));
    for (auto& v : values) v = static_cast<std::uint16_t>(rng() & 0x7f7f);  // finite, spread out
    const std::int64_t scale_cols = cols / 32;
    std::vector<std::uint8_t> data(values.size()), row_major(values.size() / 32),
        data2(values.size());
    std::vector<std::uint8_t> swizzled(
        static_cast<std::size_t>(swizzled_scale_bytes(rows, scale_cols)), 0xee);
    reference_mxfp8_quantize(values.data(), rows, cols, MxScaleRounding::kMegatron, data.data(),
                             row_major.data());
    reference_mxfp8_quantize(values.data(), rows, cols, MxScaleRounding::kMegatron, data2.data(),
                             swizzled.data(), MxScaleLayout::kSwizzled);
    ASSERT_EQ(data, data2);
    const std::int64_t col_tiles = (scale_cols + 3) / 4;
    std::vector<bool> taken(swizzled.size());
    for (std::int64_t r = 0; r < rows; ++r) {
      for (std::int64_t c = 0; c < scale_cols; ++c) {
        const auto at = static_cast<std::size_t>(((r / 128) * col_tiles + c / 4) * 512 +
                                                 (r % 32) * 16 + (r % 128) / 32 * 4 + c % 4);
        ASSERT_FALSE(taken[at]);
        taken[at] = true;
        ASSERT_EQ(swizzled[at], row_major[static_cast<std::size_t>(r * scale_cols + c)]);
        // And the scale is Megatron's, from the block's maximum.
        float amax = 0;
        for (int i = 0; i < 32; ++i) {
          amax = std::max(amax, std::fabs(bf16_to_float(values[r * cols + c * 32 + i])));
        }
        ASSERT_EQ(swizzled[at], megatron_scale_bits(amax));
      }
    }
    for (std::size_t i = 0; i < swizzled.size(); ++i) {
      if (!taken[i]) ASSERT_EQ(swizzled[i], 0xee) << "padding byte " << i << " written";
    }
  }
}

TEST(NumberFormats, MxEncodingMatchesTheDoubleArithmeticForRandomFloats) {
  std::mt19937 rng(2026);
  // Every float bit pattern is equally likely, so subnormals, NaN payloads and the ties of the
  // low mantissa bits that bf16 lacks all come up.
  for (int i = 0; i < 4'000'000; ++i) {
    const float value = bits_float(rng());
    const auto scale = static_cast<std::uint8_t>(rng());
    ASSERT_EQ(mx_encode(value, scale), mx_encode_in_double(value, scale))
        << "float 0x" << std::hex << float_bits(value) << " scale " << std::dec << int{scale};
    const float magnitude = std::fabs(value);
    ASSERT_EQ(mx_scale_bits(magnitude, i % 2 == 0), mx_scale_bits_in_double(magnitude, i % 2 == 0))
        << "float 0x" << std::hex << float_bits(value);
  }
  // Exact ties at every subnormal and normal step of E4M3, for a few scales.
  for (int scale : {100, 127, 140}) {
    for (int code = 0; code < 0x7e; ++code) {
      const double low = e4m3_to_float(static_cast<std::uint8_t>(code));
      const double high = e4m3_to_float(static_cast<std::uint8_t>(code + 1));
      const auto value = static_cast<float>(std::ldexp((low + high) / 2, scale - 127));
      const auto bits = static_cast<std::uint8_t>(scale);
      ASSERT_EQ(mx_encode(value, bits), mx_encode_in_double(value, bits)) << "code " << code;
      ASSERT_EQ(mx_encode(-value, bits), mx_encode_in_double(-value, bits)) << "code " << code;
    }
  }
}

// block_scale divides in float: for every finite float maximum that is the double division
// rounded to float (the arithmetic of DeepSeek-style reference code), bit for bit.
TEST(NumberFormats, BlockScaleIsTheDoubleDivisionRoundedForEveryFloat) {
  for (std::uint64_t bits = 1; bits < 0x7f800000u; ++bits) {
    const float amax = bits_float(static_cast<std::uint32_t>(bits));
    const float twice_rounded = static_cast<float>(static_cast<double>(amax) / kE4m3Max);
    if (float_bits(block_scale(amax)) != float_bits(twice_rounded)) {
      FAIL() << "maximum " << amax << ": " << block_scale(amax) << " against " << twice_rounded;
    }
  }
}

// The GPU's block-FP8 shortcut, done here in host float arithmetic: a quotient taken as
// value * (1 / scale), rounded to E4M3, must give the reference's code wherever
// quotient_is_decisive says so — for random floats under random scales and for values placed
// within a few ulps of rounding ties, where the shortcut and the division can part.
TEST(NumberFormats, BlockQuotientByReciprocalRoundsLikeTheDivisionWhereDecisive) {
  std::mt19937 rng(61);
  std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
  std::size_t decisive = 0, decisive_subnormal = 0, near_ties = 0;
  for (int i = 0; i < 4'000'000; ++i) {
    const float amax = std::ldexp(1.0f + std::fabs(unit(rng)), static_cast<int>(rng() % 240) - 120);
    const float scale = block_scale(amax);
    if (!reciprocal_is_usable(scale)) continue;
    const float reciprocal = 1.0f / scale;
    // Down to 2^-24 of the maximum: quotients among E4M3's subnormals (below 2^-6) too.
    float value = std::ldexp(amax * unit(rng), -static_cast<int>(rng() % 25));
    if (i % 2 == 1) {  // near a tie between two codes below 448
      const auto code = static_cast<std::uint8_t>(rng() % 0x7d);
      const double tie = (e4m3_to_float(code) + e4m3_to_float(code + 1)) / 2.0;
      value = static_cast<float>(tie * scale);
      for (int step = static_cast<int>(rng() % 13) - 6; step != 0; step += step > 0 ? -1 : 1) {
        value = std::nextafter(value, step > 0 ? 1e30f : -1e30f);
      }
    }
    const float quotient = value * reciprocal;
    if (!quotient_is_decisive(quotient)) {
      near_ties += i % 2;
      continue;
    }
    ++decisive;
    decisive_subnormal += std::fabs(quotient) < std::ldexp(1.0f, -6);
    ASSERT_EQ(double_to_e4m3(quotient), block_encode(value, scale))
        << "value " << value << " scale " << scale << " quotient " << quotient;
  }
  EXPECT_GT(decisive, 2'000'000u);  // the shortcut covers the random half
  EXPECT_GT(decisive_subnormal, 500'000u);
  EXPECT_GT(near_ties, 100'000u);  // and the test reached the ties it guards against
}

// The GPU's path for bfloat16 tiles (block_bf16_reciprocal, block_bf16_quotient): for every
// bfloat16 tile maximum whose scale the path takes (at least 2^-100) and every bfloat16 value of
// at most that magnitude, both signs, the quotient rounds to the reference's code. (A billion
// pairs, about ten seconds: the argument in number_formats.hpp, checked in full.)
TEST(NumberFormats, BlockBf16QuotientRoundsLikeTheDivisionForEveryMaximumAndValue) {
  std::uint64_t checked = 0, exact_scales = 0, ties = 0;
  for (std::uint32_t max_bits = 1; max_bits < 0x7f80u; ++max_bits) {
    const float amax = bits_float(max_bits << 16);
    const float scale = block_scale(amax);
    if (!(scale >= 0x1p-100f)) continue;
    const float reciprocal = 1.0f / scale;
    const float nudged = block_bf16_reciprocal(amax, scale, reciprocal);
    exact_scales += nudged == 0.0f;
    for (std::uint32_t bits = 0; bits <= max_bits; ++bits) {
      for (const std::uint32_t sign : {0u, 0x8000u}) {
        const float value = bits_float((bits | sign) << 16);
        const float quotient = nudged != 0.0f ? block_bf16_quotient<false>(value, scale, nudged)
                                              : block_bf16_quotient<true>(value, scale, reciprocal);
        const std::uint8_t want = block_encode(value, scale);
        if (double_to_e4m3(quotient) != want) {
          FAIL() << "maximum " << amax << " value " << value << ": quotient " << quotient
                 << " gives 0x" << std::hex << int{double_to_e4m3(quotient)} << ", reference 0x"
                 << int{want};
        }
        ties += !quotient_is_decisive(value / scale);
        ++checked;
      }
    }
  }
  EXPECT_GT(checked, 1'000'000'000u);
  EXPECT_GT(exact_scales, 3'000u);  // maxima that are multiples of 7: the correction step
  EXPECT_GT(ties, 500'000u);        // quotients at rounding ties, where a plain product can miss
}

TEST(NumberFormats, ReferenceMxfp8QuantizesBlocksOfThirtyTwo) {
  std::vector<std::uint16_t> row(64);
  for (int i = 0; i < 32; ++i) row[i] = float_to_bf16(static_cast<float>(i));  // amax 31
  for (int i = 32; i < 64; ++i) row[i] = float_to_bf16(0.001f * (i - 32));
  std::vector<std::uint8_t> data(64), scales(2);
  reference_mxfp8_quantize(row.data(), 1, 64, MxScaleRounding::kOcp, data.data(), scales.data());
  EXPECT_EQ(scales[0], 127 + 4 - 8);  // floor(log2 31) = 4
  // Elements are i * 2^4 in E4M3: exact up to 16 * 16, then rounded; 31 * 16 = 496 saturates.
  for (int i = 0; i < 16; ++i) EXPECT_EQ(mx_decode(data[i], scales[0]), static_cast<float>(i));
  EXPECT_EQ(mx_decode(data[17], scales[0]), 16.0f);  // 272: a tie between 256 and 288, even
  EXPECT_EQ(mx_decode(data[31], scales[0]), 28.0f);  // 448 / 16
  EXPECT_LT(scales[1], scales[0]);
  EXPECT_THROW(reference_mxfp8_quantize(row.data(), 1, 48, MxScaleRounding::kOcp, data.data(),
                                        scales.data()),
               reshard::Error);
}

TEST(NumberFormats, ReferenceBlockFp8ScalesEachTileByItsMaximum) {
  const std::int64_t rows = 130, cols = 200;  // partial tiles at both edges
  std::vector<std::uint16_t> values(rows * cols);
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    values[i] = float_to_bf16(static_cast<float>((i % 97) - 48) * (i / cols < 128 ? 1.0f : 8.0f));
  }
  std::vector<std::uint8_t> data(rows * cols);
  std::vector<float> scales(4);
  reference_fp8_block_quantize(values.data(), rows, cols, data.data(), scales.data());
  EXPECT_FLOAT_EQ(scales[0], 48.0f / 448.0f);
  EXPECT_FLOAT_EQ(scales[2], 8.0f * 48.0f / 448.0f);  // the two-row tile below
  for (std::int64_t i = 0; i < rows * cols; i += 37) {
    const float scale = scales[(i / cols) / 128 * 2 + (i % cols) / 128];
    const float back = e4m3_to_float(data[i]) * scale;
    EXPECT_NEAR(back, bf16_to_float(values[i]), std::fabs(bf16_to_float(values[i])) / 8 + 1e-6);
  }
}

}  // namespace
}  // namespace reshard::formats

// Number-format conversions shared by the CPU reference and the CUDA kernels: one source, so the
// GPU results are bit-identical to the reference by construction and the tests check the kernels'
// indexing, reductions and scale placement. Each value is rounded once (to nearest even): the MX
// paths scale by powers of two on the integer bits (the kernels on GPUs that have one use the FP8
// conversion instruction, checked against them for every bf16 value and scale), the block-FP8
// path divides in double (the kernels multiply by the reciprocal and fall back to the division
// where that could round differently).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "gpu/host_device.hpp"

namespace reshard::formats {

RESHARD_HD std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
#endif
}

RESHARD_HD float bits_float(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof value);
  return value;
#endif
}

RESHARD_HD bool is_nan(double value) { return value != value; }

RESHARD_HD bool has_sign_bit(double value) {
#if defined(__CUDA_ARCH__)
  return signbit(value);
#else
  return std::signbit(value);
#endif
}

// ---- bfloat16 and float16 (stored as uint16) ----

RESHARD_HD float bf16_to_float(std::uint16_t bits) {
  return bits_float(static_cast<std::uint32_t>(bits) << 16);
}

RESHARD_HD std::uint16_t float_to_bf16(float value) {
  const std::uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep the sign, make it quiet
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  }
  const std::uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // to nearest, ties to even
  return static_cast<std::uint16_t>((bits + rounding) >> 16);
}

RESHARD_HD float fp16_to_float(std::uint16_t bits) {
  const std::uint32_t sign = static_cast<std::uint32_t>(bits & 0x8000u) << 16;
  const std::uint32_t exponent = (bits >> 10) & 0x1fu;
  const std::uint32_t mantissa = bits & 0x3ffu;
  if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-08f;
    return sign ? -magnitude : magnitude;
  }
  return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
}

RESHARD_HD std::uint16_t float_to_fp16(float value) {
  const std::uint32_t bits = float_bits(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((bits >> 16) & 0x8000u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);   // NaN
  if (magnitude >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow
  if (magnitude < 0x38800000u) {  // below the smallest normal (2^-14): subnormal steps of 2^-24
    const double scaled = static_cast<double>(bits_float(magnitude)) * 16777216.0;
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(rint(scaled)));
  }
  const std::uint32_t rounding = 0xfffu + ((magnitude >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | ((magnitude - 0x38000000u + rounding) >> 13));
}

// ---- FP8 E4M3 (OCP "fn": bias 7, no infinities, max 448, NaN = S.1111.111) ----

constexpr double kE4m3Max = 448.0;

RESHARD_HD float e4m3_to_float(std::uint8_t bits) {
  const float sign = (bits & 0x80u) ? -1.0f : 1.0f;
  const int exponent = (bits >> 3) & 0xf;
  const int mantissa = bits & 0x7;
  if (exponent == 0xf && mantissa == 0x7) return bits_float(0x7fc00000u);
  if (exponent == 0) return sign * static_cast<float>(mantissa) * 0.001953125f;  // m * 2^-9
  return sign * ldexpf(1.0f + static_cast<float>(mantissa) / 8.0f, exponent - 7);
}

// Rounds to nearest even, saturating to +-448 (NaN stays NaN; infinities saturate).
RESHARD_HD std::uint8_t double_to_e4m3(double value) {
  if (is_nan(value)) return 0x7f;
  const bool negative = has_sign_bit(value);  // -0.0 keeps its sign
  const std::uint8_t sign = negative ? 0x80 : 0x00;
  const double magnitude = negative ? -value : value;
  if (magnitude >= kE4m3Max) return sign | 0x7e;
  if (magnitude < 0.015625) {  // below 2^-6: subnormal steps of 2^-9; 8 steps = the first normal
    return sign | static_cast<std::uint8_t>(rint(magnitude * 512.0));
  }
  int exponent = 0;
  frexp(magnitude, &exponent);  // magnitude = f * 2^exponent, f in [0.5, 1)
  exponent -= 1;                // magnitude in [2^exponent, 2^(exponent + 1))
  const double steps = rint(ldexp(magnitude, 3 - exponent));  // 8..16 (mantissa + implicit one)
  int code = ((exponent + 7) << 3) + static_cast<int>(steps) - 8;
  if (code > 0x7e) code = 0x7e;
  return sign | static_cast<std::uint8_t>(code);
}

// ---- MX scales (E8M0: value 2^(bits - 127), 0xff = NaN) ----

constexpr int kMxBlock = 32;
constexpr std::uint8_t kE8m0Nan = 0xff;

// A finite, nonzero float magnitude as significand * 2^(exponent - 23) with the significand in
// [2^23, 2^24): subnormals normalised, so the MX paths below work on integers only (the double
// arithmetic they replace cost more than the memory traffic of a quantization kernel).
struct Normalized {
  std::uint32_t significand;
  int exponent;  // floor(log2(magnitude))
};

RESHARD_HD int leading_zeros(std::uint32_t word) {
#if defined(__CUDA_ARCH__)
  return __clz(static_cast<int>(word));
#else
  return word == 0 ? 32 : __builtin_clz(word);
#endif
}

RESHARD_HD Normalized normalize(std::uint32_t magnitude_bits) {
  const std::uint32_t exponent_field = magnitude_bits >> 23;
  const std::uint32_t mantissa = magnitude_bits & 0x7fffffu;
  if (exponent_field != 0) {
    return {mantissa | 0x800000u, static_cast<int>(exponent_field) - 127};
  }
  const int shift = leading_zeros(mantissa) - 8;  // brings the top bit to bit 23
  return {mantissa << shift, -126 - shift};
}

// significand / 2^drop (1 <= drop <= 31), rounded to nearest, ties to even.
RESHARD_HD std::uint32_t round_shift(std::uint32_t significand, int drop) {
  const std::uint32_t kept = significand >> drop;
  const std::uint32_t rest = significand & ((1u << drop) - 1u);
  const std::uint32_t half = 1u << (drop - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u) != 0)) ? 1u : 0u);
}

// double_to_e4m3(value * 2^scale) for a float value, exactly, without floating-point arithmetic:
// NaN gives 0x7f, magnitudes from 448 (infinities too) saturate, the rest round to nearest even.
RESHARD_HD std::uint8_t scaled_to_e4m3(float value, int scale) {
  const std::uint32_t bits = float_bits(value);
  const auto sign = static_cast<std::uint8_t>((bits >> 24) & 0x80u);
  const std::uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7f;
  if (magnitude == 0x7f800000u) return sign | 0x7e;
  if (magnitude == 0) return sign;
  const Normalized n = normalize(magnitude);
  const int exponent = n.exponent + scale;
  if (exponent > 8 || (exponent == 8 && n.significand >= 0xe00000u)) return sign | 0x7e;
  if (exponent < -6) {  // subnormal steps of 2^-9: significand * 2^(exponent - 14)
    const int drop = 14 - exponent;
    return drop > 24 ? sign : static_cast<std::uint8_t>(sign | round_shift(n.significand, drop));
  }
  const std::uint32_t steps = round_shift(n.significand, 20);  // 8..16: implicit one + mantissa
  const std::uint32_t code = (static_cast<std::uint32_t>(exponent + 7) << 3) + steps - 8;
  return static_cast<std::uint8_t>(sign | (code > 0x7e ? 0x7eu : code));
}

// The shared exponent of a block from its largest magnitude. OCP (v1.0, section 6.3):
// floor(log2(amax)) - emax(E4M3) = -8, which may saturate the largest elements; the round-up rule
// picks the smallest exponent with amax / 2^e <= 448 (a significand above 1.75), which never does.
// A block that is not all zeros gets at least `least_bits` (Megatron-LM computes amax / 448 in
// float32 and rounds it up to a power of two, so its scales never fall below 2^-126: 1; except
// where that quotient rounds to zero, amax <= 7 * 2^-144, a float32 subnormal: 0).
RESHARD_HD std::uint8_t mx_scale_bits(float amax, bool round_up, std::uint8_t least_bits = 0) {
  if (!(amax == amax) || amax > 3.4028234663852886e38f) return kE8m0Nan;  // NaN or Inf in block
  if (amax == 0.0f) return 0;  // an all-zero block: smallest scale, elements encode as zeros
  if (least_bits != 0 && float_bits(amax) <= 7u << 5) return 0;  // 7 * 2^-144 = 7 * 32 * 2^-149
  const Normalized n = normalize(float_bits(amax) & 0x7fffffffu);
  int exponent = n.exponent - 8;
  if (round_up && n.significand > 0xe00000u) exponent += 1;
  if (exponent < static_cast<int>(least_bits) - 127) exponent = static_cast<int>(least_bits) - 127;
  if (exponent > 127) exponent = 127;
  return static_cast<std::uint8_t>(exponent + 127);
}

// The least scale bits of each MxScaleRounding rule (see mx_scale_bits).
constexpr std::uint8_t kMegatronLeastScaleBits = 1;

// cuBLAS's blocked layout of MXFP8 scales (what Megatron-LM and Transformer Engine keep for their
// GEMMs): the [rows, cols] scale matrix in tiles of 128 rows x 4 columns, 512 bytes each, tiles
// row-major (`col_tiles` = ceil(cols / 4) per tile row); inside a tile, rows r and r + 32, r + 64,
// r + 96 sit side by side: byte (r % 32) * 16 + (r % 128 / 32) * 4 + c % 4. In 64 bits, or in
// 32 (the GPU's common path) where the caller knows every offset fits.
template <typename Int = std::int64_t>
RESHARD_HD Int swizzled_scale_offset(std::type_identity_t<Int> row, std::type_identity_t<Int> col,
                                     std::type_identity_t<Int> col_tiles) {
  return ((row >> 7) * col_tiles + (col >> 2)) * 512 + (row & 31) * 16 + ((row >> 5) & 3) * 4 +
         (col & 3);
}
// Bytes of that layout for a [rows, cols] scale matrix: padded to whole tiles.
inline std::int64_t swizzled_scale_bytes(std::int64_t rows, std::int64_t cols) {
  return (rows + 127) / 128 * ((cols + 3) / 4) * 512;
}

RESHARD_HD double mx_scale_value(std::uint8_t bits) {
  return ldexp(1.0, static_cast<int>(bits) - 127);
}

// 2^scale as a float, scale in [-127, 127] (2^-127 is a subnormal, still exact).
RESHARD_HD float power_of_two(int scale) {
  return bits_float(scale >= -126 ? static_cast<std::uint32_t>(scale + 127) << 23 : 0x00400000u);
}

RESHARD_HD std::uint8_t mx_encode(float value, std::uint8_t scale_bits) {
  if (scale_bits == kE8m0Nan) return 0x7f;
  return scaled_to_e4m3(value, 127 - static_cast<int>(scale_bits));
}

// Two values in E4M3 (round to nearest even, saturating at 448, NaN 0x7f), `low` in the low
// byte: the FP8 conversion instruction where the GPU has it (Ada and later), else the integer
// path, which gives the same bits.
RESHARD_HD std::uint16_t e4m3_pair(float low, float high) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  std::uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(high), "f"(low));
  return pair;
#else
  return static_cast<std::uint16_t>(scaled_to_e4m3(low, 0) |
                                    (static_cast<std::uint16_t>(scaled_to_e4m3(high, 0)) << 8));
#endif
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
// mx_encode of two values of a block whose scale is not NaN (so no value is NaN or infinite),
// `factor` = power_of_two(127 - scale_bits), `low` in the low byte: with the FP8 conversion
// instruction (round to nearest even, saturating at 448, as scaled_to_e4m3; the integer path
// costs a quantization kernel most of its time). The multiply by a power of two, without flushing
// subnormals, is exact down to the float subnormals, far below E4M3's, where both paths give a
// signed zero.
__device__ __forceinline__ std::uint16_t mx_encode_finite_pair(float low, float high,
                                                               float factor) {
  float scaled_low, scaled_high;
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(scaled_low) : "f"(low), "f"(factor));
  asm("mul.rn.f32 %0, %1, %2;" : "=f"(scaled_high) : "f"(high), "f"(factor));
  std::uint16_t pair;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(scaled_high), "f"(scaled_low));
  return pair;
}
#elif defined(__CUDA_ARCH__)
// GPUs before Ada have no FP8 conversion instruction: the integer path, with the exponent that
// `factor` (a power of two, subnormal only as 2^-127) stands for.
__device__ __forceinline__ std::uint16_t mx_encode_finite_pair(float low, float high,
                                                               float factor) {
  const std::uint32_t bits = float_bits(factor);
  const int exponent = bits >= 0x00800000u ? static_cast<int>(bits >> 23) - 127 : -127;
  return static_cast<std::uint16_t>(
      scaled_to_e4m3(low, exponent) |
      (static_cast<std::uint16_t>(scaled_to_e4m3(high, exponent)) << 8));
}
#endif

// mx_encode of two values of one block: `low` in the low byte. NaN gives 0x7f whatever its sign.
RESHARD_HD std::uint16_t mx_encode_pair(float low, float high, std::uint8_t scale_bits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (scale_bits == kE8m0Nan) return 0x7f7f;
  std::uint16_t pair =
      mx_encode_finite_pair(low, high, power_of_two(127 - static_cast<int>(scale_bits)));
  if (low != low) pair = static_cast<std::uint16_t>((pair & 0xff00u) | 0x7fu);
  if (high != high) pair = static_cast<std::uint16_t>((pair & 0x00ffu) | 0x7f00u);
  return pair;
#else
  return static_cast<std::uint16_t>(mx_encode(low, scale_bits) |
                                    (static_cast<std::uint16_t>(mx_encode(high, scale_bits)) << 8));
#endif
}

RESHARD_HD float mx_decode(std::uint8_t value, std::uint8_t scale_bits) {
  if (scale_bits == kE8m0Nan) return bits_float(0x7fc00000u);
  return static_cast<float>(static_cast<double>(e4m3_to_float(value)) * mx_scale_value(scale_bits));
}

// ---- 128x128 block-scaled FP8 (DeepSeek-V3 style: float32 scale = amax / 448 per block) ----

constexpr int kFp8Block = 128;

RESHARD_HD float block_scale(float amax) {
  if (amax == 0.0f) return 1.0f;  // keeps zeros zero without dividing by zero
  // One NaN for both sides: GPU arithmetic would return its own canonical NaN payload.
  if (!(amax == amax)) return bits_float(0x7fc00000u);
  // amax / 448 rounded once to float: the same as rounded to double and then to float (the
  // division DeepSeek-style reference code does) for every float amax, as a unit test checks for
  // all of them (k / 7 in binary repeats 3 bits, never the long run a second rounding needs),
  // so the kernels need no double arithmetic for it.
  return amax / static_cast<float>(kE4m3Max);
}

// value / scale in E4M3: the quotient in double, rounded once more to E4M3. That is the exactly
// rounded quotient: a tie point p between two E4M3 codes has at most 5 significant bits, so a
// value != p * scale lies at least 2^-30 (relative) from p * scale, far beyond double's rounding.
RESHARD_HD std::uint8_t block_encode(float value, float scale) {
  return double_to_e4m3(static_cast<double>(value) / static_cast<double>(scale));
}

// Whether block_encode_pair can trust a quotient rounded to float twice (value * reciprocal, with
// reciprocal = 1 / scale rounded): it is within 2 ulps of the exact quotient, so it rounds to the
// same E4M3 code unless it lies within a few ulps of a rounding tie. About 1 quotient in 100,000
// fails this and takes the double path.
RESHARD_HD bool quotient_is_decisive(float quotient) {
  constexpr std::int32_t kMargin = 4;                     // ulps either side of a tie (2 would do)
  constexpr std::uint32_t kSmallestNormal = 0x3c800000u;  // 2^-6, E4M3's smallest normal
  const std::uint32_t magnitude = float_bits(quotient) & 0x7fffffffu;
  if (magnitude >= kSmallestNormal) {  // E4M3 keeps 3 mantissa bits: a tie drops exactly half
    constexpr std::uint32_t kTie = 0x80000u;
    return (magnitude & 0xfffffu) - (kTie - kMargin) > 2 * kMargin;  // unsigned: off the margin
  }
  // E4M3 subnormals are steps of 2^-9, so the ties are odd multiples of 2^-10; the float bit
  // patterns of positive numbers count ulps, across binades too.
  const float half_steps = bits_float(magnitude) * 1024.0f;   // exact: a power of two
  const float tie = 2.0f * floorf(half_steps * 0.5f) + 1.0f;  // the nearest odd number of them
  const auto distance = static_cast<std::int32_t>(float_bits(half_steps) - float_bits(tie));
  return distance > kMargin || distance < -kMargin;
}

// Block FP8 of bfloat16 tiles with no test per element (the GPU kernel's path for tiles whose
// maximum is finite and whose scale is at least 2^-100). A bfloat16 value has 8 significant bits,
// and so has the tile's maximum, so value / (maximum / 448) lies either exactly on a rounding tie
// of E4M3 (a tie has at most 5 significant bits: 7 * the value's significand = the tie's * the
// maximum's, up to powers of two) or at least 2^-13 (relative) from every tie. The scale is
// maximum / 448 rounded to float, up to 2^-24 off, which moves the exact ties just off a tie, to
// the side opposite the scale's rounding. block_bf16_reciprocal makes value * reciprocal land on
// that side: the reciprocal times 1 -+ 2^-20, which three float roundings (2^-24 each) cannot
// undo and which is far too small to cross any tie the quotient is not on. Where the scale is
// exact (it returns 0) the exact ties stay ties, and the quotient must be exact there (round half
// to even): one correction step gives it, value - quotient * scale being exact in an fma
// (block_bf16_quotient<true>; written as it is so that -0 keeps its sign). Checked against
// block_encode for every bfloat16 maximum and value (tests/unit/number_formats_test.cpp).
RESHARD_HD float block_bf16_reciprocal(float amax, float scale, float reciprocal) {
  const float rounded_by = fmaf(scale, static_cast<float>(kE4m3Max), -amax);  // exact sign
  if (rounded_by == 0.0f) return 0.0f;
  return reciprocal * (rounded_by > 0.0f ? 1.0f - 0x1p-20f : 1.0f + 0x1p-20f);
}

// value / scale as a float that rounds to block_encode(value, scale) under round to nearest even:
// `reciprocal` is block_bf16_reciprocal's where it is not 0 (kExactScale false), else 1 / scale.
template <bool kExactScale>
RESHARD_HD float block_bf16_quotient(float value, float scale, float reciprocal) {
  const float quotient = value * reciprocal;
  if constexpr (!kExactScale) return quotient;
  return fmaf(-fmaf(quotient, scale, -value), reciprocal, quotient);
}

// Scales below FLT_MIN (their reciprocal may overflow) and NaN scales leave block_encode_pair on
// the double path for the whole tile.
RESHARD_HD bool reciprocal_is_usable(float scale) { return scale >= 1.17549435e-38f; }

RESHARD_HD std::uint16_t block_encode_pair_by_division(float low, float high, float scale) {
  return static_cast<std::uint16_t>(block_encode(low, scale) |
                                    (static_cast<std::uint16_t>(block_encode(high, scale)) << 8));
}

#if defined(__CUDACC__)
// Out of line on GPUs: rarely taken, and inlined for every pair of a tile it would cost the
// kernel its registers.
static __device__ __noinline__ std::uint16_t block_encode_pair_out_of_line(float low, float high,
                                                                           float scale) {
  return block_encode_pair_by_division(low, high, scale);
}
#endif

// block_encode of two values of one tile, `low` in the low byte; `reciprocal` is 1 / scale in
// float. On GPUs with the FP8 conversion instruction (round to nearest even, saturating at 448)
// the quotient is a multiply and the conversion, not a division: the double division cost the
// block-FP8 kernel 4x the time of the MX one.
RESHARD_HD std::uint16_t block_encode_pair(float low, float high, float scale, float reciprocal) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  if (reciprocal_is_usable(scale)) {
    float q_low, q_high;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q_low) : "f"(low), "f"(reciprocal));
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(q_high) : "f"(high), "f"(reciprocal));
    if (quotient_is_decisive(q_low) && quotient_is_decisive(q_high)) {
      std::uint16_t pair;
      asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(q_high), "f"(q_low));
      if (q_low != q_low) pair = static_cast<std::uint16_t>((pair & 0xff00u) | 0x7fu);
      if (q_high != q_high) pair = static_cast<std::uint16_t>((pair & 0x00ffu) | 0x7f00u);
      return pair;
    }
  }
  return block_encode_pair_out_of_line(low, high, scale);
#else
  (void)reciprocal;
  return block_encode_pair_by_division(low, high, scale);
#endif
}

// |value| for the amax reductions; NaN propagates (a NaN anywhere makes the block's scale NaN).
RESHARD_HD float abs_max(float running, float value) {
  const float magnitude = value < 0 ? -value : value;
  if (!(magnitude == magnitude) || !(running == running)) return bits_float(0x7fc00000u);
  return magnitude > running ? magnitude : running;
}

}  // namespace reshard::formats

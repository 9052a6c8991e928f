// Loading and storing one element of a float32 / bfloat16 / float16 tensor as float, for the
// host reference and the kernels alike.
#pragma once

#include "reshard/layout.hpp"
#include "transforms/number_formats.hpp"

namespace reshard::execution {

RESHARD_HD float load_float(const void* data, DType dtype, std::int64_t index) {
  switch (dtype) {
    case DType::kFloat32:
      return static_cast<const float*>(data)[index];
    case DType::kBFloat16:
      return formats::bf16_to_float(static_cast<const std::uint16_t*>(data)[index]);
    default:  // kFloat16 (the transforms refuse other dtypes before any kernel runs)
      return formats::fp16_to_float(static_cast<const std::uint16_t*>(data)[index]);
  }
}

RESHARD_HD void store_float(void* data, DType dtype, std::int64_t index, float value) {
  switch (dtype) {
    case DType::kFloat32:
      static_cast<float*>(data)[index] = value;
      break;
    case DType::kBFloat16:
      static_cast<std::uint16_t*>(data)[index] = formats::float_to_bf16(value);
      break;
    default:
      static_cast<std::uint16_t*>(data)[index] = formats::float_to_fp16(value);
      break;
  }
}

}  // namespace reshard::execution

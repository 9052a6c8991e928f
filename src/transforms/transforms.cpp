// What the public transform interface defines out of line (src/transforms: the base the
// built-ins share, the cast and the scaled FP8 transforms, the conversions they run).
#include "reshard/error.hpp"
#include "reshard/transform.hpp"

namespace reshard {

void ReshardTransform::convert_local(const OpSlice& from, const LocalTensor&, const OpSlice&,
                                     const LocalTensor&, void*) {
  throw_error(ErrorCode::kUnsupported, "transform '" + name() +
                                           "' has no local conversion, yet was asked for '" +
                                           from.param.name + "' " + from.op.region.str());
}

std::size_t ScaleTensor::bytes() const {
  std::size_t n = dtype_size(dtype);
  for (std::int64_t extent : shape) n *= static_cast<std::size_t>(extent);
  return n;
}

}  // namespace reshard

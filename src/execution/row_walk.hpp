// What the batched kernels need to find a work item's place without dividing: a division by a
// divisor fixed for a launch as a multiply and a shift, and a block's rows as one stride where
// they are evenly spaced. A 32-bit division per lane costs a conversion kernel more than its
// arithmetic; a 64-bit one, more than its memory traffic.
#pragma once

#include <cstdint>
#include <vector>

#include "execution/box_view.hpp"

namespace reshard::execution {

// n / divisor for every 32-bit n (Granlund and Montgomery, "Division by invariant integers using
// multiplication", 1994, section 4: a multiplier of 33 bits, its top bit implicit).
struct FastDivisor {
  std::uint32_t divisor = 1;
  std::uint32_t multiplier = 1;
  std::uint32_t shift = 0;

  static FastDivisor of(std::uint32_t d) {
    FastDivisor f;
    f.divisor = d;
    while ((std::uint64_t{1} << f.shift) < d) ++f.shift;
    f.multiplier = static_cast<std::uint32_t>(
        ((std::uint64_t{1} << 32) * ((std::uint64_t{1} << f.shift) - d)) / d + 1);
    return f;
  }
  RESHARD_HD std::uint32_t divide(std::uint32_t n) const {
#if defined(__CUDA_ARCH__)
    const std::uint32_t high = __umulhi(n, multiplier);
#else
    const auto high = static_cast<std::uint32_t>((std::uint64_t{n} * multiplier) >> 32);
#endif
    return static_cast<std::uint32_t>((std::uint64_t{high} + n) >> shift);
  }
};

// The elements between consecutive rows of `view` where that is one number (a block of a matrix,
// or of a tensor whose outer dimensions the block spans whole), else 0.
inline std::int64_t even_row_stride(const BoxView& view) {
  std::int64_t step = 0, span = 0;  // the innermost dimension that moves, and what it spans
  for (int d = view.outer_dims - 1; d >= 0; --d) {
    if (view.outer_extent[d] <= 1) continue;
    if (step == 0) {
      step = view.outer_stride[d];
    } else if (view.outer_stride[d] != span) {
      return 0;
    }
    span = view.outer_stride[d] * view.outer_extent[d];
  }
  return step > 0 ? step : (view.cols > 0 ? view.cols : 1);  // one row: any stride will do
}

// Where the rows of a BoxView start: `stride` apart from `base` when they are evenly spaced, else
// through
// the view itself, kept aside (`uneven`, uploaded beside the jobs) so that a job stays small: a
// refit queues thousands, and the host builds and uploads every one.
struct RowWalk {
  std::int64_t base = 0, stride = 0;
  std::int32_t view = -1;  // >= 0: rows not evenly spaced; the view is uneven[view]
  std::int32_t zero = 0;   // where padding would be: job lists are compared byte for byte

  static RowWalk of(const BoxView& view, std::vector<BoxView>& uneven) {
    RowWalk walk{view.base, even_row_stride(view), -1};
    if (walk.stride == 0) {
      walk.view = static_cast<std::int32_t>(uneven.size());
      uneven.push_back(view);
    }
    return walk;
  }
  RESHARD_HD std::int64_t row_start(std::int64_t row, const BoxView* uneven) const {
    return view < 0 ? base + row * stride : uneven[view].row_start(row);
  }
};

}  // namespace reshard::execution

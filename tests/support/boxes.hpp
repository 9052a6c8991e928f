// Element-by-element walks over boxes, for tests that check plans and transfers one element at a
// time (independently of the library's own block views).
#pragma once

#include <cstdint>
#include <vector>

#include "reshard/layout.hpp"

namespace reshard::testing_support {

// Row-major linear index of `at` in a tensor of `shape`.
inline std::int64_t linear(const Extents& at, const std::vector<std::int64_t>& shape) {
  std::int64_t index = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + at[d];
  return index;
}

// Calls fn(position) for every position inside box, in row-major order.
template <typename Fn>
void for_each_position(const Box& box, Fn fn) {
  if (box.empty()) return;
  Extents at = box.offset;
  while (true) {
    fn(at);
    int d = box.ndim - 1;
    for (; d >= 0; --d) {
      if (++at[d] < box.offset[d] + box.extent[d]) break;
      at[d] = box.offset[d];
    }
    if (d < 0) return;
  }
}

}  // namespace reshard::testing_support

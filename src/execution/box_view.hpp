// A block of a row-major tensor seen as rows of contiguous elements: what the pack, unpack and
// conversion loops (host and CUDA) walk. Plain data, so kernels take it by value.
#pragma once

#include <cstdint>
#include <vector>

#include "reshard/layout.hpp"
#include "transforms/number_formats.hpp"

namespace reshard::execution {

struct BoxView {
  int outer_dims = 0;  // dimensions before the row dimension
  // Zero, where the compiler would leave padding: views travel inside job lists, which are
  // compared byte for byte (job_upload.cuh).
  std::int32_t zero = 0;
  // Plain arrays rather than Extents: std::array's accessors are host-only in device code.
  std::int64_t outer_extent[kMaxDims] = {};  // their extents in the box
  std::int64_t outer_stride[kMaxDims] = {};  // their strides in the tensor, in elements
  std::int64_t base = 0;                     // element offset of the box's first element
  std::int64_t rows = 1;                     // product of outer_extent
  std::int64_t cols = 0;                     // elements per row (contiguous in the tensor)

  // Element offset of the first element of `row`.
  RESHARD_HD std::int64_t row_start(std::int64_t row) const {
    std::int64_t offset = base;
    if (rows <= 0xffffffffll) {  // every extent fits too: 32-bit divisions, far cheaper on GPUs
      auto rest = static_cast<std::uint32_t>(row);
      for (int d = outer_dims - 1; d >= 0; --d) {
        const auto extent = static_cast<std::uint32_t>(outer_extent[d]);
        offset += static_cast<std::int64_t>(rest % extent) * outer_stride[d];
        rest /= extent;
      }
      return offset;
    }
    for (int d = outer_dims - 1; d >= 0; --d) {
      const std::int64_t extent = outer_extent[d];
      offset += (row % extent) * outer_stride[d];
      row /= extent;
    }
    return offset;
  }
  // Elements between consecutive rows that share their outer indices but the innermost: within
  // one matrix of a view whose rows are the last dimension.
  RESHARD_HD std::int64_t row_stride() const {
    return outer_dims > 0 ? outer_stride[outer_dims - 1] : cols;
  }
  bool contiguous() const { return rows == 1 || cols == 0; }
  std::int64_t elements() const { return rows * cols; }
};

// `box` of a tensor of `shape`. With merge_full_dims, trailing dimensions the box spans fully
// fold into longer rows (for plain copies); without, a row is exactly the last dimension (for
// conversions whose blocks run along it).
inline BoxView view_of(const Box& box, const std::vector<std::int64_t>& shape,
                       bool merge_full_dims) {
  BoxView view;
  const int n = box.ndim;
  if (n == 0) {
    view.cols = 1;
    return view;
  }
  Extents stride{};
  std::int64_t s = 1;
  for (int d = n - 1; d >= 0; --d) {
    stride[d] = s;
    s *= shape[d];
    view.base += box.offset[d] * stride[d];
  }
  int row_dim = n - 1;
  view.cols = box.extent[n - 1];
  if (merge_full_dims) {
    while (row_dim > 0 && box.extent[row_dim] == shape[row_dim]) {
      --row_dim;
      view.cols *= box.extent[row_dim];
    }
  }
  view.outer_dims = row_dim;
  for (int d = 0; d < row_dim; ++d) {
    view.outer_extent[d] = box.extent[d];
    view.outer_stride[d] = stride[d];
    view.rows *= box.extent[d];
  }
  // Leading extents of 1 do not make a block non-contiguous.
  if (view.rows == 1) {
    view.cols = box.elements();
    view.outer_dims = 0;
  }
  return view;
}

// The view's bytes as a strided range of its tensor's buffer (rows of `cols` elements).
inline StridedRange strided_range_of(const BoxView& view, std::size_t element_bytes) {
  StridedRange range{static_cast<std::size_t>(view.base) * element_bytes,
                     static_cast<std::uint64_t>(view.cols) * element_bytes, view.outer_dims};
  for (int d = 0; d < view.outer_dims; ++d) {
    range.extent[d] = static_cast<std::uint64_t>(view.outer_extent[d]);
    range.stride[d] = static_cast<std::uint64_t>(view.outer_stride[d]) * element_bytes;
  }
  return range;
}

// A dense buffer holding exactly the box, in row-major order (a wire or staging buffer).
inline BoxView dense_view(const Box& box) {
  std::vector<std::int64_t> shape(box.extent.begin(), box.extent.begin() + box.ndim);
  Box at_origin = box;
  at_origin.offset = {};
  return view_of(at_origin, shape, false);
}

}  // namespace reshard::execution

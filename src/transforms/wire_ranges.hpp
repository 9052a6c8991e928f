// What the built-in transforms offer the executor beyond the public ReshardTransform hooks: wire
// buffers as strided ranges. Where the copy service moves rows in place, a slice that is not
// contiguous in its tensor is sent from, or lands in, the tensor itself, row by row: no pack into a
// wire buffer on the sender, no wire buffer and no unpack on the receiver.
#pragma once

#include <vector>

#include "reshard/transform.hpp"
#include "reshard/types.hpp"

namespace reshard::exec {

// One wire buffer of an op: `range` of `buffer`.
struct WireRange {
  Buffer buffer;
  StridedRange range;
  static WireRange whole(const Buffer& buffer) {
    return {buffer, StridedRange::contiguous(0, buffer.bytes)};
  }
};

class RangedTransform {
 public:
  virtual ~RangedTransform() = default;
  // prepare_send and prepare_recv, with strided slices in place; finalize_recv then leaves them
  // alone (it is given the tensor's own buffer for them).
  virtual std::vector<WireRange> send_ranges(const OpSlice& slice, const LocalTensor& src,
                                             void* stream) = 0;
  virtual std::vector<WireRange> recv_ranges(const OpSlice& slice, const LocalTensor& dst) = 0;
};

}  // namespace reshard::exec

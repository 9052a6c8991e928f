// What the built-in transforms offer the executor beyond the public ReshardTransform hooks: wire
// buffers as strided ranges. Where the copy service moves rows in place, a slice that is not
// contiguous in its tensor is sent from, or lands in, the tensor itself, row by row: no pack into a
// wire buffer on the sender, no wire buffer and no unpack on the receiver.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "reshard/transform.hpp"
#include "reshard/types.hpp"

namespace reshard::execution {

class StagingPool;
class ConversionRecording;

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
  // prepare_send and prepare_recv, with strided slices in place (where `in_place`); finalize_recv
  // then leaves them alone (it is given the tensor's own buffer for them). Wire buffers come from
  // `pool`, the executor's, so a staging budget bounds them.
  virtual std::vector<WireRange> send_ranges(const OpSlice& slice, const LocalTensor& src,
                                             void* stream, StagingPool& pool, bool in_place) = 0;
  virtual std::vector<WireRange> recv_ranges(const OpSlice& slice, const LocalTensor& dst,
                                             StagingPool& pool, bool in_place) = 0;
  // While on, the hooks convert nothing: they run only to learn their wire buffers (sizing, and
  // the schedule of a refit whose conversions run phase by phase later).
  virtual void set_dry_run(bool on) = 0;
  // Where each PE's tensors are: `gpu_of_rank[r]` names PE r's GPU (0: not on a GPU). A
  // transform that quantizes on arrival quantizes on the sender instead for an op between two
  // PEs on the same GPU: the same kernel on the same GPU writes the same bits, and half the bytes
  // travel with no bf16 landing buffer. Empty: every op as configured.
  virtual void set_placement(std::vector<std::uint64_t> gpu_of_rank) = 0;
  // ReshardTransform::converts_locally, told whether other ops send the same source slice (to
  // replicas): the public hook cannot know, and answers as if they did.
  virtual bool converts_local_op(const OpSlice& from, const LocalTensor& src, const OpSlice& to,
                                 const LocalTensor& dst, bool source_also_sent) = 0;
  // While set, the transform's calls on its conversion queues (what its hooks queue and its
  // flushes) are also appended to `into`; replaying them later queues the same work. nullptr
  // stops recording.
  virtual void record_conversions(ConversionRecording* into) = 0;
  // The same transform with none of this one's state: what an executor converts with, so the
  // caller's object stays a description (shared by refits and threads, never written by one).
  virtual std::shared_ptr<ReshardTransform> fresh_copy() const = 0;
  // What the transform does, in a string: two built-in transforms with the same description
  // convert alike (execute_reshard_plan keeps one executor for both).
  virtual std::string description() const = 0;
};

}  // namespace reshard::execution

// Executing a reshard plan on a copy service: register once, schedule once, run every refit.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "reshard/copy_service.hpp"
#include "reshard/plan.hpp"
#include "reshard/transform.hpp"

namespace reshard {

// This rank's local tensors by parameter name.
using TensorMap = std::unordered_map<std::string, LocalTensor>;

struct ReshardReport {
  bool rescheduled = false;      // this call registered and scheduled (first call, new buffers)
  std::uint64_t bytes_sent = 0;  // on the wire from this rank, local copies excluded
  std::uint64_t bytes_received = 0;
  std::uint64_t packed_bytes = 0;  // copied through staging because a slice was not contiguous
  // Slices that are not contiguous but travelled in place, row by row (no staging): all of them
  // on transports that move rows in place (CopyService::moves_rows_in_place).
  std::uint64_t strided_bytes = 0;
  // Local ops (source and destination on this rank) that the transform converted straight into
  // the destination, beside the transfer: their bytes in the parameter's dtype.
  std::uint64_t locally_converted_bytes = 0;
  // With RESHARD_PHASE_TIMING=1 only (each phase is then waited for): packing and send-side
  // transforms, the copy service's run (with the local conversions beside it), unpacking and
  // receive-side transforms.
  double prepare_seconds = 0, transfer_seconds = 0, finalize_seconds = 0;
  double issue_seconds = 0;  // of those, the host's own time queuing the work
};

class Resharder {
 public:
  // The plan's ranks are the service's PEs. The transform, if any, applies to the parameters it
  // selects with should_transform().
  Resharder(std::shared_ptr<const ReshardPlan> plan, CopyService& service,
            std::shared_ptr<ReshardTransform> transform = nullptr);
  ~Resharder();
  Resharder(const Resharder&) = delete;
  Resharder& operator=(const Resharder&) = delete;

  // Collective: every PE calls it once per refit. Moves this rank's source slices into the
  // destination tensors of every rank. The first call (and any call whose tensors changed:
  // other pointers, sizes or dtypes) registers and schedules; later calls only run. Scheduling is
  // collective, so a refit with new tensors must pass them on every rank at once. With a CUDA
  // stream, packing, the transfers and the conversions are queued on it; otherwise the call returns
  // when the bytes have landed. Refused before any byte moves when a tensor is missing or too small
  // (naming it).
  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream = nullptr);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One call per refit: keeps a Resharder for (plan, transform) on the service, so the second call
// with the same plan and buffers reuses the schedule. clear_requests() on the service drops it.
ReshardReport execute_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                   const TensorMap& src, const TensorMap& dst, CopyService& service,
                                   std::shared_ptr<ReshardTransform> transform = nullptr,
                                   void* cuda_stream = nullptr);

}  // namespace reshard

// Stream memory operations: waits and flag writes made by a stream's front end
// (cuStreamWaitValue64 / cuStreamWriteValue64, or one cuStreamBatchMemOp call for many), not by a
// kernel. On a GPU that processes share without MPS, kernels of different processes take turns:
// a kernel spinning for another process holds the GPU for a whole time slice (about 4.5 ms on an
// H100), while a stream waiting in its front end lets the other process's work run meanwhile.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <span>

namespace reshard::cuda {

// Wait until `*flag` >= `value`, or write `value` into it. Writes keep the default flags, which
// put a memory barrier before the write: the work queued before a raised flag is visible to the
// peer that sees it. `flush`: a wait that data written by a remote NIC follows
// (CU_STREAM_WAIT_VALUE_FLUSH: those writes are made visible to the work after the wait).
struct StreamMemoryOp {
  std::uint64_t* flag;
  std::uint64_t value;
  bool wait;
  bool flush = false;
  bool operator==(const StreamMemoryOp&) const = default;
};

// Whether the driver has 64-bit stream memory operations for `device` (false: kernels must wait).
bool stream_memory_ops_supported(int device);
// Whether a wait on `device` can flush the writes of remote NICs (CU_STREAM_WAIT_VALUE_FLUSH).
bool can_flush_remote_writes(int device);
// Whether an MPS server runs for this process (its control socket exists where the CUDA driver
// looks for it): then kernels of different processes run side by side, and kernels waiting for
// each other on the GPU are faster than stream waits (4 KiB all-to-all of 2 PEs on one H100:
// 5.4 us against 19.2; without MPS 4,498 us against 302).
bool mps_server_found();
// Queues `ops` on `stream` in order: in cuStreamBatchMemOp calls where `batch` (and the driver
// has it: tens of operations a run cost one driver call each otherwise), else one call each.
void queue_stream_memory_ops(cudaStream_t stream, std::span<const StreamMemoryOp> ops, bool batch);
// Writes `value` into `flag` on `stream`, ignoring failures (releases on the way out).
void write_value_noexcept(cudaStream_t stream, std::uint64_t* flag, std::uint64_t value) noexcept;

}  // namespace reshard::cuda

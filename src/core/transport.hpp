// The seam between the copy service and the engines that move bytes. Each transport lives in its
// own folder under src/transports/ and is created through a factory declared here.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>

#include "core/execution_plan.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/options.hpp"
#include "reshard/types.hpp"

namespace reshard {

struct TransportCaps {
  std::uint64_t chunk_bytes = 1 << 20;  // largest batch it moves at once
  int max_peers_per_round = 1;          // the scheduler's k
  // Smallest chunk the scheduler may shrink to. Transports that copy straight into the
  // destination gain nothing from small batches and set it to chunk_bytes.
  std::uint64_t min_chunk_bytes = 64 << 10;
  // Spans of a strided range (one per row) cost no more than one span of the same bytes; false
  // where each span is a message of its own (NCCL).
  bool strided_rows = true;
  // It waits for peers in its stream's front end (stream memory operations), not in kernels, as
  // GPU transports do where processes share the GPU without MPS. Two streams of one process both
  // waiting there keep such a GPU for a time slice (one H200: 2,224 us against 168 on one stream),
  // so work beside such a transport goes on the same stream, in turn.
  bool front_end_waits = false;
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual TransportCaps caps() const = 0;
  virtual int device() const = 0;
  // Throws kInvalidArgument when the transport cannot read or write this buffer.
  virtual void check_buffer(const Buffer& buffer) const = 0;
  // Collective, at schedule(): anything the plans need before the first run (mappings, handles).
  // A schedule has one plan per phase; the phases run one after the other, in the same order on
  // every PE, and a later phase may reuse memory an earlier one wrote (the executor's staging):
  // a run must not write a peer's memory before that peer has reached the same run.
  virtual void schedule(std::span<const ExecutionPlan> phases) = 0;
  // Moves the bytes of phase `phase` once (`plan` is that phase's plan, as passed to schedule).
  // With stream == nullptr it returns when this PE's sends are read and its receives have landed.
  // A GPU transport given a CUDA stream enqueues the work there instead (ordered after the work
  // already queued) and returns at once.
  virtual void run(const ExecutionPlan& plan, std::size_t phase, void* stream) = 0;
  // Waits for runs enqueued on streams; throws the error a device-side wait recorded.
  virtual void synchronize() {}
  // The schedule was cleared (CopyService::clear_requests): once its runs are complete, let go of
  // what only its plans used, such as mappings of peers' memory, so that the peers may free that
  // memory and share what they allocate in its place. Local: no peer takes part.
  virtual void forget_schedule() {}
  // Where two GPU transports run side by side (the mixed transport's parts), each one's kernels
  // that wait on other kernels may hold at most 1 / `parts` of what the GPU holds at once (parts:
  // the PEs sharing the GPU times the transports each of them runs), so that every such kernel of
  // every PE can be resident together. Local; called before the first schedule().
  virtual void limit_gpu_share(int /*parts*/) {}
  // Tells peers this PE has failed, so they stop waiting for it at once.
  virtual void abort(const std::string& reason) noexcept = 0;
  // Instead of abort() after a run that can_retry(): tells peers this PE failed that run, is
  // alive, and will meet them at its next run to run again; they stop waiting for it at once too.
  virtual void offer_retry(const std::string& reason) noexcept { abort(reason); }
  // After run() threw: whether the failure left every PE able to meet and run again (a peer that
  // timed out or asked for a retry, not one that died or was interrupted), so that the service
  // stays usable. Transports that cannot tell say no, and the service is failed.
  virtual bool can_retry() const { return false; }
  // Whether some PE failed a run it can retry and waits for the others to meet it: checked at the
  // start of each run, before any byte moves.
  virtual bool retry_requested() const { return false; }
  // Collective, on every PE once they have all met outside run(): back to the state schedule()
  // left, so that the next run starts afresh.
  virtual void recover() {}
  virtual void finalize() noexcept = 0;
};

using TransportFactory = std::function<std::unique_ptr<Transport>(Bootstrap&)>;

// Each factory reads its own group of the options (and the common fields: timeout, device).
std::unique_ptr<Transport> make_host_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options);
struct NodeMap;
// Collective: `intra` over a bootstrap of this PE's node, `inter` over `bootstrap`; one schedule
// sends each batch through the one that reaches its peer.
std::unique_ptr<Transport> make_mixed_transport(Bootstrap& bootstrap, const NodeMap& nodes,
                                                const TransportFactory& intra,
                                                const TransportFactory& inter);
// Defined only in builds with CUDA (RESHARD_WITH_CUDA) and NCCL (RESHARD_WITH_NCCL).
std::unique_ptr<Transport> make_cuda_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options);
std::unique_ptr<Transport> make_nccl_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options);
// Defined only in builds with NVSHMEM (RESHARD_WITH_NVSHMEM).
std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap,
                                                  const CopyServiceOptions& options);
// ", CUDA runtime R, driver D" / ", NCCL V" / ", NVSHMEM V" for component_versions(); defined
// with their transports.
std::string cuda_versions();
std::string nccl_version();
std::string nvshmem_version();
// Number of CUDA devices this process sees (0 without CUDA or without a GPU).
int visible_cuda_devices() noexcept;
// Synchronous copies between a CUDA device's memory and the host (verify mode reads GPU ranges
// through them); defined with the CUDA transport.
void copy_device_to_host(void* dst, const void* src, std::size_t bytes, int device);
void copy_host_to_device(void* dst, const void* src, std::size_t bytes, int device);

}  // namespace reshard

// How a copy service is configured, in code. Every field has the default the matching RESHARD_*
// environment variable gives (CopyServiceOptions::from_environment() reads them all), so a
// program can start from the environment and change what it needs, or set everything itself and
// run two services with different settings in one process.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/log.hpp"

namespace reshard {

// kAuto picks, at init(): inside a node (one machine, or `node_size` consecutive PEs) the CUDA
// transport when every PE has a GPU, else the host transport; when the PEs span several nodes,
// one mixed schedule with `inter_node_transport` between them.
enum class TransportKind { kAuto, kHost, kCuda, kNccl, kNvshmem };

TransportKind parse_transport_kind(
    const std::string& name);  // "auto", "host", "cuda", "nccl", "nvshmem"
const char* transport_kind_name(TransportKind kind);

// Host shared memory (CPU buffers; the transport CI runs).
struct HostTransportOptions {
  // Shared memory each PE offers its peers to stage sends. RESHARD_HOST_STAGING_BYTES.
  std::uint64_t staging_bytes = 8ull << 20;
};

// CUDA IPC between the GPUs of one machine, and between processes sharing a GPU.
struct CudaTransportOptions {
  // "auto" (by per-peer size), "sm" (copy kernels), "ce" (copy engines), or "autotune" (times
  // sm, ce and auto at schedule() and all PEs take the fastest). RESHARD_CUDA_ENGINE.
  std::string engine = "auto";
  // How runs are ordered with peers on this PE's own GPU (colocated processes): "delegate" (one
  // process per GPU makes the copies among its PEs), "stream" (each PE copies its own bytes, the
  // streams wait on each other's flags), "kernel" (copy kernels spin on flags: fast only under
  // MPS) or "auto" (kernel where an MPS server is found, else delegate).
  // RESHARD_CUDA_SAME_DEVICE.
  std::string same_device = "auto";

  // Former names of AdvancedOptions::cuda_ce_min_bytes, cuda_ctas_per_peer and
  // cuda_bytes_per_cta, kept for one release: a value set here (and not there) is used, with a
  // warning at the service's construction.
  std::uint64_t ce_min_bytes = 32ull << 20;
  int ctas_per_peer = 64;
  std::uint64_t bytes_per_cta = 64ull << 10;
};

// NCCL point-to-point (GPUs across nodes, or where CUDA IPC is not available).
struct NcclTransportOptions {
  // Nonblocking communicator, every NCCL call awaited with the timeout and dead-peer checks;
  // false: NCCL's blocking calls (less host time per run). RESHARD_NCCL_NONBLOCKING.
  bool nonblocking = true;
  // Former name of AdvancedOptions::nccl_group_spans, kept for one release (as
  // CudaTransportOptions' former names).
  std::uint32_t group_spans = 64;
};

// NVSHMEM (GPUs across nodes, one mixed schedule with CUDA IPC inside them).
struct NvshmemTransportOptions {
  // Symmetric staging each PE allocates: two inbox slots per peer and two outbox slots.
  // RESHARD_NVSHMEM_STAGING_BYTES.
  std::uint64_t staging_bytes = 512ull << 20;
  // Where a PE waits for its peers' signals: "kernel" (the copy kernels spin on them), "stream"
  // (the stream's front end waits, stream memory operations, before kernels that do not wait),
  // or "auto": the stream where processes share this PE's GPU without MPS (a kernel spinning there
  // for another process holds the GPU a time slice), else the kernels. RESHARD_NVSHMEM_WAITS.
  std::string waits = "auto";
};

// Tuning and diagnosis: the defaults are what the measurements chose (docs/performance.md says
// what each measured), and a refit needs none of them changed. Each has its RESHARD_* variable.
struct AdvancedOptions {
  // Tuning.
  // Per-peer size from which the CUDA engine "auto" drives a peer with the copy engine (when those
  // bytes go in at most 4 copies). RESHARD_CUDA_CE_MIN_BYTES.
  std::uint64_t cuda_ce_min_bytes = 32ull << 20;
  // Most CTAs the CUDA SM engine gives one peer, 1..1024 (the total stays within one wave).
  // RESHARD_CUDA_CTAS_PER_PEER.
  int cuda_ctas_per_peer = 64;
  // Bytes of a peer's share that earn it another SM-engine CTA, at least 4 KiB.
  // RESHARD_CUDA_BYTES_PER_CTA.
  std::uint64_t cuda_bytes_per_cta = 64ull << 10;
  // Streams the CUDA copy engine's peers are spread over, 1..kMaxCudaCeStreams (one copy at a
  // time per GPU is what NVSwitch serves best). RESHARD_CUDA_CE_STREAMS.
  static constexpr int kMaxCudaCeStreams = 8;
  int cuda_ce_streams = 1;
  // 16-byte loads in flight per thread in the SM engine: 4 or 8. RESHARD_CUDA_UNROLL.
  int cuda_unroll = 8;
  // The SM engine's kernel is launched with programmatic dependent launch (on the GPU when the
  // stream's previous kernel ends); false: launched plainly. RESHARD_CUDA_EARLY_LAUNCH.
  bool cuda_early_launch = true;
  // The stream memory operations that order PEs sharing a GPU (and their pairs with other GPUs)
  // go to each stream in one cuStreamBatchMemOp call per run's begin and end, instead of one
  // driver call each (tens of calls a run at 8 PEs; on 2x H200 the batch took a 4 KiB all-to-all
  // of 4 PEs from 83 to 41 us). false: one call each. RESHARD_CUDA_BATCH_MEMOPS.
  bool cuda_batch_memops = true;
  // Most spans per (peer, direction) in one NCCL group, at least 1. RESHARD_NCCL_GROUP_SPANS.
  std::uint32_t nccl_group_spans = 64;
  // false: the NVSHMEM transport puts through its outbox even to peers it could write directly,
  // the path a peer on another node takes. RESHARD_NVSHMEM_DIRECT.
  bool nvshmem_direct = true;
  // false: the NVSHMEM transport queues its sends on the caller's stream, between the receives.
  // RESHARD_NVSHMEM_SEND_STREAM.
  bool nvshmem_send_stream = true;
  // Most peers each way in one round of the NVSHMEM transport (0: every peer at once).
  // RESHARD_NVSHMEM_PEERS_PER_ROUND.
  int nvshmem_peers_per_round = 0;
  // A refit in phases on GPUs that no two PEs share, where some PE reads staging after its bytes
  // land (conversions on arrival, packed slices), alternates its phases between two halves of the
  // staging budget and reads each phase's arrivals beside the next phase's transfer
  // (ReshardReport::pipelined). false on any PE: one phase after the other, each in the whole
  // budget. RESHARD_PIPELINED_PHASES.
  bool pipelined_phases = true;

  // Diagnosis.
  // The CUDA transport's kernel stamps each run's steps on the GPU clock and logs their medians
  // at finalize. RESHARD_CUDA_TRACE.
  bool cuda_trace = false;
  // The NVSHMEM transport times every step of a run (serialising it) and logs the means at
  // finalize. RESHARD_NVSHMEM_TRACE.
  bool nvshmem_trace = false;
  // A refit waits after each of its steps (prepare, transfer, finalize) and reports their times
  // (ReshardTimings); the waits slow the refit. RESHARD_STEP_TIMING (RESHARD_PHASE_TIMING, its
  // former name, is read where it is not set).
  bool step_timing = false;

  bool operator==(const AdvancedOptions&) const = default;
};

// Former name of AdvancedOptions (CopyServiceOptions::debug), kept for one release: a field set
// here (and not there) is used, with a warning at the service's construction. `phase_timing` is
// AdvancedOptions::step_timing.
struct DebugOptions {
  bool cuda_trace = false;
  bool nvshmem_trace = false;
  bool phase_timing = false;
  bool pipelined_phases = true;
  static constexpr int kMaxCudaCeStreams = AdvancedOptions::kMaxCudaCeStreams;
  int cuda_ce_streams = 1;
  int cuda_unroll = 8;
  bool cuda_early_launch = true;
  bool cuda_batch_memops = true;
  bool nvshmem_direct = true;
  bool nvshmem_send_stream = true;
  int nvshmem_peers_per_round = 0;

  bool operator==(const DebugOptions&) const = default;
};

struct CopyServiceOptions {
  // Which transport; RESHARD_TRANSPORT.
  TransportKind transport = TransportKind::kAuto;
  // What kAuto uses between nodes: kNvshmem (default where built), kNccl, or kHost (nodes declared
  // on one machine only); nullopt: the default. RESHARD_INTER_NODE_TRANSPORT.
  std::optional<TransportKind> inter_node_transport;
  // Splits the PEs into nodes of this many consecutive PEs (each host is a node already), so
  // one machine runs the schedule a cluster runs. RESHARD_NODE_SIZE.
  std::optional<int> node_size;
  // CUDA device of this PE; nullopt: local rank modulo the visible devices. RESHARD_DEVICE.
  std::optional<int> device;
  // How long a wait on a peer may last before it fails naming the peer, once every PE it waits for
  // has arrived (begun the same schedule() or run()): a transfer or exchange that stalls.
  // RESHARD_TIMEOUT_S.
  std::chrono::milliseconds timeout{30000};
  // How long schedule() and run() wait for a PE that has not begun them yet: an RL engine entering
  // the refit while its trainer finishes a long step arrives minutes late without anything being
  // wrong (NCCL and torch.distributed allow 10 minutes too). RESHARD_ARRIVAL_TIMEOUT_S.
  std::chrono::milliseconds arrival_timeout{600000};
  // Verify mode (see CopyService::set_verify). RESHARD_VERIFY.
  bool verify = false;
  // Caps the scheduler's chunk size (nullopt: the transport's). RESHARD_CHUNK_BYTES.
  std::optional<std::uint64_t> chunk_bytes;
  // Log level from init() on. RESHARD_LOG_LEVEL.
  LogLevel log_level = LogLevel::kInfo;

  HostTransportOptions host;
  CudaTransportOptions cuda;
  NcclTransportOptions nccl;
  NvshmemTransportOptions nvshmem;
  AdvancedOptions advanced;
  DebugOptions debug;  // former name of `advanced`, kept for one release (see DebugOptions)

  // The defaults, each overridden by its RESHARD_* variable where set (a malformed value is
  // refused naming the variable).
  static CopyServiceOptions from_environment();
  // Refuses a value outside its range, naming the field (e.g. "cuda.engine"), and a field set
  // under its former name and its new one to different values. The service checks its options
  // at construction.
  void validate() const;
  // These options with every field set under a former name moved to its new name, the former
  // names left at their defaults: what a service runs with (CopyService::options()). Logs a
  // warning for each former name it moves.
  CopyServiceOptions with_former_names_applied() const;
  // Every (former name, new name) pair of fields, e.g. ("debug.phase_timing",
  // "advanced.step_timing"): the one table the C++ and Python former names follow.
  static std::vector<std::pair<std::string, std::string>> former_names();
};

}  // namespace reshard

// Every RESHARD_* environment variable is read here and nowhere else, so the full list of knobs
// lives in one place (and in the README).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "reshard/log.hpp"
#include "reshard/options.hpp"

namespace reshard::env {

// RESHARD_TIMEOUT_S: how long any wait on a peer may last (default 30 s).
std::chrono::milliseconds timeout();
// RESHARD_LOG_LEVEL: overrides the level passed to init().
std::optional<LogLevel> log_level();
// RESHARD_HOST_STAGING_BYTES: shared memory each PE offers its peers to stage sends (default 8
// MiB).
std::uint64_t host_staging_bytes();
// RESHARD_STAGING_BUDGET: most staging memory the executor holds per rank at once ("unlimited" for
// no bound; 0 for none); unset: none given (see ReshardOptions::staging_budget).
std::optional<std::uint64_t> staging_budget();
// RESHARD_CHUNK_BYTES: caps the scheduler's chunk size (default: the transport's).
std::optional<std::uint64_t> chunk_bytes();
// RESHARD_JOB_ID: set by reshard-run so leftovers of a failed job can be found and removed.
std::optional<std::string> job_id();

// RESHARD_TRANSPORT: overrides the transport chosen in code ("auto", "host", "cuda", "nccl").
std::optional<std::string> transport();
// RESHARD_NODE_SIZE: splits the PEs into nodes of this many consecutive ranks (each host is a node
// already), so one machine runs the mixed intra-/inter-node schedule a cluster runs.
std::optional<int> node_size();
// RESHARD_INTER_NODE_TRANSPORT: what auto uses between nodes: "nvshmem" (default where built),
// "nccl", or "host" (CPU memory, nodes declared on one machine only).
std::optional<std::string> inter_node_transport();
// RESHARD_DEVICE: CUDA device of this PE (default: local rank modulo the visible devices).
std::optional<int> device();
// RESHARD_CUDA_ENGINE: "auto" (by per-peer size), "sm", "ce", or "autotune" (times sm, ce and auto
// at schedule() and all PEs take the fastest) for the CUDA transport.
std::string cuda_engine();
// RESHARD_CUDA_CE_STREAMS: streams the copy engine's peers are spread over (default 1: one
// copy-engine copy at a time per GPU is what NVSwitch serves best).
int cuda_ce_streams();
// RESHARD_CUDA_CE_MIN_BYTES: per-peer size from which "auto" drives a peer with the copy engine
// (when those bytes go in at most 4 copies; default 32 MiB).
std::uint64_t cuda_ce_min_bytes();
// RESHARD_CUDA_CTAS_PER_PEER: most CTAs the SM engine gives one peer (default 64; the total stays
// within one wave).
int cuda_ctas_per_peer();
// RESHARD_CUDA_BYTES_PER_CTA: bytes of a peer's share that earn it another SM-engine CTA (up to
// cuda_ctas_per_peer; default 64 KiB).
std::uint64_t cuda_bytes_per_cta();
// RESHARD_CUDA_UNROLL: 16-byte loads in flight per thread in the SM engine, 4 or 8 (default 8).
int cuda_unroll();
// RESHARD_CUDA_SAME_DEVICE: how runs are ordered with peers on this PE's own GPU (colocated
// processes): "delegate" (one process per GPU makes the copies among its PEs, the others' streams
// only wait: the GPU never changes hands within a run), "stream" (each PE copies its own bytes,
// the streams wait on each other's flags, so the other process's kernels run meanwhile),
// "kernel" (the copy kernels spin on flags, as between GPUs: fast only when MPS is on) or "auto"
// (default: kernel where this process finds an MPS server, else delegate).
std::string cuda_same_device();
// RESHARD_CUDA_EARLY_LAUNCH: the SM engine's kernel is launched with programmatic dependent launch,
// so it is on the GPU when the stream's previous kernel ends (default 1; 0 launches it plainly).
bool cuda_early_launch();

// RESHARD_NCCL_NONBLOCKING: NCCL communicator in nonblocking mode, every call awaited with
// RESHARD_TIMEOUT_S and dead-peer checks (default 1); 0: NCCL's blocking calls.
bool nccl_nonblocking();
// RESHARD_NCCL_GROUP_SPANS: most spans per (peer, direction) in one NCCL group (default 64).
std::uint32_t nccl_group_spans();
// RESHARD_NVSHMEM_STAGING_BYTES: symmetric staging each PE allocates for the NVSHMEM transport,
// split into two inbox slots per peer and two outbox slots (default 512 MiB).
std::uint64_t nvshmem_staging_bytes();
// RESHARD_NVSHMEM_DIRECT=0: the NVSHMEM transport puts through its outbox even to peers it could
// write directly (over NVLink), which is the path a peer on another node takes.
bool nvshmem_direct();
// RESHARD_NVSHMEM_SEND_STREAM=0: the NVSHMEM transport queues its sends on the caller's stream,
// between the receives, instead of on a stream of their own (default 1).
bool nvshmem_send_stream();
// RESHARD_NVSHMEM_PEERS_PER_ROUND: most peers each way in one round of the NVSHMEM transport
// (default 0: every peer at once; 1 is the matching schedule, one kernel per peer and direction).
int nvshmem_peers_per_round();
// RESHARD_NVSHMEM_TRACE=1: the NVSHMEM transport times every step of a run (diagnosis; it
// serialises the run) and logs the means at finalize.
bool nvshmem_trace();
// RESHARD_CUDA_TRACE=1: the CUDA transport's fused kernel stamps each run's phases on the GPU
// clock (diagnosis of the fixed cost per run) and logs their medians at finalize.
bool cuda_trace();
// RESHARD_VERIFY=1: verify mode for every copy service (see CopyService::set_verify).
bool verify();
// RESHARD_TEST_CORRUPT_TASK=<task id>: tests of verify mode flip a byte of that task's receive
// after each run, before the check.
std::optional<std::uint64_t> test_corrupt_task();
// RESHARD_PHASE_TIMING=1: execute_reshard_plan waits for each phase (prepare, transfer,
// finalize) and reports its time; the waits slow the refit, so this is for diagnosis.
bool phase_timing();

std::optional<std::string> get(const char* name);
int get_int(const char* name, int fallback);

}  // namespace reshard::env

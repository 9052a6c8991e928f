// The CUDA transport's state, shared by the files that implement it, one idea each:
// cuda_transport.cpp sets up and tears down, destination_exchange.cpp maps peers' memory,
// schedule_layout.cpp lays each schedule out, launch.cpp queues a run, run_failures.cpp handles
// a run that fails. Internal to src/transports/cuda.
#pragma once

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/message.hpp"
#include "core/processes.hpp"
#include "core/transport.hpp"
#include "gpu/copy_kernels.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/device_array.hpp"
#include "gpu/run_board.hpp"
#include "gpu/run_watchdog.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "transports/cuda/ipc_memory.hpp"
#include "transports/cuda/same_device_order.hpp"

namespace reshard::cuda {

constexpr std::uint64_t kUnbounded = 1ull << 50;  // direct copies need no chunks or rounds
constexpr std::uint32_t kBounceHandle = UINT32_MAX;
constexpr int kCopyEngineStreams = AdvancedOptions::kMaxCudaCeStreams;
// Autotune: untimed then timed runs of each candidate engine at schedule().
constexpr int kAutotuneWarmups = 2;
constexpr int kAutotuneRuns = 5;
// Most copies to one peer that auto still gives the copy engine (see lay_out).
constexpr std::size_t kCopyEngineMaxCopies = 4;
// Pieces (descriptors) one SM-engine CTA takes on: 4 for each of its 16 warps.
constexpr std::uint64_t kPiecesPerCta = 64;

// A span of memory shared through CUDA IPC, as the exchange carries it: which of the sender's
// exported allocations, and where in it.
struct SharedSpan {
  std::uint32_t handle;  // kBounceHandle: into the receiver's bounce buffer
  std::uint32_t reserved;
  std::uint64_t offset;
  std::uint64_t bytes;
};

struct PeerHandle {
  std::int32_t owner;
  std::uint32_t handle;
};

struct WireBatch {
  std::int32_t peer;
  std::uint32_t span_count;
};

// Everything this PE copies to one destination, before it is laid out for the kernels.
struct GroupPlan {
  PeerGroup group{};
  std::vector<CopyDescriptor> descriptors;
  // Copies of another PE on this GPU that this PE, the GPU's leader, makes for it (its sends and
  // its local copies): no flags, the streams order them (SameDeviceOrder::lead).
  bool delegated = false;

  void add(const unsigned char* src, unsigned char* dst, std::uint64_t bytes) {
    append_copy(descriptors, 0, group.bytes, src, dst, bytes);
  }
  bool has_rows() const {
    return std::any_of(descriptors.begin(), descriptors.end(),
                       [](const CopyDescriptor& d) { return d.has_rows(); });
  }
};

// One copy-engine stream's share of a run: its peers' copies in start order, in the arrays
// cudaMemcpyBatchAsync takes, and per peer where its copies end and the done flag that follows
// them.
struct CopyEngineBatch {
  struct Peer {
    std::size_t copies_end;
    std::size_t boxes_end;
    std::uint64_t* done;  // the peer's done[me], mapped here (null: local copies)
  };
  std::vector<void*> dsts;
  std::vector<const void*> srcs;
  std::vector<std::size_t> sizes;
  std::vector<CopyDescriptor> boxes;  // descriptors with rows: one cudaMemcpy2DAsync each
  std::vector<Peer> peers;
};

// Kernel inputs of one schedule, in device memory.
struct PreparedRun {
  std::vector<GroupPlan> groups;  // every destination, in start order; engines not yet chosen
  KernelArgs base{};
  DeviceArray<CopyDescriptor> copy_descriptors, unstage_descriptors;
  DeviceArray<PeerGroup> copy_groups, signal_groups, end_groups, unstage_groups;
  DeviceArray<int> sources;
  DeviceArray<std::uint64_t*> source_ready;
  KernelArgs copy_args{};     // fused, or the SM share of a mixed run
  KernelArgs signal_args{};   // begin of a copy-engine or mixed run: every peer group
  KernelArgs end_args{};      // its end: the groups the copy engine does not signal
  KernelArgs unstage_args{};  // bounce buffer -> destinations
  bool fused = true;
  std::vector<CopyEngineBatch> copy_engine_batches;  // one per stream used
  std::uint64_t copy_engine_bytes = 0;
  void* bounce = nullptr;
  std::uint64_t bounce_bytes = 0;
  SameDeviceOrder same_device;  // this phase's peers ordered by the streams
  // Delegated copies (see CudaTransport::exchange_destinations): `delegated` when this phase's
  // sends of the PEs of this GPU to the peers their streams order are made by its leader. A
  // follower's local copies are the leader's then too, and a follower with no peer its kernels
  // order runs no kernel at all (kernel_idle): the leader's kernel advances its run count
  // (`follower_runs`, on the leader).
  bool delegated = false;
  bool local_copies_delegated = false;
  bool kernel_idle = false;
  DeviceArray<std::uint64_t*> follower_runs;
  std::uint32_t follower_run_count = 0;
  // The same-GPU done flags the kernel completing each run raises (KernelArgs::stream_done; the
  // run then queues no SameDeviceOrder::end()).
  DeviceArray<std::uint64_t*> stream_done;
  // The CTAs this phase's launches may keep resident at once (0: no limit), where PEs on this GPU
  // order their runs by the kernels (see kernel_ordered_sharers_): the GPU's resident wave shared
  // in proportion to what each of them wants in this phase.
  std::uint64_t cta_share = 0;

  ~PreparedRun() {
    if (bounce != nullptr) cudaFree(bounce);
  }
};

class CudaTransport final : public Transport {
 public:
  CudaTransport(Bootstrap& bootstrap, const CopyServiceOptions& options);
  ~CudaTransport() override { finalize(); }

  const char* name() const override { return "cuda"; }
  TransportCaps caps() const override {
    TransportCaps caps{kUnbounded, n_pes_, kUnbounded};
    caps.front_end_waits = front_end_waits_;
    return caps;
  }
  int device() const override { return device_; }
  void limit_gpu_share(int parts) override {
    const std::uint64_t share =
        std::max<std::uint64_t>(1, static_cast<std::uint64_t>(sm_count_) *
                                       std::max(1, fused_copy_ctas_per_sm()) / std::max(1, parts));
    resident_cta_share_ = resident_cta_share_ == 0 ? share : std::min(resident_cta_share_, share);
  }
  void check_buffer(const Buffer& buffer) const override {
    check_device_buffer(buffer, device_, "cuda");
  }
  void schedule(std::span<const ExecutionPlan> phases) override;
  void run(const ExecutionPlan& plan, std::size_t phase, void* stream) override;
  void synchronize() override;
  void forget_schedule() override;
  void abort(const std::string& reason) noexcept override;
  void offer_retry(const std::string& reason) noexcept override;
  bool can_retry() const override { return can_retry_; }
  bool retry_requested() const override;
  void recover() override;
  void finalize() noexcept override;

 private:
  // Collective. Empty optional: some PE could not map an allocation; `refused` then lists, on
  // each PE, its allocations to stage through the bounce buffer on the next attempt.
  // `first_phase`: the first phase of a new schedule, which closes the mappings of the last one
  // that the new phase does not use.
  std::optional<std::vector<GroupPlan>> exchange_destinations(const ExecutionPlan& plan,
                                                              PreparedRun& prepared,
                                                              std::vector<CopyDescriptor>& unstage,
                                                              std::vector<std::uintptr_t>& refused,
                                                              bool first_phase, bool last_attempt);
  // Collective: one phase of a schedule.
  std::unique_ptr<PreparedRun> schedule_phase(const ExecutionPlan& plan, bool first_phase);
  void assign_ctas(std::vector<PeerGroup>& groups, std::uint32_t& total, std::uint64_t share) const;
  // The CTAs `groups` (and a bounce buffer's `unstage` copies) would take with no share.
  std::uint64_t ctas_wanted(const std::vector<GroupPlan>& groups,
                            const std::vector<CopyDescriptor>& unstage) const;
  // Collective where some GPU is shared by kernel-ordered PEs: this phase's resident share.
  std::uint64_t phase_cta_share(std::uint64_t wanted);
  // Chooses each group's engine by `engine` (sm, ce or auto) and uploads the kernels' inputs.
  void lay_out(PreparedRun& prepared, const std::string& engine);
  // Collective: times each engine on the schedule and lays out the one slowest PE finds fastest.
  void autotune(PreparedRun& prepared);
  void launch(PreparedRun& prepared, cudaStream_t stream);
  void launch_with_copy_engines(PreparedRun& prepared, cudaStream_t stream);
  // Queues batch's copies [begin, end) on stream.
  void queue_copies(const CopyEngineBatch& batch, std::size_t begin, std::size_t end,
                    bool may_batch, cudaStream_t stream);
  // One descriptor with rows as a 2-D copy-engine copy.
  void queue_rows(const CopyDescriptor& box, cudaStream_t stream);
  // Waits for the run that recorded `event`: a peer that exits, or (watch_board) gives its run up,
  // ends the wait at once; a wait past the kernels' own limits ends it too.
  void wait_for(cudaEvent_t event, const char* what, bool watch_board = true);
  // Whether a launch of `ctas` CTAs may be early (programmatic dependent launch).
  bool early_launch_for(std::uint32_t ctas, std::uint64_t share);
  // A run is stuck: records why (as a kernel's failed wait would), stops the copies that follow
  // and lets this PE's stream past its waits on same-GPU peers.
  void fail_run(unsigned int code, int peer, unsigned int wait_kind,
                const std::string& why = {}) noexcept;
  // While a run with same-GPU peers is pending: their waits are the stream's, with no timeout of
  // their own, so the watchdog gives up on them after RESHARD_TIMEOUT_S or when a peer exits.
  void check_same_device_run() noexcept;
  void log_trace() noexcept;
  void throw_device_failure();
  // Throws where a peer gave its run up (the run board): before a run, or while waiting for one.
  void check_peers_on_board(const char* waiting_for);
  // The seconds a wait of kind `wait_kind` (kWait*) had: arrival for kWaitArrival.
  std::uint64_t seconds_for(unsigned int wait_kind) const;

  Bootstrap& bootstrap_;
  int me_ = 0;
  int n_pes_ = 0;
  int device_ = -1;
  int sm_count_ = 0;
  std::string engine_;
  std::uint64_t copy_engine_min_bytes_ = 0;
  int copy_engine_streams_used_ = 1;
  bool batch_copies_ = true;     // cudaMemcpyBatchAsync works here (else one cudaMemcpyAsync each)
  std::uint64_t max_pitch_ = 0;  // cudaMemcpy2DAsync refuses longer pitches
  int ctas_per_peer_ = 64;
  std::uint64_t bytes_per_cta_ = 64 << 10;
  int unroll_ = 8;
  bool early_launch_ = true;
  bool batch_memops_ = false;             // SameDeviceOrder's batch
  std::uint64_t* ready_epoch_ = nullptr;  // SignalLayout::ready_epoch of this PE
  std::chrono::milliseconds timeout_{};   // CopyServiceOptions::timeout
  std::uint64_t timeout_ns_ = 0;
  std::chrono::milliseconds arrival_timeout_{};  // CopyServiceOptions::arrival_timeout
  RunBoard board_;
  // The last run failed with every peer alive and able to meet (a timeout, a peer's retry).
  bool can_retry_ = false;
  cudaStream_t stream_ = nullptr;
  cudaStream_t copy_engine_streams_[kCopyEngineStreams] = {};
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t joins_[kCopyEngineStreams] = {};
  cudaEvent_t last_run_ = nullptr;
  bool run_pending_ = false;
  std::uint64_t* trace_ = nullptr;  // RESHARD_CUDA_TRACE: device stamps, see TraceMark
  std::uint64_t* signals_ = nullptr;
  std::vector<std::uint64_t*> peer_signals_;           // mapped; [me_] is signals_
  DeviceArray<const std::uint64_t*> peer_waiting_on_;  // each PE's SignalLayout::waiting_on
  DeviceStatus* status_ = nullptr;                     // pinned host memory
  HostFailure host_failure_;                           // what the host found (fail_run)
  DeviceStatus* status_device_ = nullptr;
  std::vector<pid_t> pids_;
  IpcImports signal_imports_;  // peers' flags, for the transport's lifetime
  IpcImports imports_;         // peers' destinations, for the current schedule
  std::vector<std::unique_ptr<PreparedRun>> prepared_;  // per phase
  // Same-GPU peers (colocated processes) ordered by the streams, not by the kernels.
  std::vector<bool> same_device_;
  // Peers ordered by the streams: those of same_device_, and every peer on another GPU where this
  // PE's GPU or the peer's is shared that way. Without MPS a kernel that waits on a GPU shared by
  // processes holds it for a whole time slice, and with peers on other GPUs the waits chain from
  // GPU to GPU (4 H200s, 2 PEs each: a 4 KiB all-to-all took 4.8 ms with the kernels waiting
  // across GPUs). Flags raised and waited for by the streams let the other processes' work run.
  std::vector<bool> stream_ordered_;
  // What init found: the relation every schedule starts from, each PE's GPU, whether each PE would
  // order its GPU's pairs by the streams, and whether it orders them per schedule instead (MPS with
  // the `auto` order: a pair whose bytes go one way in a schedule is ordered by the streams, where
  // the receiver's kernel would only wait; a pair that exchanges both ways by the kernels).
  std::vector<std::string> gpus_;
  std::vector<bool> streams_, per_schedule_;
  std::vector<bool> stream_shared_;  // on a GPU shared through the streams (stream_ordered_peers)
  // Some pair of one GPU orders per schedule (the same on every PE).
  bool any_per_schedule_ = false;
  bool front_end_waits_ = false;  // as init found it (TransportCaps::front_end_waits)
  // The pair (p, q) as init ordered it: by the streams (stream_ordered_peers's relation).
  bool init_by_streams(int p, int q) const {
    return ordered_by_streams(streams_, stream_shared_, p, q);
  }
  // Collective where any_per_schedule_: this schedule's order of pairs on one GPU.
  void order_pairs_of_this_schedule(std::span<const ExecutionPlan> phases);
  // stream_ordered_ and the kernel-ordered sharers of this PE's GPU, given which pairs the streams
  // order and which pairs exchange bytes at all.
  void order_pairs(const std::function<bool(int, int)>& by_streams,
                   const std::function<bool(int, int)>& exchange);
  bool any_stream_ordered() const {
    return std::find(stream_ordered_.begin(), stream_ordered_.end(), true) != stream_ordered_.end();
  }
  // Where peers on this GPU are ordered by the kernels (MPS: the processes' kernels run side by
  // side and wait on each other's flags), every one of those kernels must be resident at once:
  // the GPU's resident wave is shared among them, each phase in proportion to the CTAs each wants
  // (PreparedRun::cta_share: a PE that only receives wants one, so the senders beside it get the
  // rest). This PE and those peers (empty where it has none), and whether any GPU of the job is
  // shared so (the same on every PE: the share's all-gather is collective).
  std::vector<int> kernel_ordered_sharers_;
  bool kernel_ordered_sharing_anywhere_ = false;
  // Where another GPU transport runs beside this one (limit_gpu_share): a fixed share.
  std::uint64_t resident_cta_share_ = 0;
  bool previous_launch_large_ = false;  // more than half the share (early_launch_for)
  // Where every PE on this GPU delegates (see exchange_destinations): the lowest of them leads.
  // Found at init without MPS; under MPS with the `auto` order, per schedule (where the GPU's PEs
  // send one way only: order_pairs_of_this_schedule).
  bool delegate_ = false;
  int leader_ = -1;
  std::vector<int> followers_;  // the group but its leader
  // Delegates among this PE and the PEs `with` picks: the lowest of them leads (delegate_,
  // leader_ and followers_ as init and each schedule set them).
  void delegate_among(const std::function<bool(int)>& with);
  bool in_delegated_group(int pe) const {
    return delegate_ && pe != me_ &&
           (pe == leader_ ||
            std::find(followers_.begin(), followers_.end(), pe) != followers_.end());
  }
  SameDeviceOrder same_device_order_;  // every phase's same-GPU peers (the watchdog's)
  cudaStream_t release_stream_ = nullptr;
  std::chrono::steady_clock::time_point watched_since_{};  // of the pending run; epoch: none
  // When the watchdog first saw every same-GPU peer begin the pending run (the transfer's clock
  // starts there; a peer not yet begun has the arrival timeout). Epoch: not yet.
  std::chrono::steady_clock::time_point all_begun_since_{};
  RunWatchdog watchdog_;  // its mutex guards same_device_order_ and watched_since_
  bool aborted_ = false;
  bool finalized_ = false;
};

}  // namespace reshard::cuda

// The NVSHMEM transport's state, shared by the files that implement it, one idea each:
// nvshmem_runtime.cpp holds NVSHMEM's process-wide state and start, nvshmem_transport.cpp sets a
// service's transport up and tears it down, schedule_waves.cpp lays each schedule out in rounds
// and waves, launch.cpp queues a run, run_failures.cpp bounds its waits and handles a run that
// fails. Internal to src/transports/nvshmem.
#pragma once

#include <nvshmem_host.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/message.hpp"
#include "core/nodes.hpp"
#include "core/processes.hpp"
#include "core/transport.hpp"
#include "gpu/copy_kernels.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/device_array.hpp"
#include "gpu/run_board.hpp"
#include "gpu/run_watchdog.hpp"
#include "gpu/stream_memory_ops.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard::nvshmem {

using Clock = std::chrono::steady_clock;
using cuda::CopyDescriptor;
using cuda::DeviceArray;
using cuda::KernelArgs;
using cuda::PeerGroup;

constexpr int kDepth = 2;  // inbox slots per source PE: one filling while one drains
constexpr std::uint64_t kAlign = 256;
constexpr std::uint64_t kMinChunk = 64 << 10;
constexpr std::uint64_t kMaxChunk = 64 << 20;
constexpr std::uint64_t kBytesPerCta = 64 << 10;

inline std::uint64_t align_up(std::uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Adds a group to a launch the caller sized to fit (for_each_launch).
inline void add_to_launch(cuda::FlaggedLaunch& launch, std::uint32_t group, std::uint32_t ctas,
                          const cuda::CopyFlags& flags) {
  if (!launch.add(group, ctas, flags)) {
    throw_error(ErrorCode::kInvalidState, "nvshmem: a flagged launch of more than " +
                                              std::to_string(cuda::kMaxFlaggedGroups) +
                                              " groups (a bug in reshard)");
  }
}

// NVSHMEM is initialised once per process and stays up until the process ends: initialising it
// again after nvshmem_finalize is not supported, and its finalize is a collective that would hang
// beside a dead peer. The symmetric heap, its slots and the per-pair batch counters live here too,
// so a later copy service in the same process continues where the last one stopped.
struct Runtime {
  std::mutex mutex;
  bool initialized = false;
  bool in_use = false;
  std::string broken;  // why NVSHMEM cannot be used again in this process
  int rank = -1, size = 0, device = -1;
  std::uint64_t chunk = 0;
  std::byte* heap = nullptr;
  // Global batch counts per peer: sent to it, received from it; the sequence number of the next
  // batch. Both ends of a pair count the same batches, so they agree on every signal value.
  std::vector<std::uint64_t> sent, received;
  // Per peer and inbox slot: the sequence number last put there, which must be acknowledged
  // before the slot is filled again.
  std::vector<std::array<std::optional<std::uint64_t>, kDepth>> last_put;
  std::uint64_t outbox_uses = 0;

  // Heap layout, identical on every PE: data signals [peer][slot], acknowledgements [peer], the
  // waiting_on word (see cuda::SignalLayout), inboxes [peer][slot][chunk], outboxes [slot][chunk].
  std::uint64_t* data_signal(int peer, int slot) const {
    return reinterpret_cast<std::uint64_t*>(heap) + peer * kDepth + slot;
  }
  std::uint64_t* ack_signal(int peer) const {
    return reinterpret_cast<std::uint64_t*>(heap) + size * kDepth + peer;
  }
  std::uint64_t* waiting_on() const {
    return reinterpret_cast<std::uint64_t*>(heap) + size * (kDepth + 1);
  }
  // The data signals and acknowledgements.
  std::uint64_t signal_words_bytes() const { return sizeof(std::uint64_t) * size * (kDepth + 1); }
  std::uint64_t signal_bytes() const { return align_up(signal_words_bytes() + 8); }
  std::byte* inbox(int peer, int slot) const {
    return heap + signal_bytes() + (static_cast<std::uint64_t>(peer) * kDepth + slot) * chunk;
  }
  std::byte* outbox(int slot) const {
    return heap + signal_bytes() + (static_cast<std::uint64_t>(size) * kDepth + slot) * chunk;
  }
  std::uint64_t heap_bytes() const {
    return signal_bytes() + (static_cast<std::uint64_t>(size) + 1) * kDepth * chunk;
  }
};

// The process's NVSHMEM state (one per process: see Runtime).
Runtime& runtime();
// Collective over `bootstrap`: NVSHMEM's unique-id bootstrap, the id from PE 0.
void initialize(Runtime& rt, Bootstrap& bootstrap, int device, std::uint64_t budget);

// One batch as this PE moves it: the peer, its bytes, and a copy group per slot that packs it into
// the peer's inbox slot or an outbox slot (send), or unpacks it from the peer's inbox slot
// (receive). Which slot a batch uses depends on how many batches went before it, in this run and
// the earlier ones, so run() picks the group.
struct StagedBatch {
  int peer = 0;
  std::uint64_t bytes = 0;
  // Send: written straight into the peer's inbox and signalled by the kernel. Receive:
  // acknowledged by the kernel. Otherwise put through the outbox / acknowledged by NVSHMEM.
  bool mapped = false;
  std::array<std::uint32_t, kDepth> group{};
};

// The batches of one wave of one round, as indices into the send and receive lists, in the
// order their copies are launched (up to cuda::kMaxFlaggedGroups groups per kernel).
struct Wave {
  std::vector<std::uint32_t> sends;  // mapped sends, then the ones put through the outbox
  std::uint32_t mapped_sends = 0;
  std::vector<std::uint32_t> receives;
};

class NvshmemTransport final : public Transport {
 public:
  NvshmemTransport(Bootstrap& bootstrap, const CopyServiceOptions& options);
  ~NvshmemTransport() override { finalize(); }

  const char* name() const override { return "nvshmem"; }
  // Every peer in one round unless AdvancedOptions::nvshmem_peers_per_round says fewer: the waves
  // keep every slot drained before it is filled again without waiting in a cycle (see
  // build_waves).
  TransportCaps caps() const override {
    const int limit = peers_per_round_;
    TransportCaps caps{rt_.chunk, limit == 0 ? n_pes_ : std::min(limit, n_pes_), rt_.chunk};
    caps.front_end_waits = stream_waits_;
    return caps;
  }
  int device() const override { return device_; }
  void limit_gpu_share(int parts) override {
    gpu_parts_ = std::max(gpu_parts_, parts);
    const int resident = sm_count_ * std::max(1, ctas_per_sm_) / gpu_parts_;
    max_ctas_ = std::max(1, std::min(sm_count_, two_streams() ? resident / 2 : resident));
  }
  void check_buffer(const Buffer& buffer) const override {
    cuda::check_device_buffer(buffer, device_, "nvshmem");
  }
  void schedule(std::span<const ExecutionPlan> phases) override;
  void run(const ExecutionPlan& plan, std::size_t phase, void* stream) override;
  void synchronize() override;
  void abort(const std::string& reason) noexcept override;
  // A run given up (a timeout with every PE of this machine alive, or a peer here that gave its
  // run up and meets the others) is run again: the peers of this machine see it on the run board
  // at once; those of other machines at their own timeout. recover() puts every pair counter and
  // signal word back to zero on every PE.
  void offer_retry(const std::string& reason) noexcept override;
  bool can_retry() const override { return can_retry_; }
  bool retry_requested() const override;
  void recover() override;
  void finalize() noexcept override;

 private:
  void build_copies(const ExecutionPlan& plan);
  void build_waves(const ExecutionPlan& plan);
  void share_ctas(const std::vector<std::uint32_t>& batches, std::size_t first, std::size_t last,
                  const std::vector<StagedBatch>& list);
  KernelArgs args_for(std::uint32_t group) const;
  KernelArgs launch_args() const;
  void send_wave(const Wave& wave, cudaStream_t stream);
  void receive_wave(const Wave& wave, cudaStream_t stream);
  void to_stream(cuda::CopyFlags& flags, std::vector<cuda::StreamMemoryOp>& waits, bool data);
  // The kind of this run's next wait on `peer` (waiting[peer] says whether one came before): the
  // first has the arrival timeout (kWaitArrival), the others `later`.
  static unsigned int next_wait_kind(std::vector<std::uint8_t>& waited, int peer,
                                     unsigned int later);
  void queue_waits(cudaStream_t stream, std::vector<cuda::StreamMemoryOp>& waits);
  void check_stream_waits() noexcept;
  void fail_stream_waits(unsigned int code, int peer, unsigned int wait_kind) noexcept;
  void release_own_waits(cudaStream_t side) noexcept;
  std::pair<int, unsigned int> first_unmet_wait() noexcept;
  void throw_device_failure();
  void check_peers_on_board(const char* waiting_for);
  // This PE's run is given up: its peers here are told (the board), its work stopped.
  void give_up_run(const std::string& reason) noexcept;
  // Stops this PE's waits and copies and raises its own signal words, so its streams drain.
  void stop_own_work() noexcept;

  Runtime& rt_ = runtime();
  Bootstrap& bootstrap_;
  cuda::RunBoard board_;  // this machine's PEs: the runs they began, the runs they gave up
  bool can_retry_ = false;
  int me_ = 0;
  int n_pes_ = 0;
  int device_ = -1;
  int sm_count_ = 1;
  int ctas_per_sm_ = 1;  // flagged copy CTAs one SM holds
  cudaStream_t stream_ = nullptr;
  // Sends go on their own stream, forked from the caller's and joined back at the end of run():
  // a round's sends then need not wait behind the previous round's receives. Receives never
  // wait on this PE's sends, so the two streams cannot wait on each other in a cycle.
  bool send_stream_enabled_ = true;  // AdvancedOptions::nvshmem_send_stream
  int peers_per_round_ = 0;          // AdvancedOptions::nvshmem_peers_per_round
  std::chrono::milliseconds timeout_{};
  // CopyServiceOptions::arrival_timeout: a run's first wait on each peer has it (kWaitArrival).
  std::chrono::milliseconds arrival_timeout_{};
  // The peers this run has waited on already, for an acknowledgement and for data: NVSHMEM has
  // no flag that says a peer began the run, so its first word of the run says so.
  std::vector<std::uint8_t> acknowledged_, delivered_;
  // Not with stream waits: a PE whose two streams both wait in their front ends on a GPU shared
  // without MPS kept the GPU for a time slice (one H200, 2 PEs, 4 KiB all-to-all: 2,224 us on two
  // streams, 168 us on one).
  bool two_streams() const { return send_stream_enabled_ && !trace_ && !stream_waits_; }
  cudaStream_t send_stream_ = nullptr;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
  cudaEvent_t last_run_ = nullptr;
  bool run_pending_ = false;
  cuda::DeviceStatus* status_ = nullptr;  // pinned, mapped: stops the waits on abort
  cuda::HostFailure host_failure_;        // what the host found (the watchdog, abort)
  cuda::DeviceStatus* status_device_ = nullptr;
  // Device memory, nonzero once a wait failed or the run was aborted: copy kernels skip.
  unsigned int* failure_ = nullptr;
  int max_ctas_ = 1;   // CTAs of one flagged launch
  int gpu_parts_ = 1;  // the GPU's share this PE's launches keep to (limit_gpu_share)
  // Calls body(first, last) for each flagged launch that carries batches [0, count) of a wave's
  // list: as many per launch as one launch holds, each batch needing a CTA at least. Sharing the
  // CTAs at schedule() and launching at run() split the list the same way through it.
  template <typename Body>
  void for_each_launch(std::size_t count, Body&& body) const {
    const std::size_t width =
        std::min<std::size_t>(cuda::kMaxFlaggedGroups, static_cast<std::size_t>(max_ctas_));
    for (std::size_t first = 0; first < count; first += width)
      body(first, std::min(count, first + width));
  }
  std::uint64_t timeout_ns_ = 0;
  // Each PE's waiting_on word where NVSHMEM maps it here (null elsewhere), for the kernels.
  DeviceArray<const std::uint64_t*> peer_waiting_on_;
  std::vector<pid_t> local_pids_;
  // Each phase of the schedule, resolved: local copies, each round's send and receive batches,
  // and the waves that run them, in order. Slots and signals are the runtime's, so phases follow
  // one another like runs: sequence numbers only grow.
  struct PhaseCopies {
    std::vector<StagedBatch> sends, receives;
    std::vector<Wave> waves;
    std::vector<PeerGroup> groups;
    DeviceArray<CopyDescriptor> descriptors;
    DeviceArray<PeerGroup> device_groups;
    CopyDescriptor* descriptors_device = nullptr;
    PeerGroup* groups_device = nullptr;
    std::optional<std::uint32_t> local_group;
  };
  std::vector<std::unique_ptr<PhaseCopies>> phases_;
  PhaseCopies* at_ = nullptr;  // the phase being built or run
  // Per peer, where NVSHMEM maps it here (null otherwise): its data signals from this PE, per
  // slot, and its acknowledgement from this PE. Raised by a one-thread kernel instead of an
  // NVSHMEM signal op, which costs a proxy round trip.
  std::vector<std::array<std::uint64_t*, kDepth>> remote_data_;
  std::vector<std::uint64_t*> remote_ack_;
  bool direct_ = true;  // AdvancedOptions::nvshmem_direct
  NodeMap nodes_;       // peers of other nodes take the put path even where NVLink reaches them
  // AdvancedOptions::nvshmem_trace (diagnosis): waits after every step of a run and adds its time
  // to trace_[step], printed at finalize. The waits serialise everything.
  bool trace_ = false;
  std::array<double, 4> trace_seconds_{};
  std::array<std::uint64_t, 4> trace_count_{};
  template <typename Step>
  void step(int kind, cudaStream_t stream, Step&& body) {
    if (!trace_) return body();
    RESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto start = Clock::now();
    body();
    RESHARD_CUDA_CHECK(cudaStreamSynchronize(stream));
    trace_seconds_[kind] += std::chrono::duration<double>(Clock::now() - start).count();
    ++trace_count_[kind];
  }
  // Waits in the stream's front end instead of the kernels (NvshmemTransportOptions::waits).
  bool stream_waits_ = false;
  bool batch_memops_ = true;  // AdvancedOptions::cuda_batch_memops
  bool can_flush_ = false;    // CU_STREAM_WAIT_VALUE_FLUSH, for data that NICs write
  // For the watchdog: each run in flight with stream waits, oldest first (its end, and its waits in
  // the order queued), and when the newest was queued; guarded by the watchdog's mutex.
  struct StreamWait {
    const std::uint64_t* flag;
    std::uint64_t value;
    int peer;
    unsigned int wait_kind;
  };
  struct WatchedRun {
    cudaEvent_t done;
    std::vector<StreamWait> waits;
  };
  std::vector<StreamWait> run_waits_;  // the run being queued
  std::deque<WatchedRun> watched_;
  std::vector<cudaEvent_t> spare_events_;  // of runs over, for the next ones
  Clock::time_point last_queued_{};
  bool watch_failed_ = false;  // the watchdog released this run's waits; it keeps them released
  cuda::RunWatchdog watchdog_;
  cudaStream_t release_stream_ = nullptr;
  bool prepared_ = false;
  bool aborted_ = false;
  bool finalized_ = false;
};

}  // namespace reshard::nvshmem

// CUDA transport: PEs are processes on one machine, one GPU each, peers reachable over NVLink (or
// PCIe) through CUDA IPC. At schedule() every PE exports the allocations holding its destination
// ranges; senders map them and copy straight from their source into the peer's destination.
// Ordering with the peers uses flags in device memory (see device_work.hpp), so run() involves no
// host synchronisation and can be captured in a CUDA graph.
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
#include "gpu/run_watchdog.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "transports/cuda/ipc_memory.hpp"
#include "transports/cuda/run_board.hpp"
#include "transports/cuda/same_device_order.hpp"

namespace reshard {
namespace {

using namespace cuda;

// Whether a descriptor's rows lie in one allocation on each side (its whole span, first byte to
// last), as one cudaMemcpy2DAsync needs.
bool rows_within_allocations(const CopyDescriptor& d) {
  const std::uint64_t rows = d.bytes / d.row_bytes;
  const unsigned char* src_last = d.src + (rows - 1) * d.src_pitch + d.row_bytes - 1;
  const unsigned char* dst_last = d.dst + (rows - 1) * d.dst_pitch + d.row_bytes - 1;
  return allocation_base(d.src) == allocation_base(src_last) &&
         allocation_base(d.dst) == allocation_base(dst_last);
}

constexpr std::uint64_t kUnbounded = 1ull << 50;  // direct copies need no chunks or rounds
constexpr std::uint32_t kBounceHandle = UINT32_MAX;
constexpr int kCopyEngineStreams = DebugOptions::kMaxCudaCeStreams;
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
    caps.front_end_waits = any_stream_ordered();
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
  void prepare(std::span<const ExecutionPlan> phases) override;
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
  std::unique_ptr<PreparedRun> prepare_phase(const ExecutionPlan& plan, bool first_phase);
  void assign_ctas(std::vector<PeerGroup>& groups, std::uint32_t& total) const;
  // Chooses each group's engine by `engine` (sm, ce or auto) and uploads the kernels' inputs.
  void lay_out(PreparedRun& prepared, const std::string& engine);
  // Collective: times each engine on the schedule and lays out the one slowest PE finds fastest.
  void autotune(PreparedRun& prepared);
  void launch(PreparedRun& prepared, cudaStream_t stream);
  // Queues batch's copies [begin, end) on stream.
  void queue_copies(const CopyEngineBatch& batch, std::size_t begin, std::size_t end,
                    bool may_batch, cudaStream_t stream);
  // One descriptor with rows as a 2-D copy-engine copy.
  void queue_rows(const CopyDescriptor& box, cudaStream_t stream);
  // Waits for the run that recorded `event`: a peer that exits, or (watch_board) gives its run up,
  // ends the wait at once; a wait past the kernels' own limits ends it too.
  void wait_for(cudaEvent_t event, const char* what, bool watch_board = true);
  // Whether a launch of `ctas` CTAs may be early (programmatic dependent launch).
  bool early_launch_for(std::uint32_t ctas);
  // A run is stuck: records why (as a kernel's failed wait would), stops the copies that follow
  // and lets this PE's stream past its waits on same-GPU peers.
  void fail_run(unsigned int code, int peer, unsigned int phase) noexcept;
  // While a run with same-GPU peers is pending: their waits are the stream's, with no timeout of
  // their own, so the watchdog gives up on them after RESHARD_TIMEOUT_S or when a peer exits.
  void check_same_device_run() noexcept;
  void log_trace() noexcept;
  void throw_device_failure();
  // Throws where a peer gave its run up (the run board): before a run, or while waiting for one.
  void check_peers_on_board(const char* waiting_for);
  // The seconds a wait of kind `phase` (kPhase*) had: arrival for kPhaseReady.
  std::uint64_t seconds_for(unsigned int phase) const;

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
  std::uint64_t* trace_ = nullptr;  // RESHARD_CUDA_TRACE: device stamps, see TracePhase
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
  bool any_stream_ordered() const {
    return std::find(stream_ordered_.begin(), stream_ordered_.end(), true) != stream_ordered_.end();
  }
  // Where peers on this GPU are ordered by the kernels (MPS: the processes' kernels run side by
  // side and wait on each other's flags), every one of those kernels must be resident at once:
  // the CTAs of one resident wave each may take, shared among them (assign_ctas); less where
  // another GPU transport runs beside this one (limit_gpu_share).
  std::uint64_t resident_cta_share_ = 0;
  bool previous_launch_large_ = false;  // more than half the share (early_launch_for)
  // Where every PE on this GPU delegates (see exchange_destinations): the lowest of them leads.
  bool delegate_ = false;
  int leader_ = -1;
  std::vector<int> followers_;         // the group but its leader
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

CudaTransport::CudaTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : bootstrap_(bootstrap), me_(bootstrap.rank()), n_pes_(bootstrap.size()) {
  device_ = select_device(bootstrap, options.device);
  DeviceScope scope(device_);
  load_copy_kernels();
  engine_ = options.cuda.engine;
  copy_engine_min_bytes_ = options.cuda.ce_min_bytes;
  copy_engine_streams_used_ = options.debug.cuda_ce_streams;
  ctas_per_peer_ = options.cuda.ctas_per_peer;
  bytes_per_cta_ = options.cuda.bytes_per_cta;
  unroll_ = options.debug.cuda_unroll;
  early_launch_ = options.debug.cuda_early_launch;
  batch_memops_ = options.debug.cuda_batch_memops;
  timeout_ = options.timeout;
  timeout_ns_ = static_cast<std::uint64_t>(timeout_.count()) * 1000000ull;
  arrival_timeout_ = options.arrival_timeout;
  board_ = RunBoard(me_, n_pes_);
  RESHARD_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
  int max_pitch = 0;
  RESHARD_CUDA_CHECK(cudaDeviceGetAttribute(&max_pitch, cudaDevAttrMaxPitch, device_));
  max_pitch_ = static_cast<std::uint64_t>(max_pitch);
  RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  for (int i = 0; i < copy_engine_streams_used_; ++i) {
    RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_engine_streams_[i], cudaStreamNonBlocking));
    RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&joins_[i], cudaEventDisableTiming));
  }
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&last_run_, cudaEventDisableTiming));
  RESHARD_CUDA_CHECK(cudaHostAlloc(&status_, sizeof(DeviceStatus), cudaHostAllocMapped));
  *status_ = DeviceStatus{};
  RESHARD_CUDA_CHECK(cudaHostGetDevicePointer(&status_device_, status_, 0));

  // A whole 2 MiB page: small allocations sharing a page cannot both be mapped through IPC.
  const std::uint64_t signal_bytes = std::max<std::uint64_t>(SignalLayout::bytes(n_pes_), 2 << 20);
  RESHARD_CUDA_CHECK(cudaMalloc(&signals_, signal_bytes));
  RESHARD_CUDA_CHECK(cudaMemset(signals_, 0, signal_bytes));
  ready_epoch_ = SignalLayout::ready_epoch(signals_, n_pes_);
  if (options.debug.cuda_trace) {
    const std::size_t bytes = sizeof(std::uint64_t) * kTraceRuns * kTracePhases;
    RESHARD_CUDA_CHECK(cudaMalloc(&trace_, bytes));
    RESHARD_CUDA_CHECK(cudaMemset(trace_, 0, bytes));
  }
  RESHARD_CUDA_CHECK(cudaDeviceSynchronize());
  cudaIpcMemHandle_t handle;
  RESHARD_CUDA_CHECK(cudaIpcGetMemHandle(&handle, signals_));

  // Peers on this GPU are ordered by stream memory operations where the driver has them, unless
  // MPS runs both processes' kernels side by side (see SameDeviceOrder). Both PEs of a pair must
  // order it the same way: each says what it would do, and a pair streams only if both would.
  const std::string& same_device_mode = options.cuda.same_device;
  const bool stream_ordered = same_device_mode != "kernel" &&
                              stream_memory_ops_supported(device_) &&
                              (same_device_mode != "auto" || !mps_server_found());
  const bool delegates = stream_ordered && same_device_mode != "stream";
  message::Writer mine;
  mine.put<std::int32_t>(::getpid());
  // Same GPU by host and PCI bus id, not by ordinal: processes may see different
  // CUDA_VISIBLE_DEVICES (one GPU each, as Ray gives its workers, or all of them).
  const std::string my_gpu = cuda::physical_gpu(device_);
  mine.put_string(my_gpu);
  mine.put(handle);
  mine.put<std::uint8_t>(engine_ == "autotune");
  mine.put<std::uint8_t>(stream_ordered);
  mine.put<std::uint8_t>(delegates);
  mine.put_string(board_.name());
  const auto all = bootstrap_.all_gather(mine.bytes());
  bool every_one_delegates = delegates;
  int kernel_ordered_on_device = 0;
  peer_signals_.assign(n_pes_, nullptr);
  pids_.assign(n_pes_, 0);
  same_device_.assign(n_pes_, false);
  std::vector<std::string> gpus(n_pes_);
  std::vector<bool> streams(n_pes_, false);  // whether each PE would order by its stream
  for (int pe = 0; pe < n_pes_; ++pe) {
    message::Reader reader(all[pe]);
    const auto pid = reader.get<std::int32_t>();
    pids_[pe] = pe == me_ ? 0 : pid;  // only peers are watched
    const std::string peer_gpu = reader.get_string();
    const auto peer_handle = reader.get<cudaIpcMemHandle_t>();
    // Autotune runs the schedule at schedule() time: a PE that does not would leave it waiting.
    if ((reader.get<std::uint8_t>() != 0) != (engine_ == "autotune")) {
      throw_error(ErrorCode::kInvalidArgument,
                  "cuda.engine (RESHARD_CUDA_ENGINE): PE " + std::to_string(me_) + " has '" +
                      engine_ + "' but PE " + std::to_string(pe) +
                      (engine_ == "autotune" ? " has not" : " has 'autotune'") +
                      "; autotune must be set on every PE or none");
    }
    const bool peer_stream_ordered = reader.get<std::uint8_t>() != 0;
    const bool peer_delegates = reader.get<std::uint8_t>() != 0;
    const std::string peer_board = reader.get_string();
    if (pe != me_) board_.open(pe, peer_board);
    gpus[pe] = peer_gpu;
    streams[pe] = peer_stream_ordered;
    if (pe == me_) {
      peer_signals_[pe] = signals_;
      continue;
    }
    if (peer_gpu == my_gpu) {
      same_device_[pe] = stream_ordered && peer_stream_ordered;
      if (!same_device_[pe]) ++kernel_ordered_on_device;
      if (same_device_[pe]) every_one_delegates = every_one_delegates && peer_delegates;
      RESHARD_LOG(kDebug, "PE " << pe << " shares CUDA device " << device_ << " with this PE"
                                << (same_device_[pe] ? ": runs ordered by the streams" : ""));
    }
    HandleBytes bytes;
    std::memcpy(bytes.data(), &peer_handle, sizeof peer_handle);
    peer_signals_[pe] = reinterpret_cast<std::uint64_t*>(signal_imports_.map(pe, bytes));
  }
  stream_ordered_ = stream_ordered_peers(gpus, streams, me_);
  for (int pe = 0; pe < n_pes_; ++pe) {
    if (stream_ordered_[pe] && !same_device_[pe])
      RESHARD_LOG(kDebug, "PE " << pe
                                << " (another GPU): runs ordered by the streams, as a GPU "
                                   "of the pair is shared by processes");
  }
  if (kernel_ordered_on_device > 0) {
    limit_gpu_share(kernel_ordered_on_device + 1);
    RESHARD_LOG(kDebug, kernel_ordered_on_device << " PE(s) share CUDA device " << device_
                                                 << " with kernels that wait on this PE's: at most "
                                                 << resident_cta_share_ << " CTAs per launch");
  }
  std::vector<const std::uint64_t*> waiting_on;
  for (std::uint64_t* signals : peer_signals_)
    waiting_on.push_back(SignalLayout::waiting_on(signals, n_pes_));
  peer_waiting_on_.upload(waiting_on);
  // The PEs ordered by the streams on this GPU form one group (the relation is the same for
  // every pair of them); the group delegates only if every member was asked to.
  std::vector<int> group{me_};
  for (int pe = 0; pe < n_pes_; ++pe)
    if (same_device_[pe]) group.push_back(pe);
  std::sort(group.begin(), group.end());
  if (group.size() > 1 && every_one_delegates) {
    delegate_ = true;
    leader_ = group.front();
    followers_.assign(group.begin() + 1, group.end());
    RESHARD_LOG(kDebug, "PE " << leader_ << " makes the copies among the " << group.size()
                              << " PEs on CUDA device " << device_);
  }
  same_device_order_ = SameDeviceOrder(signals_, peer_signals_, me_, batch_memops_);
  if (any_stream_ordered()) {
    RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking));
    watchdog_.start(
        device_, [this] { return watched_since_ != std::chrono::steady_clock::time_point{}; },
        [this] { check_same_device_run(); });
  }
  bootstrap_.barrier();  // every PE has mapped every other's flags and board before any run
  board_.unlink();
  RESHARD_LOG(kDebug, "cuda transport on device " << device_ << " (" << sm_count_
                                                  << " SMs), engine " << engine_);
}

std::optional<std::vector<GroupPlan>> CudaTransport::exchange_destinations(
    const ExecutionPlan& plan, PreparedRun& prepared, std::vector<CopyDescriptor>& unstage,
    std::vector<std::uintptr_t>& refused, bool first_phase, bool last_attempt) {
  IpcExporter exporter;
  for (std::uintptr_t base : refused) exporter.refuse(base);
  std::vector<WireBatch> batches;
  std::vector<SharedSpan> spans;
  struct Staged {
    std::size_t shared_span;
    const CopySpan* destination;
  };
  std::vector<Staged> staged;
  // Where each staged destination lands first (its place in the bounce buffer): a leader that
  // makes a follower's copies to it must write there too, as the unstage copy moves it after.
  std::unordered_map<const CopySpan*, unsigned char*> staged_at;
  for (const PlannedBatch& batch : plan.receives) {
    batches.push_back({batch.peer, batch.span_count});
    for (std::uint32_t s = 0; s < batch.span_count; ++s) {
      const CopySpan& span = plan.spans[batch.first_span + s];
      const auto exported = exporter.export_pointer(span.data);
      if (exported) {
        spans.push_back({exported->handle, 0, exported->offset, span.bytes});
      } else {
        prepared.bounce_bytes = (prepared.bounce_bytes + 255) / 256 * 256;
        spans.push_back({kBounceHandle, 0, prepared.bounce_bytes, span.bytes});
        staged.push_back({spans.size() - 1, &span});
        prepared.bounce_bytes += span.bytes;
      }
    }
  }
  if (!staged.empty()) {
    RESHARD_CUDA_CHECK(
        cudaMalloc(&prepared.bounce, std::max<std::uint64_t>(prepared.bounce_bytes, 2 << 20)));
    const auto bounce = exporter.export_pointer(prepared.bounce);
    if (!bounce)
      throw_error(ErrorCode::kSystem, "cannot export the CUDA transport's bounce buffer");
    for (const Staged& s : staged) {
      SharedSpan& span = spans[s.shared_span];
      span.handle = bounce->handle;
      span.offset += bounce->offset;
      unsigned char* landing =
          static_cast<unsigned char*>(prepared.bounce) + (span.offset - bounce->offset);
      unstage.push_back(
          {landing, reinterpret_cast<unsigned char*>(s.destination->data), span.bytes, 0});
      staged_at.emplace(s.destination, landing);
    }
    RESHARD_LOG(kInfo, staged.size()
                           << " destination range(s), " << format_bytes(prepared.bounce_bytes)
                           << ", cannot be shared through CUDA IPC (stream-ordered or "
                              "virtual-memory allocations): staging them through a "
                              "bounce buffer");
  }

  // Delegation (see SameDeviceOrder): a follower hands its GPU's leader its sends to the PEs its
  // stream orders (on this GPU, or on another where a GPU is shared) and its local copies, as
  // (allocation, offset) of its own memory; the leader maps them. A follower left with no other
  // peer runs no kernel, so its GPU runs one process's kernel a run and is never handed over.
  // A follower whose memory cannot all be exported (or mapped, by the retry) keeps the whole
  // group to pairwise order for this phase.
  const bool follower = delegate_ && leader_ != me_;
  std::uint8_t delegable = follower ? 1 : 0;
  std::uint8_t kernel_ordered_work = 0;
  for (const auto* batches_of : {&plan.sends, &plan.receives})
    for (const PlannedBatch& batch : *batches_of)
      if (!stream_ordered_[batch.peer]) kernel_ordered_work = 1;
  std::vector<WireBatch> delegated_batches;
  std::vector<SharedSpan> delegated_spans, local_sources, local_destinations;
  auto export_span = [&](const void* pointer, std::uint64_t bytes, std::vector<SharedSpan>& into) {
    const auto exported = delegable ? exporter.export_pointer(pointer) : std::nullopt;
    if (!exported) {
      delegable = 0;
      return;
    }
    into.push_back({exported->handle, 0, exported->offset, bytes});
  };
  if (follower) {
    for (const PlannedBatch& batch : plan.sends) {
      if (!stream_ordered_[batch.peer]) continue;
      delegated_batches.push_back({batch.peer, batch.span_count});
      for (std::uint32_t s = 0; s < batch.span_count; ++s) {
        const CopySpan& span = plan.spans[batch.first_span + s];
        export_span(span.data, span.bytes, delegated_spans);
      }
    }
    for (const LocalCopy& copy : plan.local_copies) {
      export_span(copy.src, copy.bytes, local_sources);
      export_span(copy.dst, copy.bytes, local_destinations);
    }
    if (!delegable) {
      delegated_batches.clear();
      delegated_spans.clear();
      local_sources.clear();
      local_destinations.clear();
    }
  }

  message::Writer mine;
  mine.put_array(std::span<const HandleBytes>(exporter.handles()));
  mine.put_array(std::span<const WireBatch>(batches));
  mine.put_array(std::span<const SharedSpan>(spans));
  mine.put<std::uint8_t>(delegable);
  mine.put<std::uint8_t>(kernel_ordered_work);
  mine.put_array(std::span<const WireBatch>(delegated_batches));
  mine.put_array(std::span<const SharedSpan>(delegated_spans));
  mine.put_array(std::span<const SharedSpan>(local_sources));
  mine.put_array(std::span<const SharedSpan>(local_destinations));
  const auto all = bootstrap_.all_gather(mine.bytes());

  // My sends to each peer, in plan order, meet that peer's receives from me in its plan order.
  std::vector<std::vector<const PlannedBatch*>> sends_to(n_pes_);
  for (const PlannedBatch& batch : plan.sends) sends_to[batch.peer].push_back(&batch);

  struct PeerExports {
    std::vector<HandleBytes> handles;
    std::vector<WireBatch> batches;
    std::vector<SharedSpan> spans;
    bool delegable = false;
    bool kernel_ordered_work = false;
    std::vector<WireBatch> delegated_batches;
    std::vector<SharedSpan> delegated_spans, local_sources, local_destinations;
  };
  std::vector<PeerExports> exports(n_pes_);
  for (int pe = 0; pe < n_pes_; ++pe) {
    message::Reader reader(all[pe]);
    PeerExports& e = exports[pe];
    e.handles = reader.get_array<HandleBytes>();
    e.batches = reader.get_array<WireBatch>();
    e.spans = reader.get_array<SharedSpan>();
    e.delegable = reader.get<std::uint8_t>() != 0;
    e.kernel_ordered_work = reader.get<std::uint8_t>() != 0;
    e.delegated_batches = reader.get_array<WireBatch>();
    e.delegated_spans = reader.get_array<SharedSpan>();
    e.local_sources = reader.get_array<SharedSpan>();
    e.local_destinations = reader.get_array<SharedSpan>();
  }
  bool delegated = delegate_;
  for (int pe : followers_) delegated = delegated && exports[pe].delegable;
  const bool leads = delegated && leader_ == me_;
  // What this PE copies itself: a follower leaves its sends to its GPU's PEs to the leader.
  auto copies_to = [&](int pe) {
    return pe != me_ && !sends_to[pe].empty() && !(delegated && follower && stream_ordered_[pe]);
  };

  // The batches `receiver` expects from `sender`, in its plan order (which meets the sender's
  // plan order of its sends to it): where each one's spans start, in the receiver's exported
  // spans (in `plan.spans` for this PE's own receives), and how many there are.
  struct BatchSpans {
    std::size_t first;
    std::uint32_t count;
  };
  auto receives_from = [&](int receiver, int sender) {
    std::vector<BatchSpans> found;
    if (receiver == me_) {
      for (const PlannedBatch& batch : plan.receives)
        if (batch.peer == sender) found.push_back({batch.first_span, batch.span_count});
      return found;
    }
    std::size_t first = 0;
    for (const WireBatch& batch : exports[receiver].batches) {
      if (batch.peer == sender) found.push_back({first, batch.span_count});
      first += batch.span_count;
    }
    return found;
  };

  std::set<IpcImports::Key> needed;
  auto need_handle = [&](int owner, std::uint32_t handle) {
    if (handle < exports[owner].handles.size())
      needed.insert({owner, exports[owner].handles[handle]});
  };
  // `receiver`'s destinations of its batches from `sender`.
  auto need_destinations = [&](int receiver, int sender) {
    for (const BatchSpans& batch : receives_from(receiver, sender))
      for (std::uint32_t s = 0; s < batch.count; ++s)
        need_handle(receiver, exports[receiver].spans.at(batch.first + s).handle);
  };
  for (int pe = 0; pe < n_pes_; ++pe)
    if (copies_to(pe)) need_destinations(pe, me_);
  if (leads) {
    for (int f : followers_) {
      const PeerExports& from = exports[f];
      for (const auto* list :
           {&from.delegated_spans, &from.local_sources, &from.local_destinations})
        for (const SharedSpan& span : *list) need_handle(f, span.handle);
      std::set<int> destinations;
      for (const WireBatch& batch : from.delegated_batches)
        if (batch.peer != me_) destinations.insert(batch.peer);
      for (int pe : destinations) need_destinations(pe, f);
    }
  }
  // Mappings this schedule does not use are closed before any new one opens: a peer that freed a
  // buffer and allocated another on the same driver page can be mapped only once the old mapping
  // is gone (the bench's alternating buffers were staged through the bounce buffer before).
  // Later phases keep what earlier phases of the schedule mapped.
  if (first_phase) imports_.retain(needed);
  std::vector<GroupPlan> groups;
  std::vector<PeerHandle> unmappable;  // (owner PE, handle index)
  // Base address of `owner`'s allocation `handle` here; null (and noted) where it cannot be
  // mapped on this attempt.
  auto map_handle = [&](int owner, std::uint32_t handle) -> unsigned char* {
    const auto& handles = exports[owner].handles;
    if (handle >= handles.size())
      throw_error(ErrorCode::kSystem, "internal: PE " + std::to_string(owner) +
                                          " named an allocation it did not export");
    unsigned char* base = imports_.map(owner, handles[handle], !last_attempt);
    if (base == nullptr) unmappable.push_back({owner, handle});
    return base;
  };
  for (int pe = 0; pe < n_pes_; ++pe) {
    if (!copies_to(pe)) continue;
    const auto& peer_spans = exports[pe].spans;
    const std::vector<BatchSpans> receives = receives_from(pe, me_);
    if (receives.size() > sends_to[pe].size()) {
      throw_error(ErrorCode::kSystem, "internal: PE " + std::to_string(pe) +
                                          " expects more batches from PE " + std::to_string(me_) +
                                          " than it plans to send");
    }
    GroupPlan group;
    group.group.peer = pe;
    // The rows of a strided destination share their allocation: look it up once for them all.
    std::uint32_t mapped_handle = UINT32_MAX;
    unsigned char* mapped_base = nullptr;
    for (std::size_t b = 0; b < receives.size(); ++b) {
      const PlannedBatch& send = *sends_to[pe][b];
      if (send.span_count != receives[b].count) {
        throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(me_) + " and " +
                                            std::to_string(pe) + " split a batch differently");
      }
      for (std::uint32_t s = 0; s < send.span_count; ++s) {
        const CopySpan& source = plan.spans[send.first_span + s];
        const SharedSpan& target = peer_spans.at(receives[b].first + s);
        if (target.bytes != source.bytes) {
          throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(me_) + " and " +
                                              std::to_string(pe) + " disagree on a span");
        }
        if (target.handle != mapped_handle) {
          mapped_base = map_handle(pe, target.handle);
          mapped_handle = target.handle;
        }
        if (mapped_base == nullptr) continue;
        group.add(reinterpret_cast<const unsigned char*>(source.data), mapped_base + target.offset,
                  source.bytes);
      }
    }
    groups.push_back(std::move(group));
  }
  // The leader makes follower f's copies: f's sends to each PE of this GPU, in f's plan order,
  // meet that PE's receives from f in its plan order (as a sender's own do); then its local ones.
  auto add_delegated_copies = [&](int f) {
    const PeerExports& from = exports[f];
    std::map<int, GroupPlan> by_destination;
    std::map<int, std::vector<BatchSpans>> receives;  // per destination, from f
    std::map<int, std::size_t> next_receive;
    std::size_t source_index = 0;
    for (const WireBatch& send : from.delegated_batches) {
      const int to = send.peer;
      GroupPlan& group = by_destination[to];
      group.group.peer = to;
      group.delegated = true;
      const auto& expected = receives.try_emplace(to, receives_from(to, f)).first->second;
      const std::size_t b = next_receive[to]++;
      if (b >= expected.size() || expected[b].count != send.span_count) {
        throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(f) + " and " +
                                            std::to_string(to) + " split a batch differently");
      }
      const std::size_t first = expected[b].first;
      const std::uint32_t count = expected[b].count;
      for (std::uint32_t s = 0; s < count; ++s) {
        const SharedSpan& source = from.delegated_spans.at(source_index + s);
        unsigned char* source_base = map_handle(f, source.handle);
        unsigned char* destination = nullptr;
        std::uint64_t bytes = 0;
        if (to == me_) {
          // This PE's own destination, or its bounce buffer where it is staged (else the unstage
          // copy after the run would overwrite what lands here).
          const CopySpan& target = plan.spans.at(first + s);
          const auto landing = staged_at.find(&target);
          destination = landing != staged_at.end() ? landing->second
                                                   : reinterpret_cast<unsigned char*>(target.data);
          bytes = target.bytes;
        } else {
          const SharedSpan& target = exports[to].spans.at(first + s);
          unsigned char* base = map_handle(to, target.handle);
          destination = base == nullptr ? nullptr : base + target.offset;
          bytes = target.bytes;
        }
        if (bytes != source.bytes) {
          throw_error(ErrorCode::kSystem, "internal: PEs " + std::to_string(f) + " and " +
                                              std::to_string(to) + " disagree on a span");
        }
        if (source_base != nullptr && destination != nullptr)
          group.add(source_base + source.offset, destination, bytes);
      }
      source_index += count;
    }
    for (auto& entry : by_destination) groups.push_back(std::move(entry.second));
    GroupPlan local;
    local.group.peer = f;
    local.delegated = true;
    for (std::size_t i = 0; i < from.local_sources.size(); ++i) {
      const SharedSpan& source = from.local_sources[i];
      const SharedSpan& target = from.local_destinations.at(i);
      unsigned char* source_base = map_handle(f, source.handle);
      unsigned char* target_base = map_handle(f, target.handle);
      if (source_base != nullptr && target_base != nullptr)
        local.add(source_base + source.offset, target_base + target.offset, source.bytes);
    }
    if (local.group.bytes > 0) groups.push_back(std::move(local));
  };
  std::vector<std::uint64_t*> idle_followers;
  if (leads) {
    for (int f : followers_) {
      add_delegated_copies(f);
      if (!exports[f].kernel_ordered_work)
        idle_followers.push_back(SignalLayout::run_count(peer_signals_[f], n_pes_));
    }
  }
  prepared.delegated = delegated;
  prepared.local_copies_delegated = delegated && follower;
  prepared.kernel_idle = delegated && follower && kernel_ordered_work == 0;
  prepared.follower_run_count = static_cast<std::uint32_t>(idle_followers.size());
  prepared.follower_runs.upload(idle_followers);
  // Every PE learns which of its allocations a peer could not map, and all retry together.
  message::Writer failures;
  failures.put_array(std::span<const PeerHandle>(unmappable));
  bool any = false;
  for (const auto& part : bootstrap_.all_gather(failures.bytes())) {
    message::Reader reader(part);
    for (const PeerHandle& failed : reader.get_array<PeerHandle>()) {
      any = true;
      if (failed.owner == me_) refused.push_back(exporter.base_of(failed.handle));
    }
  }
  if (any) return std::nullopt;
  return groups;
}

void CudaTransport::assign_ctas(std::vector<PeerGroup>& groups, std::uint32_t& total) const {
  std::uint64_t wanted = 0;
  std::vector<std::uint64_t> want(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    // Bytes earn CTAs, and so do pieces: a CTA's warps take a piece each when they are small.
    const std::uint64_t by_bytes = (groups[g].bytes + bytes_per_cta_ - 1) / bytes_per_cta_;
    const std::uint64_t by_pieces =
        (groups[g].descriptor_count + kPiecesPerCta - 1) / kPiecesPerCta;
    want[g] = std::clamp<std::uint64_t>(std::max(by_bytes, by_pieces), 1, ctas_per_peer_);
    wanted += want[g];
  }
  // One resident wave at most, leaving the rest of the GPU to the caller's kernels; with peers on
  // this GPU whose kernels wait on ours, a share of what it holds at once, so that all of them
  // are resident together (else spinning CTAs could keep a peer's kernel off the GPU).
  const std::uint64_t cap = resident_cta_share_ > 0
                                ? std::min<std::uint64_t>(sm_count_, resident_cta_share_)
                                : std::max(1, sm_count_);
  total = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const std::uint64_t ctas =
        wanted <= cap ? want[g] : std::max<std::uint64_t>(1, want[g] * cap / wanted);
    groups[g].first_cta = total;
    groups[g].cta_count = static_cast<std::uint32_t>(ctas);
    total += static_cast<std::uint32_t>(ctas);
  }
}

void CudaTransport::prepare(std::span<const ExecutionPlan> phases) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "schedule() after finalize()");
  DeviceScope scope(device_);
  if (run_pending_) wait_for(last_run_, "the previous schedule's runs");
  // A run given up (this PE's or a peer's) is over for the new schedule: it starts afresh.
  if (!retry_requested()) throw_device_failure();
  recover();
  prepared_.clear();
  SameDeviceOrder every_phase(signals_, peer_signals_, me_, batch_memops_);
  for (std::size_t p = 0; p < phases.size(); ++p) {
    prepared_.push_back(prepare_phase(phases[p], p == 0));
    every_phase.merge(prepared_.back()->same_device);
  }
  // Once per schedule; the watchdog reads them.
  std::lock_guard lock(watchdog_.mutex());
  same_device_order_ = std::move(every_phase);
}

std::unique_ptr<PreparedRun> CudaTransport::prepare_phase(const ExecutionPlan& plan,
                                                          bool first_phase) {
  auto prepared = std::make_unique<PreparedRun>();
  std::vector<CopyDescriptor> unstage;

  std::vector<std::uintptr_t> refused;
  auto exchanged = exchange_destinations(plan, *prepared, unstage, refused, first_phase, false);
  if (!exchanged) {
    // Small allocations can share a driver page that a peer already maps under another handle;
    // those are staged instead. The first attempt's bounce buffer lives until the second one is
    // mapped, so the new one cannot reuse its memory under a handle peers still map.
    auto first_attempt = std::move(prepared);
    prepared = std::make_unique<PreparedRun>();
    unstage.clear();
    exchanged = exchange_destinations(plan, *prepared, unstage, refused, first_phase, true);
  }
  std::vector<GroupPlan> groups = std::move(*exchanged);
  GroupPlan local;
  local.group.peer = -1;
  // A follower's local copies are its leader's (PreparedRun::local_copies_delegated).
  for (std::size_t c = 0; !prepared->local_copies_delegated && c < plan.local_copies.size(); ++c) {
    const LocalCopy& copy = plan.local_copies[c];
    local.add(reinterpret_cast<const unsigned char*>(copy.src),
              reinterpret_cast<unsigned char*>(copy.dst), copy.bytes);
  }
  if (local.group.bytes > 0) groups.push_back(std::move(local));

  // Start with the next PE so that senders do not all reach one receiver first.
  std::sort(groups.begin(), groups.end(), [&](const GroupPlan& a, const GroupPlan& b) {
    auto order = [&](int peer) { return peer < 0 ? n_pes_ : (peer - me_ + n_pes_) % n_pes_; };
    return order(a.group.peer) < order(b.group.peer);
  });
  // Pairs the streams order (SameDeviceOrder); where this GPU's copies are delegated, its leader
  // orders those among its PEs instead.
  std::vector<int> stream_destinations, stream_sources;
  auto pairwise = [&](int peer) { return !(prepared->delegated && same_device_[peer]); };
  // A follower's sends that its leader makes are ordered by its own stream all the same.
  for (const PlannedBatch& batch : plan.sends) {
    const int peer = batch.peer;
    if (stream_ordered_[peer] && pairwise(peer) &&
        std::find(stream_destinations.begin(), stream_destinations.end(), peer) ==
            stream_destinations.end())
      stream_destinations.push_back(peer);
  }
  for (GroupPlan& g : groups) {
    if (g.group.peer < 0 || g.delegated || stream_ordered_[g.group.peer]) continue;
    g.group.remote_done = SignalLayout::done(peer_signals_[g.group.peer], n_pes_, me_);
    g.group.local_ready = SignalLayout::ready(signals_, n_pes_, g.group.peer);
  }

  std::vector<int> sources;
  std::vector<std::uint64_t*> source_ready;
  for (const PlannedBatch& batch : plan.receives) {
    if (stream_ordered_[batch.peer] && !pairwise(batch.peer)) continue;
    std::vector<int>& list = stream_ordered_[batch.peer] ? stream_sources : sources;
    if (std::find(list.begin(), list.end(), batch.peer) == list.end()) list.push_back(batch.peer);
  }
  std::sort(sources.begin(), sources.end());
  for (int s : sources) source_ready.push_back(SignalLayout::ready(peer_signals_[s], n_pes_, me_));

  KernelArgs& base = prepared->base;
  base.sources = prepared->sources.upload(sources);
  base.source_ready = prepared->source_ready.upload(source_ready);
  base.source_count = static_cast<std::uint32_t>(sources.size());
  base.signals = signals_;
  base.n_pes = n_pes_;
  base.me = me_;
  base.waiting_on = SignalLayout::waiting_on(signals_, n_pes_);
  base.peer_waiting_on = peer_waiting_on_.get();
  base.status = status_device_;
  base.failure = SignalLayout::failure(signals_, n_pes_);
  base.timeout_ns = timeout_ns_;
  base.arrival_timeout_ns = static_cast<std::uint64_t>(arrival_timeout_.count()) * 1000000ull;
  base.unroll = unroll_;
  base.trace = trace_;
  base.follower_runs = prepared->follower_runs.get();
  base.follower_count = prepared->follower_run_count;
  prepared->groups = std::move(groups);

  if (!unstage.empty()) {
    GroupPlan staged;
    staged.group.peer = -1;
    for (const CopyDescriptor& d : unstage) staged.add(d.src, d.dst, d.bytes);
    std::vector<PeerGroup> unstage_groups{staged.group};
    unstage_groups[0].descriptor_count = static_cast<std::uint32_t>(staged.descriptors.size());
    prepared->unstage_args = base;
    assign_ctas(unstage_groups, prepared->unstage_args.cta_count);
    prepared->unstage_args.descriptors = prepared->unstage_descriptors.upload(staged.descriptors);
    prepared->unstage_args.groups = prepared->unstage_groups.upload(unstage_groups);
    prepared->unstage_args.group_count = 1;
  }
  // Every launch of the phase, autotune's included, orders the same peers.
  prepared->same_device = SameDeviceOrder(signals_, peer_signals_, me_, batch_memops_);
  if (prepared->delegated && leader_ == me_)
    prepared->same_device.lead(followers_);
  else if (prepared->delegated)
    prepared->same_device.follow(leader_);
  prepared->same_device.order_pairs(stream_destinations, stream_sources);
  if (engine_ == "autotune")
    autotune(*prepared);
  else
    lay_out(*prepared, engine_);
  return prepared;
}

void CudaTransport::lay_out(PreparedRun& prepared, const std::string& engine) {
  prepared.copy_engine_batches.clear();
  prepared.copy_engine_bytes = 0;
  std::vector<PeerGroup> sm_groups, signal_groups, end_groups;
  std::vector<CopyDescriptor> sm_descriptors;
  std::size_t copy_engine_groups = 0;
  for (GroupPlan& g : prepared.groups) {
    // Copy engines win on a few large copies per peer (4-GPU all-to-all from 64 MiB per peer:
    // 368 vs 345 GB/s) and lose on many: a Llama-3-8B refit (hundreds of copies per peer) ran
    // 32.2 ms on them, 22.8 on SMs (4x H200, 2026-11-22). auto gives them only peers of at least
    // RESHARD_CUDA_CE_MIN_BYTES in at most kCopyEngineMaxCopies copies; autotune decides the rest.
    // A peer goes whole to one engine: sharing each peer's bytes between the copy engine and SMs
    // at once measured no better than the better of the two (4x H200, 2026-11-22: 16 MiB 310
    // GB/s vs 330 on SMs, 64 MiB 352 vs 367 on the copy engine).
    // Rows go to the copy engine only when asked for (ce, or autotune's trial of it): 2-D copies
    // have not been measured against the SM engine's row walk.
    const bool copy_engine =
        engine == "ce" || (engine == "auto" && g.group.bytes >= copy_engine_min_bytes_ &&
                           g.descriptors.size() <= kCopyEngineMaxCopies && !g.has_rows());
    if (g.group.local_ready != nullptr) signal_groups.push_back(g.group);
    if (copy_engine) {
      // Peers take the streams in start order, so each stream's first copy goes to a different
      // peer, and with one stream every sender walks its peers in its own rotated order.
      const std::size_t stream = copy_engine_groups++ % copy_engine_streams_used_;
      if (prepared.copy_engine_batches.size() <= stream)
        prepared.copy_engine_batches.emplace_back();
      CopyEngineBatch& batch = prepared.copy_engine_batches[stream];
      for (const CopyDescriptor& d : g.descriptors) {
        if (d.has_rows() && rows_within_allocations(d)) {
          batch.boxes.push_back(d);
          continue;
        }
        if (d.has_rows()) {
          // Equal copies out of separate tensors merged into "rows": one 2-D copy may not span
          // allocations (cudaMemcpy2DAsync refuses it), so each row is a copy of the batch.
          for (std::uint64_t r = 0; r < d.bytes / d.row_bytes; ++r) {
            batch.dsts.push_back(d.dst + r * d.dst_pitch);
            batch.srcs.push_back(d.src + r * d.src_pitch);
            batch.sizes.push_back(d.row_bytes);
          }
          continue;
        }
        batch.dsts.push_back(d.dst);
        batch.srcs.push_back(d.src);
        batch.sizes.push_back(d.bytes);
      }
      batch.peers.push_back({batch.dsts.size(), batch.boxes.size(), g.group.remote_done});
      prepared.copy_engine_bytes += g.group.bytes;
      continue;
    }
    if (g.group.remote_done != nullptr) end_groups.push_back(g.group);
    g.group.first_descriptor = static_cast<std::uint32_t>(sm_descriptors.size());
    g.group.descriptor_count = static_cast<std::uint32_t>(g.descriptors.size());
    sm_descriptors.insert(sm_descriptors.end(), g.descriptors.begin(), g.descriptors.end());
    sm_groups.push_back(g.group);
  }
  prepared.fused = copy_engine_groups == 0;

  prepared.copy_args = prepared.base;
  assign_ctas(sm_groups, prepared.copy_args.cta_count);
  prepared.copy_args.descriptors = prepared.copy_descriptors.upload(sm_descriptors);
  prepared.copy_args.groups = prepared.copy_groups.upload(sm_groups);
  prepared.copy_args.group_count = static_cast<std::uint32_t>(sm_groups.size());
  if (prepared.fused) prepared.copy_args.cta_count = std::max(1u, prepared.copy_args.cta_count);

  prepared.signal_args = prepared.base;
  prepared.signal_args.groups = prepared.signal_groups.upload(signal_groups);
  prepared.signal_args.group_count = static_cast<std::uint32_t>(signal_groups.size());
  prepared.end_args = prepared.base;
  prepared.end_args.groups = prepared.end_groups.upload(end_groups);
  prepared.end_args.group_count = static_cast<std::uint32_t>(end_groups.size());
  RESHARD_LOG(kDebug, "cuda plan (" << engine << "): " << sm_groups.size() << " SM group(s) on "
                                    << prepared.copy_args.cta_count << " CTAs, "
                                    << copy_engine_groups << " copy-engine group(s) of "
                                    << format_bytes(prepared.copy_engine_bytes) << " on "
                                    << prepared.copy_engine_batches.size() << " stream(s)");
}

void CudaTransport::autotune(PreparedRun& prepared) {
  // The candidates run the real schedule: sources are read and destinations written with what
  // run() will write. Work the caller queued on them finishes first.
  RESHARD_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<std::string> candidates{"sm", "ce", "auto"};
  // Destroyed on every way out, a failed run's exception included.
  auto timing_event = [] {
    cudaEvent_t event = nullptr;
    RESHARD_CUDA_CHECK(cudaEventCreate(&event));
    return std::unique_ptr<CUevent_st, cudaError_t (*)(cudaEvent_t)>(event, cudaEventDestroy);
  };
  const auto start = timing_event(), stop = timing_event();
  std::vector<double> seconds;
  for (const std::string& engine : candidates) {
    lay_out(prepared, engine);
    for (int i = 0; i < kAutotuneWarmups; ++i) launch(prepared, stream_);
    RESHARD_CUDA_CHECK(cudaEventRecord(start.get(), stream_));
    for (int i = 0; i < kAutotuneRuns; ++i) launch(prepared, stream_);
    RESHARD_CUDA_CHECK(cudaEventRecord(stop.get(), stream_));
    wait_for(stop.get(), "autotune's runs");
    throw_device_failure();
    float ms = 0;
    RESHARD_CUDA_CHECK(cudaEventElapsedTime(&ms, start.get(), stop.get()));
    seconds.push_back(ms / 1e3 / kAutotuneRuns);
  }
  // Every PE takes the engine whose slowest PE was fastest: the same data, the same choice.
  message::Writer mine;
  mine.put_array(std::span<const double>(seconds));
  std::vector<double> slowest(candidates.size(), 0.0);
  for (const auto& part : bootstrap_.all_gather(mine.bytes())) {
    message::Reader reader(part);
    const auto theirs = reader.get_array<double>();
    for (std::size_t c = 0; c < candidates.size() && c < theirs.size(); ++c)
      slowest[c] = std::max(slowest[c], theirs[c]);
  }
  const std::size_t best =
      static_cast<std::size_t>(std::min_element(slowest.begin(), slowest.end()) - slowest.begin());
  std::ostringstream text;
  text << "cuda autotune (slowest PE per run):";
  for (std::size_t c = 0; c < candidates.size(); ++c)
    text << " " << candidates[c] << " " << slowest[c] * 1e6 << " us" << (c == best ? " <-" : "");
  RESHARD_LOG(kInfo, text.str());
  lay_out(prepared, candidates[best]);
}

void CudaTransport::run(const ExecutionPlan& /*plan*/, std::size_t phase, void* stream_handle) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "run() after finalize()");
  if (phase >= prepared_.size()) throw_error(ErrorCode::kInvalidState, "run() before schedule()");
  throw_device_failure();
  if (const int dead = first_exited_process(pids_); dead >= 0) {
    throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": PE " +
                                             std::to_string(dead) + " (pid " +
                                             std::to_string(pids_[dead]) + ") has exited");
  }
  can_retry_ = false;
  // A PE that gave the last run up waits for the others to meet it: this run would wait for it.
  check_peers_on_board("to begin this run");
  board_.begin_run();
  DeviceScope scope(device_);
  cudaStream_t stream = stream_handle ? static_cast<cudaStream_t>(stream_handle) : stream_;
  if (stream_handle == nullptr) wait_for_default_stream(stream);
  launch(*prepared_[phase], stream);
  // The watchdog queries last_run_ and compares the time since watched_since_: both change
  // under its lock, so it never sees this run's event beside the last run's start time.
  std::unique_lock<std::mutex> lock;
  const bool watched = watchdog_.running() && !same_device_order_.empty();
  if (watched) lock = std::unique_lock(watchdog_.mutex());
  if (record_run_unless_capturing(last_run_, stream)) {
    run_pending_ = true;
    if (watched) {
      watched_since_ = std::chrono::steady_clock::now();
      all_begun_since_ = {};
      watchdog_.wake();
    }
    if (lock.owns_lock()) lock.unlock();
    if (stream_handle == nullptr) synchronize();
  }
}

bool CudaTransport::early_launch_for(std::uint32_t ctas) {
  if (!early_launch_) return false;
  if (resident_cta_share_ == 0) return true;
  // An early launch is resident beside the previous one (the kernel lets the next launch in once
  // the previous ended, so never more than two): where peers' kernels on this GPU must be
  // resident too, only two launches of at most half a share each may overlap; a larger one
  // neither launches early nor lets the next one in early.
  const bool large = 2ull * ctas > resident_cta_share_;
  const bool early = !large && !previous_launch_large_;
  previous_launch_large_ = large;
  return early;
}

void CudaTransport::launch(PreparedRun& p, cudaStream_t stream) {
  p.same_device.begin(stream);
  if (p.kernel_idle) {
    // A follower with no peer its kernels order: its GPU's leader makes its copies and counts its
    // run (KernelArgs::follower_runs); a kernel here would hand the GPU over twice.
  } else if (p.fused) {
    launch_fused_copy(p.copy_args, stream, early_launch_for(p.copy_args.cta_count));
  } else {
    launch_begin(p.signal_args, stream, early_launch_for(1));
    const int used = static_cast<int>(p.copy_engine_batches.size());
    // With one copy-engine batch and no SM share nothing runs beside the copies: they go on the
    // caller's stream itself, without the fork and join (two cross-stream waits per run).
    const bool on_stream = used == 1 && p.copy_args.cta_count == 0;
    if (!on_stream) {
      RESHARD_CUDA_CHECK(cudaEventRecord(fork_, stream));
      for (int i = 0; i < used; ++i)
        RESHARD_CUDA_CHECK(cudaStreamWaitEvent(copy_engine_streams_[i], fork_, 0));
    }
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RESHARD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
    const bool may_batch = capture == cudaStreamCaptureStatusNone;
    for (int i = 0; i < used; ++i) {
      const CopyEngineBatch& batch = p.copy_engine_batches[i];
      cudaStream_t side = on_stream ? stream : copy_engine_streams_[i];
      // Each peer's done flag follows its data on the same stream: the copy engine raises it once
      // the copies before it are complete, which is when that peer's bytes have landed, with no
      // kernel boundary in between (2x H200: 4 KiB copy-engine run 18.7-19.1 -> 16.0-16.6 us with
      // the early-launched begin kernel; a batch does not order its copies, so each peer's copies
      // form their own batch).
      std::size_t begin = 0, boxes_begin = 0;
      for (const CopyEngineBatch::Peer& peer : batch.peers) {
        queue_copies(batch, begin, peer.copies_end, may_batch, side);
        begin = peer.copies_end;
        for (; boxes_begin < peer.boxes_end; ++boxes_begin)
          queue_rows(batch.boxes[boxes_begin], side);
        if (peer.done != nullptr) {
          RESHARD_CUDA_CHECK(cudaMemcpyAsync(peer.done, ready_epoch_, sizeof(std::uint64_t),
                                             cudaMemcpyDeviceToDevice, side));
        }
      }
    }
    // The SM share runs while the copy engines work (it was queued after the join, which made
    // a mixed run the sum of its two parts); the end kernel waits for both.
    launch_plain_copy(p.copy_args, stream);
    for (int i = 0; !on_stream && i < used; ++i) {
      RESHARD_CUDA_CHECK(cudaEventRecord(joins_[i], copy_engine_streams_[i]));
      RESHARD_CUDA_CHECK(cudaStreamWaitEvent(stream, joins_[i], 0));
    }
    launch_end(p.end_args, stream);
  }
  p.same_device.end(stream);
  if (p.unstage_args.group_count > 0) launch_plain_copy(p.unstage_args, stream);
}

void CudaTransport::queue_copies(const CopyEngineBatch& batch, std::size_t begin, std::size_t end,
                                 bool may_batch, cudaStream_t stream) {
  if (begin == end) return;  // a peer with nothing to send (a batch must not be empty)
  // One call for the range; graphs cannot hold a batch, so a captured run (and a driver without
  // batches) queues one copy each. A batch does not order its copies among themselves.
  if (batch_copies_ && may_batch) {
    cudaMemcpyAttributes attributes{};
    attributes.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t first = 0;
    const cudaError_t status = cudaMemcpyBatchAsync(
        batch.dsts.data() + begin, batch.srcs.data() + begin, batch.sizes.data() + begin,
        end - begin, &attributes, &first, 1, stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotSupported && status != cudaErrorInvalidValue)
      throw_cuda_error(status, "cudaMemcpyBatchAsync");
    cudaGetLastError();
    batch_copies_ = false;
    RESHARD_LOG(kInfo, "cudaMemcpyBatchAsync refused peer copies ("
                           << cudaGetErrorString(status)
                           << "): the copy engine queues one cudaMemcpyAsync per copy");
  }
  for (std::size_t c = begin; c < end; ++c) {
    RESHARD_CUDA_CHECK(cudaMemcpyAsync(batch.dsts[c], batch.srcs[c], batch.sizes[c],
                                       cudaMemcpyDeviceToDevice, stream));
  }
}

void CudaTransport::queue_rows(const CopyDescriptor& box, cudaStream_t stream) {
  const std::uint64_t rows = box.bytes / box.row_bytes;
  // cudaMemcpy2DAsync takes pitches no shorter than a row (source rows may overlap, when a send
  // repeats bytes) and no longer than the device's limit (2 GiB: "rows" that are equal copies
  // out of tensors far apart, merged into one descriptor): those go one row at a time.
  if (box.src_pitch >= box.row_bytes && box.dst_pitch >= box.row_bytes &&
      box.src_pitch <= max_pitch_ && box.dst_pitch <= max_pitch_) {
    const cudaError_t status =
        cudaMemcpy2DAsync(box.dst, box.dst_pitch, box.src, box.src_pitch, box.row_bytes, rows,
                          cudaMemcpyDeviceToDevice, stream);
    if (status != cudaSuccess) {
      std::ostringstream what;
      what << "cudaMemcpy2DAsync of " << rows << " rows of " << box.row_bytes
           << " bytes (pitches: source " << box.src_pitch << ", destination " << box.dst_pitch
           << "; addresses " << static_cast<const void*>(box.src) << " -> "
           << static_cast<void*>(box.dst) << ")";
      throw_cuda_error(status, what.str().c_str());
    }
    return;
  }
  for (std::uint64_t r = 0; r < rows; ++r) {
    RESHARD_CUDA_CHECK(cudaMemcpyAsync(box.dst + r * box.dst_pitch, box.src + r * box.src_pitch,
                                       box.row_bytes, cudaMemcpyDeviceToDevice, stream));
  }
}

void CudaTransport::wait_for(cudaEvent_t event, const char* what, bool watch_board) {
  // The kernels' own waits give up at the arrival timeout (a peer that has not begun the run)
  // and then at the transfer timeout, and say whom they waited for; the host allows them 10 s
  // more to report it.
  const auto grace = std::chrono::seconds(10);
  const auto limit = std::max(timeout_, arrival_timeout_) + timeout_ + grace;
  int gone = -1;
  RunBoard::State gone_state = RunBoard::kRunning;
  const auto board_problem = [&]() -> std::string {
    if (!watch_board || (gone = board_.first_peer_gone(&gone_state)) < 0) return {};
    return "PE " + std::to_string(gone) +
           (gone_state == RunBoard::kFailed ? " failed" : " gave this run up") + " (" +
           board_.reason(gone) + ")";
  };
  int dead = -1;
  const std::string problem = wait_for_run(event, pids_, what, &dead, limit, board_problem);
  if (dead >= 0 || gone >= 0) {
    // The kernels stop waiting for a peer that cannot answer any more, and must have ended
    // before the caller frees what they touch.
    const int peer = dead >= 0 ? dead : gone;
    cancel_waits(status_);
    if (!same_device_order_.empty()) fail_run(kStatusCancelled, peer, kPhaseDone);
    int ignored = -1;
    if (std::string stuck = wait_for_run(event, {}, what, &ignored, timeout_ + grace);
        !stuck.empty())
      throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + stuck);
    if (dead >= 0) {
      throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": PE " +
                                               std::to_string(dead) + " (pid " +
                                               std::to_string(pids_[dead]) + ") exited mid-run");
    }
    // A peer alive and meeting the others to run again: this PE runs again too.
    can_retry_ = gone_state != RunBoard::kFailed && first_exited_process(pids_, true) < 0;
    throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  if (!problem.empty()) {
    if (!same_device_order_.empty()) fail_run(kStatusTimeout, -1, kPhaseDone);
    throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + problem);
  }
}

void CudaTransport::check_peers_on_board(const char* waiting_for) {
  RunBoard::State state = RunBoard::kRunning;
  const int peer = board_.first_peer_gone(&state);
  if (peer < 0) return;
  can_retry_ = state != RunBoard::kFailed && first_exited_process(pids_, true) < 0;
  throw_error(ErrorCode::kPeerFailure,
              "PE " + std::to_string(peer) +
                  (state == RunBoard::kFailed ? " failed" : " gave its last run up") +
                  " while PE " + std::to_string(me_) + " was waiting " + waiting_for + ": " +
                  board_.reason(peer));
}

bool CudaTransport::retry_requested() const {
  if (finalized_) return false;
  for (int pe = 0; pe < n_pes_; ++pe) {
    const RunBoard::State state = board_.state(pe);
    if (state == RunBoard::kWillRetry || state == RunBoard::kGivingUp) return true;
  }
  return false;
}

void CudaTransport::offer_retry(const std::string& reason) noexcept {
  board_.mark(RunBoard::kWillRetry, reason);
}

void CudaTransport::recover() {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "recover() after finalize()");
  DeviceScope scope(device_);
  // The run given up has ended on this PE (its waits were cancelled or ran out); a PE that never
  // began it has nothing pending.
  if (run_pending_) wait_for(last_run_, "the last run", /*watch_board=*/false);
  run_pending_ = false;
  if (release_stream_ != nullptr) RESHARD_CUDA_CHECK(cudaStreamSynchronize(release_stream_));
  bootstrap_.barrier();  // no PE's device work writes into a peer's flags any more
  {
    // Every flag back to zero on every PE at once: epochs start again from the first run, no
    // flag of the run given up can be taken for one of the next.
    std::lock_guard lock(watchdog_.mutex());
    RESHARD_CUDA_CHECK(cudaMemsetAsync(signals_, 0, SignalLayout::bytes(n_pes_), stream_));
    RESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
    *status_ = DeviceStatus{};
    host_failure_.clear();
    watched_since_ = {};
    all_begun_since_ = {};
  }
  previous_launch_large_ = false;
  can_retry_ = false;
  board_.reset();
  bootstrap_.barrier();  // every PE's flags and board are zero before any run
}

void CudaTransport::fail_run(unsigned int code, int peer, unsigned int phase) noexcept {
  if (status_ == nullptr) return;
  RESHARD_LOG(kDebug, "PE " << me_ << " gives up its run on CUDA device " << device_ << ": "
                            << (code == kStatusTimeout ? "timed out" : "cancelled")
                            << " waiting for PE " << peer);
  // Before its stream is released: the done flags it then raises for the peers it orders by the
  // streams carry no data, and those peers must hear so before they take their run as complete.
  if (board_.state(me_) == RunBoard::kRunning)
    board_.mark(RunBoard::kGivingUp, "PE " + std::to_string(me_) + " gave its run up " +
                                         (code == kStatusTimeout ? "(timed out" : "(cancelled") +
                                         " waiting for PE " + std::to_string(peer) + ")");
  host_failure_.record(code, peer, phase);
  cancel_waits(status_);
  // The kernels after the waits copy nothing once this word is set (see KernelArgs::failure).
  static const unsigned int one = 1;
  cudaMemcpyAsync(SignalLayout::failure(signals_, n_pes_), &one, sizeof one, cudaMemcpyHostToDevice,
                  release_stream_);
  same_device_order_.release(release_stream_);
}

void CudaTransport::check_same_device_run() noexcept {
  const cudaError_t state = cudaEventQuery(last_run_);
  if (state != cudaErrorNotReady) {
    cudaGetLastError();
    watched_since_ = {};  // the run is complete (or failed, which the caller hears of)
    return;
  }
  const int dead = first_exited_process(pids_);
  if (dead >= 0) {
    fail_run(kStatusCancelled, dead, kPhaseDone);
    watched_since_ = {};
    return;
  }
  // A peer that has not begun this run is arriving (the arrival timeout, from this run's start);
  // once all have, the transfer's clock starts.
  const auto now = std::chrono::steady_clock::now();
  const std::uint64_t mine = board_.runs_begun(me_);
  int late = -1;
  for (int pe : same_device_order_.peers()) {
    if (board_.runs_begun(pe) < mine) {
      late = pe;
      break;
    }
  }
  if (late < 0 && all_begun_since_ == std::chrono::steady_clock::time_point{})
    all_begun_since_ = now;
  if (late >= 0 && now - watched_since_ > arrival_timeout_) {
    fail_run(kStatusTimeout, late, kPhaseReady);
    watched_since_ = {};
  } else if (late < 0 && now - all_begun_since_ > std::chrono::nanoseconds(timeout_ns_)) {
    const int stopped = first_stopped_process(pids_);
    const auto& peers = same_device_order_.peers();
    const int peer = stopped >= 0 ? stopped : (peers.empty() ? -1 : peers.front());
    fail_run(kStatusTimeout, peer, kPhaseDone);
    watched_since_ = {};
  }
}

void CudaTransport::synchronize() {
  if (!run_pending_) return throw_device_failure();
  DeviceScope scope(device_);
  wait_for(last_run_, "run()");
  run_pending_ = false;
  throw_device_failure();
  // A peer ordered by the streams that gave its run up still raised its done flags (its stream
  // had to drain): its mark on the board, made before that, says the bytes did not come.
  if (any_stream_ordered()) check_peers_on_board("for its run to complete");
}

void CudaTransport::forget_schedule() {
  if (finalized_) return;
  DeviceScope scope(device_);
  synchronize();
  prepared_.clear();
  {
    std::lock_guard lock(watchdog_.mutex());
    same_device_order_ = SameDeviceOrder(signals_, peer_signals_, me_, batch_memops_);
  }
  // A follower's sources are mapped by its leader too: without this, a follower that frees them
  // and shares new memory from the same driver allocation would find it "already mapped" here.
  imports_.close_all();
}

void CudaTransport::throw_device_failure() {
  const std::optional<RunFailure> failure = run_failure(status_, host_failure_);
  if (!failure) return;
  const RunFailure* status = &*failure;
  const int peer = status->peer;
  std::ostringstream text;
  text << "run() on PE " << me_ << ": ";
  if (status->code == kStatusCancelled) {
    text << "cancelled while waiting for PE " << peer << " (a PE failed or exited)";
    throw_error(ErrorCode::kPeerFailure, text.str());
  }
  // Every PE alive: they may all meet and run again.
  can_retry_ = first_exited_process(pids_, true) < 0;
  if (status->phase == kPhaseReady) {
    text << "PE " << peer << " did not begin this run within " << seconds_for(kPhaseReady) << " s"
         << stuck_behind_clause(*status) << " (is PE " << status->stuck_behind
         << " calling run()? the arrival timeout: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  } else {
    text << "the data from PE " << peer << " did not arrive within " << seconds_for(kPhaseDone)
         << " s" << stuck_behind_clause(*status) << " (is PE " << status->stuck_behind
         << " calling run()? RESHARD_TIMEOUT_S sets the limit)";
  }
  throw_error(ErrorCode::kTimeout, text.str());
}

std::uint64_t CudaTransport::seconds_for(unsigned int phase) const {
  const auto limit = phase == kPhaseReady ? std::max(arrival_timeout_, timeout_) : timeout_;
  return static_cast<std::uint64_t>(limit.count()) / 1000;
}

// Medians over the recorded runs of each phase of the fused kernel, and of the gap from one
// run's end to the next one's start (kernel launch, or the host falling behind).
void CudaTransport::log_trace() noexcept {
  std::vector<std::uint64_t> stamps(static_cast<std::size_t>(kTraceRuns) * kTracePhases);
  if (cudaMemcpy(stamps.data(), trace_, stamps.size() * sizeof stamps[0], cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    cudaGetLastError();
    return;
  }
  auto at = [&](int run, int phase) { return stamps[run * kTracePhases + phase]; };
  auto complete = [&](int run) {
    for (int p = 0; p < kTracePhases; ++p) {
      if (at(run, p) == 0) return false;
    }
    return true;
  };
  const char* names[] = {"wait for peer ready", "copy", "signal done", "wait for sources"};
  std::vector<std::vector<double>> deltas(kTracePhases);
  for (int run = 0; run < kTraceRuns; ++run) {
    if (!complete(run)) continue;
    for (int p = 0; p + 1 < kTracePhases; ++p)
      deltas[p].push_back(static_cast<double>(at(run, p + 1)) - static_cast<double>(at(run, p)));
    const int next = (run + 1) % kTraceRuns;
    if (complete(next) && at(next, kTraceStart) > at(run, kTraceAllDone))
      deltas[kTracePhases - 1].push_back(at(next, kTraceStart) - at(run, kTraceAllDone));
  }
  std::ostringstream text;
  text << "cuda trace, PE " << me_ << ", medians over " << deltas[0].size() << " runs (us):";
  for (int p = 0; p < kTracePhases; ++p) {
    auto& d = deltas[p];
    if (d.empty()) continue;
    std::nth_element(d.begin(), d.begin() + d.size() / 2, d.end());
    text << " " << (p + 1 < kTracePhases ? names[p] : "end to next start") << " "
         << d[d.size() / 2] / 1000.0 << ";";
  }
  RESHARD_LOG(kWarn, text.str());
}

void CudaTransport::abort(const std::string& reason) noexcept {
  aborted_ = true;
  board_.mark(RunBoard::kFailed, reason);  // peers stop waiting for this PE at once
  cancel_waits(status_);
  RESHARD_LOG(kDebug, "cuda transport aborted: " << reason);
}

void CudaTransport::finalize() noexcept {
  if (finalized_) return;
  finalized_ = true;
  const auto scope = DeviceScope::try_enter(device_);
  try {
    if (run_pending_) wait_for(last_run_, "the last run()");
  } catch (const Error& error) {
    RESHARD_LOG(kWarn, "finalize: " << error.what());
  }
  if (!aborted_) {
    // Peers may still write their last flags into this PE's memory until they finish too.
    try {
      bootstrap_.barrier();
    } catch (const Error&) {
    }
  }
  watchdog_.stop();
  if (trace_ != nullptr) {
    log_trace();
    cudaFree(trace_);
    trace_ = nullptr;
  }
  prepared_.clear();
  imports_.close_all();
  signal_imports_.close_all();
  if (signals_ != nullptr) cudaFree(signals_);
  if (status_ != nullptr) cudaFreeHost(status_);
  signals_ = nullptr;
  status_ = nullptr;
  for (int i = 0; i < kCopyEngineStreams; ++i) {
    if (copy_engine_streams_[i]) cudaStreamDestroy(copy_engine_streams_[i]);
    if (joins_[i]) cudaEventDestroy(joins_[i]);
  }
  if (release_stream_) cudaStreamDestroy(release_stream_);
  if (fork_) cudaEventDestroy(fork_);
  if (last_run_) cudaEventDestroy(last_run_);
  if (stream_) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  cudaGetLastError();
}

}  // namespace

std::unique_ptr<Transport> make_cuda_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options) {
  return std::make_unique<CudaTransport>(bootstrap, options);
}

}  // namespace reshard

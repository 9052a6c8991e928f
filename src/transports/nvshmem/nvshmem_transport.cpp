// NVSHMEM transport: pack -> put -> unpack through symmetric staging slots, ordered by NVSHMEM
// signals on the caller's stream. It reaches whatever NVSHMEM reaches (NVLink, InfiniBand through
// its IBRC/IBGDA/UCX transports), so it is the one-sided path across nodes.
//
// Per batch, the sender waits until the receiver has drained the inbox slot it is about to fill,
// fills it, and raises the slot's signal; the receiver waits for that signal, unpacks, and
// acknowledges. A round carries batches to and from any number of peers; its batches are taken in
// waves (wave w holds each pair's w-th batch of the round, so a peer appears once per wave), and
// one kernel moves a whole wave's batches to the peers NVSHMEM maps into this process (NVLink):
// each group of CTAs waits for its slot, stores straight into the peer's inbox through
// nvshmem_ptr and raises the slot's signal from its last CTA; one kernel on the receiver waits,
// unpacks and acknowledges each batch the same way. Any other peer gets the copy-engine variant:
// the batch is packed into a local outbox slot and put with its signal
// (nvshmemx_putmem_signal_on_stream). RESHARD_NVSHMEM_DIRECT=0 sends every peer the put way, as
// across nodes.
// Everything is queued on the stream: no per-round host synchronisation, no global barrier.
// Where processes share this PE's GPU without MPS, the waits move out of the kernels into the
// stream's front end (stream memory operations before kernels that do not wait): a kernel
// spinning there for another process holds the GPU for a whole time slice, and across nodes
// the spins chain from GPU to GPU (2 PEs on each of 4 GPUs, two declared nodes: a Llama-3-8B
// refit took 158 ms against 20 ms on the CUDA transport alone). A watchdog thread then bounds
// those waits, as the kernels' own timeouts bound theirs.
// The host API only (nvshmemx_hostlib_init_attr): no relocatable device code, no device library.
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
#include "gpu/run_watchdog.hpp"
#include "gpu/stream_memory_ops.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard {
namespace {

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

std::uint64_t align_up(std::uint64_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// Adds a group to a launch the caller sized to fit (for_each_launch).
void add_to_launch(cuda::FlaggedLaunch& launch, std::uint32_t group, std::uint32_t ctas,
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

Runtime& runtime() {
  static Runtime instance;
  return instance;
}

// NVSHMEM takes some settings from the environment only, when it initialises: they are set for
// that where the caller has not set them, and taken out again afterwards, so the process's
// environment is left as it was found.
class InitialisationEnv {
 public:
  InitialisationEnv() = default;
  InitialisationEnv(const InitialisationEnv&) = delete;
  InitialisationEnv& operator=(const InitialisationEnv&) = delete;
  ~InitialisationEnv() {
    for (const char* name : set_) ::unsetenv(name);
  }
  void set_default(const char* name, const std::string& value) {
    if (std::getenv(name) != nullptr) return;
    ::setenv(name, value.c_str(), 0);
    set_.push_back(name);
  }

 private:
  std::vector<const char*> set_;
};

// Collective over `bootstrap`: NVSHMEM's unique-id bootstrap, the id from PE 0.
void initialize(Runtime& rt, Bootstrap& bootstrap, int device, std::uint64_t budget) {
  const int me = bootstrap.rank(), n = bootstrap.size();
  if (rt.initialized) {
    if (rt.rank != me || rt.size != n) {
      throw_error(ErrorCode::kUnsupported,
                  "NVSHMEM was initialised in this process as PE " + std::to_string(rt.rank) +
                      " of " + std::to_string(rt.size) + "; it cannot join a job of " +
                      std::to_string(n) + " PEs as PE " + std::to_string(me) +
                      " (NVSHMEM is initialised once per process)");
    }
    return;
  }
  // Staging: NvshmemTransportOptions::staging_bytes per PE (default 512 MiB) split into the
  // slots; the first service of the process sizes them.
  const std::uint64_t slots = (static_cast<std::uint64_t>(n) + 1) * kDepth;
  rt.chunk = std::clamp<std::uint64_t>(budget / slots / kAlign * kAlign, kMinChunk, kMaxChunk);
  rt.rank = me;
  rt.size = n;
  rt.device = device;
  // NVLink multicast stays off (shared machines), and the symmetric heap holds the staging.
  InitialisationEnv env;
  env.set_default("NVSHMEM_DISABLE_NVLS", "1");
  env.set_default("NVSHMEM_SYMMETRIC_SIZE", std::to_string(rt.heap_bytes() + (64 << 20)));

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (me == 0 && nvshmemx_get_uniqueid(&id) != 0) {
    throw_error(ErrorCode::kSystem, "nvshmemx_get_uniqueid failed on PE 0");
  }
  message::Writer mine;
  mine.put(id);
  id = message::Reader(bootstrap.all_gather(mine.bytes())[0]).get<nvshmemx_uniqueid_t>();
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(me, n, &id, &attr) != 0 ||
      nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    rt.broken = "NVSHMEM initialisation failed";
    throw_error(ErrorCode::kSystem, "NVSHMEM initialisation failed on PE " + std::to_string(me) +
                                        " (NVSHMEM_DEBUG=WARN says why; NVSHMEM_SYMMETRIC_SIZE=" +
                                        std::getenv("NVSHMEM_SYMMETRIC_SIZE") + ")");
  }
  rt.initialized = true;
  rt.heap = static_cast<std::byte*>(nvshmem_calloc(1, rt.heap_bytes()));
  if (rt.heap == nullptr) {
    rt.broken = "the NVSHMEM staging heap could not be allocated";
    throw_error(ErrorCode::kSystem,
                "nvshmem_calloc of " + std::to_string(rt.heap_bytes()) +
                    " bytes of staging failed (RESHARD_NVSHMEM_STAGING_BYTES sets the budget, "
                    "NVSHMEM_SYMMETRIC_SIZE the heap)");
  }
  rt.sent.assign(n, 0);
  rt.received.assign(n, 0);
  rt.last_put.assign(n, {});
  RESHARD_LOG(kDebug, "nvshmem transport: PE " << me << " of " << n << " on device " << device
                                               << ", " << kDepth << " slots of " << rt.chunk
                                               << " bytes per peer");
}

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
  // Every peer in one round unless DebugOptions::nvshmem_peers_per_round says fewer: the waves
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
  void prepare(std::span<const ExecutionPlan> phases) override;
  void run(const ExecutionPlan& plan, std::size_t phase, void* stream) override;
  void synchronize() override;
  void abort(const std::string& reason) noexcept override;
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
  void to_stream(cuda::CopyFlags& flags, std::vector<cuda::StreamMemoryOp>& waits);
  void queue_waits(cudaStream_t stream, std::vector<cuda::StreamMemoryOp>& waits);
  void check_stream_waits() noexcept;
  void fail_stream_waits(unsigned int code, int peer, unsigned int phase) noexcept;
  void release_own_waits(cudaStream_t side) noexcept;
  std::pair<int, unsigned int> first_unmet_wait() noexcept;
  void throw_device_failure();

  Runtime& rt_ = runtime();
  int me_ = 0;
  int n_pes_ = 0;
  int device_ = -1;
  int sm_count_ = 1;
  int ctas_per_sm_ = 1;  // flagged copy CTAs one SM holds
  cudaStream_t stream_ = nullptr;
  // Sends go on their own stream, forked from the caller's and joined back at the end of run():
  // a round's sends then need not wait behind the previous round's receives. Receives never
  // wait on this PE's sends, so the two streams cannot wait on each other in a cycle.
  bool send_stream_enabled_ = true;  // DebugOptions::nvshmem_send_stream
  int peers_per_round_ = 0;          // DebugOptions::nvshmem_peers_per_round
  std::chrono::milliseconds timeout_{};
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
  bool direct_ = true;  // DebugOptions::nvshmem_direct
  NodeMap nodes_;       // peers of other nodes take the put path even where NVLink reaches them
  // DebugOptions::nvshmem_trace (diagnosis): waits after every step of a run and adds its time
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
  bool batch_memops_ = true;  // DebugOptions::cuda_batch_memops
  bool can_flush_ = false;    // CU_STREAM_WAIT_VALUE_FLUSH, for data that NICs write
  // For the watchdog: each run in flight with stream waits, oldest first (its end, and its waits in
  // the order queued), and when the newest was queued; guarded by the watchdog's mutex.
  struct StreamWait {
    const std::uint64_t* flag;
    std::uint64_t value;
    int peer;
    unsigned int phase;
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

NvshmemTransport::NvshmemTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : me_(bootstrap.rank()), n_pes_(bootstrap.size()) {
  send_stream_enabled_ = options.debug.nvshmem_send_stream;
  peers_per_round_ = options.debug.nvshmem_peers_per_round;
  direct_ = options.debug.nvshmem_direct;
  trace_ = options.debug.nvshmem_trace;
  timeout_ = options.timeout;
  device_ = cuda::select_device(bootstrap, options.device);
  cuda::DeviceScope scope(device_);
  cuda::load_copy_kernels();
  RESHARD_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device_));
  ctas_per_sm_ = cuda::flagged_copy_ctas_per_sm();
  {
    std::lock_guard lock(rt_.mutex);
    if (!rt_.broken.empty()) {
      throw_error(ErrorCode::kUnsupported,
                  "the nvshmem transport cannot start again in this "
                  "process: " +
                      rt_.broken);
    }
    if (rt_.in_use) {
      throw_error(ErrorCode::kUnsupported,
                  "one nvshmem copy service per process at a time: finalize() the other first");
    }
    initialize(rt_, bootstrap, device_, options.nvshmem.staging_bytes);
    if (rt_.device != device_) {
      throw_error(ErrorCode::kUnsupported, "NVSHMEM runs on device " + std::to_string(rt_.device) +
                                               " in this process, not device " +
                                               std::to_string(device_));
    }
    rt_.in_use = true;
  }
  RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&send_stream_, cudaStreamNonBlocking));
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&last_run_, cudaEventDisableTiming));
  RESHARD_CUDA_CHECK(
      cudaHostAlloc(reinterpret_cast<void**>(&status_), sizeof *status_, cudaHostAllocMapped));
  *status_ = {};
  RESHARD_CUDA_CHECK(
      cudaHostGetDevicePointer(reinterpret_cast<void**>(&status_device_), status_, 0));
  RESHARD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&failure_), sizeof *failure_));
  RESHARD_CUDA_CHECK(cudaMemset(failure_, 0, sizeof *failure_));
  // On two streams a send and a receive kernel run at once, and a receive kernel's CTAs wait
  // for the peers' sends: each gets at most half of what the GPU holds at once, so both are
  // always resident together and a PE's sends are never starved of SMs by its own waiting
  // receive. At 64 registers a thread an SM holds 2 CTAs, so the cap stays at one per SM.
  // PEs sharing the GPU (colocated processes) divide it among them: under MPS their kernels run
  // side by side, each waiting on the others', and kernels that did not all fit spun until the
  // timeout (one H100, 2026-11-27: 2 PEs at 16 MiB per peer, 4 PEs at 1 MiB). Without MPS the
  // processes take turns on the whole GPU, so the share costs nothing there that the turns did not.
  const int sharing = cuda::pes_on_this_gpu(bootstrap, device_);
  batch_memops_ = options.debug.cuda_batch_memops;
  const std::string& waits = options.nvshmem.waits;
  const bool can_stream = cuda::stream_memory_ops_supported(device_);
  if (waits == "stream" && !can_stream) {
    throw_error(ErrorCode::kUnsupported,
                "nvshmem.waits (RESHARD_NVSHMEM_WAITS) is \"stream\" but the driver has no 64-bit "
                "stream memory operations for device " +
                    std::to_string(device_));
  }
  stream_waits_ = waits == "stream" ||
                  (waits == "auto" && can_stream && sharing > 1 && !cuda::mps_server_found());
  can_flush_ = cuda::can_flush_remote_writes(device_);
  if (stream_waits_) {
    RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&release_stream_, cudaStreamNonBlocking));
    RESHARD_LOG(kDebug, "nvshmem transport on PE "
                            << me_ << ": waits on the stream"
                            << (can_flush_ ? " (remote writes flushed)" : ""));
  }
  limit_gpu_share(sharing);
  if (sharing > 1) {
    RESHARD_LOG(kDebug, sharing << " PEs share CUDA device " << device_ << ": at most " << max_ctas_
                                << " CTAs per launch");
  }

  local_pids_ = cuda::local_peer_pids(bootstrap);
  nodes_ = map_nodes(bootstrap, options.node_size);
  timeout_ns_ = static_cast<std::uint64_t>(timeout_.count()) * 1000000;
  std::vector<const std::uint64_t*> waiting_on(n_pes_, nullptr);
  for (int pe = 0; pe < n_pes_; ++pe) {
    if (nodes_.same_node(me_, pe))
      waiting_on[pe] = static_cast<const std::uint64_t*>(nvshmem_ptr(rt_.waiting_on(), pe));
  }
  peer_waiting_on_.upload(waiting_on);
  if (stream_waits_) {
    watchdog_.start(
        device_, [this] { return !watched_.empty(); }, [this] { check_stream_waits(); });
  }
}

KernelArgs NvshmemTransport::launch_args() const {
  KernelArgs args{};
  args.descriptors = at_->descriptors_device;
  args.groups = at_->groups_device;
  args.status = status_device_;
  args.failure = failure_;
  args.n_pes = n_pes_;
  args.me = me_;
  args.waiting_on = rt_.waiting_on();
  args.peer_waiting_on = peer_waiting_on_.get();
  args.timeout_ns = timeout_ns_;
  // A late peer has the transfer timeout here too: this transport's host waits allow no more.
  args.arrival_timeout_ns = 0;
  return args;
}

KernelArgs NvshmemTransport::args_for(std::uint32_t group) const {
  KernelArgs args = launch_args();
  args.groups = at_->groups_device + group;
  args.group_count = 1;
  args.cta_count = at_->groups[group].cta_count;
  return args;
}

void NvshmemTransport::build_copies(const ExecutionPlan& plan) {
  std::vector<CopyDescriptor> descriptors;
  at_->groups.clear();
  auto add_group = [&](auto&& fill) {
    PeerGroup group{};
    group.peer = -1;
    group.first_descriptor = static_cast<std::uint32_t>(descriptors.size());
    fill(group);
    group.descriptor_count =
        static_cast<std::uint32_t>(descriptors.size()) - group.first_descriptor;
    group.cta_count = static_cast<std::uint32_t>(
        std::clamp<std::uint64_t>((group.bytes + kBytesPerCta - 1) / kBytesPerCta, 1, max_ctas_));
    at_->groups.push_back(group);
    return static_cast<std::uint32_t>(at_->groups.size() - 1);
  };
  auto add = [&](PeerGroup& group, const std::byte* src, std::byte* dst, std::uint64_t bytes) {
    cuda::append_copy(descriptors, group.first_descriptor, group.bytes,
                      reinterpret_cast<const unsigned char*>(src),
                      reinterpret_cast<unsigned char*>(dst), bytes);
  };
  at_->local_group.reset();
  if (!plan.local_copies.empty()) {
    at_->local_group = add_group([&](PeerGroup& group) {
      for (const LocalCopy& copy : plan.local_copies) add(group, copy.src, copy.dst, copy.bytes);
    });
  }
  remote_data_.assign(n_pes_, {});
  remote_ack_.assign(n_pes_, nullptr);
  for (int peer = 0; direct_ && peer < n_pes_; ++peer) {
    if (peer == me_ || !nodes_.same_node(me_, peer)) continue;
    for (int slot = 0; slot < kDepth; ++slot) {
      remote_data_[peer][slot] =
          static_cast<std::uint64_t*>(nvshmem_ptr(rt_.data_signal(me_, slot), peer));
    }
    remote_ack_[peer] = static_cast<std::uint64_t*>(nvshmem_ptr(rt_.ack_signal(me_), peer));
  }
  // A peer is mapped when NVSHMEM maps its inbox and signals here (nvshmem_ptr non-null).
  auto mapped_inbox = [&](int peer, int slot) -> std::byte* {
    if (remote_data_[peer][slot] == nullptr || remote_ack_[peer] == nullptr) return nullptr;
    return static_cast<std::byte*>(nvshmem_ptr(rt_.inbox(me_, slot), peer));
  };
  at_->sends.clear();
  at_->receives.clear();
  for (const PlannedBatch& batch : plan.sends) {
    if (batch.bytes > rt_.chunk) {
      throw_error(ErrorCode::kValidation, "a batch of " + std::to_string(batch.bytes) +
                                              " bytes to PE " + std::to_string(batch.peer) +
                                              " exceeds the NVSHMEM slot of " +
                                              std::to_string(rt_.chunk) + " bytes");
    }
    StagedBatch staged{batch.peer, batch.bytes, mapped_inbox(batch.peer, 0) != nullptr, {}};
    for (int slot = 0; slot < kDepth; ++slot) {
      staged.group[slot] = add_group([&](PeerGroup& group) {
        std::byte* out = staged.mapped ? mapped_inbox(batch.peer, slot) : rt_.outbox(slot);
        for (std::uint32_t s = 0; s < batch.span_count; ++s) {
          const CopySpan& span = plan.spans[batch.first_span + s];
          add(group, span.data, out + group.bytes, span.bytes);
        }
      });
    }
    at_->sends.push_back(staged);
  }
  for (const PlannedBatch& batch : plan.receives) {
    StagedBatch staged{batch.peer, batch.bytes, remote_ack_[batch.peer] != nullptr, {}};
    for (int slot = 0; slot < kDepth; ++slot) {
      staged.group[slot] = add_group([&](PeerGroup& group) {
        const std::byte* in = rt_.inbox(batch.peer, slot);
        for (std::uint32_t s = 0; s < batch.span_count; ++s) {
          const CopySpan& span = plan.spans[batch.first_span + s];
          add(group, in + group.bytes, span.data, span.bytes);
        }
      });
    }
    at_->receives.push_back(staged);
  }
  build_waves(plan);
  std::size_t mapped = 0;
  for (const StagedBatch& batch : at_->sends) mapped += batch.mapped;
  RESHARD_LOG(kInfo, "nvshmem plan on PE " << me_ << ": " << at_->sends.size() << " send batches ("
                                           << mapped << " written straight into the peer's inbox, "
                                           << at_->sends.size() - mapped << " put) in "
                                           << at_->waves.size() << " waves over " << plan.rounds
                                           << " rounds");
  at_->descriptors_device = at_->descriptors.upload(descriptors);
  at_->groups_device = at_->device_groups.upload(at_->groups);
}

// A round may hold several batches of one pair (the scheduler merges matching rounds), and a
// batch waits for the acknowledgement of the pair's batch kDepth before it. Wave w of a round
// holds each pair's w-th batch of the round, on both PEs of the pair alike; waves run in (round,
// wave) order, and per wave the sends go before the receives. A batch then waits only on
// batches of earlier waves, and a stream never holds a kernel behind one of a later wave, so no
// PE waits on one that waits on it; and a wave's kernel never waits on itself.
void NvshmemTransport::build_waves(const ExecutionPlan& plan) {
  using Key = std::pair<std::uint32_t, std::uint32_t>;  // (round, wave)
  std::vector<std::pair<Key, std::uint32_t>> sends, receives;
  auto number = [](const std::vector<PlannedBatch>& batches, auto& out) {
    std::map<std::pair<std::uint32_t, int>, std::uint32_t> seen;  // (round, peer) -> batches
    for (std::uint32_t i = 0; i < batches.size(); ++i) {
      const PlannedBatch& b = batches[i];
      out.push_back({Key{b.round, seen[{b.round, b.peer}]++}, i});
    }
  };
  number(plan.sends, sends);
  number(plan.receives, receives);
  std::map<Key, Wave> waves;
  for (const auto& [key, i] : sends) {
    if (at_->sends[i].mapped) waves[key].sends.push_back(i);
  }
  for (const auto& [key, i] : sends) {
    if (!at_->sends[i].mapped) waves[key].sends.push_back(i);
  }
  for (const auto& [key, i] : receives) waves[key].receives.push_back(i);
  at_->waves.clear();
  for (auto& [key, wave] : waves) {
    for (std::uint32_t i : wave.sends) wave.mapped_sends += at_->sends[i].mapped;
    // The CTAs of one launch are shared by its groups; a put batch is packed alone.
    for_each_launch(wave.mapped_sends, [&](std::size_t first, std::size_t last) {
      share_ctas(wave.sends, first, last, at_->sends);
    });
    for_each_launch(wave.receives.size(), [&](std::size_t first, std::size_t last) {
      share_ctas(wave.receives, first, last, at_->receives);
    });
    at_->waves.push_back(std::move(wave));
  }
}

// Gives batches[first, last) CTAs of one launch: each what its bytes want (one per kBytesPerCta)
// when they fit in max_ctas_ together, else a share by bytes, one at least.
void NvshmemTransport::share_ctas(const std::vector<std::uint32_t>& batches, std::size_t first,
                                  std::size_t last, const std::vector<StagedBatch>& list) {
  const std::size_t count = last - first;
  std::uint64_t total = 0, wanted = 0;
  for (std::size_t k = first; k < last; ++k) {
    total += list[batches[k]].bytes;
    wanted += at_->groups[list[batches[k]].group[0]].cta_count;
  }
  if (wanted <= static_cast<std::uint64_t>(max_ctas_)) return;
  const std::uint64_t spare = static_cast<std::uint64_t>(max_ctas_) - count;
  for (std::size_t k = first; k < last; ++k) {
    const StagedBatch& batch = list[batches[k]];
    const std::uint64_t share = total == 0 ? 0 : spare * batch.bytes / total;
    for (std::uint32_t group : batch.group) {
      at_->groups[group].cta_count = static_cast<std::uint32_t>(
          std::min<std::uint64_t>(at_->groups[group].cta_count, 1 + share));
    }
  }
}

void NvshmemTransport::prepare(std::span<const ExecutionPlan> phases) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "schedule() after finalize()");
  cuda::DeviceScope scope(device_);
  prepared_ = false;
  phases_.clear();
  for (const ExecutionPlan& plan : phases) {
    at_ = phases_.emplace_back(std::make_unique<PhaseCopies>()).get();
    build_copies(plan);
  }
  prepared_ = true;
}

// Signal values: once batch q of a pair has landed, its slot's data signal holds
// cuda::done_mark(q + 1); once it was unpacked, the pair's acknowledgement holds done_mark(q + 1).
// NVSHMEM sets them whole on the put path; a mapped peer's flagged kernels add to them, each CTA
// its share (cuda::done_share), so no CTA waits to count the others first.

// The wave's sends to mapped peers in as few kernels as their groups allow: each group waits
// until its peer drained the slot, writes the peer's inbox and adds to the slot's signal from
// each CTA. Then each put batch: packed into an outbox slot (after the same wait) and put with
// its signal.
void NvshmemTransport::send_wave(const Wave& wave, cudaStream_t stream) {
  const KernelArgs args = launch_args();
  // The batch's sequence number and slot; its flags wait until the peer acknowledged the batch
  // that last used the slot, and raise the slot's signal from that batch's mark to this one's.
  auto next_send = [&](const StagedBatch& batch, std::uint64_t* sequence, int* slot) {
    *sequence = rt_.sent[batch.peer]++;
    *slot = static_cast<int>(*sequence % kDepth);
    cuda::CopyFlags flags;
    flags.raise_units = *sequence + 1;
    if (const auto previous = rt_.last_put[batch.peer][*slot]) {
      flags.wait = rt_.ack_signal(batch.peer);
      flags.wait_value = cuda::done_mark(*previous + 1);
      flags.peer = batch.peer;
      flags.phase = cuda::kPhaseReady;
      flags.raise_units -= *previous + 1;
    }
    rt_.last_put[batch.peer][*slot] = *sequence;
    return flags;
  };
  std::vector<cuda::StreamMemoryOp> waits;
  for_each_launch(wave.mapped_sends, [&](std::size_t first, std::size_t last) {
    cuda::FlaggedLaunch launch;
    for (std::size_t k = first; k < last; ++k) {
      const StagedBatch& batch = at_->sends[wave.sends[k]];
      std::uint64_t sequence = 0;
      int slot = 0;
      cuda::CopyFlags flags = next_send(batch, &sequence, &slot);
      flags.raise = remote_data_[batch.peer][slot];
      to_stream(flags, waits);
      add_to_launch(launch, batch.group[slot], at_->groups[batch.group[slot]].cta_count, flags);
    }
    step(0, stream, [&] {
      queue_waits(stream, waits);
      cuda::launch_flagged_copies(args, launch, stream);
    });
  });
  for (std::size_t k = wave.mapped_sends; k < wave.sends.size(); ++k) {
    const StagedBatch& batch = at_->sends[wave.sends[k]];
    std::uint64_t sequence = 0;
    int slot = 0;
    cuda::CopyFlags flags = next_send(batch, &sequence, &slot);
    to_stream(flags, waits);
    const int outbox = static_cast<int>(rt_.outbox_uses++ % kDepth);
    cuda::FlaggedLaunch launch;
    add_to_launch(launch, batch.group[outbox], at_->groups[batch.group[outbox]].cta_count, flags);
    step(0, stream, [&] {
      queue_waits(stream, waits);
      cuda::launch_flagged_copies(args, launch, stream);
    });
    // Put with signal: NVSHMEM delivers the signal only after the data, with no quiet between
    // (a quiet waits for every put of this PE to complete), and the stream moves on once the
    // outbox slot may be filled again.
    step(1, stream, [&] {
      nvshmemx_putmem_signal_on_stream(rt_.inbox(me_, slot), rt_.outbox(outbox), batch.bytes,
                                       rt_.data_signal(me_, slot), cuda::done_mark(sequence + 1),
                                       NVSHMEM_SIGNAL_SET, batch.peer, stream);
    });
  }
}

// The wave's receives in as few kernels as their groups allow: each group waits for its slot's
// data, unpacks it and, where the peer is mapped here, acknowledges from each CTA; the others are
// acknowledged through NVSHMEM once their kernel is done.
void NvshmemTransport::receive_wave(const Wave& wave, cudaStream_t stream) {
  const KernelArgs args = launch_args();
  std::vector<std::pair<int, std::uint64_t>> acks;  // (peer, value) after the kernel
  std::vector<cuda::StreamMemoryOp> waits;
  for_each_launch(wave.receives.size(), [&](std::size_t first, std::size_t last) {
    cuda::FlaggedLaunch launch;
    acks.clear();
    for (std::size_t k = first; k < last; ++k) {
      const StagedBatch& batch = at_->receives[wave.receives[k]];
      const int peer = batch.peer;
      const std::uint64_t sequence = rt_.received[peer]++;
      const int slot = static_cast<int>(sequence % kDepth);
      cuda::CopyFlags flags;
      flags.wait = rt_.data_signal(peer, slot);
      flags.wait_value = cuda::done_mark(sequence + 1);
      flags.peer = peer;
      flags.phase = cuda::kPhaseDone;
      if (batch.mapped) {
        flags.raise = remote_ack_[peer];  // one unit: the acknowledgements of a pair go in order
      } else {
        acks.emplace_back(peer, cuda::done_mark(sequence + 1));
      }
      to_stream(flags, waits);
      add_to_launch(launch, batch.group[slot], at_->groups[batch.group[slot]].cta_count, flags);
    }
    step(2, stream, [&] {
      queue_waits(stream, waits);
      cuda::launch_flagged_copies(args, launch, stream);
    });
    for (const auto& [peer, value] : acks) {
      step(3, stream, [&] {
        nvshmemx_signal_op_on_stream(rt_.ack_signal(me_), value, NVSHMEM_SIGNAL_SET, peer, stream);
      });
    }
  });
}

void NvshmemTransport::run(const ExecutionPlan& /*plan*/, std::size_t phase, void* stream_handle) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "run() after finalize()");
  if (!prepared_) throw_error(ErrorCode::kInvalidState, "run() before schedule()");
  at_ = phases_.at(phase).get();
  if (aborted_) throw_error(ErrorCode::kPeerFailure, "run() after a failed run on this PE");
  cuda::DeviceScope scope(device_);
  // A run the watchdog (or a kernel's wait) failed since: say why before queuing more.
  if (cuda::run_failure(status_, host_failure_)) synchronize();
  run_waits_.clear();
  cudaStream_t stream = stream_handle ? static_cast<cudaStream_t>(stream_handle) : stream_;
  if (stream_handle == nullptr) cuda::wait_for_default_stream(stream);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RESHARD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    // Signal values advance with every run, so a replayed graph would wait for stale ones.
    throw_error(ErrorCode::kUnsupported,
                "the nvshmem transport cannot be captured in a CUDA graph (its signal values "
                "advance every run); use the cuda transport for graph capture");
  }
  // With trace on, one stream: each step is timed alone.
  cudaStream_t sends = stream;
  if (two_streams()) {
    sends = send_stream_;
    RESHARD_CUDA_CHECK(cudaEventRecord(fork_, stream));
    RESHARD_CUDA_CHECK(cudaStreamWaitEvent(sends, fork_, 0));
  }
  if (at_->local_group) cuda::launch_plain_copy(args_for(*at_->local_group), stream);
  // On one stream each wave's receives follow its sends; on two, the receives of every wave
  // drain while the later waves' sends go out.
  for (const Wave& wave : at_->waves) {
    send_wave(wave, sends);
    receive_wave(wave, stream);
  }
  if (two_streams()) {
    RESHARD_CUDA_CHECK(cudaEventRecord(join_, sends));
    RESHARD_CUDA_CHECK(cudaStreamWaitEvent(stream, join_, 0));
  }
  RESHARD_CUDA_CHECK(cudaGetLastError());
  RESHARD_CUDA_CHECK(cudaEventRecord(last_run_, stream));
  run_pending_ = true;
  if (watchdog_.running()) {
    std::lock_guard lock(watchdog_.mutex());
    cudaEvent_t done = nullptr;
    if (spare_events_.empty()) {
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
    } else {
      done = spare_events_.back();
      spare_events_.pop_back();
    }
    watched_.push_back({done, std::move(run_waits_)});
    RESHARD_CUDA_CHECK(cudaEventRecord(done, stream));
    last_queued_ = Clock::now();
    watchdog_.wake();
  }
  if (stream_handle == nullptr) synchronize();
}

// Where this PE waits on the stream, the wait in `flags` moves from the kernel to `waits` (queued
// before the kernel). Data that a NIC writes needs the wait to flush it; where the GPU cannot,
// a wait for a peer on another machine stays in the kernel, whose acquiring loads see the data.
void NvshmemTransport::to_stream(cuda::CopyFlags& flags, std::vector<cuda::StreamMemoryOp>& waits) {
  if (!stream_waits_ || flags.wait == nullptr) return;
  const bool remote_data =
      flags.phase == cuda::kPhaseDone && !nodes_.one_machine && !nodes_.same_node(me_, flags.peer);
  if (remote_data && !can_flush_) return;
  waits.push_back({const_cast<std::uint64_t*>(flags.wait), flags.wait_value, true, remote_data});
  run_waits_.push_back({flags.wait, flags.wait_value, flags.peer, flags.phase});
  flags.wait = nullptr;
}

void NvshmemTransport::queue_waits(cudaStream_t stream, std::vector<cuda::StreamMemoryOp>& waits) {
  if (waits.empty()) return;
  cuda::queue_stream_memory_ops(stream, waits, batch_memops_);
  waits.clear();
}

// Follows the runs queued with stream waits: a local peer that exits, or no run ending within the
// timeout of the last one queued, fails the run (the pinned status names the peer) and releases
// this PE's waits, so the caller's stream drains (its copies skip) instead of waiting forever. It
// keeps them released until the runs are over: a peer's late signal may set a word back below
// what a later wait wants.
void NvshmemTransport::check_stream_waits() noexcept {
  while (!watched_.empty()) {
    const cudaError_t state = cudaEventQuery(watched_.front().done);
    if (state == cudaErrorNotReady) break;
    cudaGetLastError();  // over, or failed (which the caller hears of)
    spare_events_.push_back(watched_.front().done);
    watched_.pop_front();
  }
  if (watched_.empty()) {
    watch_failed_ = false;
  } else if (watch_failed_) {
    fail_stream_waits(cuda::kStatusCancelled, -1, 0);
  } else if (const int dead = first_exited_process(local_pids_, true); dead >= 0) {
    fail_stream_waits(cuda::kStatusCancelled, dead, cuda::kPhaseDone);
  } else if (Clock::now() - last_queued_ > timeout_) {
    const int stopped = first_stopped_process(local_pids_);
    const auto [peer, phase] = first_unmet_wait();
    fail_stream_waits(cuda::kStatusTimeout, stopped >= 0 ? stopped : peer, phase);
  }
}

// The peer and phase of the first watched wait whose word is still below its value (-1: none).
std::pair<int, unsigned int> NvshmemTransport::first_unmet_wait() noexcept {
  const std::size_t words = rt_.signal_words_bytes() / sizeof(std::uint64_t);
  std::vector<std::uint64_t> now(words);
  if (cudaMemcpyAsync(now.data(), rt_.heap, words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                      release_stream_) != cudaSuccess ||
      cudaStreamSynchronize(release_stream_) != cudaSuccess) {
    cudaGetLastError();
    return {-1, cuda::kPhaseDone};
  }
  const auto* base = reinterpret_cast<const std::uint64_t*>(rt_.heap);
  for (const WatchedRun& run : watched_) {
    for (const StreamWait& wait : run.waits) {
      const auto word = static_cast<std::size_t>(wait.flag - base);
      if (word < words && now[word] < wait.value) return {wait.peer, wait.phase};
    }
  }
  return {-1, cuda::kPhaseDone};
}

// Records the failure in the pinned status (first one only), stops the kernels' copies and raises
// every signal word this PE waits on past any value a run expects.
void NvshmemTransport::fail_stream_waits(unsigned int code, int peer, unsigned int phase) noexcept {
  host_failure_.record(code, peer, phase);
  cuda::cancel_waits(status_);
  watch_failed_ = true;
  release_own_waits(release_stream_);
}

// Raises every signal word this PE waits on past any value a run expects (0x7f7f...: above any
// count) and sets the failure word, so its streams drain (their copies skip) instead of waiting
// until the process ends. The waiting_on word stays: peers may still follow it.
void NvshmemTransport::release_own_waits(cudaStream_t side) noexcept {
  if (rt_.heap != nullptr) cudaMemsetAsync(rt_.heap, 0x7f, rt_.signal_words_bytes(), side);
  if (failure_ != nullptr) cudaMemsetAsync(failure_, 0xff, sizeof *failure_, side);
  cudaStreamSynchronize(side);
  cudaGetLastError();
}

void NvshmemTransport::synchronize() {
  if (!run_pending_) return throw_device_failure();
  cuda::DeviceScope scope(device_);
  int dead = -1;
  // Stream waits are the watchdog's to end (it names the wait that was not met); this wait gives
  // it a moment beyond the timeout to do so.
  const auto limit =
      timeout_ + (stream_waits_ ? std::chrono::milliseconds(2000) : std::chrono::milliseconds(0));
  const std::string problem = cuda::wait_for_run(last_run_, local_pids_, "NVSHMEM", &dead, limit);
  run_pending_ = false;
  if (!problem.empty()) {
    abort(problem);
    throw_error(dead >= 0 ? ErrorCode::kPeerFailure : ErrorCode::kTimeout,
                "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  throw_device_failure();
}

void NvshmemTransport::throw_device_failure() {
  const std::optional<cuda::RunFailure> failure = cuda::run_failure(status_, host_failure_);
  if (!failure) return;
  const cuda::RunFailure* status = &*failure;
  // A wait ran out or was cancelled (by the kernels, or by the watchdog for stream waits): the
  // peer it waited for is named, and the PE that peer is itself stuck behind, where known.
  const int peer = status->peer;
  const bool known = peer >= 0 && peer < static_cast<int>(local_pids_.size());
  if (status->code == cuda::kStatusCancelled && known && local_pids_[peer] > 0 &&
      first_exited_process(std::span(&local_pids_[peer], 1), true) == 0) {
    const std::string problem = "PE " + std::to_string(peer) + " (pid " +
                                std::to_string(local_pids_[peer]) + ") exited mid-run";
    abort(problem);
    throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  const std::string problem =
      std::string(status->code == cuda::kStatusTimeout ? "timed out" : "stopped") +
      (known ? " waiting for PE " + std::to_string(peer) +
                   (status->phase == cuda::kPhaseReady ? " to drain its inbox"
                                                       : " to deliver its data")
             : std::string(" waiting for its peers")) +
      cuda::stuck_behind_clause(*status) + " (RESHARD_TIMEOUT_S sets the limit)";
  abort(problem);
  throw_error(ErrorCode::kTimeout, "run() on PE " + std::to_string(me_) + ": " + problem);
}

void NvshmemTransport::abort(const std::string& reason) noexcept {
  if (aborted_) return;
  aborted_ = true;
  RESHARD_LOG(kDebug, "nvshmem transport aborted: " << reason);
  std::lock_guard lock(rt_.mutex);
  // The pair counters no longer match the peers' (a run stopped half-way on some PEs).
  rt_.broken = "an earlier run failed (" + reason + ")";
  // Waits stop at once (each records itself cancelled unless a failure was claimed first).
  host_failure_.record(cuda::kStatusCancelled, -1, cuda::kPhaseDone);
  cuda::cancel_waits(status_);
  if (rt_.heap != nullptr) {
    cudaStream_t side = nullptr;
    if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess) {
      release_own_waits(side);
      cudaStreamDestroy(side);
    }
  }
}

void NvshmemTransport::finalize() noexcept {
  if (finalized_) return;
  finalized_ = true;
  const auto scope = cuda::DeviceScope::try_enter(device_);
  if (trace_) {
    // send: wait for the slot, fill it (and signal a mapped peer); put: put with signal; receive:
    // wait for the data, unpack (and acknowledge a mapped peer); ack: acknowledge a put peer.
    static const char* const names[] = {"send", "put", "receive", "ack"};
    std::string line;
    for (std::size_t k = 0; k < trace_seconds_.size(); ++k) {
      line += std::string(" ") + names[k] + " " +
              std::to_string(trace_count_[k] ? trace_seconds_[k] / trace_count_[k] * 1e6 : 0) +
              " us x" + std::to_string(trace_count_[k]);
    }
    RESHARD_LOG(kWarn, "nvshmem trace (mean per step):" << line);
  }
  try {
    synchronize();
  } catch (const Error& error) {
    RESHARD_LOG(kWarn, "finalize: " << error.what());
  }
  watchdog_.stop();
  for (const WatchedRun& run : watched_) spare_events_.push_back(run.done);
  watched_.clear();
  for (cudaEvent_t event : spare_events_) cudaEventDestroy(event);
  spare_events_.clear();
  if (!aborted_ && stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (!aborted_ && send_stream_ != nullptr) cudaStreamSynchronize(send_stream_);
  if (last_run_) cudaEventDestroy(last_run_);
  if (fork_) cudaEventDestroy(fork_);
  if (join_) cudaEventDestroy(join_);
  if (stream_) cudaStreamDestroy(stream_);
  if (send_stream_) cudaStreamDestroy(send_stream_);
  if (release_stream_) cudaStreamDestroy(release_stream_);
  if (status_) cudaFreeHost(status_);
  if (failure_ != nullptr && !aborted_) cudaFree(failure_);
  failure_ = nullptr;
  last_run_ = nullptr;
  fork_ = join_ = nullptr;
  stream_ = send_stream_ = release_stream_ = nullptr;
  status_ = nullptr;
  std::lock_guard lock(rt_.mutex);
  rt_.in_use = false;
}

}  // namespace

std::string nvshmem_version() {
  // The library's own version needs NVSHMEM running; the headers it was built against must match
  // it (the build checks 3.4.5).
  return ", NVSHMEM " + std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap,
                                                  const CopyServiceOptions& options) {
  return std::make_unique<NvshmemTransport>(bootstrap, options);
}

}  // namespace reshard

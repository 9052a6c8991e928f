// NCCL transport: grouped ncclSend/ncclRecv per round of the schedule. It reaches any GPU NCCL
// reaches (NVLink, PCIe, sockets, InfiniBand), so it is the path across nodes and the baseline the
// benchmark compares the CUDA transport against.
#include <nccl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <future>
#include <optional>
#include <thread>
#include <vector>

#include "core/message.hpp"
#include "core/processes.hpp"
#include "core/transport.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/run_board.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard {
namespace {

constexpr std::uint64_t kUnbounded = 1ull << 50;

// What a failed NCCL call says, or an empty string when it did not fail.
std::string nccl_failure(const char* call, ncclResult_t status) {
  if (status == ncclSuccess || status == ncclInProgress) return {};
  return std::string(call) + " failed: " + ncclGetErrorString(status) + " (" +
         ncclGetLastError(nullptr) + ")";
}

#define RESHARD_NCCL_CHECK(call)                                             \
  do {                                                                       \
    if (std::string failure = nccl_failure(#call, (call)); !failure.empty()) \
      throw_error(ErrorCode::kSystem, failure);                              \
  } while (0)

// Inside run(): with a nonblocking communicator a call may return ncclInProgress and is then
// awaited with reshard's timeout and dead-peer checks. A failed call usually means a peer is gone
// (its proxy socket refuses us): the error names it where it was a local process, and the
// communicator is aborted so that teardown does not wait on it.
#define RESHARD_NCCL_RUN_CHECK(call)                                      \
  do {                                                                    \
    if (Failure failure = settle(#call, (call), true)) fail_run(failure); \
  } while (0)

struct Failure {
  std::string text;  // empty: none
  ErrorCode code = ErrorCode::kSystem;
  explicit operator bool() const { return !text.empty(); }
};

class NcclTransport final : public Transport {
 public:
  NcclTransport(Bootstrap& bootstrap, const CopyServiceOptions& options);
  ~NcclTransport() override { finalize(); }

  const char* name() const override { return "nccl"; }
  // NCCL pipelines large messages itself and runs every peer of a group at once.
  TransportCaps caps() const override { return {kUnbounded, n_pes_, kUnbounded, false}; }
  int device() const override { return device_; }
  void check_buffer(const Buffer& buffer) const override {
    cuda::check_device_buffer(buffer, device_, "nccl");
  }
  // NCCL needs nothing between phases: a receive lands when the receiver's stream reaches it. A
  // new schedule starts as after a retry: a communicator given up on any PE is made again.
  void schedule(std::span<const ExecutionPlan> phases) override {
    if (finalized_) throw_error(ErrorCode::kInvalidState, "schedule() after finalize()");
    recover();
    peers_.clear();
    for (const ExecutionPlan& plan : phases) {
      for (const auto* list : {&plan.sends, &plan.receives}) {
        for (const PlannedBatch& batch : *list) peers_.push_back(batch.peer);
      }
    }
    std::sort(peers_.begin(), peers_.end());
    peers_.erase(std::unique(peers_.begin(), peers_.end()), peers_.end());
    remote_peers_ = std::any_of(peers_.begin(), peers_.end(), [&](int pe) {
      return local_pids_[static_cast<std::size_t>(pe)] == 0;
    });
  }
  void run(const ExecutionPlan& plan, std::size_t phase, void* stream) override;
  void synchronize() override;
  void abort(const std::string& reason) noexcept override;
  // A run given up on peers that are alive (a timeout, a peer that gave its run up) is run again:
  // the communicator, which only an abort stops waiting for a lost peer, is aborted when the run
  // is given up, and recover() makes a new one on every PE. The peers of this machine learn of
  // it on the run board at once; those of other machines at their own timeout.
  void offer_retry(const std::string& reason) noexcept override;
  bool can_retry() const override { return can_retry_; }
  bool retry_requested() const override;
  void recover() override;
  void finalize() noexcept override;

 private:
  // Collective: a communicator over every PE, the unique id from PE 0.
  void make_communicator();
  // Aborts the communicator (bounded: ncclCommAbort may wait on peers that are gone).
  void drop_communicator(const std::string& reason) noexcept;
  // This PE's run is given up: the communicator goes, the peers of this machine are told.
  void give_up_run(const std::string& reason) noexcept;
  // A peer of this machine that gave its run up (or failed): this PE's run cannot complete.
  void check_peers_on_board(const char* waiting_for);
  // What went wrong with call `call` that returned `status`, waiting for it to finish where it
  // is in progress (nonblocking communicator); none once it succeeded.
  // `in_run`: a call of run(), bounded as the run is (late_peer_problem).
  Failure settle(const char* call, ncclResult_t status, bool in_run = false);
  // Why this run has waited too long, or nothing. A peer of this machine that has not begun it
  // (the run board counts the runs each PE began) has the arrival timeout (where it is the longer)
  // from this run's start;
  // once every peer of the schedule has begun, the transfer timeout counts. A peer on another
  // machine cannot be seen beginning: a schedule that exchanges with one has the longer of the
  // two from this run's start.
  std::string late_peer_problem();
  // The most a wait in a run may take: the limits above, and a margin for them to report.
  std::chrono::milliseconds run_backstop() const {
    return std::max(timeout_, arrival_timeout_) + timeout_ + std::chrono::seconds(2);
  }
  [[noreturn]] void fail_run(const Failure& failure);

  Bootstrap& bootstrap_;
  std::uint32_t group_spans_;                  // AdvancedOptions::nccl_group_spans
  std::chrono::milliseconds timeout_;          // CopyServiceOptions::timeout
  std::chrono::milliseconds arrival_timeout_;  // CopyServiceOptions::arrival_timeout
  std::chrono::steady_clock::time_point run_started_{};
  std::chrono::steady_clock::time_point all_begun_since_{};  // none yet: every peer began
  int me_ = 0;
  int n_pes_ = 0;
  int device_ = -1;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t last_run_ = nullptr;
  bool run_pending_ = false;
  std::vector<pid_t> local_pids_;  // 0 for PEs on other hosts
  std::vector<int> peers_;         // the PEs the schedule exchanges with, for timeouts
  bool remote_peers_ = false;      // whether one of them is on another machine
  bool nonblocking_ = true;        // NcclTransportOptions::nonblocking
  bool aborted_ = false;           // failed for good (abort()): no retry
  std::string abort_reason_;
  bool can_retry_ = false;
  cuda::RunBoard board_;  // this machine's PEs: the runs they began, the runs they gave up
  bool finalized_ = false;
};

NcclTransport::NcclTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : bootstrap_(bootstrap),
      group_spans_(options.advanced.nccl_group_spans),
      timeout_(options.timeout),
      arrival_timeout_(options.arrival_timeout),
      me_(bootstrap.rank()),
      n_pes_(bootstrap.size()) {
  device_ = cuda::select_device(bootstrap, options.device);
  cuda::DeviceScope scope(device_);
  RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&last_run_, cudaEventDisableTiming));

  local_pids_ = cuda::local_peer_pids(bootstrap_);
  board_ = cuda::RunBoard::of_this_machine(bootstrap_, local_pids_);
  nonblocking_ = options.nccl.nonblocking;
  make_communicator();
  int version = 0;
  ncclGetVersion(&version);
  RESHARD_LOG(kDebug, "nccl transport on device " << device_ << ", NCCL " << version);
}

void NcclTransport::make_communicator() {
  ncclUniqueId id{};
  if (me_ == 0) RESHARD_NCCL_CHECK(ncclGetUniqueId(&id));
  message::Writer mine;
  mine.put(id);
  id = message::Reader(bootstrap_.all_gather(mine.bytes())[0]).get<ncclUniqueId>();
  // Nonblocking: no NCCL call (setup, first connections to a peer, teardown) can then block
  // beyond the service's timeout on a peer that died, whatever NCCL's own timeouts are.
  // NcclTransportOptions::nonblocking = false trades that for NCCL's blocking calls (no helper
  // thread per group: less host time per run).
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = nonblocking_ ? 0 : 1;
  const ncclResult_t init = ncclCommInitRankConfig(&comm_, n_pes_, id, me_, &config);
  if (Failure failure = settle("ncclCommInitRankConfig", init)) {
    abort(failure.text);
    throw_error(failure.code, "nccl transport on PE " + std::to_string(me_) + ": " + failure.text);
  }
}

void NcclTransport::run(const ExecutionPlan& plan, std::size_t /*phase*/, void* stream_handle) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "run() after finalize()");
  if (comm_ == nullptr) {
    throw_error(ErrorCode::kInvalidState,
                "run() on PE " + std::to_string(me_) + " after the NCCL transport " +
                    (aborted_ ? "failed: " + abort_reason_
                              : std::string("gave a run up (every PE runs again from its first "
                                            "phase, where they meet)")));
  }
  // A peer of this machine that failed for good: this run would wait for it in vain.
  check_peers_on_board("to begin this run");
  board_.begin_run();
  run_started_ = std::chrono::steady_clock::now();
  all_begun_since_ = {};
  cuda::DeviceScope scope(device_);
  cudaStream_t stream = stream_handle ? static_cast<cudaStream_t>(stream_handle) : stream_;
  if (stream_handle == nullptr) cuda::wait_for_default_stream(stream);
  for (const LocalCopy& copy : plan.local_copies) {
    RESHARD_CUDA_CHECK(
        cudaMemcpyAsync(copy.dst, copy.src, copy.bytes, cudaMemcpyDeviceToDevice, stream));
  }
  // A round's ops go out in NCCL groups holding at most group_spans_ spans of each (peer,
  // direction): one group of everything stalled on large refits (~500 sends and ~500 receives per
  // PE), and small groups are what ran. Both ends of a pair list the same spans in the same order,
  // so group k on one PE meets group k on its peers and every group is complete by itself.
  std::size_t next_send = 0, next_receive = 0;
  for (std::uint32_t round = 0; round < plan.rounds; ++round) {
    std::vector<const PlannedBatch*> sends, receives;
    for (; next_send < plan.sends.size() && plan.sends[next_send].round == round; ++next_send) {
      sends.push_back(&plan.sends[next_send]);
    }
    for (; next_receive < plan.receives.size() && plan.receives[next_receive].round == round;
         ++next_receive) {
      receives.push_back(&plan.receives[next_receive]);
    }
    std::uint32_t longest = 0;
    for (const auto* list : {&sends, &receives}) {
      for (const PlannedBatch* batch : *list) longest = std::max(longest, batch->span_count);
    }
    for (std::uint32_t first = 0; first < longest; first += group_spans_) {
      const std::uint32_t last = first + group_spans_;
      RESHARD_NCCL_RUN_CHECK(ncclGroupStart());
      for (const PlannedBatch* batch : sends) {
        for (std::uint32_t s = first; s < std::min(last, batch->span_count); ++s) {
          const CopySpan& span = plan.spans[batch->first_span + s];
          RESHARD_NCCL_RUN_CHECK(
              ncclSend(span.data, span.bytes, ncclUint8, batch->peer, comm_, stream));
        }
      }
      for (const PlannedBatch* batch : receives) {
        for (std::uint32_t s = first; s < std::min(last, batch->span_count); ++s) {
          const CopySpan& span = plan.spans[batch->first_span + s];
          RESHARD_NCCL_RUN_CHECK(
              ncclRecv(span.data, span.bytes, ncclUint8, batch->peer, comm_, stream));
        }
      }
      RESHARD_NCCL_RUN_CHECK(ncclGroupEnd());
    }
  }
  if (cuda::record_run_unless_capturing(last_run_, stream)) {
    run_pending_ = true;
    if (stream_handle == nullptr) synchronize();
  }
}

Failure NcclTransport::settle(const char* call, ncclResult_t status, bool in_run) {
  if (status != ncclInProgress) return {nccl_failure(call, status)};
  ncclResult_t state = ncclInProgress;
  int dead = -1;
  std::string problem = cuda::wait_until(
      [&] {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess) state = ncclInternalError;
        return state != ncclInProgress;
      },
      local_pids_, std::string("NCCL's ") + call, &dead, in_run ? run_backstop() : timeout_,
      in_run ? std::function<std::string()>([this] { return late_peer_problem(); })
             : std::function<std::string()>(),
      peers_);
  if (!problem.empty()) return {problem, dead >= 0 ? ErrorCode::kPeerFailure : ErrorCode::kTimeout};
  return {nccl_failure(call, state)};
}

std::string NcclTransport::late_peer_problem() {
  const auto now = std::chrono::steady_clock::now();
  // A peer not yet begun has the arrival timeout where it is the longer, as on CUDA.
  const auto arrival_limit = std::max(arrival_timeout_, timeout_);
  if (remote_peers_) {
    if (now - run_started_ <= arrival_limit) return {};
    return "the NCCL transfers did not finish within " + format_seconds(arrival_limit) +
           " of this run's start" + cuda::waiting_on_clause(local_pids_, peers_) +
           " (a peer on another machine may not have begun it, so the longer of the arrival and "
           "transfer timeouts applies: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S; timeout, "
           "RESHARD_TIMEOUT_S)";
  }
  const std::uint64_t mine = board_.runs_begun(me_);
  for (const int pe : peers_) {
    if (board_.runs_begun(pe) >= mine) continue;
    if (now - run_started_ <= arrival_limit) return {};
    return "PE " + std::to_string(pe) + " did not begin this run within " +
           format_seconds(arrival_limit) + " (is PE " + std::to_string(pe) +
           " calling run()? the arrival timeout: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  }
  if (all_begun_since_ == std::chrono::steady_clock::time_point{}) all_begun_since_ = now;
  if (now - all_begun_since_ <= timeout_) return {};
  return "the NCCL transfers did not finish within " + format_seconds(timeout_) +
         " of every peer having begun this run" + cuda::waiting_on_clause(local_pids_, peers_) +
         " (CopyServiceOptions::timeout / RESHARD_TIMEOUT_S sets the limit)";
}

void NcclTransport::fail_run(const Failure& failure) {
  Failure named = failure;
  if (named.code == ErrorCode::kSystem) {
    // NCCL's own error (a refused connection) can arrive a moment before the peer's exit shows:
    // look for a dead local PE for a while, to name it.
    int dead = -1;
    for (int i = 0; i < 50 && (dead = first_exited_process(local_pids_, true)) < 0; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (dead >= 0) {
      named.text = "PE " + std::to_string(dead) + " (pid " + std::to_string(local_pids_[dead]) +
                   ") has exited; " + failure.text;
      named.code = ErrorCode::kPeerFailure;
    }
  }
  // A peer of this machine that gave its run up (and aborted its communicator) is why this call
  // failed: its words say more, and every PE runs again.
  if (named.code != ErrorCode::kPeerFailure) check_peers_on_board("in an NCCL call");
  if (named.code != ErrorCode::kTimeout) {
    abort(named.text);
    throw_error(named.code, "run() on PE " + std::to_string(me_) + ": " + named.text);
  }
  // Timed out with every PE of this machine alive: given up, and run again.
  give_up_run(named.text);
  can_retry_ = first_exited_process(local_pids_, true) < 0;
  throw_error(named.code, "run() on PE " + std::to_string(me_) + ": " + named.text);
}

void NcclTransport::synchronize() {
  if (!run_pending_) return;
  cuda::DeviceScope scope(device_);
  int dead = -1;
  cuda::RunBoard::State gone_state = cuda::RunBoard::kRunning;
  const std::string problem = cuda::wait_for_run(
      last_run_, local_pids_, "NCCL", &dead, run_backstop(),
      [&] {
        if (comm_ == nullptr) return std::string("the communicator was given up");
        if (const int gone = board_.first_peer_gone(&gone_state); gone >= 0)
          return board_.gone_clause(gone, gone_state);
        ncclResult_t async = ncclSuccess;
        ncclCommGetAsyncError(comm_, &async);
        if (async != ncclSuccess && async != ncclInProgress)
          return std::string("NCCL reported ") + ncclGetErrorString(async);
        return late_peer_problem();
      },
      peers_);
  run_pending_ = false;
  if (!problem.empty()) {
    // Aborting the communicator is the only way to stop NCCL kernels waiting on a lost peer.
    if (dead >= 0) {
      abort(problem);
      throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": " + problem);
    }
    give_up_run(problem);
    check_peers_on_board("for its run to complete");
    can_retry_ = first_exited_process(local_pids_, true) < 0;
    throw_error(ErrorCode::kTimeout, "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  // This PE has every byte it waited for, but a peer that gave this run up has not: the run is
  // given up on every PE, so that every PE runs it again.
  check_peers_on_board("for its run to complete");
}

void NcclTransport::check_peers_on_board(const char* waiting_for) {
  cuda::RunBoard::State state = cuda::RunBoard::kRunning;
  const int peer = board_.first_peer_gone(&state);
  if (peer < 0) return;
  give_up_run("PE " + std::to_string(me_) + " gave its run up: " + board_.gone_clause(peer, state));
  can_retry_ = state != cuda::RunBoard::kFailed && first_exited_process(local_pids_, true) < 0;
  throw_error(ErrorCode::kPeerFailure, board_.gone_message(peer, state, waiting_for));
}

void NcclTransport::give_up_run(const std::string& reason) noexcept {
  if (board_.state(me_) == cuda::RunBoard::kRunning) board_.mark(cuda::RunBoard::kGivingUp, reason);
  drop_communicator(reason);
}

bool NcclTransport::retry_requested() const { return !finalized_ && board_.retry_asked(); }

void NcclTransport::offer_retry(const std::string& reason) noexcept {
  give_up_run(reason);
  board_.mark_will_retry(reason);
}

void NcclTransport::recover() {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "recover() after finalize()");
  if (aborted_) {
    throw_error(ErrorCode::kPeerFailure,
                "recover() on PE " + std::to_string(me_) + " after a failure: " + abort_reason_);
  }
  cuda::DeviceScope scope(device_);
  if (run_pending_) {
    // A run queued on a stream and not waited for. At a new schedule every peer queued its part
    // and it completes; at a retry's meeting a peer that gave its run up (still marked on the
    // board until the end of this call) never sends, and only aborting the communicator ends it.
    int dead = -1;
    cuda::RunBoard::State gone_state = cuda::RunBoard::kRunning;
    const std::string problem = cuda::wait_for_run(
        last_run_, local_pids_, "NCCL", &dead, timeout_,
        [&] {
          const int gone = board_.first_peer_gone(&gone_state);
          return gone < 0 ? std::string() : board_.gone_clause(gone, gone_state);
        },
        peers_);
    if (dead >= 0) {
      abort(problem);
      throw_error(ErrorCode::kPeerFailure, "PE " + std::to_string(me_) + ": " + problem);
    }
    if (!problem.empty()) {
      give_up_run(problem);
      int ignored = -1;
      if (std::string stuck = cuda::wait_for_run(last_run_, {}, "NCCL", &ignored, timeout_);
          !stuck.empty())
        throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + stuck);
    }
    run_pending_ = false;
  }
  // Any PE without a communicator (it gave a run up): every PE makes a new one together.
  message::Writer mine;
  mine.put<std::uint8_t>(comm_ == nullptr);
  bool any_lost = false;
  for (const auto& part : bootstrap_.all_gather(mine.bytes()))
    any_lost = any_lost || message::Reader(part).get<std::uint8_t>() != 0;
  if (any_lost) {
    if (comm_ != nullptr) drop_communicator("a peer gave its communicator up");
    make_communicator();
    RESHARD_LOG(kDebug, "nccl transport on PE " << me_ << ": a new communicator");
  }
  can_retry_ = false;
  board_.reset();
  bootstrap_.barrier();  // every PE's board entry is "running" before any run
}

void NcclTransport::abort(const std::string& reason) noexcept {
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = reason;
  RESHARD_LOG(kDebug, "nccl transport aborted: " << reason);
  board_.mark(cuda::RunBoard::kFailed, reason);  // peers of this machine stop waiting at once
  drop_communicator(reason);
}

void NcclTransport::drop_communicator(const std::string& reason) noexcept {
  if (comm_ == nullptr) return;
  RESHARD_LOG(kDebug,
              "nccl transport on PE " << me_ << ": communicator aborted (" << reason << ")");
  // ncclCommAbort can itself wait on peers that are gone: it gets a bounded time, then is left
  // behind (with the communicator) so that the caller still gets its error.
  ncclComm_t comm = comm_;
  comm_ = nullptr;
  std::packaged_task<void()> task([comm] { ncclCommAbort(comm); });
  auto finished = task.get_future();
  std::thread(std::move(task)).detach();
  if (finished.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    RESHARD_LOG(kWarn,
                "ncclCommAbort did not return within 10 s; its communicator is left "
                "behind");
  }
}

void NcclTransport::finalize() noexcept {
  if (finalized_) return;
  finalized_ = true;
  const auto scope = cuda::DeviceScope::try_enter(device_);
  try {
    synchronize();
  } catch (const Error& error) {
    RESHARD_LOG(kWarn, "finalize: " << error.what());
  }
  if (comm_ != nullptr) {
    // Flushes and frees the communicator's resources; a nonblocking communicator's finalize is
    // awaited with the same limits as a run, and one that cannot finish is aborted instead.
    const Failure failure = settle("ncclCommFinalize", ncclCommFinalize(comm_));
    if (!failure) {
      ncclCommDestroy(comm_);
      comm_ = nullptr;
    } else {
      RESHARD_LOG(kWarn, "finalize: " << failure.text);
      abort(failure.text);
    }
  }
  if (last_run_) cudaEventDestroy(last_run_);
  if (stream_) cudaStreamDestroy(stream_);
  stream_ = nullptr;
  last_run_ = nullptr;
}

}  // namespace

std::string nccl_version() {
  int version = 0;
  ncclGetVersion(&version);
  return ", NCCL " + std::to_string(version);
}

std::unique_ptr<Transport> make_nccl_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options) {
  return std::make_unique<NcclTransport>(bootstrap, options);
}

}  // namespace reshard

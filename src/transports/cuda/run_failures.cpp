// The CUDA transport's failures: waiting for a run with its peers watched, a run given up (the
// kernels' failed waits, the same-GPU watchdog, a peer's mark on the run board), its error, and
// the recovery that lets every PE run again.
#include "transports/cuda/cuda_transport_impl.hpp"

namespace reshard::cuda {

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
    return board_.gone_clause(gone, gone_state);
  };
  int dead = -1;
  const std::string problem = wait_for_run(event, pids_, what, &dead, limit, board_problem);
  if (dead >= 0 || gone >= 0) {
    // The kernels stop waiting for a peer that cannot answer any more, and must have ended
    // before the caller frees what they touch.
    const int peer = dead >= 0 ? dead : gone;
    cancel_waits(status_);
    if (!same_device_order_.empty())
      fail_run(kStatusCancelled, peer, kWaitData, dead >= 0 ? std::string() : problem);
    int ignored = -1;
    if (std::string stuck = wait_for_run(event, {}, what, &ignored, timeout_ + grace);
        !stuck.empty())
      throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + stuck);
    if (dead >= 0) {
      throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": PE " +
                                               std::to_string(dead) + " (pid " +
                                               std::to_string(pids_[dead]) + ") exited mid-run");
    }
    // The board says who gave up and whether every PE can run again (read afresh: an entry goes
    // back to "running" only in a recover() this PE takes part in).
    check_peers_on_board(("for " + std::string(what)).c_str());
    throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  if (!problem.empty()) {
    if (!same_device_order_.empty()) fail_run(kStatusTimeout, -1, kWaitData);
    throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + problem);
  }
}

void CudaTransport::check_peers_on_board(const char* waiting_for) {
  RunBoard::State state = RunBoard::kRunning;
  const int peer = board_.first_peer_gone(&state);
  if (peer < 0) return;
  can_retry_ = state != RunBoard::kFailed && first_exited_process(pids_, true) < 0;
  throw_error(ErrorCode::kPeerFailure, board_.gone_message(peer, state, waiting_for));
}

void CudaTransport::fail_run(unsigned int code, int peer, unsigned int wait_kind,
                             const std::string& why) noexcept {
  if (status_ == nullptr) return;
  RESHARD_LOG(kDebug, "PE " << me_ << " gives up its run on CUDA device " << device_ << ": "
                            << (code == kStatusTimeout ? "timed out" : "cancelled")
                            << " waiting for PE " << peer);
  // Before its stream is released: the done flags it then raises for the peers it orders by the
  // streams carry no data, and those peers must hear so before they take their run as complete.
  // `why` (a peer that gave its own run up, and its reason) carries the first PE's cause on: the
  // PE that timed out names the late one, those that followed it name it too.
  if (board_.state(me_) == RunBoard::kRunning) {
    board_.mark(
        RunBoard::kGivingUp,
        "PE " + std::to_string(me_) + " gave its run up " +
            (!why.empty() ? "because " + why
                          : std::string(code == kStatusTimeout ? "(timed out" : "(cancelled") +
                                " waiting for PE " + std::to_string(peer) + ")"));
  }
  host_failure_.record(code, peer, wait_kind);
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
    fail_run(kStatusCancelled, dead, kWaitData);
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
    fail_run(kStatusTimeout, late, kWaitArrival);
    watched_since_ = {};
  } else if (late < 0 && now - all_begun_since_ > std::chrono::nanoseconds(timeout_ns_)) {
    const int stopped = first_stopped_process(pids_);
    const auto& peers = same_device_order_.peers();
    const int peer = stopped >= 0 ? stopped : (peers.empty() ? -1 : peers.front());
    fail_run(kStatusTimeout, peer, kWaitData);
    watched_since_ = {};
  }
}

void CudaTransport::synchronize() {
  if (!run_pending_) return throw_device_failure();
  DeviceScope scope(device_);
  wait_for(last_run_, "run()");
  run_pending_ = false;
  throw_device_failure();
  // A peer that gave this run up: a peer ordered by the streams still raised its done flags (its
  // stream had to drain), and its mark on the board, made before that, says the bytes did not
  // come. A peer whose waits timed out had sent its bytes before: this PE has them all, but that
  // peer runs again, so this PE must too (2 H200s, PE 1 stopped 9 s mid-run: it woke to a
  // complete run and went on alone while PE 0 met to run again).
  check_peers_on_board("for its run to complete");
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
  if (status->wait_kind == kWaitArrival) {
    text << "PE " << peer << " did not begin this run within " << seconds_for(kWaitArrival) << " s"
         << stuck_behind_clause(*status) << " (is PE " << status->stuck_behind
         << " calling run()? the arrival timeout: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  } else {
    text << "the data from PE " << peer << " did not arrive within " << seconds_for(kWaitData)
         << " s" << stuck_behind_clause(*status) << " (is PE " << status->stuck_behind
         << " calling run()? RESHARD_TIMEOUT_S sets the limit)";
  }
  throw_error(ErrorCode::kTimeout, text.str());
}

std::uint64_t CudaTransport::seconds_for(unsigned int wait_kind) const {
  const auto limit = wait_kind == kWaitArrival ? std::max(arrival_timeout_, timeout_) : timeout_;
  return static_cast<std::uint64_t>(limit.count()) / 1000;
}

bool CudaTransport::retry_requested() const { return !finalized_ && board_.retry_asked(); }

void CudaTransport::offer_retry(const std::string& reason) noexcept {
  board_.mark_will_retry(reason);
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

void CudaTransport::abort(const std::string& reason) noexcept {
  aborted_ = true;
  board_.mark(RunBoard::kFailed, reason);  // peers stop waiting for this PE at once
  cancel_waits(status_);
  RESHARD_LOG(kDebug, "cuda transport aborted: " << reason);
}

}  // namespace reshard::cuda

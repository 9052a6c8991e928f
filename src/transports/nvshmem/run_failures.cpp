// The NVSHMEM transport's waits and failures: waits moved to the stream's front end and the
// watchdog that bounds them, waiting for a run, its error, a run given up and run again, and
// abort().
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard::nvshmem {

// Where this PE waits on the stream, the wait in `flags` moves from the kernel to `waits` (queued
// before the kernel). Data that a NIC writes needs the wait to flush it; where the GPU cannot,
// a wait for a peer on another machine stays in the kernel, whose acquiring loads see the data.
void NvshmemTransport::to_stream(cuda::CopyFlags& flags, std::vector<cuda::StreamMemoryOp>& waits,
                                 bool data) {
  if (!stream_waits_ || flags.wait == nullptr) return;
  const bool remote_data = data && !nodes_.one_machine && !nodes_.same_node(me_, flags.peer);
  if (remote_data && !can_flush_) return;
  waits.push_back({const_cast<std::uint64_t*>(flags.wait), flags.wait_value, true, remote_data});
  run_waits_.push_back({flags.wait, flags.wait_value, flags.peer, flags.wait_kind});
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
  cuda::RunBoard::State gone_state = cuda::RunBoard::kRunning;
  if (watched_.empty()) {
    watch_failed_ = false;
  } else if (watch_failed_) {
    fail_stream_waits(cuda::kStatusCancelled, -1, 0);
  } else if (const int dead = first_exited_process(local_pids_, true); dead >= 0) {
    fail_stream_waits(cuda::kStatusCancelled, dead, cuda::kWaitData);
  } else if (const int gone = board_.first_peer_gone(&gone_state); gone >= 0) {
    fail_stream_waits(cuda::kStatusCancelled, gone, cuda::kWaitData);
  } else if (const auto waited = Clock::now() - last_queued_; waited > timeout_) {
    const auto [peer, wait_kind] = first_unmet_wait();
    // The run's first wait on a peer that may not have begun it has the arrival timeout.
    if (wait_kind == cuda::kWaitArrival && waited <= arrival_timeout_) return;
    const int stopped = first_stopped_process(local_pids_);
    fail_stream_waits(cuda::kStatusTimeout, stopped >= 0 ? stopped : peer, wait_kind);
  }
}

// The peer and kind of the first watched wait whose word is still below its value (-1: none).
std::pair<int, unsigned int> NvshmemTransport::first_unmet_wait() noexcept {
  const std::size_t words = rt_.signal_words_bytes() / sizeof(std::uint64_t);
  std::vector<std::uint64_t> now(words);
  if (cudaMemcpyAsync(now.data(), rt_.heap, words * sizeof(std::uint64_t), cudaMemcpyDeviceToHost,
                      release_stream_) != cudaSuccess ||
      cudaStreamSynchronize(release_stream_) != cudaSuccess) {
    cudaGetLastError();
    return {-1, cuda::kWaitData};
  }
  const auto* base = reinterpret_cast<const std::uint64_t*>(rt_.heap);
  for (const WatchedRun& run : watched_) {
    for (const StreamWait& wait : run.waits) {
      const auto word = static_cast<std::size_t>(wait.flag - base);
      if (word < words && now[word] < wait.value) return {wait.peer, wait.wait_kind};
    }
  }
  return {-1, cuda::kWaitData};
}

// Records the failure in the pinned status (first one only), stops the kernels' copies and raises
// every signal word this PE waits on past any value a run expects.
void NvshmemTransport::fail_stream_waits(unsigned int code, int peer,
                                         unsigned int wait_kind) noexcept {
  host_failure_.record(code, peer, wait_kind);
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
  // The kernels' waits (or the watchdog, for stream waits) end a run that waits too long and name
  // the wait: a peer's first word of the run has the arrival timeout, the rest the transfer
  // timeout. This backstop allows both, and a moment for them to report.
  const auto limit = std::max(timeout_, arrival_timeout_) + timeout_ + std::chrono::seconds(2);
  // A peer of this machine that gave its run up ends the wait at once (its signals will not come).
  int gone = -1;
  cuda::RunBoard::State gone_state = cuda::RunBoard::kRunning;
  const auto board_problem = [&]() -> std::string {
    if ((gone = board_.first_peer_gone(&gone_state)) < 0) return {};
    return board_.gone_clause(gone, gone_state);
  };
  const std::string problem =
      cuda::wait_for_run(last_run_, local_pids_, "NVSHMEM", &dead, limit, board_problem);
  if (gone >= 0 && dead < 0) {
    // The kernels stop waiting, and must have ended before the caller frees what they touch.
    give_up_run("PE " + std::to_string(me_) + " gave its run up: " + problem);
    int ignored = -1;
    const std::string stuck =
        cuda::wait_for_run(last_run_, {}, "NVSHMEM", &ignored, timeout_ + std::chrono::seconds(10));
    run_pending_ = false;
    if (!stuck.empty()) {
      abort(stuck);
      throw_error(ErrorCode::kTimeout, "run() on PE " + std::to_string(me_) + ": " + stuck);
    }
    check_peers_on_board("for its run to complete");
  }
  run_pending_ = false;
  if (!problem.empty()) {
    if (dead >= 0) {
      abort(problem);
      throw_error(ErrorCode::kPeerFailure, "run() on PE " + std::to_string(me_) + ": " + problem);
    }
    // The host's own limit passed (the kernels' waits or the watchdog should have ended it
    // first): given up, and run again if every PE of this machine is alive.
    give_up_run(problem);
    can_retry_ = first_exited_process(local_pids_, true) < 0;
    throw_error(ErrorCode::kTimeout, "run() on PE " + std::to_string(me_) + ": " + problem);
  }
  throw_device_failure();
  // This PE has every byte it waited for, but a peer that gave this run up has not: the run is
  // given up on every PE, so that every PE runs it again (a PE stopped mid-run finds its run
  // complete on the GPU when it wakes, its peers having given up on it long before).
  check_peers_on_board("for its run to complete");
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
  const bool arrival = status->wait_kind == cuda::kWaitArrival;
  std::string problem;
  if (!known) {
    problem = std::string(status->code == cuda::kStatusTimeout ? "timed out" : "stopped") +
              " waiting for its peers" + cuda::stuck_behind_clause(*status) +
              " (RESHARD_TIMEOUT_S sets the limit)";
  } else if (arrival && status->code == cuda::kStatusTimeout) {
    problem = "PE " + std::to_string(peer) + " did not begin this run within " +
              format_seconds(std::max(arrival_timeout_, timeout_)) + " (nothing of it came)" +
              cuda::stuck_behind_clause(*status) + " (is PE " +
              std::to_string(status->stuck_behind) +
              " calling run()? the arrival timeout: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  } else {
    problem = std::string(status->code == cuda::kStatusTimeout ? "timed out" : "stopped") +
              " waiting for PE " + std::to_string(peer) +
              (status->wait_kind == cuda::kWaitDrain ? " to drain its inbox"
               : arrival                             ? " to begin this run"
                                                     : " to deliver its data") +
              cuda::stuck_behind_clause(*status) + " (within " + format_seconds(timeout_) +
              "; RESHARD_TIMEOUT_S sets the limit)";
  }
  // A peer of this machine that gave its run up is why this one stopped: its words say more.
  check_peers_on_board("for its data");
  // Every PE of this machine alive: they may all meet and run again (a PE of another machine
  // that died fails that meeting).
  give_up_run(problem);
  can_retry_ = first_exited_process(local_pids_, true) < 0;
  throw_error(ErrorCode::kTimeout, "run() on PE " + std::to_string(me_) + ": " + problem);
}

void NvshmemTransport::check_peers_on_board(const char* waiting_for) {
  cuda::RunBoard::State state = cuda::RunBoard::kRunning;
  const int peer = board_.first_peer_gone(&state);
  if (peer < 0) return;
  if (run_pending_ || cuda::run_failure(status_, host_failure_))
    give_up_run("PE " + std::to_string(me_) +
                " gave its run up: " + board_.gone_clause(peer, state));
  can_retry_ = state != cuda::RunBoard::kFailed && first_exited_process(local_pids_, true) < 0;
  throw_error(ErrorCode::kPeerFailure, board_.gone_message(peer, state, waiting_for));
}

void NvshmemTransport::give_up_run(const std::string& reason) noexcept {
  if (board_.state(me_) == cuda::RunBoard::kRunning) board_.mark(cuda::RunBoard::kGivingUp, reason);
  stop_own_work();
}

void NvshmemTransport::stop_own_work() noexcept {
  // Waits stop at once (each records itself cancelled unless a failure was claimed first).
  host_failure_.record(cuda::kStatusCancelled, -1, cuda::kWaitData);
  cuda::cancel_waits(status_);
  if (rt_.heap == nullptr) return;
  cudaStream_t side = nullptr;
  if (cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking) == cudaSuccess) {
    release_own_waits(side);
    cudaStreamDestroy(side);
  }
}

bool NvshmemTransport::retry_requested() const { return !finalized_ && board_.retry_asked(); }

void NvshmemTransport::offer_retry(const std::string& reason) noexcept {
  give_up_run(reason);
  board_.mark_will_retry(reason);
}

void NvshmemTransport::recover() {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "recover() after finalize()");
  if (aborted_) throw_error(ErrorCode::kPeerFailure, "recover() after a failed run on this PE");
  cuda::DeviceScope scope(device_);
  // The run given up has ended on this PE (its waits were cancelled, released or ran out), and
  // every put it queued has landed: no word of it can reach a peer after the zeroing below.
  if (run_pending_) {
    int dead = -1;
    const std::string stuck = cuda::wait_for_run(last_run_, local_pids_, "the last run", &dead,
                                                 timeout_ + std::chrono::seconds(10));
    run_pending_ = false;
    if (!stuck.empty())
      throw_error(ErrorCode::kTimeout, "PE " + std::to_string(me_) + ": " + stuck);
  }
  RESHARD_CUDA_CHECK(cudaStreamSynchronize(send_stream_));
  nvshmemx_quiet_on_stream(stream_);
  RESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  {
    std::lock_guard lock(watchdog_.mutex());
    for (const WatchedRun& run : watched_) spare_events_.push_back(run.done);
    watched_.clear();
    watch_failed_ = false;
  }
  bootstrap_.barrier();  // no PE's device work writes into a peer's heap any more
  // Every pair counter and signal word back to zero on every PE at once: sequence numbers start
  // again from the first batch, no signal of the run given up can be taken for one of the next.
  RESHARD_CUDA_CHECK(cudaMemsetAsync(rt_.heap, 0, rt_.signal_bytes(), stream_));
  RESHARD_CUDA_CHECK(cudaMemsetAsync(failure_, 0, sizeof *failure_, stream_));
  RESHARD_CUDA_CHECK(cudaStreamSynchronize(stream_));
  {
    std::lock_guard lock(rt_.mutex);
    std::fill(rt_.sent.begin(), rt_.sent.end(), 0);
    std::fill(rt_.received.begin(), rt_.received.end(), 0);
    rt_.last_put.assign(rt_.last_put.size(), {});
    rt_.outbox_uses = 0;
  }
  *status_ = cuda::DeviceStatus{};
  host_failure_.clear();
  can_retry_ = false;
  board_.reset();
  bootstrap_.barrier();  // every PE's counters, words and board are zero before any run
}

void NvshmemTransport::abort(const std::string& reason) noexcept {
  if (aborted_) return;
  aborted_ = true;
  RESHARD_LOG(kDebug, "nvshmem transport aborted: " << reason);
  board_.mark(cuda::RunBoard::kFailed, reason);  // peers of this machine stop waiting at once
  std::lock_guard lock(rt_.mutex);
  // The pair counters no longer match the peers' (a run stopped half-way on some PEs).
  rt_.broken = "an earlier run failed (" + reason + ")";
  stop_own_work();
}

}  // namespace reshard::nvshmem

// The NVSHMEM transport's waits and failures: waits moved to the stream's front end and the
// watchdog that bounds them, waiting for a run, its error, and abort().
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard::nvshmem {

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

}  // namespace reshard::nvshmem

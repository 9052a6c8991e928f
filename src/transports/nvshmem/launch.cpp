// The NVSHMEM transport's run, every run: each wave's sends and receives queued on the stream.
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard::nvshmem {

unsigned int NvshmemTransport::next_wait_kind(std::vector<std::uint8_t>& waited, int peer,
                                              unsigned int later) {
  auto& seen = waited[static_cast<std::size_t>(peer)];
  if (seen) return later;
  seen = 1;
  return cuda::kWaitArrival;
}

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
      flags.wait_kind = next_wait_kind(acknowledged_, batch.peer, cuda::kWaitDrain);
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
      to_stream(flags, waits, false);
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
    to_stream(flags, waits, false);
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
      flags.wait_kind = next_wait_kind(delivered_, peer, cuda::kWaitData);
      if (batch.mapped) {
        flags.raise = remote_ack_[peer];  // one unit: the acknowledgements of a pair go in order
      } else {
        acks.emplace_back(peer, cuda::done_mark(sequence + 1));
      }
      to_stream(flags, waits, true);
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
  // A peer of this machine that gave its last run up waits for every PE to meet it: this run
  // would wait for it in vain.
  check_peers_on_board("to begin this run");
  board_.begin_run();
  run_waits_.clear();
  acknowledged_.assign(static_cast<std::size_t>(n_pes_), 0);
  delivered_.assign(static_cast<std::size_t>(n_pes_), 0);
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

}  // namespace reshard::nvshmem

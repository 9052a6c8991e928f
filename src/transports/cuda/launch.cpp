// The CUDA transport's run, every run: the kernels, copy-engine batches and stream memory
// operations of one phase, queued on the caller's stream.
#include "transports/cuda/cuda_transport_impl.hpp"

namespace reshard::cuda {

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

bool CudaTransport::early_launch_for(std::uint32_t ctas, std::uint64_t share) {
  if (!early_launch_) return false;
  if (share == 0) return true;
  // An early launch is resident beside the previous one (the kernel lets the next launch in once
  // the previous ended, so never more than two): where peers' kernels on this GPU must be
  // resident too, only two launches of at most half a share each may overlap; a larger one
  // neither launches early nor lets the next one in early.
  const bool large = 2ull * ctas > share;
  const bool early = !large && !previous_launch_large_;
  previous_launch_large_ = large;
  return early;
}

void CudaTransport::launch(PreparedRun& p, cudaStream_t stream) {
  if (p.kernel_idle) {
    // A follower with no peer its kernels order: its GPU's leader makes its copies and counts its
    // run (KernelArgs::follower_runs); a kernel here would hand the GPU over twice. Its stream
    // hands its memory over and waits for it back in one queue.
    p.same_device.begin_and_end(stream);
  } else {
    p.same_device.begin(stream);
    if (p.fused) {
      launch_fused_copy(p.copy_args, stream, early_launch_for(p.copy_args.cta_count, p.cta_share));
    } else {
      launch_with_copy_engines(p, stream);
    }
    // Where all end() would do is raise done flags, the run's last kernel raised them.
    if (p.base.stream_done_count == 0) p.same_device.end(stream);
  }
  if (p.unstage_args.group_count > 0) launch_plain_copy(p.unstage_args, stream);
}

// A copy-engine or mixed run: the begin kernel, each copy-engine batch on its stream (forked from
// and joined back into `stream` where there are several, or an SM share beside them), the SM
// share, and the end kernel.
void CudaTransport::launch_with_copy_engines(PreparedRun& p, cudaStream_t stream) {
  launch_begin(p.signal_args, stream, early_launch_for(1, p.cta_share));
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

}  // namespace reshard::cuda

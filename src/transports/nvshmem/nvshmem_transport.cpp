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
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard {
namespace nvshmem {

NvshmemTransport::NvshmemTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : bootstrap_(bootstrap), me_(bootstrap.rank()), n_pes_(bootstrap.size()) {
  send_stream_enabled_ = options.advanced.nvshmem_send_stream;
  peers_per_round_ = options.advanced.nvshmem_peers_per_round;
  direct_ = options.advanced.nvshmem_direct;
  trace_ = options.advanced.nvshmem_trace;
  timeout_ = options.timeout;
  arrival_timeout_ = options.arrival_timeout;
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
  batch_memops_ = options.advanced.cuda_batch_memops;
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
  board_ = cuda::RunBoard::of_this_machine(bootstrap, local_pids_);
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

}  // namespace nvshmem

std::string nvshmem_version() {
  // The library's own version needs NVSHMEM running; the headers it was built against must match
  // it (the build checks 3.4.5).
  return ", NVSHMEM " + std::to_string(NVSHMEM_VENDOR_MAJOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_MINOR_VERSION) + "." +
         std::to_string(NVSHMEM_VENDOR_PATCH_VERSION);
}

std::unique_ptr<Transport> make_nvshmem_transport(Bootstrap& bootstrap,
                                                  const CopyServiceOptions& options) {
  return std::make_unique<nvshmem::NvshmemTransport>(bootstrap, options);
}

}  // namespace reshard

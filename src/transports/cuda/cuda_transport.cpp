// CUDA transport: PEs are processes on one machine, one GPU each, peers reachable over NVLink (or
// PCIe) through CUDA IPC. At schedule() every PE exports the allocations holding its destination
// ranges; senders map them and copy straight from their source into the peer's destination.
// Ordering with the peers uses flags in device memory (see device_work.hpp), so run() involves no
// host synchronisation and can be captured in a CUDA graph.
#include "transports/cuda/cuda_transport_impl.hpp"

namespace reshard {
namespace cuda {

CudaTransport::CudaTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : bootstrap_(bootstrap), me_(bootstrap.rank()), n_pes_(bootstrap.size()) {
  device_ = select_device(bootstrap, options.device);
  DeviceScope scope(device_);
  load_copy_kernels();
  engine_ = options.cuda.engine;
  copy_engine_min_bytes_ = options.advanced.cuda_ce_min_bytes;
  copy_engine_streams_used_ = options.advanced.cuda_ce_streams;
  ctas_per_peer_ = options.advanced.cuda_ctas_per_peer;
  bytes_per_cta_ = options.advanced.cuda_bytes_per_cta;
  unroll_ = options.advanced.cuda_unroll;
  early_launch_ = options.advanced.cuda_early_launch;
  batch_memops_ = options.advanced.cuda_batch_memops;
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
  if (options.advanced.cuda_trace) {
    const std::size_t bytes = sizeof(std::uint64_t) * kTraceRuns * kTraceMarks;
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
  const bool per_schedule =
      same_device_mode == "auto" && !stream_ordered && stream_memory_ops_supported(device_);
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
  mine.put<std::uint8_t>(per_schedule);
  mine.put_string(board_.name());
  const auto all = bootstrap_.all_gather(mine.bytes());
  bool every_one_delegates = delegates;
  int kernel_ordered_on_device = 0;
  peer_signals_.assign(n_pes_, nullptr);
  pids_.assign(n_pes_, 0);
  same_device_.assign(n_pes_, false);
  std::vector<std::string> gpus(n_pes_);
  std::vector<bool> streams(n_pes_, false);  // whether each PE would order by its stream
  per_schedule_.assign(n_pes_, false);
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
    per_schedule_[pe] = reader.get<std::uint8_t>() != 0;
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
  front_end_waits_ = any_stream_ordered();
  gpus_ = gpus;
  streams_ = streams;
  stream_shared_ = stream_shared(gpus_, streams_);
  // Before a schedule says who sends to whom, every pair may exchange.
  order_pairs([&](int p, int q) { return init_by_streams(p, q); }, [](int, int) { return true; });
  for (int a = 0; a < n_pes_; ++a)
    for (int b = a + 1; b < n_pes_; ++b)
      if (gpus_[a] == gpus_[b] && per_schedule_[a] && per_schedule_[b]) any_per_schedule_ = true;
  if (kernel_ordered_on_device > 0) {
    RESHARD_LOG(kDebug, kernel_ordered_on_device << " PE(s) share CUDA device " << device_
                                                 << " with kernels that wait on this PE's: "
                                                    "they share its resident CTAs");
  }
  std::vector<const std::uint64_t*> waiting_on;
  for (std::uint64_t* signals : peer_signals_)
    waiting_on.push_back(SignalLayout::waiting_on(signals, n_pes_));
  peer_waiting_on_.upload(waiting_on);
  // The PEs ordered by the streams on this GPU form one group (the relation is the same for
  // every pair of them); the group delegates only if every member was asked to.
  if (every_one_delegates &&
      std::find(same_device_.begin(), same_device_.end(), true) != same_device_.end()) {
    delegate_among([&](int pe) { return same_device_[pe]; });
    RESHARD_LOG(kDebug, "PE " << leader_ << " makes the copies among the " << followers_.size() + 1
                              << " PEs on CUDA device " << device_);
  }
  same_device_order_ = SameDeviceOrder(signals_, peer_signals_, me_, batch_memops_);
  // Under MPS with the `auto` order the streams order pairs per schedule: watched as well.
  if (any_stream_ordered() || any_per_schedule_) {
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

// Medians over the recorded runs of the time between each two marks of the fused kernel, and of the
// gap from one run's end to the next one's start (kernel launch, or the host falling behind).
void CudaTransport::log_trace() noexcept {
  std::vector<std::uint64_t> stamps(static_cast<std::size_t>(kTraceRuns) * kTraceMarks);
  if (cudaMemcpy(stamps.data(), trace_, stamps.size() * sizeof stamps[0], cudaMemcpyDeviceToHost) !=
      cudaSuccess) {
    cudaGetLastError();
    return;
  }
  auto at = [&](int run, int mark) { return stamps[run * kTraceMarks + mark]; };
  auto complete = [&](int run) {
    for (int p = 0; p < kTraceMarks; ++p) {
      if (at(run, p) == 0) return false;
    }
    return true;
  };
  const char* names[] = {"wait for peer ready", "copy", "signal done", "wait for sources"};
  std::vector<std::vector<double>> deltas(kTraceMarks);
  for (int run = 0; run < kTraceRuns; ++run) {
    if (!complete(run)) continue;
    for (int p = 0; p + 1 < kTraceMarks; ++p)
      deltas[p].push_back(static_cast<double>(at(run, p + 1)) - static_cast<double>(at(run, p)));
    const int next = (run + 1) % kTraceRuns;
    if (complete(next) && at(next, kTraceStart) > at(run, kTraceAllDone))
      deltas[kTraceMarks - 1].push_back(at(next, kTraceStart) - at(run, kTraceAllDone));
  }
  std::ostringstream text;
  text << "cuda trace, PE " << me_ << ", medians over " << deltas[0].size() << " runs (us):";
  for (int p = 0; p < kTraceMarks; ++p) {
    auto& d = deltas[p];
    if (d.empty()) continue;
    std::nth_element(d.begin(), d.begin() + d.size() / 2, d.end());
    text << " " << (p + 1 < kTraceMarks ? names[p] : "end to next start") << " "
         << d[d.size() / 2] / 1000.0 << ";";
  }
  RESHARD_LOG(kWarn, text.str());
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

}  // namespace cuda

std::unique_ptr<Transport> make_cuda_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options) {
  return std::make_unique<cuda::CudaTransport>(bootstrap, options);
}

}  // namespace reshard

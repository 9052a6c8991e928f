// The CUDA transport's schedule, once per schedule(): each phase's copies grouped per peer, laid
// out for the SM engine, the copy engine or both (auto), or timed and chosen (autotune).
#include "transports/cuda/cuda_transport_impl.hpp"

namespace reshard::cuda {
namespace {

// Whether a descriptor's rows lie in one allocation on each side (its whole span, first byte to
// last), as one cudaMemcpy2DAsync needs.
bool rows_within_allocations(const CopyDescriptor& d) {
  const std::uint64_t rows = d.bytes / d.row_bytes;
  const unsigned char* src_last = d.src + (rows - 1) * d.src_pitch + d.row_bytes - 1;
  const unsigned char* dst_last = d.dst + (rows - 1) * d.dst_pitch + d.row_bytes - 1;
  return allocation_base(d.src) == allocation_base(src_last) &&
         allocation_base(d.dst) == allocation_base(dst_last);
}

}  // namespace

void CudaTransport::schedule(std::span<const ExecutionPlan> phases) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "schedule() after finalize()");
  DeviceScope scope(device_);
  if (run_pending_) wait_for(last_run_, "the previous schedule's runs");
  // A run given up (this PE's or a peer's) is over for the new schedule: it starts afresh.
  if (!retry_requested()) throw_device_failure();
  recover();
  prepared_.clear();
  order_pairs_of_this_schedule(phases);
  SameDeviceOrder every_phase(signals_, peer_signals_, me_, batch_memops_);
  for (std::size_t p = 0; p < phases.size(); ++p) {
    prepared_.push_back(schedule_phase(phases[p], p == 0));
    every_phase.merge(prepared_.back()->same_device);
  }
  // Once per schedule; the watchdog reads them.
  std::lock_guard lock(watchdog_.mutex());
  same_device_order_ = std::move(every_phase);
}

void CudaTransport::order_pairs_of_this_schedule(std::span<const ExecutionPlan> phases) {
  if (!any_per_schedule_) return;
  // Whom each PE sends to in this schedule: both ends of a pair then know whether its bytes go
  // both ways, and every PE of a GPU which of its PEs wait on a kernel (the CTA share).
  std::vector<std::uint8_t> sends(n_pes_, 0);
  for (const ExecutionPlan& plan : phases)
    for (const PlannedBatch& batch : plan.sends) sends[batch.peer] = 1;
  message::Writer mine;
  mine.put_array(std::span<const std::uint8_t>(sends));
  const auto all = bootstrap_.all_gather(mine.bytes());
  std::vector<std::vector<std::uint8_t>> sends_of(n_pes_);
  for (int pe = 0; pe < n_pes_; ++pe)
    sends_of[pe] = message::Reader(all[pe]).get_array<std::uint8_t>();
  // One H200, MPS on, FSDP2 -> TP 2 on 4 PEs: the streams' order 0.98 of the copy ceiling, the
  // kernels' 0.86 (the receivers' kernels only wait); a small all-to-all is faster on the kernels'.
  const auto per_schedule_pair = [&](int p, int q) {
    return p != q && gpus_[p] == gpus_[q] && per_schedule_[p] && per_schedule_[q];
  };
  // A GPU whose PEs send one way only delegates, as a GPU without MPS does: one kernel whose CTAs
  // share its wave by bytes. With each sender's kernel beside the others' their CTAs ended far
  // apart (FSDP2 -> TP 2, 4 PEs on one H200 under MPS: 4.94-4.97 ms, delegated 4.81-4.83 ms in
  // the same call; a refit of Llama 16 layers on 2 PEs 9.45 ms either way).
  const std::vector<bool> delegating = delegating_per_schedule(gpus_, per_schedule_, sends_of);
  order_pairs(
      [&](int p, int q) {
        if (init_by_streams(p, q)) return true;
        return per_schedule_pair(p, q) && (delegating[p] || !(sends_of[p][q] && sends_of[q][p]));
      },
      [&](int p, int q) { return sends_of[p][q] || sends_of[q][p]; });
  if (!per_schedule_[me_]) return;
  delegate_ = false;
  leader_ = -1;
  followers_.clear();
  if (!delegating[me_]) return;
  delegate_among([&](int pe) { return per_schedule_pair(me_, pe); });
  RESHARD_LOG(kDebug, "PE " << leader_ << " makes this schedule's copies among the "
                            << followers_.size() + 1 << " PEs on CUDA device " << device_
                            << " (MPS, bytes one way)");
}

void CudaTransport::delegate_among(const std::function<bool(int)>& with) {
  delegate_ = true;
  leader_ = -1;
  followers_.clear();
  for (int pe = 0; pe < n_pes_; ++pe) {
    if (pe != me_ && !with(pe)) continue;
    if (leader_ < 0)
      leader_ = pe;
    else
      followers_.push_back(pe);
  }
}

void CudaTransport::order_pairs(const std::function<bool(int, int)>& by_streams,
                                const std::function<bool(int, int)>& exchange) {
  for (int pe = 0; pe < n_pes_; ++pe) stream_ordered_[pe] = by_streams(me_, pe);
  // A PE waits in its kernels for a peer it exchanges bytes with that the streams do not order,
  // on its GPU or on another: every such PE of a GPU shares it (a chain of waits may cross GPUs).
  const auto in_kernels = [&](int p, int q) { return exchange(p, q) && !by_streams(p, q); };
  const std::vector<bool> waiters = kernel_waiters(n_pes_, in_kernels);
  kernel_ordered_sharers_ = kernel_ordered_sharers(gpus_, waiters, me_);
  kernel_ordered_sharing_anywhere_ = kernel_ordered_sharing_anywhere(gpus_, waiters);
}

std::unique_ptr<PreparedRun> CudaTransport::schedule_phase(const ExecutionPlan& plan,
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
  auto pairwise = [&](int peer) { return !(prepared->delegated && in_delegated_group(peer)); };
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

  prepared->cta_share = phase_cta_share(ctas_wanted(groups, unstage));
  // Every launch of the phase, autotune's included, orders the same peers.
  prepared->same_device = SameDeviceOrder(signals_, peer_signals_, me_, batch_memops_);
  if (prepared->delegated && leader_ == me_)
    prepared->same_device.lead(followers_);
  else if (prepared->delegated)
    prepared->same_device.follow(leader_);
  prepared->same_device.order_pairs(stream_destinations, stream_sources);
  // Every run that launches a kernel ends with one that completes it (the fused or end kernel).
  const std::vector<std::uint64_t*> stream_done =
      prepared->kernel_idle ? std::vector<std::uint64_t*>{} : prepared->same_device.end_raises();

  KernelArgs& base = prepared->base;
  base.stream_done = prepared->stream_done.upload(stream_done);
  base.stream_done_count = static_cast<std::uint32_t>(stream_done.size());
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
    assign_ctas(unstage_groups, prepared->unstage_args.cta_count, prepared->cta_share);
    prepared->unstage_args.descriptors = prepared->unstage_descriptors.upload(staged.descriptors);
    prepared->unstage_args.groups = prepared->unstage_groups.upload(unstage_groups);
    prepared->unstage_args.group_count = 1;
  }
  if (engine_ == "autotune")
    autotune(*prepared);
  else
    lay_out(*prepared, engine_);
  return prepared;
}

// Bytes earn CTAs, and so do pieces: a CTA's warps take a piece each when they are small.
static std::uint64_t group_ctas(std::uint64_t bytes, std::uint64_t pieces,
                                std::uint64_t bytes_per_cta, std::uint64_t ctas_per_peer) {
  const std::uint64_t by_bytes = (bytes + bytes_per_cta - 1) / bytes_per_cta;
  const std::uint64_t by_pieces = (pieces + kPiecesPerCta - 1) / kPiecesPerCta;
  return std::clamp<std::uint64_t>(std::max(by_bytes, by_pieces), 1, ctas_per_peer);
}

std::uint64_t CudaTransport::ctas_wanted(const std::vector<GroupPlan>& groups,
                                         const std::vector<CopyDescriptor>& unstage) const {
  std::uint64_t copies = 0;
  for (const GroupPlan& g : groups)
    copies += group_ctas(g.group.bytes, g.descriptors.size(), bytes_per_cta_, ctas_per_peer_);
  std::uint64_t unstage_bytes = 0;
  for (const CopyDescriptor& d : unstage) unstage_bytes += d.bytes;
  // The bounce buffer's copies run after this PE's own copy kernel, not beside it.
  const std::uint64_t unstaging =
      unstage.empty() ? 0
                      : group_ctas(unstage_bytes, unstage.size(), bytes_per_cta_, ctas_per_peer_);
  return std::clamp<std::uint64_t>(std::max(copies, unstaging), 1, std::max(1, sm_count_));
}

std::uint64_t CudaTransport::phase_cta_share(std::uint64_t wanted) {
  if (!kernel_ordered_sharing_anywhere_) return resident_cta_share_;
  message::Writer mine;
  mine.put<std::uint64_t>(wanted);
  const auto all = bootstrap_.all_gather(mine.bytes());
  if (kernel_ordered_sharers_.empty()) return resident_cta_share_;
  std::vector<std::uint64_t> wants;
  for (const int pe : kernel_ordered_sharers_) {
    message::Reader reader(all[pe]);
    wants.push_back(reader.get<std::uint64_t>());
  }
  // What the GPU holds resident at once, shared by what each of its kernel-ordered PEs wants.
  const std::uint64_t wave =
      static_cast<std::uint64_t>(std::max(1, sm_count_)) * std::max(1, fused_copy_ctas_per_sm());
  const std::uint64_t share = resident_share(wants, 0, wave);  // this PE is the first sharer
  return resident_cta_share_ == 0 ? share : std::min(resident_cta_share_, share);
}

void CudaTransport::assign_ctas(std::vector<PeerGroup>& groups, std::uint32_t& total,
                                std::uint64_t share) const {
  std::vector<std::uint64_t> want(groups.size()), bytes(groups.size());
  for (std::size_t g = 0; g < groups.size(); ++g) {
    want[g] =
        group_ctas(groups[g].bytes, groups[g].descriptor_count, bytes_per_cta_, ctas_per_peer_);
    bytes[g] = groups[g].bytes;
  }
  // One resident wave at most, leaving the rest of the GPU to the caller's kernels; with peers on
  // this GPU whose kernels wait on ours, this phase's share of what it holds at once, so that all
  // of them are resident together (else spinning CTAs could keep a peer's kernel off the GPU).
  const std::uint64_t cap =
      share > 0 ? std::min<std::uint64_t>(sm_count_, share) : std::max(1, sm_count_);
  const std::vector<std::uint64_t> ctas = group_cta_counts(bytes, want, cap);
  total = 0;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    groups[g].first_cta = total;
    groups[g].cta_count = static_cast<std::uint32_t>(ctas[g]);
    total += static_cast<std::uint32_t>(ctas[g]);
  }
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
  assign_ctas(sm_groups, prepared.copy_args.cta_count, prepared.cta_share);
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

}  // namespace reshard::cuda

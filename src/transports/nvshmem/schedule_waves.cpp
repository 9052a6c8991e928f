// The NVSHMEM transport's schedule, once per schedule(): each phase's batches as copy groups,
// taken in rounds and waves, and the CTAs each group gets.
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard::nvshmem {

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
  // A run's first wait on each peer (kWaitArrival) has the arrival timeout.
  args.arrival_timeout_ns = static_cast<std::uint64_t>(arrival_timeout_.count()) * 1000000;
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

void NvshmemTransport::schedule(std::span<const ExecutionPlan> phases) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "schedule() after finalize()");
  cuda::DeviceScope scope(device_);
  // A new schedule starts from zeroed pair counters and signals on every PE, as after a retry.
  recover();
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

}  // namespace reshard::nvshmem

#include "transports/cuda/same_device_order.hpp"

#include <algorithm>
#include <string_view>
#include <unordered_map>

#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/device_work.hpp"
#include "gpu/stream_memory_ops.hpp"

namespace reshard::cuda {
namespace {

void add(std::vector<int>& into, const std::vector<int>& from) {
  into.insert(into.end(), from.begin(), from.end());
  std::sort(into.begin(), into.end());
  into.erase(std::unique(into.begin(), into.end()), into.end());
}

}  // namespace

std::vector<bool> stream_ordered_peers(const std::vector<std::string>& gpus,
                                       const std::vector<bool>& streams, int me) {
  const std::vector<bool> shared = stream_shared(gpus, streams);
  std::vector<bool> ordered(gpus.size(), false);
  for (int pe = 0; pe < static_cast<int>(gpus.size()); ++pe)
    ordered[pe] = ordered_by_streams(streams, shared, me, pe);
  return ordered;
}

std::vector<bool> stream_shared(const std::vector<std::string>& gpus,
                                const std::vector<bool>& streams) {
  const int n = static_cast<int>(gpus.size());
  std::vector<bool> shared(n, false);
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (gpus[a] == gpus[b] && streams[a] && streams[b]) shared[a] = shared[b] = true;
  return shared;
}

std::vector<bool> delegating_per_schedule(const std::vector<std::string>& gpus,
                                          const std::vector<bool>& per_schedule,
                                          const std::vector<std::vector<std::uint8_t>>& sends) {
  const int n = static_cast<int>(gpus.size());
  std::unordered_map<std::string_view, int> members;
  std::unordered_map<std::string_view, bool> both_ways;
  for (int p = 0; p < n; ++p) {
    if (!per_schedule[p]) continue;
    ++members[gpus[p]];
    for (int q = p + 1; q < n; ++q)
      if (per_schedule[q] && gpus[q] == gpus[p] && sends[p][q] && sends[q][p])
        both_ways[gpus[p]] = true;
  }
  std::vector<bool> delegating(n, false);
  for (int p = 0; p < n; ++p)
    delegating[p] = per_schedule[p] && members[gpus[p]] > 1 && !both_ways[gpus[p]];
  return delegating;
}

std::vector<bool> kernel_waiters(int n, const std::function<bool(int, int)>& in_kernels) {
  std::vector<bool> waits(n, false);
  for (int pe = 0; pe < n; ++pe)
    for (int other = 0; other < n && !waits[pe]; ++other)
      waits[pe] = other != pe && in_kernels(pe, other);
  return waits;
}

std::vector<int> kernel_ordered_sharers(const std::vector<std::string>& gpus,
                                        const std::vector<bool>& waiters, int me) {
  if (!waiters[me]) return {};
  std::vector<int> sharers{me};
  for (int pe = 0; pe < static_cast<int>(gpus.size()); ++pe)
    if (pe != me && waiters[pe] && gpus[pe] == gpus[me]) sharers.push_back(pe);
  if (sharers.size() == 1) sharers.clear();
  return sharers;
}

std::vector<int> kernel_ordered_sharers(const std::vector<std::string>& gpus,
                                        const std::function<bool(int, int)>& in_kernels, int me) {
  return kernel_ordered_sharers(gpus, kernel_waiters(static_cast<int>(gpus.size()), in_kernels),
                                me);
}

bool kernel_ordered_sharing_anywhere(const std::vector<std::string>& gpus,
                                     const std::vector<bool>& waiters) {
  std::unordered_map<std::string_view, int> on_gpu;
  for (std::size_t pe = 0; pe < gpus.size(); ++pe)
    if (waiters[pe] && ++on_gpu[gpus[pe]] == 2) return true;
  return false;
}

std::vector<std::uint64_t> group_cta_counts(const std::vector<std::uint64_t>& bytes,
                                            const std::vector<std::uint64_t>& want,
                                            std::uint64_t cap) {
  const std::size_t n = want.size();
  std::vector<std::uint64_t> wants(n);  // at least one CTA each
  std::uint64_t wanted = 0;
  for (std::size_t g = 0; g < n; ++g) wanted += wants[g] = std::max<std::uint64_t>(1, want[g]);
  if (wanted <= cap) return wants;
  std::vector<std::uint64_t> ctas = wants;
  // Water-filling: the groups whose byte share reaches their want take it; the others share
  // what is left by their bytes, until none reaches its want.
  std::vector<bool> full(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    std::uint64_t left = cap, open = 0, open_bytes = 0;
    for (std::size_t g = 0; g < n; ++g) {
      if (full[g]) {
        left -= std::min(left, ctas[g]);
      } else {
        ++open;
        open_bytes += bytes[g];
      }
    }
    // One CTA each first, so that the shares never add up to more than the cap.
    const std::uint64_t spare = left > open ? left - open : 0;
    for (std::size_t g = 0; g < n; ++g) {
      if (full[g]) continue;
      // Doubles: bytes * cap can pass 2^64 (hundreds of GiB times thousands of CTAs).
      const double part = open_bytes == 0
                              ? 0.0
                              : static_cast<double>(spare) * static_cast<double>(bytes[g]) /
                                    static_cast<double>(open_bytes);
      ctas[g] = 1 + std::min(spare, static_cast<std::uint64_t>(part));
      if (ctas[g] >= wants[g]) {
        ctas[g] = wants[g];
        full[g] = changed = true;
      }
    }
  }
  return ctas;
}

std::uint64_t resident_share(const std::vector<std::uint64_t>& wants, std::size_t mine,
                             std::uint64_t wave) {
  std::uint64_t together = 0;
  for (const std::uint64_t want : wants) together += std::max<std::uint64_t>(1, want);
  const std::uint64_t want = std::max<std::uint64_t>(1, wants.at(mine));
  if (together <= wave) return want + (wave - together) * want / together;
  const std::uint64_t sharers = wants.size();
  if (wave <= sharers) return 1;
  return 1 + (wave - sharers) * (want - 1) / (together - sharers);
}

SameDeviceOrder::SameDeviceOrder(std::uint64_t* signals, std::vector<std::uint64_t*> peer_signals,
                                 int me, bool batch)
    : signals_(signals), peer_signals_(std::move(peer_signals)), me_(me), batch_(batch) {}

void SameDeviceOrder::order_pairs(const std::vector<int>& destinations,
                                  const std::vector<int>& sources) {
  // Every flag is raised before any is waited for (begin, end): two PEs that write into each
  // other each wait for the other's.
  add(raise_ready_, sources);
  add(wait_ready_, destinations);
  add(raise_done_, destinations);
  add(wait_done_, sources);
  build();
}

void SameDeviceOrder::follow(int leader) {
  leader_ = leader;
  build();
}

void SameDeviceOrder::lead(const std::vector<int>& followers) {
  add(wait_ready_, followers);
  add(raise_done_, followers);
  build();
}

void SameDeviceOrder::merge(const SameDeviceOrder& other) {
  if (other.leader_ >= 0) leader_ = other.leader_;
  add(raise_ready_, other.raise_ready_);
  add(wait_ready_, other.wait_ready_);
  add(raise_done_, other.raise_done_);
  add(wait_done_, other.wait_done_);
  build();
}

void SameDeviceOrder::build() {
  peers_.clear();
  for (const auto* list : {&raise_ready_, &wait_ready_, &raise_done_, &wait_done_})
    peers_.insert(peers_.end(), list->begin(), list->end());
  if (leader_ >= 0) peers_.push_back(leader_);
  std::sort(peers_.begin(), peers_.end());
  peers_.erase(std::unique(peers_.begin(), peers_.end()), peers_.end());

  // Each flag waited for is reset by the stream that waited, before anything it does next can
  // let the peer raise it again.
  const int n = static_cast<int>(peer_signals_.size());
  auto raise = [](std::vector<MemoryOp>& ops, std::uint64_t* flag) {
    ops.push_back({flag, 1, false});
  };
  auto wait_and_reset = [](std::vector<MemoryOp>& ops, std::uint64_t* flag) {
    ops.push_back({flag, 1, true});
    ops.push_back({flag, 0, false});
  };
  begin_ops_.clear();
  end_ops_.clear();
  begin_and_end_ops_.clear();
  if (n == 0) return;
  for (int pe : raise_ready_)
    raise(begin_ops_, SignalLayout::same_device_ready(peer_signals_[pe], n, me_));
  for (int pe : wait_ready_)
    wait_and_reset(begin_ops_, SignalLayout::same_device_ready(signals_, n, pe));
  // Only now may the leader write this PE's destinations (on other GPUs too).
  if (leader_ >= 0)
    raise(begin_ops_, SignalLayout::same_device_ready(peer_signals_[leader_], n, me_));
  // The leader's copies of this PE's sends have landed before this PE says so.
  if (leader_ >= 0) wait_and_reset(end_ops_, SignalLayout::same_device_done(signals_, n, leader_));
  for (int pe : raise_done_)
    raise(end_ops_, SignalLayout::same_device_done(peer_signals_[pe], n, me_));
  for (int pe : wait_done_)
    wait_and_reset(end_ops_, SignalLayout::same_device_done(signals_, n, pe));
  begin_and_end_ops_ = begin_ops_;
  begin_and_end_ops_.insert(begin_and_end_ops_.end(), end_ops_.begin(), end_ops_.end());
}

void SameDeviceOrder::queue(cudaStream_t stream, const std::vector<MemoryOp>& ops) const {
  queue_stream_memory_ops(stream, ops, batch_);
}

void SameDeviceOrder::begin(cudaStream_t stream) const { queue(stream, begin_ops_); }

void SameDeviceOrder::end(cudaStream_t stream) const { queue(stream, end_ops_); }

void SameDeviceOrder::begin_and_end(cudaStream_t stream) const {
  queue(stream, begin_and_end_ops_);
}

std::vector<std::uint64_t*> SameDeviceOrder::end_raises() const {
  std::vector<std::uint64_t*> flags;
  for (const MemoryOp& op : end_ops_) {
    if (op.wait) return {};
    flags.push_back(op.flag);
  }
  return flags;
}

void SameDeviceOrder::release(cudaStream_t side) const noexcept {
  const int n = static_cast<int>(peer_signals_.size());
  if (signals_ == nullptr) return;
  for (int pe = 0; pe < n; ++pe) {
    write_value_noexcept(side, SignalLayout::same_device_ready(signals_, n, pe), 1);
    write_value_noexcept(side, SignalLayout::same_device_done(signals_, n, pe), 1);
  }
  cudaStreamSynchronize(side);
  cudaGetLastError();
}

}  // namespace reshard::cuda

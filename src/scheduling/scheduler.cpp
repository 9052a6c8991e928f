// Segmenting, packing and round assignment. docs/design.md explains the algorithm and its bound.
#include <algorithm>
#include <bit>
#include <numeric>

#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"

namespace reshard {
namespace {

// Which rounds each PE can still send in (or receive in): a per-PE bitset of full rounds plus a
// counter per round, so the first round free at both ends is found 64 rounds per step.
class RoundOccupancy {
 public:
  RoundOccupancy(int n_pes, int capacity)
      : capacity_(capacity), counts_(n_pes), full_(n_pes), first_free_(n_pes, 0) {}

  std::uint32_t first_free(PeId pe) const { return first_free_[pe]; }
  std::uint64_t full_word(PeId pe, std::size_t word) const {
    return word < full_[pe].size() ? full_[pe][word] : 0;
  }

  void take(PeId pe, std::uint32_t round) {
    auto& counts = counts_[pe];
    if (counts.size() <= round) counts.resize(std::max<std::size_t>(round + 1, counts.size() * 2));
    if (++counts[round] < capacity_) return;
    auto& full = full_[pe];
    const std::size_t word = round >> 6;
    if (full.size() <= word) full.resize(std::max(word + 1, full.size() * 2), 0);
    full[word] |= std::uint64_t{1} << (round & 63);
    std::uint32_t& first = first_free_[pe];
    while (is_full(full, first)) ++first;
  }

 private:
  static bool is_full(const std::vector<std::uint64_t>& full, std::uint32_t round) {
    const std::size_t word = round >> 6;
    return word < full.size() && ((full[word] >> (round & 63)) & 1);
  }

  int capacity_;
  std::vector<std::vector<std::uint8_t>> counts_;
  std::vector<std::vector<std::uint64_t>> full_;
  std::vector<std::uint32_t> first_free_;
};

std::uint32_t first_common_free_round(const RoundOccupancy& senders, PeId src,
                                      const RoundOccupancy& receivers, PeId dst) {
  const std::uint32_t start = std::max(senders.first_free(src), receivers.first_free(dst));
  std::size_t word = start >> 6;
  std::uint64_t below_start = (std::uint64_t{1} << (start & 63)) - 1;
  for (;; ++word) {
    const std::uint64_t busy = senders.full_word(src, word) | receivers.full_word(dst, word) |
                               below_start;
    below_start = 0;
    if (busy != ~std::uint64_t{0}) {
      return static_cast<std::uint32_t>(word * 64 + std::countr_one(busy));
    }
  }
}

void segment_and_pack(Schedule& schedule) {
  const std::uint64_t chunk = schedule.options.chunk_bytes;
  const auto& transfers = schedule.transfers;
  Batch open{};
  auto close_batch = [&] {
    if (open.bytes > 0) schedule.batches.push_back(open);
    open.bytes = 0;
    open.segment_count = 0;
    open.first_segment = static_cast<std::uint32_t>(schedule.segments.size());
  };
  for (std::size_t i = 0; i < transfers.size(); ++i) {
    const Transfer& transfer = transfers[i];
    if (transfer.src == transfer.dst) {
      schedule.local.push_back(static_cast<std::uint32_t>(i));
      continue;
    }
    if (transfer.src != open.src || transfer.dst != open.dst) {
      close_batch();
      open.src = transfer.src;
      open.dst = transfer.dst;
    }
    std::uint64_t offset = 0;
    while (offset < transfer.bytes) {
      const std::uint64_t take = std::min(transfer.bytes - offset, chunk - open.bytes);
      schedule.segments.push_back({static_cast<std::uint32_t>(i), offset, take});
      ++open.segment_count;
      open.bytes += take;
      offset += take;
      if (open.bytes == chunk) close_batch();
    }
  }
  close_batch();
}

void assign_rounds(Schedule& schedule, const std::vector<std::uint64_t>& out_load,
                   const std::vector<std::uint64_t>& in_load) {
  const int n = schedule.n_pes;
  struct Key {
    std::uint64_t bytes;
    std::uint64_t critical_load;
    std::uint32_t rotation;
    std::uint32_t index;
  };
  std::vector<Key> keys(schedule.batches.size());
  for (std::uint32_t i = 0; i < keys.size(); ++i) {
    const Batch& b = schedule.batches[i];
    // Heaviest batches first; among equals, those of the busiest PEs (they set the bound); then by
    // the shift (dst - src) mod n, which turns a uniform all-to-all into perfect matchings.
    keys[i] = {b.bytes, std::max(out_load[b.src], in_load[b.dst]),
               static_cast<std::uint32_t>((b.dst - b.src + n) % n), i};
  }
  std::sort(keys.begin(), keys.end(), [](const Key& a, const Key& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    if (a.critical_load != b.critical_load) return a.critical_load > b.critical_load;
    if (a.rotation != b.rotation) return a.rotation < b.rotation;
    return a.index < b.index;
  });
  const int k = schedule.options.max_peers_per_round;
  RoundOccupancy senders(n, k);
  RoundOccupancy receivers(n, k);
  for (const Key& key : keys) {
    Batch& batch = schedule.batches[key.index];
    const std::uint32_t round = first_common_free_round(senders, batch.src, receivers, batch.dst);
    batch.round = round;
    senders.take(batch.src, round);
    receivers.take(batch.dst, round);
    schedule.rounds = std::max(schedule.rounds, round + 1);
  }
  std::stable_sort(schedule.batches.begin(), schedule.batches.end(),
                   [](const Batch& a, const Batch& b) {
                     if (a.round != b.round) return a.round < b.round;
                     if (a.src != b.src) return a.src < b.src;
                     return a.dst < b.dst;
                   });
}

}  // namespace

std::uint64_t simulate_makespan(const Schedule& schedule) {
  std::vector<std::uint64_t> out(schedule.n_pes, 0), in(schedule.n_pes, 0);
  std::vector<PeId> touched;
  std::uint64_t makespan = 0;
  std::size_t i = 0;
  while (i < schedule.batches.size()) {
    const std::uint32_t round = schedule.batches[i].round;
    std::uint64_t round_time = 0;
    for (; i < schedule.batches.size() && schedule.batches[i].round == round; ++i) {
      const Batch& b = schedule.batches[i];
      out[b.src] += b.bytes;
      in[b.dst] += b.bytes;
      round_time = std::max({round_time, out[b.src], in[b.dst]});
      touched.push_back(b.src);
      touched.push_back(b.dst);
    }
    for (PeId pe : touched) out[pe] = in[pe] = 0;
    touched.clear();
    makespan += round_time;
  }
  return makespan;
}

Schedule build_schedule(std::span<const Transfer> transfers, int n_pes,
                        const SchedulerOptions& options) {
  if (n_pes < 1) throw_error(ErrorCode::kInvalidArgument, "a schedule needs at least one PE");
  if (options.chunk_bytes == 0) {
    throw_error(ErrorCode::kInvalidArgument, "scheduler chunk_bytes must be positive");
  }
  if (options.max_peers_per_round < 1 || options.max_peers_per_round > 255) {
    throw_error(ErrorCode::kInvalidArgument, "scheduler max_peers_per_round must be in 1..255");
  }
  Schedule schedule;
  schedule.n_pes = n_pes;
  schedule.options = options;
  schedule.transfers.assign(transfers.begin(), transfers.end());
  for (const Transfer& t : schedule.transfers) {
    if (t.src < 0 || t.src >= n_pes || t.dst < 0 || t.dst >= n_pes) {
      throw_error(ErrorCode::kInvalidArgument,
                  "task " + std::to_string(t.task) + " names a PE outside 0.." +
                      std::to_string(n_pes - 1));
    }
  }
  std::sort(schedule.transfers.begin(), schedule.transfers.end(),
            [](const Transfer& a, const Transfer& b) {
              if (a.src != b.src) return a.src < b.src;
              if (a.dst != b.dst) return a.dst < b.dst;
              return a.task < b.task;
            });
  segment_and_pack(schedule);

  std::vector<std::uint64_t> out_load(n_pes, 0), in_load(n_pes, 0);
  for (const Batch& b : schedule.batches) {
    out_load[b.src] += b.bytes;
    in_load[b.dst] += b.bytes;
  }
  for (int pe = 0; pe < n_pes; ++pe) {
    schedule.lower_bound_bytes =
        std::max({schedule.lower_bound_bytes, out_load[pe], in_load[pe]});
  }
  assign_rounds(schedule, out_load, in_load);
  schedule.makespan_bytes = simulate_makespan(schedule);
  return schedule;
}

}  // namespace reshard

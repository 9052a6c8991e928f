// Segmenting, packing and round assignment. docs/design.md explains the algorithm and its bound.
#include "reshard/scheduler.hpp"

#include <algorithm>
#include <bit>
#include <numeric>

#include "reshard/error.hpp"

namespace reshard {
namespace {

// Which batch each PE sends (or receives) in each round: rounds are built as matchings, one batch
// per PE and direction. A per-PE bitset of busy rounds finds the first round free at both ends 64
// rounds per step.
class RoundOccupancy {
 public:
  static constexpr std::uint32_t kNone = UINT32_MAX;

  explicit RoundOccupancy(int n_pes) : occupant_(n_pes), busy_(n_pes), first_free_(n_pes, 0) {}

  std::uint32_t first_free(PeId pe) const { return first_free_[pe]; }
  std::uint64_t busy_word(PeId pe, std::size_t word) const {
    return word < busy_[pe].size() ? busy_[pe][word] : 0;
  }
  std::uint32_t occupant(PeId pe, std::uint32_t round) const {
    return round < occupant_[pe].size() ? occupant_[pe][round] : kNone;
  }

  void take(PeId pe, std::uint32_t round, std::uint32_t batch) {
    auto& occupants = occupant_[pe];
    if (occupants.size() <= round) {
      occupants.resize(std::max<std::size_t>(round + 1, occupants.size() * 2), kNone);
    }
    occupants[round] = batch;
    auto& busy = busy_[pe];
    const std::size_t word = round >> 6;
    if (busy.size() <= word) busy.resize(std::max(word + 1, busy.size() * 2), 0);
    busy[word] |= std::uint64_t{1} << (round & 63);
    std::uint32_t& first = first_free_[pe];
    while (occupant(pe, first) != kNone) ++first;
  }

  void release(PeId pe, std::uint32_t round) {
    occupant_[pe][round] = kNone;
    busy_[pe][round >> 6] &= ~(std::uint64_t{1} << (round & 63));
    first_free_[pe] = std::min(first_free_[pe], round);
  }

 private:
  std::vector<std::vector<std::uint32_t>> occupant_;
  std::vector<std::vector<std::uint64_t>> busy_;
  std::vector<std::uint32_t> first_free_;
};

std::uint32_t first_common_free_round(const RoundOccupancy& senders, PeId src,
                                      const RoundOccupancy& receivers, PeId dst,
                                      std::uint32_t from = 0) {
  const std::uint32_t start = std::max({from, senders.first_free(src), receivers.first_free(dst)});
  std::size_t word = start >> 6;
  std::uint64_t below_start = (std::uint64_t{1} << (start & 63)) - 1;
  for (;; ++word) {
    const std::uint64_t busy =
        senders.busy_word(src, word) | receivers.busy_word(dst, word) | below_start;
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

// How many rounds free at both ends a batch considers before settling for the cheapest.
constexpr int kRoundCandidates = 48;

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
  // Rounds are built as matchings (one peer each way per PE) and then every k consecutive rounds
  // are merged into one: a merged round never lasts longer than the rounds it replaces, so the
  // k-peer schedule is at least as good as the matching one, which balances bytes best.
  const std::uint32_t k = schedule.options.max_peers_per_round;
  RoundOccupancy senders(n);
  RoundOccupancy receivers(n);
  auto& batches = schedule.batches;
  auto bytes_in = [&](const RoundOccupancy& side, PeId pe, std::uint32_t round) {
    const std::uint32_t b = side.occupant(pe, round);
    return b == RoundOccupancy::kNone ? std::uint64_t{0} : batches[b].bytes;
  };
  auto place = [&](std::uint32_t b, std::uint32_t round) {
    batches[b].round = round;
    senders.take(batches[b].src, round, b);
    receivers.take(batches[b].dst, round, b);
  };
  std::vector<std::uint64_t> round_cost;  // the longest batch in each round so far
  std::vector<std::uint32_t> path;
  for (const Key& key : keys) {
    const Batch& batch = batches[key.index];
    std::uint32_t round = first_common_free_round(senders, batch.src, receivers, batch.dst);
    if (round >= round_cost.size()) {
      // Every existing round is busy at one end or the other. Rather than open a new round, free
      // one by swapping two rounds along an alternating path (Konig's edge-colouring argument:
      // in a bipartite graph the path never returns to the sender).
      const std::uint32_t a = senders.first_free(batch.src);
      const std::uint32_t b = receivers.first_free(batch.dst);
      if (a < round_cost.size() && b < round_cost.size()) {
        path.clear();
        PeId receiver = batch.dst;
        while (path.size() <= static_cast<std::size_t>(4 * n)) {
          const std::uint32_t in_a = receivers.occupant(receiver, a);
          if (in_a == RoundOccupancy::kNone) break;
          path.push_back(in_a);
          const std::uint32_t out_b = senders.occupant(batches[in_a].src, b);
          if (out_b == RoundOccupancy::kNone) break;
          path.push_back(out_b);
          receiver = batches[out_b].dst;
        }
        if (path.size() <= static_cast<std::size_t>(4 * n)) {
          for (std::uint32_t e : path) {
            senders.release(batches[e].src, batches[e].round);
            receivers.release(batches[e].dst, batches[e].round);
          }
          for (std::uint32_t e : path) place(e, batches[e].round == a ? b : a);
          round_cost[a] = round_cost[b] = std::max(round_cost[a], round_cost[b]);
          round = a;
        }
      }
    }
    // Among the first rounds free at both ends, take the first the batch fits in without making
    // the round longer; failing that, the one it lengthens least (a new round costs its size).
    std::uint32_t best_round = round;
    std::uint64_t best_increase = UINT64_MAX;
    for (int candidate = 0; candidate < kRoundCandidates; ++candidate) {
      if (round >= round_cost.size()) {
        if (batch.bytes < best_increase) best_round = round;
        break;
      }
      const std::uint64_t load =
          std::max(bytes_in(senders, batch.src, round), bytes_in(receivers, batch.dst, round)) +
          batch.bytes;
      const std::uint64_t increase = load > round_cost[round] ? load - round_cost[round] : 0;
      if (increase < best_increase) {
        best_increase = increase;
        best_round = round;
        if (increase == 0) break;
      }
      round = first_common_free_round(senders, batch.src, receivers, batch.dst, round + 1);
    }
    place(key.index, best_round);
    if (round_cost.size() <= best_round) round_cost.resize(best_round + 1, 0);
    round_cost[best_round] = std::max(round_cost[best_round], batch.bytes);
  }
  schedule.rounds = static_cast<std::uint32_t>(round_cost.size());
  for (Batch& batch : schedule.batches) batch.round /= k;
  schedule.rounds = (schedule.rounds + k - 1) / k;
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
  if (options.max_peers_per_round < 1) {
    throw_error(ErrorCode::kInvalidArgument,
                "scheduler max_peers_per_round must be at least 1, not " +
                    std::to_string(options.max_peers_per_round));
  }
  Schedule schedule;
  schedule.n_pes = n_pes;
  schedule.options = options;
  schedule.transfers.assign(transfers.begin(), transfers.end());
  for (const Transfer& t : schedule.transfers) {
    if (t.src < 0 || t.src >= n_pes || t.dst < 0 || t.dst >= n_pes) {
      throw_error(
          ErrorCode::kInvalidArgument,
          "task " + std::to_string(t.task) + " names a PE outside 0.." + std::to_string(n_pes - 1));
    }
  }
  std::sort(schedule.transfers.begin(), schedule.transfers.end(),
            [](const Transfer& a, const Transfer& b) {
              if (a.src != b.src) return a.src < b.src;
              if (a.dst != b.dst) return a.dst < b.dst;
              return a.task < b.task;
            });
  std::vector<std::uint64_t> out_load(n_pes, 0), in_load(n_pes, 0);
  for (const Transfer& t : schedule.transfers) {
    if (t.src == t.dst) continue;
    out_load[t.src] += t.bytes;
    in_load[t.dst] += t.bytes;
  }
  for (int pe = 0; pe < n_pes; ++pe) {
    schedule.lower_bound_bytes = std::max({schedule.lower_bound_bytes, out_load[pe], in_load[pe]});
  }
  constexpr std::uint64_t kAlign = 4096;
  const std::uint64_t wanted =
      (schedule.lower_bound_bytes / std::max<std::uint64_t>(options.target_rounds, 1) + kAlign -
       1) /
      kAlign * kAlign;
  schedule.options.chunk_bytes = std::clamp(
      wanted, std::min(options.min_chunk_bytes, options.chunk_bytes), options.chunk_bytes);
  segment_and_pack(schedule);
  assign_rounds(schedule, out_load, in_load);
  schedule.makespan_bytes = simulate_makespan(schedule);
  return schedule;
}

}  // namespace reshard

// An independent re-derivation of what a schedule must guarantee; tests run it on every schedule
// they build, so a scheduler bug shows up as a named violation rather than as corrupted bytes.
#include <algorithm>
#include <sstream>

#include "reshard/scheduler.hpp"

namespace reshard {

std::string check_schedule(const Schedule& schedule) {
  std::ostringstream problem;
  const auto& transfers = schedule.transfers;
  const int k = schedule.options.max_peers_per_round;
  std::vector<std::vector<Segment>> pieces(transfers.size());
  std::uint32_t previous_round = 0;
  std::vector<std::vector<int>> sends_in_round(schedule.rounds, std::vector<int>(schedule.n_pes));
  std::vector<std::vector<int>> recvs_in_round(schedule.rounds, std::vector<int>(schedule.n_pes));
  for (std::size_t b = 0; b < schedule.batches.size(); ++b) {
    const Batch& batch = schedule.batches[b];
    if (batch.round < previous_round) return "batches are not sorted by round";
    previous_round = batch.round;
    if (batch.round >= schedule.rounds) return "batch round beyond the round count";
    if (batch.bytes == 0 || batch.bytes > schedule.options.chunk_bytes) {
      problem << "batch " << b << " carries " << batch.bytes << " bytes (chunk is "
              << schedule.options.chunk_bytes << ")";
      return problem.str();
    }
    if (++sends_in_round[batch.round][batch.src] > k) {
      problem << "PE " << batch.src << " sends to more than " << k << " peers in round "
              << batch.round;
      return problem.str();
    }
    if (++recvs_in_round[batch.round][batch.dst] > k) {
      problem << "PE " << batch.dst << " receives from more than " << k << " peers in round "
              << batch.round;
      return problem.str();
    }
    std::uint64_t carried = 0;
    for (std::uint32_t s = 0; s < batch.segment_count; ++s) {
      const Segment& segment = schedule.segments.at(batch.first_segment + s);
      const Transfer& transfer = transfers.at(segment.transfer);
      if (transfer.src != batch.src || transfer.dst != batch.dst) {
        problem << "batch " << b << " (PE " << batch.src << " -> PE " << batch.dst
                << ") carries task " << transfer.task << " of PE " << transfer.src << " -> PE "
                << transfer.dst;
        return problem.str();
      }
      carried += segment.bytes;
      pieces[segment.transfer].push_back(segment);
    }
    if (carried != batch.bytes) return "a batch's segments do not add up to its size";
  }
  std::vector<std::uint64_t> out(schedule.n_pes), in(schedule.n_pes);
  for (std::size_t t = 0; t < transfers.size(); ++t) {
    const Transfer& transfer = transfers[t];
    const bool is_local = transfer.src == transfer.dst;
    if (is_local != std::binary_search(schedule.local.begin(), schedule.local.end(), t)) {
      problem << "task " << transfer.task << " is misfiled as local or remote";
      return problem.str();
    }
    if (is_local) {
      if (!pieces[t].empty()) return "a local transfer was also put into a batch";
      continue;
    }
    auto& list = pieces[t];
    std::sort(list.begin(), list.end(),
              [](const Segment& a, const Segment& b) { return a.offset < b.offset; });
    std::uint64_t covered = 0;
    for (const Segment& segment : list) {
      if (segment.offset != covered || segment.bytes == 0) {
        problem << "task " << transfer.task << ": bytes from " << covered
                << " are not carried exactly once";
        return problem.str();
      }
      covered += segment.bytes;
    }
    if (covered != transfer.bytes) {
      problem << "task " << transfer.task << ": " << covered << " of " << transfer.bytes
              << " bytes carried";
      return problem.str();
    }
    out[transfer.src] += transfer.bytes;
    in[transfer.dst] += transfer.bytes;
  }
  std::uint64_t bound = 0;
  for (int pe = 0; pe < schedule.n_pes; ++pe) bound = std::max({bound, out[pe], in[pe]});
  if (bound != schedule.lower_bound_bytes) return "reported lower bound is wrong";
  if (simulate_makespan(schedule) != schedule.makespan_bytes) return "reported makespan is wrong";
  if (schedule.makespan_bytes < schedule.lower_bound_bytes) return "makespan beats the lower bound";
  return {};
}

}  // namespace reshard

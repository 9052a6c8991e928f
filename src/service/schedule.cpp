// schedule(): every PE's requests gathered at the meeting, matched, scheduled per phase and built
// into this PE's plans, which the transport schedules.
#include <algorithm>
#include <map>
#include <sstream>
#include <unordered_map>

#include "core/message.hpp"
#include "service/copy_service_impl.hpp"

namespace reshard {

ExecutionPlan CopyService::Impl::build_plan(const Schedule& schedule) const {
  const PeId me = bootstrap->rank();
  std::unordered_map<TaskId, const Registration*> my_sends, my_receives;
  my_sends.reserve(sends.size());
  my_receives.reserve(receives.size());
  for (const Registration& r : sends) my_sends.emplace(r.task, &r);
  for (const Registration& r : receives) my_receives.emplace(r.task, &r);

  ExecutionPlan plan;
  plan.rounds = schedule.rounds;
  for (std::uint32_t index : schedule.local) {
    const Transfer& t = schedule.transfers[index];
    if (t.src != me || t.bytes == 0) continue;
    const Registration* from = my_sends.at(t.task);
    const Registration* to = my_receives.at(t.task);
    for_each_piece(0, t.bytes, t.src_row_bytes, t.dst_row_bytes,
                   [&](std::uint64_t at, std::uint64_t bytes) {
                     plan.local_copies.push_back({from->at(at), to->at(at), bytes});
                   });
  }
  for (const Batch& batch : schedule.batches) {
    const bool sending = batch.src == me;
    if (!sending && batch.dst != me) continue;
    PlannedBatch planned{sending ? batch.dst : batch.src, batch.round, batch.bytes,
                         static_cast<std::uint32_t>(plan.spans.size()), 0};
    const auto& mine = sending ? my_sends : my_receives;
    for (std::uint32_t s = 0; s < batch.segment_count; ++s) {
      const Segment& segment = schedule.segments[batch.first_segment + s];
      const Transfer& transfer = schedule.transfers[segment.transfer];
      const bool contiguous = transfer.src_row_bytes == 0 && transfer.dst_row_bytes == 0;
      // Consecutive pieces of one contiguous transfer are contiguous on both PEs: both sides
      // merge them the same way, so span i of a send batch still matches span i of its receive
      // batch.
      if (s > 0 && contiguous) {
        const Segment& previous = schedule.segments[batch.first_segment + s - 1];
        if (previous.transfer == segment.transfer &&
            previous.offset + previous.bytes == segment.offset) {
          plan.spans.back().bytes += segment.bytes;
          continue;
        }
      }
      const Registration* r = mine.at(transfer.task);
      for_each_piece(segment.offset, segment.bytes, transfer.src_row_bytes, transfer.dst_row_bytes,
                     [&](std::uint64_t at, std::uint64_t bytes) {
                       plan.spans.push_back({r->at(at), bytes});
                       ++planned.span_count;
                     });
    }
    (sending ? plan.sends : plan.receives).push_back(planned);
  }
  return plan;
}

ScheduleReport CopyService::schedule() {
  impl_->require_usable("schedule()");
  Impl& self = *impl_;
  const PeId me = my_pe();
  const int n = n_pes();
  try {
    std::vector<RequestClaim> my_sends, my_receives;
    for (const Registration& r : self.sends)
      my_sends.push_back({r.task, me, r.peer, r.size, r.row_bytes(), r.phase});
    std::map<std::uint32_t, std::vector<Registration>> receives_by_phase;
    for (const Registration& r : self.receives) {
      my_receives.push_back({r.task, me, r.peer, r.size, r.row_bytes(), r.phase});
      receives_by_phase[r.phase].push_back(r);
    }
    // Receives of different phases never land at once: they may share memory.
    std::vector<LocalProblem> local_problems;
    for (const auto& [phase, receives] : receives_by_phase) {
      for (LocalProblem& problem : find_overlapping_receives(receives))
        local_problems.push_back(std::move(problem));
    }

    message::Writer summary;
    summary.put_array(std::span<const RequestClaim>(my_sends));
    summary.put_array(std::span<const RequestClaim>(my_receives));
    summary.put<std::uint64_t>(local_problems.size());
    for (const LocalProblem& problem : local_problems) {
      summary.put<std::uint64_t>(problem.first);
      summary.put<std::uint64_t>(problem.second);
      summary.put_string(problem.text);
    }
    // Every PE must build the same schedule: the batch sizes and peers per round are the
    // smallest any PE allows (its transport, or RESHARD_CHUNK_BYTES set on that PE alone).
    const TransportCaps caps = self.transport->caps();
    summary.put<std::uint64_t>(
        std::min(caps.chunk_bytes, self.options.chunk_bytes.value_or(UINT64_MAX)));
    summary.put<std::uint64_t>(caps.min_chunk_bytes);
    summary.put<std::int64_t>(caps.max_peers_per_round);
    const auto gathered = meet(*self.bootstrap, self.options, summary.bytes(), "schedule()");

    std::vector<RequestClaim> all_sends, all_receives;
    std::ostringstream problems;
    std::size_t problem_count = 0;
    std::vector<TaskId> problem_tasks;
    std::uint64_t chunk_bytes = UINT64_MAX, min_chunk_bytes = UINT64_MAX;
    std::int64_t peers_per_round = INT64_MAX;
    for (int pe = 0; pe < n; ++pe) {
      message::Reader reader(gathered[pe]);
      for (const RequestClaim& c : reader.get_array<RequestClaim>()) all_sends.push_back(c);
      for (const RequestClaim& c : reader.get_array<RequestClaim>()) all_receives.push_back(c);
      const auto count = reader.get<std::uint64_t>();
      for (std::uint64_t i = 0; i < count; ++i) {
        problem_tasks.push_back(reader.get<std::uint64_t>());
        problem_tasks.push_back(reader.get<std::uint64_t>());
        const std::string text = reader.get_string();
        if (++problem_count <= 8) problems << "\n  - PE " << pe << ": " << text;
      }
      chunk_bytes = std::min(chunk_bytes, reader.get<std::uint64_t>());
      min_chunk_bytes = std::min(min_chunk_bytes, reader.get<std::uint64_t>());
      peers_per_round = std::min(peers_per_round, reader.get<std::int64_t>());
    }
    if (problem_count > 0) {
      if (problem_count > 8) problems << "\n  - ... and " << problem_count - 8 << " more";
      throw Error(ErrorCode::kValidation,
                  "schedule() refused: " + std::to_string(problem_count) +
                      (problem_count == 1 ? " problem" : " problems") +
                      " with the registered requests:" + problems.str(),
                  problem_tasks);
    }
    const std::vector<Transfer> transfers = match_requests(all_sends, all_receives, n);
    SchedulerOptions options;
    options.chunk_bytes = chunk_bytes;
    options.min_chunk_bytes = std::min(min_chunk_bytes, options.chunk_bytes);
    options.max_peers_per_round = static_cast<int>(std::clamp<std::int64_t>(peers_per_round, 1, n));
    // Each phase is scheduled on its own: its batches never wait for another phase's.
    std::uint32_t phases = 1;
    for (const auto* claims : {&all_sends, &all_receives}) {
      for (const RequestClaim& c : *claims) phases = std::max(phases, c.phase + 1);
    }
    std::vector<std::vector<Transfer>> by_phase(phases);
    for (const Transfer& t : transfers) by_phase[t.phase].push_back(t);
    ScheduleReport report;
    report.phases = phases;
    self.plans.clear();
    for (const std::vector<Transfer>& phase : by_phase) {
      const Schedule schedule = build_schedule(phase, n, options);
      self.plans.push_back(self.build_plan(schedule));
      report.transfers += schedule.transfers.size();
      report.batches += schedule.batches.size();
      report.rounds += schedule.rounds;
      report.lower_bound_bytes += schedule.lower_bound_bytes;
      report.makespan_bytes += schedule.makespan_bytes;
    }
    self.transport->schedule(self.plans);
    self.retry_pending = false;  // schedule() started the transport afresh on every PE
    for (const ExecutionPlan& plan : self.plans) {
      for (const PlannedBatch& b : plan.sends) report.bytes_sent += b.bytes;
      for (const PlannedBatch& b : plan.receives) report.bytes_received += b.bytes;
      for (const LocalCopy& c : plan.local_copies) report.bytes_local += c.bytes;
    }
    self.state = State::kScheduled;
    self.scheduled_since_clear = true;
    RESHARD_LOG(kDebug, "scheduled " << report.transfers << " transfers in " << report.rounds
                                     << " rounds of " << phases << " phase(s), makespan/bound "
                                     << report.bound_ratio());
    return report;
  } catch (const CollectiveAbandoned&) {
    throw;  // every PE failed the meeting alike, nothing was prepared: schedule() may run again
  } catch (const Error& error) {
    // Validation errors are raised identically on every PE; the service stays usable so the
    // caller may clear_requests() and try again.
    if (error.code() == ErrorCode::kValidation) throw;
    self.fail(error);
  }
}

}  // namespace reshard

// The scheduler: a pure function from the job's matched transfers to rounds of batches. It has no
// sockets and no CUDA, so every PE computes the same schedule from the same inputs and it is tested
// on its own.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "reshard/types.hpp"

namespace reshard {

// One side of a registered request as every PE sees it after the all-gather at schedule().
struct RequestClaim {
  TaskId task = 0;
  PeId owner = 0;  // the PE that registered it
  PeId peer = 0;   // destination PE for a send, source PE for a receive
  std::uint64_t bytes = 0;
  // Length of the rows of a strided range (StridedRange), 0 for a contiguous one: both sides of
  // a transfer cut their spans where either side's rows end, so span i of one is span i of the
  // other.
  std::uint64_t row_bytes = 0;
  // The phase of the schedule it runs in (CopyService::set_phase); both sides must agree.
  std::uint32_t phase = 0;
};

// A send matched with its receive.
struct Transfer {
  TaskId task = 0;
  PeId src = 0;
  PeId dst = 0;
  std::uint64_t bytes = 0;
  std::uint64_t src_row_bytes = 0;  // RequestClaim::row_bytes of the send
  std::uint64_t dst_row_bytes = 0;  // and of the receive
  std::uint32_t phase = 0;
};

// Matches sends to receives by task id. Throws Error(kValidation) naming every task id, PE and size
// that is wrong: unmatched sends or receives, duplicate ids, disagreeing PEs, sizes or phases, PEs
// out of range. The result is sorted by task id.
std::vector<Transfer> match_requests(std::span<const RequestClaim> sends,
                                     std::span<const RequestClaim> receives, int n_pes);

struct SchedulerOptions {
  // Largest batch: large transfers are segmented into pieces no larger than this, and the transfers
  // of one (source, destination) pair are packed into batches up to this size.
  std::uint64_t chunk_bytes = 1 << 20;
  // The chunk actually used shrinks towards lower_bound / target_rounds (never below
  // min_chunk_bytes): more, evenly sized batches let rounds be balanced closely.
  std::uint64_t min_chunk_bytes = 64 << 10;
  std::uint32_t target_rounds = 64;
  // How many peers one PE may send to, and receive from, in one round (a transport capability).
  int max_peers_per_round = 1;
};

// A contiguous piece of a transfer carried by a batch.
struct Segment {
  std::uint32_t transfer = 0;  // index into Schedule::transfers
  std::uint64_t offset = 0;    // byte offset inside the transfer
  std::uint64_t bytes = 0;
};

struct Batch {
  PeId src = 0;
  PeId dst = 0;
  std::uint32_t round = 0;
  std::uint64_t bytes = 0;
  std::uint32_t first_segment = 0;
  std::uint32_t segment_count = 0;
};

struct Schedule {
  int n_pes = 0;
  SchedulerOptions options;          // options.chunk_bytes is the chunk actually used
  std::vector<Transfer> transfers;   // sorted by (src, dst, task)
  std::vector<Segment> segments;     // referenced by batches
  std::vector<Batch> batches;        // remote batches, sorted by (round, src, dst)
  std::vector<std::uint32_t> local;  // indices of same-PE transfers (copied locally)
  std::uint32_t rounds = 0;
  // Lower bound: max over PEs of max(bytes sent, bytes received), local copies excluded; dividing
  // by a link bandwidth gives a time no schedule can beat.
  std::uint64_t lower_bound_bytes = 0;
  // Simulated makespan in byte-times: sum over rounds of the busiest PE's max(out, in) that round.
  std::uint64_t makespan_bytes = 0;

  double bound_ratio() const {
    return lower_bound_bytes == 0 ? 1.0 : static_cast<double>(makespan_bytes) / lower_bound_bytes;
  }
};

Schedule build_schedule(std::span<const Transfer> transfers, int n_pes,
                        const SchedulerOptions& options);

// The simulated makespan of a schedule's rounds (see Schedule::makespan_bytes).
std::uint64_t simulate_makespan(const Schedule& schedule);

// Checks the invariants every schedule must satisfy (each byte of each transfer carried exactly
// once, batch sizes, per-round peer limits, reported bounds). Returns an empty string when they
// hold, else a description of the first violation. Used by tests and by debug builds.
std::string check_schedule(const Schedule& schedule);

}  // namespace reshard

// What one PE executes on every run(): the schedule resolved against its own buffers. Transports
// receive this and nothing else, so they never see task ids or other PEs' registrations.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "reshard/types.hpp"

namespace reshard {

struct CopySpan {
  std::byte* data = nullptr;
  std::uint64_t bytes = 0;
};

// A batch as one side sees it: the peer, and the spans of local memory it reads (send) or fills
// (receive), in the order the bytes travel.
struct PlannedBatch {
  PeId peer = 0;
  std::uint32_t round = 0;
  std::uint64_t bytes = 0;
  std::uint32_t first_span = 0;
  std::uint32_t span_count = 0;
};

struct LocalCopy {
  const std::byte* src = nullptr;
  std::byte* dst = nullptr;
  std::uint64_t bytes = 0;
};

struct ExecutionPlan {
  std::vector<CopySpan> spans;
  std::vector<PlannedBatch> sends;     // in round order
  std::vector<PlannedBatch> receives;  // in round order
  std::vector<LocalCopy> local_copies;
  std::uint32_t rounds = 0;
};

}  // namespace reshard

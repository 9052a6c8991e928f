// libFuzzer harness: random request sets through match_requests and build_schedule. A refused set
// must be refused with kValidation; an accepted one must be scheduled so that check_schedule (an
// independent re-derivation of the guarantees) finds nothing, with every transfer kept. Anything
// else — a crash, another exception, a violated guarantee — is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"

using namespace reshard;

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "scheduler_fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const int n = in.ConsumeIntegralInRange(1, 40);
  std::vector<RequestClaim> sends, receives;
  const int requests = in.ConsumeIntegralInRange(0, 160);
  for (int i = 0; i < requests; ++i) {
    const TaskId task = in.ConsumeIntegralInRange<TaskId>(0, 200);
    // Mostly valid PEs, sometimes one outside 0..n-1.
    const PeId src = in.ConsumeIntegralInRange(-1, n);
    const PeId dst = in.ConsumeIntegralInRange(-1, n);
    const std::uint64_t bytes = in.ConsumeIntegralInRange<std::uint64_t>(0, 1 << 15);
    const std::uint32_t phase = in.ConsumeIntegralInRange<std::uint32_t>(0, 3);
    switch (in.ConsumeIntegralInRange(0, 8)) {
      case 0:  // a send nobody receives
        sends.push_back({task, src, dst, bytes});
        break;
      case 1:  // a receive nobody sends
        receives.push_back({task, dst, src, bytes});
        break;
      case 2:  // sizes that disagree
        sends.push_back({task, src, dst, bytes});
        receives.push_back({task, dst, src, bytes + 1});
        break;
      case 3:  // phases that disagree
        sends.push_back({task, src, dst, bytes, 0, phase});
        receives.push_back({task, dst, src, bytes, 0, phase + 1});
        break;
      default:  // a matched pair, in a phase
        sends.push_back({task, src, dst, bytes, 0, phase});
        receives.push_back({task, dst, src, bytes, 0, phase});
    }
  }
  std::vector<Transfer> transfers;
  try {
    transfers = match_requests(sends, receives, n);
  } catch (const Error& error) {
    if (error.code() != ErrorCode::kValidation)
      finding(std::string("match_requests threw a non-validation error: ") + error.what());
    if (std::string(error.what()).empty()) finding("a refusal without a message");
    return 0;
  }
  if (transfers.size() != sends.size()) finding("an accepted request set lost or gained transfers");
  for (const Transfer& t : transfers) {
    const auto send = std::find_if(sends.begin(), sends.end(),
                                   [&](const RequestClaim& c) { return c.task == t.task; });
    if (send == sends.end() || send->phase != t.phase)
      finding("a transfer is not in its requests' phase");
  }
  SchedulerOptions options;
  // Chunks from 64 bytes: smaller ones only multiply the segments without new cases.
  options.chunk_bytes = in.ConsumeIntegralInRange<std::uint64_t>(64, 1 << 16);
  options.min_chunk_bytes = in.ConsumeIntegralInRange<std::uint64_t>(64, options.chunk_bytes);
  options.target_rounds = in.ConsumeIntegralInRange<std::uint32_t>(1, 128);
  options.max_peers_per_round = in.ConsumeIntegralInRange(1, 8);
  const Schedule schedule = build_schedule(transfers, n, options);
  if (const std::string problem = check_schedule(schedule); !problem.empty()) finding(problem);
  if (schedule.transfers.size() != transfers.size()) finding("the schedule dropped transfers");
  if (schedule.makespan_bytes < schedule.lower_bound_bytes)
    finding("the simulated makespan beats the lower bound");
  return 0;
}

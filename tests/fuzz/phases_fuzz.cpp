// libFuzzer harness: random staging needs through execution::assign_phases. A request of the
// executor's shape must be either refused with kInvalidArgument (a unit over a budget the caller
// gave) or assigned so that check_phase_assignment (an independent re-derivation of the promises)
// finds nothing; a request of another shape must be refused with kInvalidState. Anything else — a
// crash, another exception, a broken promise — is a finding.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdio>
#include <cstdlib>

#include "execution/phase_assignment.hpp"
#include "reshard/error.hpp"
#include "reshard/resharder.hpp"

using namespace reshard;
using namespace reshard::execution;

namespace {

[[noreturn]] void finding(const std::string& what) {
  std::fprintf(stderr, "phases_fuzz: %s\n", what.c_str());
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  PhaseRequest request;
  request.group_count = in.ConsumeIntegralInRange<std::uint32_t>(1, 6);
  request.ranks = in.ConsumeIntegralInRange(1, 8);
  const auto ops = in.ConsumeIntegralInRange<std::uint32_t>(0, 64);
  for (std::uint32_t i = 0; i < ops; ++i) {
    request.group.push_back(in.ConsumeIntegralInRange<std::uint32_t>(0, request.group_count - 1));
    // Mostly itself or an earlier op of its group; sometimes anything (a malformed request).
    std::uint32_t leader = i;
    switch (in.ConsumeIntegralInRange(0, 7)) {
      case 0:
        leader = in.ConsumeIntegralInRange<std::uint32_t>(0, ops);
        break;
      case 1:
      case 2:
        for (std::uint32_t j = 0; j < i; ++j)
          if (request.group[j] == request.group[i] && in.ConsumeBool()) leader = j;
        break;
      default:
        break;
    }
    request.leader.push_back(leader);
    std::vector<std::pair<PeId, std::uint64_t>> needs;
    const int count = in.ConsumeIntegralInRange(0, 3);
    for (int k = 0; k < count; ++k) {
      const PeId rank = in.ConsumeIntegralInRange(0, request.ranks + (in.ConsumeBool() ? 0 : 1));
      needs.emplace_back(rank, in.ConsumeIntegralInRange<std::uint64_t>(0, 1ull << 40));
    }
    request.needs.push_back(std::move(needs));
  }
  request.budget = in.ConsumeBool() ? ReshardOptions::kUnlimited
                                    : in.ConsumeIntegralInRange<std::uint64_t>(0, 1ull << 42);
  request.budget_given = in.ConsumeBool();
  request.may_pipeline = in.ConsumeBool();
  PhaseAssignment assignment;
  try {
    assignment = assign_phases(request, [](std::uint32_t op) { return std::to_string(op); });
  } catch (const Error& error) {
    if (error.code() == ErrorCode::kInvalidArgument && !request.budget_given) {
      finding(std::string("refused a request without a given budget: ") + error.what());
    }
    if (error.code() != ErrorCode::kInvalidArgument && error.code() != ErrorCode::kInvalidState) {
      finding(std::string("refused with another code: ") + error.what());
    }
    return 0;
  } catch (const std::exception& error) {
    finding(std::string("threw something other than an Error: ") + error.what());
  }
  if (const std::string broken = check_phase_assignment(request, assignment); !broken.empty()) {
    finding(broken);
  }
  return 0;
}

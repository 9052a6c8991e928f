// Which phase of a refit each op of a plan runs in: the staging budget splits a refit into phases
// that each fit in it on every PE. A pure function of what the PEs said they need (the
// executor gathers that collectively, every PE computes the same assignment), checked by an
// independent re-derivation of its promises (unit tests, the fuzzer).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "reshard/types.hpp"

namespace reshard::execution {

struct PhaseRequest {
  // Per op of the plan, in plan order:
  std::vector<std::uint32_t> group;  // its group (ReshardOptions::param_groups), < group_count
  // The op whose conversion it shares (following these leads to its unit's first op), itself
  // where it shares none. A unit's ops are of one group and its first op comes before the rest.
  std::vector<std::uint32_t> leader;
  // The staging bytes it needs on each PE that takes part in it.
  std::vector<std::vector<std::pair<PeId, std::uint64_t>>> needs;
  std::uint32_t group_count = 1;
  int ranks = 1;
  std::uint64_t budget = 0;   // staging per PE (ReshardOptions::kUnlimited: no limit)
  bool budget_given = false;  // the caller's: a unit that needs more is refused; else it grows
  // Whether phases may alternate between the budget's halves (some PE reads staging after its
  // bytes land, and nothing rules it out): done where the refit runs in phases anyway and every
  // unit fits in a half.
  bool may_pipeline = false;
};

struct PhaseAssignment {
  std::vector<std::uint32_t> phase_of;  // per op
  // Group g's phases are [group_phases[g], group_phases[g + 1]); a group without ops has none.
  std::vector<std::uint32_t> group_phases;
  std::uint64_t limit = 0;  // the staging one phase takes at most on any PE
  bool pipelined = false;   // phases alternate between two halves of the budget
};

// A staging budget as the errors write it ("unlimited", or bytes).
std::string budget_text(std::uint64_t bytes);

// Units (an op and those sharing its conversion) are taken group by group, in plan order within a
// group; each group begins a phase, and a new phase begins where one more unit would take some
// PE past the limit. Throws kInvalidArgument naming the op (`name_op`), the PE and the bytes
// where a unit alone needs more than a budget the caller gave; kInvalidState for a request that
// breaks the shape above (a bug of the caller).
PhaseAssignment assign_phases(const PhaseRequest& request,
                              const std::function<std::string(std::uint32_t op)>& name_op);

// What assign_phases promises, derived again from `request` alone: empty where `assignment`
// keeps every promise, else the first one it breaks.
std::string check_phase_assignment(const PhaseRequest& request, const PhaseAssignment& assignment);

}  // namespace reshard::execution

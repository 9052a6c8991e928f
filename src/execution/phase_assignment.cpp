#include "execution/phase_assignment.hpp"

#include <algorithm>
#include <map>

#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "reshard/resharder.hpp"

namespace reshard::execution {
namespace {

using RankBytes = std::map<PeId, std::uint64_t>;

// Each op's unit: the first op of those sharing its conversion. Refuses a request whose leads
// leave the op's group, point past it or go round in a circle.
std::vector<std::uint32_t> unit_of_each_op(const PhaseRequest& request) {
  const std::size_t ops = request.group.size();
  std::vector<std::uint32_t> unit(ops);
  for (std::uint32_t i = 0; i < ops; ++i) {
    std::uint32_t at = i;
    for (std::size_t steps = 0; request.leader[at] != at; ++steps) {
      at = request.leader[at];
      if (steps == ops || at >= ops) {
        throw_error(ErrorCode::kInvalidState, "phase assignment: op " + std::to_string(i) +
                                                  "'s leaders go round in a circle");
      }
    }
    if (at > i || request.group[at] != request.group[i]) {
      throw_error(ErrorCode::kInvalidState,
                  "phase assignment: op " + std::to_string(i) + " shares the conversion of op " +
                      std::to_string(at) + ", which is not before it in its group");
    }
    unit[i] = at;
  }
  return unit;
}

void check_shape(const PhaseRequest& request) {
  const std::size_t ops = request.group.size();
  if (request.leader.size() != ops || request.needs.size() != ops) {
    throw_error(ErrorCode::kInvalidState, "phase assignment: per-op lists of different lengths");
  }
  if (request.group_count == 0 || request.ranks <= 0) {
    throw_error(ErrorCode::kInvalidState, "phase assignment: no groups or no PEs");
  }
  for (std::size_t i = 0; i < ops; ++i) {
    if (request.group[i] >= request.group_count || request.leader[i] >= ops) {
      throw_error(ErrorCode::kInvalidState, "phase assignment: op " + std::to_string(i) +
                                                " names a group or op out of range");
    }
    for (const auto& [rank, bytes] : request.needs[i]) {
      if (rank < 0 || rank >= request.ranks) {
        throw_error(ErrorCode::kInvalidState, "phase assignment: op " + std::to_string(i) +
                                                  " names PE " + std::to_string(rank));
      }
    }
  }
}

// Each unit's needs per PE, on its first op.
std::vector<RankBytes> needs_of_units(const PhaseRequest& request,
                                      const std::vector<std::uint32_t>& unit) {
  std::vector<RankBytes> unit_needs(unit.size());
  for (std::size_t i = 0; i < unit.size(); ++i) {
    for (const auto& [rank, bytes] : request.needs[i]) unit_needs[unit[i]][rank] += bytes;
  }
  return unit_needs;
}

// The limit without pipelining (the budget, grown to the largest unit where the caller gave
// none), and whether the phases alternate between its halves.
std::pair<std::uint64_t, bool> limit_of(const PhaseRequest& request,
                                        const std::vector<RankBytes>& unit_needs) {
  std::uint64_t largest_unit = 0;
  RankBytes total;
  for (const auto& per_rank : unit_needs) {
    for (const auto& [rank, bytes] : per_rank) {
      largest_unit = std::max(largest_unit, bytes);
      total[rank] += bytes;
    }
  }
  const std::uint64_t limit =
      request.budget_given ? request.budget : std::max(request.budget, largest_unit);
  if (!request.may_pipeline || limit == ReshardOptions::kUnlimited) return {limit, false};
  const bool in_phases = request.group_count > 1 ||
                         std::any_of(total.begin(), total.end(),
                                     [&](const auto& entry) { return entry.second > limit; });
  return {limit, in_phases && largest_unit <= limit / 2};
}

}  // namespace

std::string budget_text(std::uint64_t bytes) {
  return bytes == ReshardOptions::kUnlimited ? "unlimited" : format_bytes(bytes);
}

PhaseAssignment assign_phases(const PhaseRequest& request,
                              const std::function<std::string(std::uint32_t op)>& name_op) {
  check_shape(request);
  const auto ops = static_cast<std::uint32_t>(request.group.size());
  const std::vector<std::uint32_t> unit = unit_of_each_op(request);
  const std::vector<RankBytes> unit_needs = needs_of_units(request, unit);
  PhaseAssignment assignment;
  auto [limit, pipelined] = limit_of(request, unit_needs);
  if (!request.budget_given && limit > request.budget) {
    RESHARD_LOG(kInfo, "a slice needs "
                           << format_bytes(limit) << " of staging, more than the default budget of "
                           << format_bytes(request.budget) << ": the budget is that slice's need");
  }
  // A unit alone over the caller's budget is refused before anything is placed.
  for (std::uint32_t i = 0; i < ops; ++i) {
    for (const auto& [rank, bytes] : unit_needs[i]) {
      if (bytes <= limit) continue;
      const auto sharing = std::count(unit.begin(), unit.end(), i) - 1;
      throw_error(
          ErrorCode::kInvalidArgument,
          "the staging budget of " + budget_text(limit) + " per PE is smaller than " + name_op(i) +
              (sharing > 0 ? " (converted once for it and " + std::to_string(sharing) + " more ops)"
                           : std::string()) +
              " needs on PE " + std::to_string(rank) + ": " + format_bytes(bytes) +
              " of wire buffers; raise ReshardOptions::staging_budget "
              "(RESHARD_STAGING_BUDGET) to at least that");
    }
  }
  if (pipelined) limit /= 2;
  assignment.limit = limit;
  assignment.pipelined = pipelined;
  // Group by group, plan order within each (a unit's ops are of one group, its first op first).
  std::vector<std::uint32_t> order(ops);
  for (std::uint32_t i = 0; i < ops; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](std::uint32_t a, std::uint32_t b) {
    return request.group[a] < request.group[b];
  });
  std::vector<std::uint32_t>& phase_of = assignment.phase_of;
  phase_of.assign(ops, 0);
  std::vector<std::uint64_t> used(static_cast<std::size_t>(request.ranks), 0);
  std::uint32_t phase = 0;
  std::vector<std::uint32_t>& group_phases = assignment.group_phases;
  group_phases.assign(request.group_count + 1, 0);
  std::uint32_t group = 0;  // groups before it have their phases
  bool any = false;         // a unit placed in the current phase
  for (std::uint32_t i : order) {
    const std::uint32_t op_group = request.group[i];
    if (op_group != group) {
      // A new group starts a phase of its own; groups without ops have none.
      if (any) ++phase;
      any = false;
      std::fill(used.begin(), used.end(), 0);
      for (std::uint32_t g = group + 1; g <= op_group; ++g) group_phases[g] = phase;
      group = op_group;
    }
    if (unit[i] != i) {
      phase_of[i] = phase_of[unit[i]];
      continue;
    }
    bool full = false;
    for (const auto& [rank, bytes] : unit_needs[i]) full = full || used[rank] + bytes > limit;
    if (full && any) {
      ++phase;
      std::fill(used.begin(), used.end(), 0);
    }
    for (const auto& [rank, bytes] : unit_needs[i]) used[rank] += bytes;
    phase_of[i] = phase;
    any = true;
  }
  for (std::uint32_t g = group + 1; g <= request.group_count; ++g)
    group_phases[g] = phase + (any ? 1 : 0);
  return assignment;
}

std::string check_phase_assignment(const PhaseRequest& request, const PhaseAssignment& assignment) {
  const std::size_t ops = request.group.size();
  const std::vector<std::uint32_t> unit = unit_of_each_op(request);
  const std::vector<RankBytes> unit_needs = needs_of_units(request, unit);
  const auto [full_limit, pipelined] = limit_of(request, unit_needs);
  if (assignment.pipelined != pipelined) {
    return std::string("pipelined is ") + (assignment.pipelined ? "true" : "false") +
           " where the request makes it " + (pipelined ? "true" : "false");
  }
  if (assignment.limit != (pipelined ? full_limit / 2 : full_limit)) {
    return "the limit is " + std::to_string(assignment.limit) + ", not what the budget makes it";
  }
  const auto& phases = assignment.group_phases;
  if (assignment.phase_of.size() != ops || phases.size() != request.group_count + 1 ||
      phases[0] != 0 || !std::is_sorted(phases.begin(), phases.end())) {
    return "the assignment's lists have the wrong lengths, or the groups' phases go back";
  }
  const std::uint32_t phase_count = phases.back();
  std::vector<std::vector<std::uint64_t>> used(
      phase_count, std::vector<std::uint64_t>(static_cast<std::size_t>(request.ranks), 0));
  std::vector<bool> occupied(phase_count, false);
  std::vector<std::uint32_t> last_phase(request.group_count, 0);
  for (std::uint32_t i = 0; i < ops; ++i) {
    const std::uint32_t g = request.group[i], p = assignment.phase_of[i];
    const std::string op = "op " + std::to_string(i);
    if (p < phases[g] || p >= phases[g + 1]) return op + " is in a phase outside its group's";
    if (p != assignment.phase_of[unit[i]]) return op + " is apart from its conversion's unit";
    if (unit[i] != i) continue;
    if (p < last_phase[g]) return op + " runs in a phase before an op ahead of it";
    last_phase[g] = p;
    // Begins its phase: it must not have fitted in the one before, of its group.
    if (!occupied[p] && p > phases[g]) {
      bool fitted = true;
      for (const auto& [rank, bytes] : unit_needs[i])
        fitted = fitted && used[p - 1][rank] + bytes <= assignment.limit;
      if (fitted) return op + " begins a phase though it fitted in the one before";
    }
    occupied[p] = true;
    for (const auto& [rank, bytes] : unit_needs[i]) {
      used[p][rank] += bytes;
      if (used[p][rank] > assignment.limit) {
        return "phase " + std::to_string(p) + " takes more than the limit on PE " +
               std::to_string(rank);
      }
    }
  }
  for (std::uint32_t p = 0; p < phase_count; ++p) {
    if (!occupied[p]) return "phase " + std::to_string(p) + " holds no op";
  }
  return {};
}

}  // namespace reshard::execution

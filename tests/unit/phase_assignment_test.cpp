// The refit's phases under a staging budget: hand-made cases, random requests checked against an
// independent re-derivation of the promises, and that re-derivation catching broken assignments.
#include "execution/phase_assignment.hpp"

#include <gtest/gtest.h>

#include <random>

#include "reshard/error.hpp"
#include "reshard/resharder.hpp"

namespace reshard::execution {
namespace {

std::string op_name(std::uint32_t op) { return "op#" + std::to_string(op); }

// Ops of one group, each needing `bytes[i]` on rank 0 alone, none sharing a conversion.
PhaseRequest plain(std::vector<std::uint64_t> bytes, std::uint64_t budget) {
  PhaseRequest request;
  for (std::uint32_t i = 0; i < bytes.size(); ++i) {
    request.group.push_back(0);
    request.leader.push_back(i);
    request.needs.push_back({{0, bytes[i]}});
  }
  request.budget = budget;
  request.budget_given = true;
  return request;
}

PhaseAssignment assigned(const PhaseRequest& request) {
  PhaseAssignment assignment = assign_phases(request, op_name);
  EXPECT_EQ(check_phase_assignment(request, assignment), "");
  return assignment;
}

TEST(PhaseAssignment, ANewPhaseBeginsWhereTheNextOpWouldPassTheBudget) {
  const PhaseAssignment a = assigned(plain({40, 40, 40, 100, 1}, 100));
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{0, 0, 1, 2, 3}));
  EXPECT_EQ(a.group_phases, (std::vector<std::uint32_t>{0, 4}));
  EXPECT_EQ(a.limit, 100u);
  EXPECT_FALSE(a.pipelined);
}

TEST(PhaseAssignment, OpsSharingAConversionRunWithItsFirstOpAndCountTogether) {
  PhaseRequest request = plain({30, 30, 50, 10}, 100);
  request.leader = {0, 0, 2, 0};  // ops 1 and 3 share op 0's conversion: a unit of 70
  const PhaseAssignment a = assigned(request);
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{0, 0, 1, 0}));
}

TEST(PhaseAssignment, EachGroupBeginsAPhaseAndEmptyGroupsHaveNone) {
  PhaseRequest request = plain({1, 1, 1, 1}, 100);
  request.group = {2, 0, 2, 0};
  request.group_count = 4;  // groups 1 and 3 have no ops
  const PhaseAssignment a = assigned(request);
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{1, 0, 1, 0}));
  EXPECT_EQ(a.group_phases, (std::vector<std::uint32_t>{0, 1, 1, 2, 2}));
}

TEST(PhaseAssignment, EachRankHasTheBudget) {
  PhaseRequest request = plain({60, 60, 60}, 100);
  request.ranks = 2;
  request.needs[1] = {{1, 60}};  // op 1 on rank 1 alone: fits beside op 0
  const PhaseAssignment a = assigned(request);
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{0, 0, 1}));
}

TEST(PhaseAssignment, AUnitOverAGivenBudgetIsRefusedNamingItsOpAndRank) {
  PhaseRequest request = plain({10, 90, 70}, 100);
  request.ranks = 3;
  request.leader = {0, 1, 1};  // ops 1 and 2: 160 bytes on rank 2
  request.needs[1] = {{2, 90}};
  request.needs[2] = {{2, 70}};
  try {
    assign_phases(request, op_name);
    ADD_FAILURE() << "a unit over the budget was placed";
  } catch (const Error& error) {
    const std::string text = error.what();
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    for (const char* words : {"op#1", "and 1 more ops", "on PE 2", "160 B", "staging_budget"})
      EXPECT_NE(text.find(words), std::string::npos) << words << " in: " << text;
  }
}

TEST(PhaseAssignment, TheDefaultBudgetGrowsToTheLargestUnit) {
  PhaseRequest request = plain({150, 20, 140}, 100);
  request.budget_given = false;
  const PhaseAssignment a = assigned(request);
  EXPECT_EQ(a.limit, 150u);
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{0, 1, 2}));
}

TEST(PhaseAssignment, PipelinedPhasesTakeHalfTheBudgetWhereEveryUnitFitsInAHalf) {
  PhaseRequest request = plain({30, 30, 30, 30}, 100);
  request.may_pipeline = true;
  PhaseAssignment a = assigned(request);
  EXPECT_TRUE(a.pipelined);
  EXPECT_EQ(a.limit, 50u);
  EXPECT_EQ(a.phase_of, (std::vector<std::uint32_t>{0, 1, 2, 3}));
  request.needs[0] = {{0, 60}};  // a unit over a half: whole budget, not pipelined
  a = assigned(request);
  EXPECT_FALSE(a.pipelined);
  EXPECT_EQ(a.limit, 100u);
  request = plain({30, 30}, 100);  // fits in one phase: nothing to pipeline
  request.may_pipeline = true;
  EXPECT_FALSE(assigned(request).pipelined);
  request.budget = ReshardOptions::kUnlimited;
  EXPECT_FALSE(assigned(request).pipelined);
}

TEST(PhaseAssignment, RequestsOfTheWrongShapeAreRefusedAsTheCallersBug) {
  PhaseRequest request = plain({1, 1, 1}, 100);
  request.leader = {1, 1, 2};  // op 0 shares the conversion of op 1, after it
  EXPECT_THROW(assign_phases(request, op_name), Error);
  request.leader = {0, 2, 1};  // a circle
  EXPECT_THROW(assign_phases(request, op_name), Error);
  request = plain({1, 1}, 100);
  request.group = {0, 1};  // group 1 of 1
  EXPECT_THROW(assign_phases(request, op_name), Error);
  request = plain({1, 1}, 100);
  request.needs[1] = {{3, 1}};  // rank 3 of 1
  EXPECT_THROW(assign_phases(request, op_name), Error);
  request = plain({1, 1}, 100);
  request.group = {0, 1};
  request.group_count = 2;
  request.leader = {0, 0};  // a unit across groups
  EXPECT_THROW(assign_phases(request, op_name), Error);
}

// A random request of the executor's shape: groups, units within a group (a later op joining an
// earlier one), needs on a few ranks.
PhaseRequest random_request(std::mt19937_64& rng) {
  const auto pick = [&](std::uint64_t below) {
    return std::uniform_int_distribution<std::uint64_t>(0, below - 1)(rng);
  };
  PhaseRequest request;
  const auto ops = static_cast<std::uint32_t>(pick(40));
  request.group_count = static_cast<std::uint32_t>(1 + pick(5));
  request.ranks = static_cast<int>(1 + pick(6));
  for (std::uint32_t i = 0; i < ops; ++i) {
    request.group.push_back(static_cast<std::uint32_t>(pick(request.group_count)));
    std::uint32_t leader = i;
    if (pick(3) == 0) {
      for (std::uint32_t j = 0; j < i; ++j) {
        if (request.group[j] == request.group[i] && pick(2) == 0) leader = j;
      }
    }
    request.leader.push_back(leader);
    std::vector<std::pair<PeId, std::uint64_t>> needs;
    for (int rank = 0; rank < request.ranks; ++rank) {
      if (pick(2) == 0) needs.emplace_back(rank, pick(4) == 0 ? 0 : 1 + pick(300));
    }
    request.needs.push_back(std::move(needs));
  }
  request.budget = pick(8) == 0 ? ReshardOptions::kUnlimited : 1 + pick(600);
  request.budget_given = pick(2) == 0;
  request.may_pipeline = pick(2) == 0;
  return request;
}

TEST(PhaseAssignment, RandomRequestsKeepEveryPromiseOrAreRefusedForTheirBudget) {
  std::mt19937_64 rng(20261129);
  int refused = 0, pipelined = 0, split = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    const PhaseRequest request = random_request(rng);
    // Refused exactly where a unit on some rank needs more than a budget the caller gave.
    std::vector<std::map<PeId, std::uint64_t>> units(request.group.size());
    bool over = false;
    for (std::uint32_t i = 0; i < request.group.size(); ++i) {
      std::uint32_t first = i;
      while (request.leader[first] != first) first = request.leader[first];
      for (const auto& [rank, bytes] : request.needs[i]) {
        units[first][rank] += bytes;
        over = over || (request.budget_given && units[first][rank] > request.budget);
      }
    }
    try {
      const PhaseAssignment a = assign_phases(request, op_name);
      EXPECT_FALSE(over) << "trial " << trial << ": a unit over the given budget was placed";
      ASSERT_EQ(check_phase_assignment(request, a), "") << "trial " << trial;
      pipelined += a.pipelined;
      split += a.group_phases.back() > request.group_count;
    } catch (const Error& error) {
      EXPECT_TRUE(over) << "trial " << trial << ": " << error.what();
      EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
      ++refused;
    }
  }
  // The random requests reach every outcome.
  EXPECT_GT(refused, 100);
  EXPECT_GT(pipelined, 100);
  EXPECT_GT(split, 100);
}

TEST(PhaseAssignment, TheCheckCatchesBrokenAssignments) {
  const PhaseRequest request = plain({40, 40, 40, 100}, 100);
  const PhaseAssignment good = assigned(request);  // phases 0, 0, 1, 2
  PhaseAssignment a = good;
  a.phase_of[2] = 0;  // three ops of 40 in one phase: 120 > 100
  EXPECT_NE(check_phase_assignment(request, a), "");
  a = good;
  a.phase_of[1] = 1;  // op 1 would have fitted beside op 0
  EXPECT_NE(check_phase_assignment(request, a), "");
  a = good;
  a.group_phases = {0, 4};  // an empty phase
  EXPECT_NE(check_phase_assignment(request, a), "");
  a = good;
  a.limit = 50;
  EXPECT_NE(check_phase_assignment(request, a), "");
  PhaseRequest shared = request;
  shared.leader = {0, 0, 2, 3};
  a = assigned(shared);
  a.phase_of[1] = a.phase_of[0] + 1;  // apart from its unit
  EXPECT_NE(check_phase_assignment(shared, a), "");
}

}  // namespace
}  // namespace reshard::execution

#include "reshard/scheduler.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "reshard/error.hpp"

namespace reshard {
namespace {

std::vector<Transfer> random_transfers(std::mt19937_64& rng, int n, int count,
                                       std::uint64_t max_bytes) {
  std::vector<Transfer> transfers;
  for (int i = 0; i < count; ++i) {
    transfers.push_back({static_cast<TaskId>(i * 3 + 1), static_cast<PeId>(rng() % n),
                         static_cast<PeId>(rng() % n), rng() % (max_bytes + 1)});
  }
  return transfers;
}

TEST(Scheduler, RandomWorkloadsSatisfyEveryInvariant) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 16);
    const int count = static_cast<int>(rng() % 300);
    SchedulerOptions options;
    options.chunk_bytes = 1 + rng() % 5000;
    options.min_chunk_bytes = 1 + rng() % 5000;
    options.max_peers_per_round = 1 + static_cast<int>(rng() % 4);
    const auto transfers = random_transfers(rng, n, count, 20000);
    const Schedule schedule = build_schedule(transfers, n, options);
    EXPECT_EQ(check_schedule(schedule), "") << "trial " << trial;
  }
}

TEST(Scheduler, StaysWithinFivePercentOfTheLowerBoundOnRandomWorkloads) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 60; ++trial) {
    const int n = 2 << (trial % 6);  // 2 .. 64 PEs  // 4 .. 64 PEs
    std::vector<Transfer> transfers;
    for (int i = 0; i < 60 * n; ++i) {
      const auto bytes = static_cast<std::uint64_t>(std::exp2((rng() % 2200) / 100.0));
      transfers.push_back({static_cast<TaskId>(i), static_cast<PeId>(rng() % n),
                           static_cast<PeId>(rng() % n), bytes});
    }
    SchedulerOptions options;
    options.chunk_bytes = 1 << 20;
    options.max_peers_per_round = 1 + trial % 2;
    const Schedule schedule = build_schedule(transfers, n, options);
    ASSERT_EQ(check_schedule(schedule), "");
    EXPECT_LE(schedule.bound_ratio(), 1.05) << n << " PEs, trial " << trial;
  }
}

TEST(Scheduler, UniformAllToAllMeetsTheBoundExactly) {
  for (int n : {2, 3, 4, 8, 17}) {
    std::vector<Transfer> transfers;
    for (int s = 0; s < n; ++s) {
      for (int d = 0; d < n; ++d) transfers.push_back({static_cast<TaskId>(s * n + d), s, d, 3000});
    }
    const Schedule schedule = build_schedule(transfers, n, {1024, 1024, 64, 1});
    ASSERT_EQ(check_schedule(schedule), "");
    EXPECT_EQ(schedule.makespan_bytes, schedule.lower_bound_bytes) << n;
    EXPECT_EQ(schedule.lower_bound_bytes, 3000u * (n - 1));
    EXPECT_EQ(schedule.local.size(), static_cast<std::size_t>(n));
  }
}

TEST(Scheduler, SameResultWhateverOrderThePesListedTheirRequests) {
  std::mt19937_64 rng(3);
  auto transfers = random_transfers(rng, 9, 400, 100000);
  const Schedule a = build_schedule(transfers, 9, {4096, 4096, 64, 2});
  std::shuffle(transfers.begin(), transfers.end(), rng);
  const Schedule b = build_schedule(transfers, 9, {4096, 4096, 64, 2});
  ASSERT_EQ(a.batches.size(), b.batches.size());
  for (std::size_t i = 0; i < a.batches.size(); ++i) {
    EXPECT_EQ(a.batches[i].src, b.batches[i].src);
    EXPECT_EQ(a.batches[i].dst, b.batches[i].dst);
    EXPECT_EQ(a.batches[i].round, b.batches[i].round);
    EXPECT_EQ(a.batches[i].bytes, b.batches[i].bytes);
  }
  EXPECT_EQ(a.makespan_bytes, b.makespan_bytes);
}

TEST(Scheduler, FullDuplexLetsAPeSendAndReceiveInOneRound) {
  const std::vector<Transfer> transfers = {{1, 0, 1, 100}, {2, 1, 0, 100}};
  const Schedule schedule = build_schedule(transfers, 2, {1024, 1024, 64, 1});
  EXPECT_EQ(schedule.rounds, 1u);
  EXPECT_EQ(schedule.makespan_bytes, 100u);
}

TEST(Scheduler, SegmentsLargeRequestsAndPacksSmallOnes) {
  const std::vector<Transfer> transfers = {{1, 0, 1, 2500}, {2, 0, 1, 10}, {3, 0, 1, 20}};
  const Schedule schedule = build_schedule(transfers, 2, {1000, 1000, 64, 1});
  ASSERT_EQ(check_schedule(schedule), "");
  ASSERT_EQ(schedule.batches.size(), 3u);  // 2530 bytes in chunks of 1000
  std::uint64_t total = 0;
  for (const Batch& b : schedule.batches) total += b.bytes;
  EXPECT_EQ(total, 2530u);
}

TEST(Scheduler, EmptyAndZeroByteWorkloads) {
  const Schedule empty = build_schedule({}, 4, {});
  EXPECT_EQ(empty.rounds, 0u);
  EXPECT_EQ(check_schedule(empty), "");
  const std::vector<Transfer> zero = {{5, 0, 1, 0}};
  const Schedule schedule = build_schedule(zero, 2, {});
  EXPECT_TRUE(schedule.batches.empty());
  EXPECT_EQ(check_schedule(schedule), "");
}

// Transports that move every peer at once (CUDA, NCCL) ask for k = the number of PEs, which a
// job of more than 255 PEs exceeds.
TEST(Scheduler, TakesEveryPeerPerRoundInLargeJobs) {
  constexpr int kPes = 300;
  std::mt19937 rng(11);
  std::vector<Transfer> transfers;
  for (int src = 0; src < kPes; ++src) {
    for (int k = 0; k < 3; ++k) {
      const int dst = static_cast<int>(rng() % kPes);
      transfers.push_back({static_cast<TaskId>(transfers.size()), src, dst, 1 + rng() % 100000});
    }
  }
  SchedulerOptions options;
  options.max_peers_per_round = kPes;
  const Schedule schedule = build_schedule(transfers, kPes, options);
  EXPECT_EQ(check_schedule(schedule), "");
  EXPECT_LE(schedule.makespan_bytes, 2 * schedule.lower_bound_bytes);
}

TEST(Scheduler, RefusesBadOptions) {
  EXPECT_THROW(build_schedule({}, 0, {}), Error);
  SchedulerOptions no_chunk;
  no_chunk.chunk_bytes = 0;
  EXPECT_THROW(build_schedule({}, 2, no_chunk), Error);
  SchedulerOptions no_peers;
  no_peers.max_peers_per_round = 0;
  EXPECT_THROW(build_schedule({}, 2, no_peers), Error);
  const std::vector<Transfer> bad = {{1, 0, 5, 10}};
  EXPECT_THROW(build_schedule(bad, 2, {}), Error);
}

}  // namespace
}  // namespace reshard

// StagingPool's arrangement of a refit's staging into phases: every phase from the start of its
// region, and with two regions (a pipelined refit) phases next to each other never overlapping.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "execution/staging.hpp"

namespace reshard::execution {
namespace {

struct Placed {
  std::uint32_t phase;
  const std::byte* begin;
  const std::byte* end;
};

// Sizes a slot per op (random sizes, random phases among `phases`), arranges them in `regions`
// and returns where each landed, and the bytes the pool says it holds.
std::vector<Placed> arrange_random(StagingPool& pool, std::mt19937_64& rng, std::uint32_t phases,
                                   std::uint32_t regions, std::size_t& held) {
  std::vector<std::byte> like_memory(1);
  const Buffer like = Buffer::host(like_memory.data(), 1);
  std::vector<std::uint32_t> phase_of_task;
  std::vector<std::size_t> bytes_of_task;
  pool.start_sizing();
  const int ops = 1 + static_cast<int>(rng() % 40);
  for (int task = 0; task < ops; ++task) {
    phase_of_task.push_back(static_cast<std::uint32_t>(rng() % phases));
    bytes_of_task.push_back(1 + rng() % 5000);
    pool.slot({task % 2 == 0, static_cast<TaskId>(task), 0}, like, bytes_of_task.back());
  }
  held = pool.arrange(
      [&](const StagingPool::OpKey& key) { return phase_of_task[static_cast<int>(key.second)]; },
      regions);
  std::vector<Placed> placed;
  for (int task = 0; task < ops; ++task) {
    const Buffer& slot =
        pool.slot({task % 2 == 0, static_cast<TaskId>(task), 0}, like, bytes_of_task[task]);
    const auto* begin = static_cast<const std::byte*>(slot.data);
    placed.push_back({phase_of_task[task], begin, begin + bytes_of_task[task]});
  }
  return placed;
}

bool overlap(const Placed& a, const Placed& b) { return a.begin < b.end && b.begin < a.end; }

TEST(StagingPool, SlotsOfAPhaseNeverOverlapAndTwoRegionsKeepNeighbouringPhasesApart) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 300; ++round) {
    StagingPool pool;
    const std::uint32_t phases = 1 + static_cast<std::uint32_t>(rng() % 6);
    const std::uint32_t regions = 1 + static_cast<std::uint32_t>(rng() % 2);
    std::size_t held = 0;
    const std::vector<Placed> placed = arrange_random(pool, rng, phases, regions, held);
    SCOPED_TRACE("round " + std::to_string(round) + ": " + std::to_string(placed.size()) +
                 " slots, " + std::to_string(phases) + " phases, " + std::to_string(regions) +
                 " regions");
    const std::byte* lowest = placed[0].begin;
    const std::byte* highest = placed[0].end;
    for (const Placed& a : placed) {
      lowest = std::min(lowest, a.begin);
      highest = std::max(highest, a.end);
      for (const Placed& b : placed) {
        if (&a == &b) continue;
        const bool apart = a.phase == b.phase || (regions == 2 && a.phase % 2 != b.phase % 2);
        if (apart) EXPECT_FALSE(overlap(a, b)) << "phases " << a.phase << " and " << b.phase;
      }
    }
    // Everything lies in what the pool holds, which is no more than the largest phase of each
    // region (slots rounded up to the pool's alignment of at most 256 bytes).
    EXPECT_LE(static_cast<std::size_t>(highest - lowest), held);
    std::vector<std::size_t> phase_bytes(phases, 0), largest(regions, 0);
    for (const Placed& a : placed) phase_bytes[a.phase] += (a.end - a.begin + 255) / 256 * 256;
    for (std::uint32_t p = 0; p < phases; ++p)
      largest[p % regions] = std::max(largest[p % regions], phase_bytes[p]);
    std::size_t bound = 0;
    for (std::size_t bytes : largest) bound += bytes;
    EXPECT_LE(held, bound);
  }
}

}  // namespace
}  // namespace reshard::execution

// The stream memory operations that order PEs sharing a GPU (SameDeviceOrder): which flags each
// run raises and waits for, and in what order. Built from pointers alone: no GPU needed (the
// GPU suites run them; these tests pin the order a GPU run cannot show when it happens to work).
#include "transports/cuda/same_device_order.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#include "gpu/device_work.hpp"

namespace reshard::cuda {
namespace {

constexpr int kPes = 5;

// Each PE's SignalLayout as this PE maps it (host memory: the order only takes addresses).
struct Flags {
  std::vector<std::vector<std::uint64_t>> memory = std::vector<std::vector<std::uint64_t>>(
      kPes, std::vector<std::uint64_t>(SignalLayout::bytes(kPes) / 8));
  std::vector<std::uint64_t*> pointers() {
    std::vector<std::uint64_t*> all;
    for (auto& m : memory) all.push_back(m.data());
    return all;
  }
  std::uint64_t* ready(int owner, int from) {
    return SignalLayout::same_device_ready(memory[owner].data(), kPes, from);
  }
  std::uint64_t* done(int owner, int from) {
    return SignalLayout::same_device_done(memory[owner].data(), kPes, from);
  }
};

using Op = SameDeviceOrder::MemoryOp;
Op raise(std::uint64_t* flag) { return {flag, 1, false}; }
std::vector<Op> wait_and_reset(std::uint64_t* flag) { return {{flag, 1, true}, {flag, 0, false}}; }

std::vector<Op> concat(std::initializer_list<std::vector<Op>> parts) {
  std::vector<Op> all;
  for (const auto& part : parts) all.insert(all.end(), part.begin(), part.end());
  return all;
}

TEST(SameDeviceOrder, PairsRaiseEveryFlagBeforeWaitingForAny) {
  Flags flags;
  const int me = 1;
  SameDeviceOrder order(flags.pointers()[me], flags.pointers(), me);
  // Writes into 3 and 4, which write into it too, and 0 writes into it.
  order.order_pairs({4, 3}, {0, 3, 4});
  EXPECT_EQ(
      order.begin_ops(),
      concat({{raise(flags.ready(0, me)), raise(flags.ready(3, me)), raise(flags.ready(4, me))},
              wait_and_reset(flags.ready(me, 3)),
              wait_and_reset(flags.ready(me, 4))}));
  EXPECT_EQ(order.end_ops(), concat({{raise(flags.done(3, me)), raise(flags.done(4, me))},
                                     wait_and_reset(flags.done(me, 0)),
                                     wait_and_reset(flags.done(me, 3)),
                                     wait_and_reset(flags.done(me, 4))}));
  EXPECT_EQ(order.peers(), (std::vector<int>{0, 3, 4}));
}

TEST(SameDeviceOrder, AFollowerHandsOverOnlyOnceItsOwnDestinationsAreReady) {
  // PE 2 follows PE 0 (its GPU's leader, which makes its copies) and sends to 3 and 4 on other
  // GPUs, which send to it too: the leader may write into 3 and 4 for it only once they are
  // ready, and 3 and 4 hear that its bytes landed only once the leader is done.
  Flags flags;
  const int me = 2;
  SameDeviceOrder order(flags.pointers()[me], flags.pointers(), me);
  order.follow(0);
  order.order_pairs({3, 4}, {3, 4});
  EXPECT_EQ(order.begin_ops(), concat({{raise(flags.ready(3, me)), raise(flags.ready(4, me))},
                                       wait_and_reset(flags.ready(me, 3)),
                                       wait_and_reset(flags.ready(me, 4)),
                                       {raise(flags.ready(0, me))}}));
  EXPECT_EQ(order.end_ops(), concat({wait_and_reset(flags.done(me, 0)),
                                     {raise(flags.done(3, me)), raise(flags.done(4, me))},
                                     wait_and_reset(flags.done(me, 3)),
                                     wait_and_reset(flags.done(me, 4))}));
  EXPECT_EQ(order.peers(), (std::vector<int>{0, 3, 4}));
}

TEST(SameDeviceOrder, ALeaderWaitsForItsFollowersAndItsPairs) {
  Flags flags;
  const int me = 0;
  SameDeviceOrder order(flags.pointers()[me], flags.pointers(), me);
  order.lead({2});
  order.order_pairs({3}, {4});
  EXPECT_EQ(order.begin_ops(), concat({{raise(flags.ready(4, me))},
                                       wait_and_reset(flags.ready(me, 2)),
                                       wait_and_reset(flags.ready(me, 3))}));
  EXPECT_EQ(order.end_ops(), concat({{raise(flags.done(2, me)), raise(flags.done(3, me))},
                                     wait_and_reset(flags.done(me, 4))}));
}

TEST(SameDeviceOrder, OnlyAnEndThatWaitsForNothingIsLeftToTheKernel) {
  Flags flags;
  // A leader of 1 and 3 that receives from no PE its stream orders: its end only raises, and the
  // kernel completing its run may raise those flags instead.
  SameDeviceOrder leader(flags.pointers()[0], flags.pointers(), 0);
  leader.lead({1, 3});
  EXPECT_EQ(leader.end_raises(), (std::vector<std::uint64_t*>{flags.done(1, 0), flags.done(3, 0)}));
  // One that receives from PE 4 waits at its end: nothing is left to the kernel.
  leader.order_pairs({}, {4});
  EXPECT_TRUE(leader.end_raises().empty());
  // A follower waits for its leader at its end.
  SameDeviceOrder follower(flags.pointers()[2], flags.pointers(), 2);
  follower.follow(0);
  EXPECT_TRUE(follower.end_raises().empty());
  EXPECT_TRUE(SameDeviceOrder(flags.pointers()[2], flags.pointers(), 2).end_raises().empty());
}

TEST(SameDeviceOrder, BeginAndEndTogetherKeepTheirOrder) {
  Flags flags;
  const int me = 2;
  SameDeviceOrder order(flags.pointers()[me], flags.pointers(), me);
  order.follow(0);
  order.order_pairs({3}, {4});
  EXPECT_EQ(order.begin_and_end_ops(), concat({order.begin_ops(), order.end_ops()}));
  EXPECT_EQ(order.begin_and_end_ops(), concat({{raise(flags.ready(4, me))},
                                               wait_and_reset(flags.ready(me, 3)),
                                               {raise(flags.ready(0, me))},
                                               wait_and_reset(flags.done(me, 0)),
                                               {raise(flags.done(3, me))},
                                               wait_and_reset(flags.done(me, 4))}));
}

TEST(SameDeviceOrder, MergedPhasesWatchEveryPeerOfEither) {
  Flags flags;
  const int me = 2;
  SameDeviceOrder first(flags.pointers()[me], flags.pointers(), me);
  first.follow(0);
  SameDeviceOrder second(flags.pointers()[me], flags.pointers(), me);
  second.order_pairs({4}, {});
  SameDeviceOrder all(flags.pointers()[me], flags.pointers(), me);
  all.merge(first);
  all.merge(second);
  EXPECT_EQ(all.peers(), (std::vector<int>{0, 4}));
  EXPECT_TRUE(SameDeviceOrder(flags.pointers()[me], flags.pointers(), me).empty());
}

// Which pairs the streams order: `gpus` names each PE's GPU, `streams` whether it would.
std::vector<std::vector<bool>> relation(const std::vector<std::string>& gpus,
                                        const std::vector<bool>& streams) {
  std::vector<std::vector<bool>> all;
  for (int me = 0; me < static_cast<int>(gpus.size()); ++me)
    all.push_back(stream_ordered_peers(gpus, streams, me));
  return all;
}

TEST(StreamOrderedPeers, PesSharingOneGpuOrderEveryPairByTheStreams) {
  const auto r = relation({"a", "a", "a"}, {true, true, true});
  EXPECT_EQ(r[0], (std::vector<bool>{false, true, true}));
  EXPECT_EQ(r[2], (std::vector<bool>{true, true, false}));
}

TEST(StreamOrderedPeers, PairsAcrossGpusFollowWhereEitherGpuIsShared) {
  // GPU a holds PEs 0 and 1 (trainer and engine); b and c one PE each.
  const auto r = relation({"a", "a", "b", "c"}, {true, true, true, true});
  EXPECT_EQ(r[0], (std::vector<bool>{false, true, true, true}));
  // PEs 2 and 3 alone on their GPUs keep the kernels' flags between them, and stream to a's PEs.
  EXPECT_EQ(r[2], (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(r[3], (std::vector<bool>{true, true, false, false}));
  // One PE per GPU: the kernels' flags everywhere.
  for (const auto& row : relation({"a", "b", "c"}, {true, true, true}))
    EXPECT_EQ(row, (std::vector<bool>(3, false)));
}

TEST(StreamOrderedPeers, APeerThatCannotStreamKeepsTheKernelsFlags) {
  // GPU a runs under MPS (its PEs order by their kernels); GPU b's PEs would stream.
  const auto r = relation({"a", "a", "b", "b"}, {false, false, true, true});
  EXPECT_EQ(r[0], (std::vector<bool>(4, false)));
  EXPECT_EQ(r[2], (std::vector<bool>{false, false, false, true}));
}

// sends[p][q]: PE p sends to q, from a list of (p, q).
std::vector<std::vector<std::uint8_t>> sends_of(int n, const std::vector<std::pair<int, int>>& to) {
  std::vector<std::vector<std::uint8_t>> sends(n, std::vector<std::uint8_t>(n, 0));
  for (const auto& [p, q] : to) sends[p][q] = 1;
  return sends;
}

TEST(DelegatingPerSchedule, AGpuWhosePesSendOneWayDelegatesAndOneExchangingBothWaysDoesNot) {
  // GPU a: trainer PEs 0, 1 send to engine PEs 2, 3. GPU b: PEs 4 and 5 exchange both ways.
  const std::vector<std::string> gpus{"a", "a", "a", "a", "b", "b"};
  const std::vector<bool> per_schedule(6, true);
  const auto sends = sends_of(6, {{0, 2}, {0, 3}, {1, 2}, {1, 3}, {4, 5}, {5, 4}, {0, 4}});
  EXPECT_EQ(delegating_per_schedule(gpus, per_schedule, sends),
            (std::vector<bool>{true, true, true, true, false, false}));
  // An engine PE answering a trainer PE: GPU a's pairs keep their own order.
  auto answered = sends;
  answered[3][1] = 1;
  EXPECT_EQ(delegating_per_schedule(gpus, per_schedule, answered), std::vector<bool>(6, false));
}

TEST(DelegatingPerSchedule, APeAloneOrNotOrderedPerScheduleDoesNotDelegate) {
  // PE 1 is told to order by its kernels: PE 0 is the only per-schedule PE of GPU a.
  EXPECT_EQ(
      delegating_per_schedule({"a", "a", "b"}, {true, false, true}, sends_of(3, {{0, 1}, {1, 2}})),
      std::vector<bool>(3, false));
  // PEs that send nothing on a shared GPU still delegate (the leader's run orders them all).
  EXPECT_EQ(delegating_per_schedule({"a", "a"}, {true, true}, sends_of(2, {})),
            (std::vector<bool>{true, true}));
}

TEST(DelegatingPerSchedule, EveryPeOfAGpuAgreesOverRandomJobs) {
  std::mt19937 random(20261130);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + static_cast<int>(random() % 10),
              gpus_count = 1 + static_cast<int>(random() % 4);
    std::vector<std::string> gpus;
    std::vector<bool> per_schedule;
    auto sends = sends_of(n, {});
    for (int pe = 0; pe < n; ++pe) {
      gpus.push_back(std::to_string(random() % gpus_count));
      per_schedule.push_back(random() % 4 != 0);
      for (int q = 0; q < n; ++q) sends[pe][q] = q != pe && random() % 3 == 0;
    }
    const std::vector<bool> delegating = delegating_per_schedule(gpus, per_schedule, sends);
    for (int p = 0; p < n; ++p) {
      if (!per_schedule[p]) {
        EXPECT_FALSE(delegating[p]) << "trial " << trial << ", PE " << p;
        continue;
      }
      // The PEs of p's GPU that order per schedule: p's mates, and whether a pair of them
      // exchanges both ways.
      auto ours = [&](int pe) { return gpus[pe] == gpus[p] && per_schedule[pe]; };
      int mates = 0;
      bool both_ways = false;
      for (int q = 0; q < n; ++q) {
        if (q == p || !ours(q)) continue;
        ++mates;
        ASSERT_EQ(delegating[p], delegating[q]) << "trial " << trial << ", PEs " << p << ", " << q;
      }
      for (int a = 0; a < n; ++a)
        for (int b = 0; b < n; ++b)
          both_ways = both_ways || (a != b && ours(a) && ours(b) && sends[a][b] && sends[b][a]);
      EXPECT_EQ(delegating[p], mates > 0 && !both_ways) << "trial " << trial << ", PE " << p;
    }
  }
}

TEST(StreamOrderedPeers, EveryPairIsSeenAlikeFromBothEndsOverRandomJobs) {
  std::mt19937 random(20261127);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + static_cast<int>(random() % 12),
              gpus_count = 1 + static_cast<int>(random() % 5);
    std::vector<std::string> gpus;
    std::vector<bool> streams;
    for (int pe = 0; pe < n; ++pe) {
      gpus.push_back(std::to_string(random() % gpus_count));
      streams.push_back(random() % 5 != 0);
    }
    const auto r = relation(gpus, streams);
    for (int p = 0; p < n; ++p) {
      EXPECT_FALSE(r[p][p]);
      for (int q = 0; q < n; ++q) {
        ASSERT_EQ(r[p][q], r[q][p]) << "trial " << trial << ", PEs " << p << " and " << q;
        const bool both = streams[p] && streams[q];
        if (p != q && gpus[p] == gpus[q]) EXPECT_EQ(r[p][q], both);  // same GPU: whenever both can
        if (!both) EXPECT_FALSE(r[p][q]);
        // A pair between GPUs that hold no other streaming PE keeps the kernels' flags.
        auto shared = [&](int pe) {
          for (int o = 0; o < n; ++o)
            if (o != pe && gpus[o] == gpus[pe] && streams[o] && streams[pe]) return true;
          return false;
        };
        if (gpus[p] != gpus[q]) EXPECT_EQ(r[p][q], both && (shared(p) || shared(q)));
      }
    }
  }
}

// The PEs of a GPU whose kernels wait for a peer's flags form one set, as each of them sees it.
TEST(KernelOrderedSharers, EveryPeOfAGpuWhoseKernelsWaitSeesTheSameSet) {
  // GPU a runs under MPS (its PEs would not stream); GPU b's two PEs stream; c holds one PE. Every
  // pair exchanges bytes; the kernels order a pair where the streams do not.
  const std::vector<std::string> gpus{"a", "b", "a", "b", "a", "c"};
  const std::vector<bool> streams{false, true, false, true, false, true};
  const std::vector<bool> shared = stream_shared(gpus, streams);
  const auto in_kernels = [&](int p, int q) {
    return p != q && !ordered_by_streams(streams, shared, p, q);
  };
  const std::vector<int> a = kernel_ordered_sharers(gpus, in_kernels, 0);
  EXPECT_EQ(a, (std::vector<int>{0, 2, 4}));
  for (const int me : {2, 4}) {
    std::vector<int> seen = kernel_ordered_sharers(gpus, in_kernels, me);
    EXPECT_EQ(seen.front(), me);
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen, a);
  }
  // b's PEs stream to each other, but wait in the kernels for a's (which would not stream) and
  // c's (no GPU of that pair is shared through the streams): they share b. c's is alone on c.
  std::vector<int> b = kernel_ordered_sharers(gpus, in_kernels, 3);
  std::sort(b.begin(), b.end());
  EXPECT_EQ(b, (std::vector<int>{1, 3}));
  EXPECT_TRUE(kernel_ordered_sharers(gpus, in_kernels, 5).empty());
  // Where b's PEs exchange bytes only with each other, they wait on no kernel.
  const auto only_b = [&](int p, int q) {
    return gpus[p] == "b" && gpus[q] == "b" && in_kernels(p, q);
  };
  EXPECT_TRUE(kernel_ordered_sharers(gpus, only_b, 1).empty());
}

// Pairs ordered per schedule (MPS, one GPU): PEs 0 and 1 send to each other (the kernels order
// them), 2 -> 3 goes one way (the streams): 2 and 3 wait on no kernel. With 2 and 3 also in
// kernel-ordered pairs with PEs of another GPU, every waiting PE of the GPU shares it.
TEST(KernelOrderedSharers, APeWaitingOnAnotherGpuSharesItsOwnGpuToo) {
  const auto only_0_1 = [](int p, int q) { return std::min(p, q) == 0 && std::max(p, q) == 1; };
  EXPECT_EQ(kernel_ordered_sharers({"a", "a", "a", "a"}, only_0_1, 1), (std::vector<int>{1, 0}));
  EXPECT_TRUE(kernel_ordered_sharers({"a", "a", "a", "a"}, only_0_1, 2).empty());
  // PE 4 on GPU b: 2 -> 4 and 3 -> 4 wait in the kernels.
  const auto across = [&](int p, int q) {
    return only_0_1(p, q) || (std::max(p, q) == 4 && std::min(p, q) >= 2);
  };
  std::vector<int> seen = kernel_ordered_sharers({"a", "a", "a", "a", "b"}, across, 3);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_TRUE(kernel_ordered_sharers({"a", "a", "a", "a", "b"}, across, 4).empty());  // alone on b
}

// A one-sided refit under MPS: two PEs copy, two only wait (one CTA each). The senders get what
// the waiting PEs leave, not a quarter of the GPU each.
// kernel_waiters once, then each PE's set and the "anywhere" answer in one pass, are what asking
// every pair again for each PE gives (the definition), over random jobs.
TEST(KernelOrderedSharers, OnePassOverTheWaitersGivesWhatAskingEveryPairGives) {
  std::mt19937 random(20261130);
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = 1 + static_cast<int>(random() % 12);
    std::vector<std::string> gpus(n);
    for (std::string& gpu : gpus) gpu = std::string(1, static_cast<char>('a' + random() % 4));
    std::vector<std::vector<bool>> pairs(n, std::vector<bool>(n));
    const unsigned density = 1 + random() % 8;  // from most pairs waiting to few
    for (auto& row : pairs)
      for (auto&& pair : row) pair = random() % density == 0;
    const auto in_kernels = [&](int p, int q) { return p != q && pairs[p][q]; };
    auto waits = [&](int pe) {
      for (int other = 0; other < n; ++other)
        if (in_kernels(pe, other)) return true;
      return false;
    };
    const std::vector<bool> waiters = kernel_waiters(n, in_kernels);
    bool anywhere = false;
    for (int me = 0; me < n; ++me) {
      ASSERT_EQ(waiters[me], waits(me)) << "trial " << trial << ", PE " << me;
      std::vector<int> expected;
      if (waits(me)) {
        expected.push_back(me);
        for (int pe = 0; pe < n; ++pe)
          if (pe != me && gpus[pe] == gpus[me] && waits(pe)) expected.push_back(pe);
        if (expected.size() == 1) expected.clear();
      }
      EXPECT_EQ(kernel_ordered_sharers(gpus, waiters, me), expected)
          << "trial " << trial << ", PE " << me;
      anywhere = anywhere || !expected.empty();
    }
    EXPECT_EQ(kernel_ordered_sharing_anywhere(gpus, waiters), anywhere) << "trial " << trial;
  }
}

TEST(ResidentShare, PesThatOnlyWaitLeaveTheGpuToThoseThatCopy) {
  const std::vector<std::uint64_t> wants{128, 128, 1, 1};
  EXPECT_GE(resident_share(wants, 0, 264), 128u);
  EXPECT_GE(resident_share(wants, 2, 264), 1u);
  EXPECT_EQ(resident_share(wants, 0, 132), 65u);  // 1 + 128 * 127 / 254
  EXPECT_EQ(resident_share(wants, 3, 132), 1u);
}

// Over random wants and GPU sizes: the shares fit the GPU together (every kernel resident at
// once), each is at least one CTA, a want that fits is met, and one that does not is cut.
TEST(ResidentShare, SharesFitTheGpuTogetherAndMeetWantsThatFit) {
  std::mt19937 random(7);
  for (int trial = 0; trial < 5000; ++trial) {
    const std::size_t sharers = 2 + random() % 7;
    std::vector<std::uint64_t> wants(sharers);
    std::uint64_t together = 0;
    for (auto& want : wants) together += (want = 1 + random() % (trial % 2 ? 300 : 40));
    const std::uint64_t wave = sharers + random() % 600;
    std::uint64_t sum = 0;
    for (std::size_t i = 0; i < sharers; ++i) {
      const std::uint64_t share = resident_share(wants, i, wave);
      sum += share;
      ASSERT_GE(share, 1u) << "trial " << trial;
      if (together <= wave)
        ASSERT_GE(share, wants[i]) << "trial " << trial;
      else
        ASSERT_LE(share, wants[i]) << "trial " << trial;
    }
    ASSERT_LE(sum, wave) << "trial " << trial << ": " << sharers << " PEs, wants " << together;
  }
}

TEST(GroupCtaCounts, AGroupWithMoreBytesGetsMoreCtasWhenTheCapCuts) {
  // Four peers wanting the per-peer most (64 CTAs each) on 132 SMs; one copies three times what
  // each other does: it gets three times the CTAs, not a quarter of the cap.
  const std::vector<std::uint64_t> counts =
      group_cta_counts({3u << 30, 1u << 30, 1u << 30, 1u << 30}, {64, 64, 64, 64}, 132);
  EXPECT_EQ(counts, (std::vector<std::uint64_t>{64, 22, 22, 22}));
  // Wants that fit are met whatever the bytes.
  EXPECT_EQ(group_cta_counts({1u << 30, 100}, {40, 1}, 132), (std::vector<std::uint64_t>{40, 1}));
}

// Over random groups: every group has a CTA and at most its want, the counts never pass the cap
// (given a CTA for each group), wants that fit are met, and where the cap cuts, a group's bytes
// per CTA stay within one CTA's worth of the others' (unless it got all it wanted, or just one).
TEST(GroupCtaCounts, CtasFollowTheBytesWithinTheCap) {
  std::mt19937_64 random(11);
  for (int trial = 0; trial < 5000; ++trial) {
    const std::size_t groups = 1 + random() % 12;
    const std::uint64_t cap = 1 + random() % 264;
    std::vector<std::uint64_t> bytes(groups), want(groups);
    std::uint64_t wanted = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      bytes[g] = random() % 4 == 0 ? 1 + random() % 4096 : 1 + random() % (std::uint64_t{8} << 30);
      want[g] = 1 + random() % 64;
      wanted += want[g];
    }
    const std::vector<std::uint64_t> counts = group_cta_counts(bytes, want, cap);
    ASSERT_EQ(counts.size(), groups);
    std::uint64_t total = 0;
    for (std::size_t g = 0; g < groups; ++g) {
      EXPECT_GE(counts[g], 1u) << "trial " << trial;
      EXPECT_LE(counts[g], want[g]) << "trial " << trial;
      total += counts[g];
    }
    if (wanted <= cap) {
      EXPECT_EQ(counts, want) << "trial " << trial;
      continue;
    }
    EXPECT_LE(total, std::max<std::uint64_t>(cap, groups)) << "trial " << trial;
    // A group held below its want has no more bytes per CTA than any other group would have
    // with one CTA fewer: moving a CTA to it could not even the load.
    for (std::size_t g = 0; g < groups; ++g) {
      if (counts[g] >= want[g]) continue;
      const double mine = static_cast<double>(bytes[g]) / static_cast<double>(counts[g] + 1);
      for (std::size_t h = 0; h < groups; ++h) {
        if (h == g || counts[h] <= 1) continue;
        EXPECT_LE(mine, static_cast<double>(bytes[h]) / static_cast<double>(counts[h] - 1))
            << "trial " << trial << ": group " << g << " (" << bytes[g] << " bytes, " << counts[g]
            << " CTAs), group " << h << " (" << bytes[h] << " bytes, " << counts[h] << " CTAs)";
      }
    }
  }
}

}  // namespace
}  // namespace reshard::cuda

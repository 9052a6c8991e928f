// The stream memory operations that order PEs sharing a GPU (SameDeviceOrder): which flags each
// run raises and waits for, and in what order. Built from pointers alone: no GPU needed (the
// GPU suites run them; these tests pin the order a GPU run cannot show when it happens to work).
#include "transports/cuda/same_device_order.hpp"

#include <gtest/gtest.h>

#include <algorithm>
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

}  // namespace
}  // namespace reshard::cuda

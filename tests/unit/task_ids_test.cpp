// The wire buffers' task ids: every (op, count, index) the executor can make is told apart and read
// back, and none reaches into the op's own bits.
#include "execution/task_ids.hpp"

#include <gtest/gtest.h>

#include <random>
#include <set>

namespace reshard::execution {
namespace {

TEST(TaskIds, EveryWireBufferOfAnOpHasItsOwnIdThatReadsBack) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 200; ++trial) {
    const TaskId op = op_task_of(rng());  // as the planner makes them: low bits zero
    ASSERT_EQ(op_task_of(op), op);
    std::set<TaskId> seen;
    for (std::size_t count = 1; count <= static_cast<std::size_t>(kMaxWireBuffers); ++count) {
      for (std::size_t index = 0; index < count; ++index) {
        const TaskId task = wire_task(op, count, index);
        EXPECT_EQ(op_task_of(task), op);
        EXPECT_EQ(wire_count_of(task), count);
        EXPECT_EQ(wire_index_of(task), index);
        EXPECT_TRUE(seen.insert(task).second) << "count " << count << " index " << index;
      }
    }
  }
}

}  // namespace
}  // namespace reshard::execution

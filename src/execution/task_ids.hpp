// How an op's wire buffers share its task id. The planner leaves the low kSubTaskBits of every
// op's task id zero (plan.hpp); the executor numbers wire buffer i of n there as n << 4 | i, so
// both sides derive each buffer's id and sides that disagree on n cannot match by accident.
#pragma once

#include <cstddef>

#include "reshard/plan.hpp"
#include "reshard/transform.hpp"
#include "reshard/types.hpp"

namespace reshard::execution {

inline constexpr int kWireIndexBits = 4;
inline constexpr TaskId kWireIndexMask = (TaskId{1} << kWireIndexBits) - 1;
static_assert(2 * kWireIndexBits == kSubTaskBits, "a wire buffer's count and index fill the bits");
static_assert(kMaxWireBuffers <= kWireIndexMask, "every wire buffer count fits its bits");

inline TaskId wire_task(TaskId op_task, std::size_t count, std::size_t index) {
  return op_task | (static_cast<TaskId>(count) << kWireIndexBits) | static_cast<TaskId>(index);
}
inline TaskId op_task_of(TaskId task) { return (task >> kSubTaskBits) << kSubTaskBits; }
inline std::size_t wire_count_of(TaskId task) {
  return static_cast<std::size_t>((task >> kWireIndexBits) & kWireIndexMask);
}
inline std::size_t wire_index_of(TaskId task) {
  return static_cast<std::size_t>(task & kWireIndexMask);
}

}  // namespace reshard::execution

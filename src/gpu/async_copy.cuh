// Asynchronous 16-byte copies from global into shared memory (cp.async, sm_80 and newer): the
// loads hold no registers while in flight, so a warp can have many kilobytes out at once.
#pragma once

#include <cstdint>

namespace reshard::execution::cuda {

// No "memory" clobber: one would make the compiler reload every value it read through a pointer
// (a kernel's job fields) after each copy. Callers order the slots' other accesses with the
// waits below (which have one) and a warp or CTA barrier before reusing a slot.
__device__ __forceinline__ void copy_16_bytes_async(uint4* shared, const void* global) {
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global));
}
// The same through L1 (cp.async.ca): for loads that take 16 of a 32-byte sector each, whose
// other half another load of the lane fetches next.
__device__ __forceinline__ void copy_16_bytes_async_through_l1(uint4* shared, const void* global) {
  const auto address = static_cast<std::uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(address), "l"(global));
}
__device__ __forceinline__ void commit_async_copies() {
  asm volatile("cp.async.commit_group;" ::: "memory");
}
// Before refilling slots this thread read since their last fill: keeps those reads above the
// refill (a compiler barrier; the thread's own order does the rest).
__device__ __forceinline__ void before_refilling_slots() { asm volatile("" ::: "memory"); }
// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void wait_async_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(pending) : "memory");
}
// The same for a count known only at run time (0 to 7; more waits for all).
__device__ __forceinline__ void wait_async_copies_at_most(int pending) {
  switch (pending) {
    case 7:
      return wait_async_copies<7>();
    case 6:
      return wait_async_copies<6>();
    case 5:
      return wait_async_copies<5>();
    case 4:
      return wait_async_copies<4>();
    case 3:
      return wait_async_copies<3>();
    case 2:
      return wait_async_copies<2>();
    case 1:
      return wait_async_copies<1>();
    default:
      return wait_async_copies<0>();
  }
}

}  // namespace reshard::execution::cuda

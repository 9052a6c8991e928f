// The device side of a run's waits, for the copy kernels (copy_kernels.cu includes it, alone):
// the clock and flag accesses, programmatic dependent launch, a wait on a peer's flag with its
// timeout and cancellation, and the failure record the first failed wait writes.
#pragma once

#include <cstdint>

#include "gpu/copy_kernels.hpp"

namespace reshard::cuda {
namespace {

__device__ __forceinline__ std::uint64_t global_timer_ns() {
  std::uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ std::uint64_t load_acquire(const std::uint64_t* flag) {
  std::uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ __forceinline__ void store_relaxed(std::uint64_t* flag, std::uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// Programmatic dependent launch (sm_90): a run launched with it may start while the stream's
// previous kernel is still finishing; everything before wait_for_previous_grid() reads only the
// schedule's own arguments, everything after it sees the previous kernel's writes. Both are no-ops
// for a kernel launched without it.
__device__ __forceinline__ void wait_for_previous_grid() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void let_next_grid_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A wait longer than this marks this PE as stuck on its peer (SignalLayout::waiting_on): long
// against a healthy wait, short against any timeout.
constexpr std::uint64_t kStuckNs = 1000000;

// Where the chain of stuck waits that starts at `peer` ends: a PE whose own kernels wait on
// another PE names it in its waiting_on word. A 4-PE NVSHMEM run whose PE 1 stopped left PE 3
// stuck on PE 1 in an early round and PE 2 stuck on PE 3 in a later one; PE 2 then named PE 3
// only. The walk stops at a PE not mapped here, at one not stuck, and before any PE it has
// already passed (this one included), so a cycle ends at the last PE new to it.
__device__ int stuck_behind(const KernelArgs& a, int peer) {
  constexpr int kMaxHops = 64;
  int chain[kMaxHops];
  int length = 0;
  int at = peer;
  while (a.peer_waiting_on != nullptr && length < kMaxHops && at >= 0 && at < a.n_pes) {
    const std::uint64_t* word = a.peer_waiting_on[at];
    if (word == nullptr) break;
    const std::uint64_t next = *reinterpret_cast<const volatile std::uint64_t*>(word);
    if (next == 0 || next > static_cast<std::uint64_t>(a.n_pes)) break;
    const int pe = static_cast<int>(next - 1);
    bool seen = pe == a.me || pe == at;
    for (int k = 0; k < length && !seen; ++k) seen = chain[k] == pe;
    if (seen) break;
    chain[length++] = at;
    at = pe;
  }
  return at;
}

// The first failed wait of a run records itself (DeviceStatus): it claims the device failure word
// (which also stops the copies of this PE's kernels), so two waits failing at once, or a wait and
// the host, never write half a record each.
__device__ void record_failure(const KernelArgs& a, unsigned int code, int peer,
                               unsigned int wait_kind) {
  volatile DeviceStatus* status = a.status;
  if (a.failure != nullptr) {
    if (atomicCAS(a.failure, 0u, code) != 0u) return;  // another wait, or the host, was first
  } else if (status->code != 0) {
    return;
  }
  status->peer = peer;
  status->stuck_behind = code == kStatusTimeout ? stuck_behind(a, peer) : peer;
  status->wait_kind = wait_kind;
  __threadfence_system();
  status->code = code;
}

// Spins until *flag >= epoch. False when the wait ran out, was cancelled, or another wait of this
// run already failed (then nothing more is written or awaited). A long wait names its peer in
// this PE's waiting_on word until it ends (a timed-out wait leaves it there).
__device__ bool wait_at_least(const std::uint64_t* flag, std::uint64_t epoch, const KernelArgs& a,
                              int peer, unsigned int wait_kind) {
  const std::uint64_t start = global_timer_ns();
  const std::uint64_t limit = wait_kind == kWaitArrival && a.arrival_timeout_ns > a.timeout_ns
                                  ? a.arrival_timeout_ns
                                  : a.timeout_ns;
  const std::uint64_t stuck_mark = static_cast<std::uint64_t>(peer) + 1;
  bool marked = false;
  for (unsigned int spins = 1; load_acquire(flag) < epoch; ++spins) {
    if (spins % 64 == 0) {
      volatile DeviceStatus* status = a.status;
      if (status->code != 0) return false;
      if (status->cancel != 0) {
        record_failure(a, kStatusCancelled, peer, wait_kind);
        return false;
      }
      const std::uint64_t waited = global_timer_ns() - start;
      if (waited > limit) {
        record_failure(a, kStatusTimeout, peer, wait_kind);
        return false;
      }
      // Other waits of this run may share the word: mark again if one of them cleared it.
      if (waited > kStuckNs && a.waiting_on != nullptr &&
          *reinterpret_cast<volatile std::uint64_t*>(a.waiting_on) != stuck_mark) {
        store_relaxed(a.waiting_on, stuck_mark);
        marked = true;
      }
    }
  }
  if (marked) {
    atomicCAS(reinterpret_cast<unsigned long long*>(a.waiting_on), stuck_mark, 0ull);
  }
  return true;
}

__device__ __forceinline__ bool failed_here(const KernelArgs& a) {
  return a.failure != nullptr && *static_cast<volatile unsigned int*>(a.failure) != 0;
}

}  // namespace
}  // namespace reshard::cuda

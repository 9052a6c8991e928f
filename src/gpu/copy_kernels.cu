#include <cstdint>

#include "gpu/copy_kernels.hpp"
#include "gpu/cuda_check.hpp"

namespace reshard::cuda {
namespace {

// Pieces averaging less than this in a CTA's slice are copied one warp per piece.
constexpr std::uint64_t kWarpPieceBytes = 16 << 10;

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
                               unsigned int phase) {
  volatile DeviceStatus* status = a.status;
  if (a.failure != nullptr) {
    if (atomicCAS(a.failure, 0u, code) != 0u) return;  // another wait, or the host, was first
  } else if (status->code != 0) {
    return;
  }
  status->peer = peer;
  status->stuck_behind = code == kStatusTimeout ? stuck_behind(a, peer) : peer;
  status->phase = phase;
  __threadfence_system();
  status->code = code;
}

// Spins until *flag >= epoch. False when the wait ran out, was cancelled, or another wait of this
// run already failed (then nothing more is written or awaited). A long wait names its peer in
// this PE's waiting_on word until it ends (a timed-out wait leaves it there).
__device__ bool wait_at_least(const std::uint64_t* flag, std::uint64_t epoch, const KernelArgs& a,
                              int peer, unsigned int phase) {
  const std::uint64_t start = global_timer_ns();
  const std::uint64_t limit = phase == kPhaseReady && a.arrival_timeout_ns > a.timeout_ns
                                  ? a.arrival_timeout_ns
                                  : a.timeout_ns;
  const std::uint64_t stuck_mark = static_cast<std::uint64_t>(peer) + 1;
  bool marked = false;
  for (unsigned int spins = 1; load_acquire(flag) < epoch; ++spins) {
    if (spins % 64 == 0) {
      volatile DeviceStatus* status = a.status;
      if (status->code != 0) return false;
      if (status->cancel != 0) {
        record_failure(a, kStatusCancelled, peer, phase);
        return false;
      }
      const std::uint64_t waited = global_timer_ns() - start;
      if (waited > limit) {
        record_failure(a, kStatusTimeout, peer, phase);
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

// Copies n elements of V with kUnroll loads in flight per thread before their stores; `lane` of
// `width` threads (a whole CTA, or one warp).
template <typename V, int kUnroll>
__device__ __forceinline__ void copy_vectors(const V* __restrict__ src, V* __restrict__ dst,
                                             std::uint64_t n, std::uint32_t lane,
                                             std::uint32_t width) {
  const std::uint64_t stride = width;
  std::uint64_t i = lane;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    V values[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) values[k] = __ldg(src + i + k * stride);
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[i + k * stride] = values[k];
  }
  for (; i < n; i += stride) dst[i] = __ldg(src + i);
}

template <typename V, int kUnroll>
__device__ __forceinline__ void copy_aligned(const unsigned char* src, unsigned char* dst,
                                             std::uint64_t bytes, std::uint32_t lane,
                                             std::uint32_t width) {
  constexpr std::uint64_t kSize = sizeof(V);
  // Bytes before src (and so dst) reaches a multiple of the vector size, then the vectors, then
  // the tail: every CTA stays on the vector path whatever the caller's offsets.
  const std::uint64_t misalign = reinterpret_cast<std::uintptr_t>(src) % kSize;
  const std::uint64_t head = misalign == 0 ? 0 : min(kSize - misalign, bytes);
  for (std::uint64_t i = lane; i < head; i += width) dst[i] = src[i];
  const std::uint64_t vectors = (bytes - head) / kSize;
  copy_vectors<V, kUnroll>(reinterpret_cast<const V*>(src + head), reinterpret_cast<V*>(dst + head),
                           vectors, lane, width);
  const std::uint64_t done = head + vectors * kSize;
  for (std::uint64_t i = done + lane; i < bytes; i += width) dst[i] = src[i];
}

__device__ void copy_piece(const unsigned char* src, unsigned char* dst, std::uint64_t bytes,
                           int unroll, std::uint32_t lane, std::uint32_t width) {
  const std::uintptr_t relative =
      reinterpret_cast<std::uintptr_t>(src) ^ reinterpret_cast<std::uintptr_t>(dst);
  if (relative % 16 == 0) {
    if (unroll == 4)
      copy_aligned<uint4, 4>(src, dst, bytes, lane, width);
    else
      copy_aligned<uint4, 8>(src, dst, bytes, lane, width);
  } else if (relative % 8 == 0) {
    copy_aligned<uint2, 8>(src, dst, bytes, lane, width);
  } else if (relative % 4 == 0) {
    copy_aligned<unsigned int, 8>(src, dst, bytes, lane, width);
  } else {
    copy_aligned<unsigned char, 8>(src, dst, bytes, lane, width);
  }
}

// Bytes [from, to) of a descriptor's rows, 16-byte vectors only (every address, length and pitch
// a multiple of 16): each of the team's threads walks its vectors with a running (row, column)
// instead of dividing per vector, kUnroll loads in flight before their stores.
template <int kUnroll>
__device__ __forceinline__ void copy_row_vectors(const CopyDescriptor& d, std::uint64_t from,
                                                 std::uint64_t to, std::uint32_t lane,
                                                 std::uint32_t width) {
  const auto* src = reinterpret_cast<const uint4*>(d.src);
  auto* dst = reinterpret_cast<uint4*>(d.dst);
  const std::uint64_t row = d.row_bytes / 16, src_pitch = d.src_pitch / 16,
                      dst_pitch = d.dst_pitch / 16;
  const std::uint64_t end = to / 16;
  std::uint64_t v = from / 16 + lane;
  if (v >= end) return;
  const std::uint64_t step_rows = width / row, step_cols = width % row;
  std::uint64_t r = v / row, c = v % row;
  auto advance = [&] {
    c += step_cols;
    r += step_rows;
    if (c >= row) {
      c -= row;
      ++r;
    }
  };
  for (; v + (kUnroll - 1) * static_cast<std::uint64_t>(width) < end; v += kUnroll * width) {
    uint4 values[kUnroll];
    std::uint64_t at[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      values[k] = __ldg(src + r * src_pitch + c);
      at[k] = r * dst_pitch + c;
      advance();
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) dst[at[k]] = values[k];
  }
  for (; v < end; v += width) {
    dst[r * dst_pitch + c] = __ldg(src + r * src_pitch + c);
    advance();
  }
}

// Bytes [from, to) of a descriptor's rows (see CopyDescriptor), by a team of `width` threads.
__device__ void copy_rows(const CopyDescriptor& d, std::uint64_t from, std::uint64_t to, int unroll,
                          std::uint32_t lane, std::uint32_t width) {
  const std::uintptr_t any = reinterpret_cast<std::uintptr_t>(d.src) |
                             reinterpret_cast<std::uintptr_t>(d.dst) | d.row_bytes | d.src_pitch |
                             d.dst_pitch | from | to;
  if (any % 16 == 0) {
    if (unroll == 4)
      copy_row_vectors<4>(d, from, to, lane, width);
    else
      copy_row_vectors<8>(d, from, to, lane, width);
    return;
  }
  // Rows not in whole vectors: a warp of the team per row, with copy_piece's alignment handling.
  const std::uint32_t warp = lane / 32, warps = max(1u, width / 32);
  const std::uint64_t first_row = from / d.row_bytes, last_row = (to - 1) / d.row_bytes;
  for (std::uint64_t r = first_row + warp; r <= last_row; r += warps) {
    const std::uint64_t begin = max(from, r * d.row_bytes) - r * d.row_bytes;
    const std::uint64_t end = min(to, (r + 1) * d.row_bytes) - r * d.row_bytes;
    copy_piece(d.src + r * d.src_pitch + begin, d.dst + r * d.dst_pitch + begin, end - begin,
               unroll, lane % 32, min(32u, width));
  }
}

// First descriptor of `first[0..count)` whose range ends after `at` (descriptors are sorted by
// their offset in the group's byte stream and do not overlap).
__device__ std::uint32_t descriptor_at(const CopyDescriptor* first, std::uint32_t count,
                                       std::uint64_t at) {
  std::uint32_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const std::uint32_t mid = (lo + hi) / 2;
    if (first[mid].offset <= at)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

// This CTA's share of a group: a 256-byte aligned slice of the group's byte stream, which may
// cross several descriptors. A slice of few large pieces is copied by the whole CTA piece after
// piece; one of many small pieces (small tensors, the tail of a refit) gives each warp its own
// pieces, since a whole CTA on a 4 KiB piece leaves most of its threads idle.
__device__ __forceinline__ void slice_of(const PeerGroup& group, std::uint32_t cta,
                                         std::uint64_t* begin, std::uint64_t* end) {
  const std::uint64_t per_cta = (group.bytes + group.cta_count - 1) / group.cta_count;
  const std::uint64_t slice = (per_cta + 255) / 256 * 256;
  *begin = cta * slice;
  *end = min(group.bytes, *begin + slice);
}

__device__ void copy_share(const KernelArgs& a, const PeerGroup& group, std::uint32_t cta) {
  std::uint64_t begin, end;
  slice_of(group, cta, &begin, &end);
  if (begin >= end) return;
  const CopyDescriptor* first = a.descriptors + group.first_descriptor;
  const std::uint32_t lo = descriptor_at(first, group.descriptor_count, begin);
  const std::uint32_t hi = descriptor_at(first, group.descriptor_count, end - 1);
  const std::uint32_t pieces = hi - lo + 1;
  const bool by_warp = pieces >= 4 && (end - begin) / pieces < kWarpPieceBytes;
  const std::uint32_t warps = blockDim.x / 32;
  const std::uint32_t step = by_warp ? warps : 1;
  const std::uint32_t lane = by_warp ? threadIdx.x % 32 : threadIdx.x;
  const std::uint32_t width = by_warp ? 32 : blockDim.x;
  for (std::uint32_t d = lo + (by_warp ? threadIdx.x / 32 : 0); d <= hi; d += step) {
    const CopyDescriptor& desc = first[d];
    const std::uint64_t from = max(begin, desc.offset) - desc.offset;
    const std::uint64_t to = min(end, desc.offset + desc.bytes) - desc.offset;
    if (from >= to) continue;
    if (desc.has_rows())
      copy_rows(desc, from, to, a.unroll, lane, width);
    else
      copy_piece(desc.src + from, desc.dst + from, to - from, a.unroll, lane, width);
  }
}

__device__ std::uint32_t find_group(const KernelArgs& a, std::uint32_t cta) {
  std::uint32_t g = 0;
  while (g + 1 < a.group_count && a.groups[g + 1].first_cta <= cta) ++g;
  return g;
}

__device__ __forceinline__ void stamp(const KernelArgs& a, std::uint64_t epoch, TracePhase phase) {
  if (a.trace != nullptr) a.trace[(epoch % kTraceRuns) * kTracePhases + phase] = global_timer_ns();
}

// The epoch of the run this kernel belongs to: one past the last run this PE completed.
__device__ __forceinline__ std::uint64_t this_run_epoch(const KernelArgs& a) {
  return *reinterpret_cast<volatile std::uint64_t*>(SignalLayout::run_count(a.signals, a.n_pes)) +
         1;
}

__device__ __forceinline__ void complete_run(const KernelArgs& a, std::uint64_t epoch) {
  *reinterpret_cast<volatile std::uint64_t*>(SignalLayout::run_count(a.signals, a.n_pes)) = epoch;
  // Followers read them only after this stream's done flag, raised behind a memory barrier.
  for (std::uint32_t f = 0; f < a.follower_count; ++f)
    *reinterpret_cast<volatile std::uint64_t*>(a.follower_runs[f]) = epoch;
}

// Adds this CTA's part of `units` units to `flag` (thread 0, after a barrier, once the CTA's
// stores are done): every CTA its done_share of one unit, CTA 0 also the units beyond the first.
// The releasing reduction publishes the CTA's stores with it; the flag gains all `units` when the
// last CTA's part lands.
__device__ __forceinline__ void add_units(std::uint64_t* flag, std::uint32_t cta,
                                          std::uint32_t ctas, std::uint64_t units) {
  std::uint64_t add = done_share(cta, ctas);
  if (cta == 0) add += done_mark(units - 1);
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(flag), "l"(add) : "memory");
}

// Raises the peer's done flag to this run's mark from each CTA of the group. The group's CTA 0
// also adds the units of runs that left this peer out since it last raised the flag, and records
// this run.
__device__ __forceinline__ void add_done_share(const KernelArgs& a, const PeerGroup& g,
                                               std::uint32_t cta, std::uint64_t epoch) {
  std::uint64_t units = 1;
  if (cta == 0) {
    auto* last = reinterpret_cast<volatile std::uint64_t*>(
        SignalLayout::signalled(a.signals, a.n_pes, g.peer));
    units = epoch - *last;
    *last = epoch;
  }
  add_units(g.remote_done, cta, g.cta_count, units);
}

// A CTA slice that is one piece, 16-byte aligned at both ends, of at most this many vectors per
// thread is loaded into registers before the peer is ready and stored once it is: the loads (and
// the descriptor lookups before them) then overlap the wait instead of following it.
constexpr int kPrefetchVectors = 8;

// This CTA's slice when it qualifies for the register path (see kPrefetchVectors).
struct Prefetch {
  const uint4* src;
  uint4* dst;
  std::uint32_t vectors;
  std::uint32_t tail;  // bytes after the vectors
};

__device__ bool plan_prefetch(const KernelArgs& a, const PeerGroup& g, std::uint32_t cta,
                              Prefetch* plan) {
  std::uint64_t begin, end;
  slice_of(g, cta, &begin, &end);
  if (begin >= end) return false;
  const CopyDescriptor* first = a.descriptors + g.first_descriptor;
  const std::uint32_t d = descriptor_at(first, g.descriptor_count, begin);
  const CopyDescriptor desc = first[d];
  if (desc.offset + desc.bytes < end || desc.has_rows()) return false;  // not one run
  const unsigned char* src = desc.src + (begin - desc.offset);
  unsigned char* dst = desc.dst + (begin - desc.offset);
  const std::uint64_t bytes = end - begin;
  if ((reinterpret_cast<std::uintptr_t>(src) | reinterpret_cast<std::uintptr_t>(dst)) % 16 != 0 ||
      bytes / 16 > static_cast<std::uint64_t>(kCopyThreads) * kPrefetchVectors)
    return false;
  *plan = {reinterpret_cast<const uint4*>(src), reinterpret_cast<uint4*>(dst),
           static_cast<std::uint32_t>(bytes / 16), static_cast<std::uint32_t>(bytes % 16)};
  return true;
}

__global__ void __launch_bounds__(kCopyThreads) fused_copy_kernel(KernelArgs a) {
  __shared__ std::uint64_t epoch;
  __shared__ std::uint32_t group_index;
  __shared__ bool may_write;
  __shared__ bool prefetched;
  __shared__ Prefetch plan;
  std::uint64_t* signals = a.signals;
  if (threadIdx.x == 0) {
    // The schedule's descriptors only: this overlaps the previous kernel's end.
    group_index = a.group_count == 0 ? 0 : find_group(a, blockIdx.x);
    may_write = a.group_count > 0;
    prefetched = may_write && plan_prefetch(a, a.groups[group_index],
                                            blockIdx.x - a.groups[group_index].first_cta, &plan);
  }
  // Sources, destinations and signals belong to the stream's earlier work from here on.
  wait_for_previous_grid();
  let_next_grid_launch();
  if (threadIdx.x == 0) {
    epoch = this_run_epoch(a);
    if (blockIdx.x == 0) stamp(a, epoch, kTraceStart);
    if (blockIdx.x == 0) {
      // No fence before "ready": the stream's earlier work (what read or wrote the destinations
      // before this run) is complete and its writes are in this GPU's L2, where the peers'
      // NVLink stores land after they see the flag. A releasing store here drained the memory
      // system first and cost 3 us of every run's critical path (4 KiB all-to-all 9.8 -> 7.0 us).
      for (std::uint32_t s = 0; s < a.source_count; ++s) store_relaxed(a.source_ready[s], epoch);
    }
  }
  __syncthreads();
  // Sources are this PE's and ready at kernel start (stream order): load them now.
  uint4 values[kPrefetchVectors];
  if (prefetched) {
#pragma unroll
    for (int k = 0; k < kPrefetchVectors; ++k) {
      const std::uint32_t i = threadIdx.x + k * kCopyThreads;
      if (i < plan.vectors) values[k] = __ldg(plan.src + i);
    }
  }
  if (threadIdx.x == 0) {
    if (may_write && a.groups[group_index].local_ready != nullptr) {
      const PeerGroup& g = a.groups[group_index];
      may_write = wait_at_least(g.local_ready, epoch, a, g.peer, kPhaseReady);
    }
    if (blockIdx.x == 0) stamp(a, epoch, kTraceReady);
  }
  __syncthreads();
  if (may_write && prefetched) {
#pragma unroll
    for (int k = 0; k < kPrefetchVectors; ++k) {
      const std::uint32_t i = threadIdx.x + k * kCopyThreads;
      if (i < plan.vectors) plan.dst[i] = values[k];
    }
    const auto* tail_src = reinterpret_cast<const unsigned char*>(plan.src + plan.vectors);
    auto* tail_dst = reinterpret_cast<unsigned char*>(plan.dst + plan.vectors);
    if (threadIdx.x < plan.tail) tail_dst[threadIdx.x] = tail_src[threadIdx.x];
  } else if (may_write) {
    const PeerGroup& g = a.groups[group_index];
    copy_share(a, g, blockIdx.x - g.first_cta);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (blockIdx.x == 0) stamp(a, epoch, kTraceCopied);
  if (may_write) {
    const PeerGroup& g = a.groups[group_index];
    if (g.remote_done != nullptr) add_done_share(a, g, blockIdx.x - g.first_cta, epoch);
  }
  if (blockIdx.x == 0) stamp(a, epoch, kTraceSignalled);
  __threadfence();
  unsigned int* grid = SignalLayout::grid_arrivals(signals, a.n_pes);
  if (atomicAdd(grid, 1u) != a.cta_count - 1) return;
  *grid = 0;
  // The last CTA: the kernel ends only when every source's bytes have landed here.
  for (std::uint32_t s = 0; s < a.source_count; ++s) {
    if (!wait_at_least(SignalLayout::done(signals, a.n_pes, a.sources[s]), done_mark(epoch), a,
                       a.sources[s], kPhaseDone))
      break;
  }
  stamp(a, epoch, kTraceAllDone);
  complete_run(a, epoch);
}

__global__ void __launch_bounds__(kCopyThreads) plain_copy_kernel(KernelArgs a) {
  // Nothing is written after a failed wait of this PE (the begin kernel's for a peer's ready).
  if (failed_here(a)) return;
  const std::uint32_t g = find_group(a, blockIdx.x);
  copy_share(a, a.groups[g], blockIdx.x - a.groups[g].first_cta);
}

__global__ void __launch_bounds__(kCopyThreads)
    flagged_copy_kernel(KernelArgs a, const __grid_constant__ FlaggedLaunch launch) {
  __shared__ bool go;
  __shared__ std::uint32_t entry;
  if (threadIdx.x == 0) {
    std::uint32_t e = 0;
    while (e + 1 < launch.count && launch.groups[e + 1].first_cta <= blockIdx.x) ++e;
    entry = e;
    const FlaggedGroup& mine = launch.groups[e];
    const CopyFlags& f = mine.flags;
    go = !failed_here(a);
    if (go && f.wait != nullptr) {
      if (blockIdx.x == mine.first_cta) {
        go = wait_at_least(f.wait, f.wait_value, a, f.peer, f.phase);
      } else {
        // The other CTAs poll gently while the peer's data streams in; the group's first CTA
        // makes the bounded wait and records a timeout or cancellation, which stops them. Every
        // CTA spinning flat out (system-scope loads, the pinned status every 64 spins) cut a
        // 4-GPU NVSHMEM all-to-all at 16 MiB from 241 to 71-74 GB/s in some runs (4x H200,
        // 2026-11-22).
        while (load_acquire(f.wait) < f.wait_value) {
          if (failed_here(a)) {
            go = false;
            break;
          }
          __nanosleep(256);
        }
      }
    }
  }
  __syncthreads();
  const FlaggedGroup& mine = launch.groups[entry];
  const PeerGroup& group = a.groups[mine.group];
  if (go) copy_share(a, group, blockIdx.x - mine.first_cta);
  if (mine.flags.raise == nullptr) return;
  __syncthreads();
  // Unless a wait of this PE failed: then the CTAs may have copied nothing.
  if (threadIdx.x == 0 && !failed_here(a)) {
    add_units(mine.flags.raise, blockIdx.x - mine.first_cta, group.cta_count,
              mine.flags.raise_units);
  }
}

__global__ void begin_kernel(KernelArgs a) {
  // Launched early (programmatic dependent launch) behind the previous run's end kernel: the run
  // count is that kernel's to write until it is done.
  wait_for_previous_grid();
  const std::uint64_t epoch = this_run_epoch(a);
  if (threadIdx.x == 0) stamp(a, epoch, kTraceStart);
  // A plain store, as in the fused kernel: the stream's earlier work is complete.
  for (std::uint32_t s = threadIdx.x; s < a.source_count; s += blockDim.x)
    store_relaxed(a.source_ready[s], epoch);
  for (std::uint32_t g = threadIdx.x; g < a.group_count; g += blockDim.x) {
    if (a.groups[g].local_ready != nullptr)
      wait_at_least(a.groups[g].local_ready, epoch, a, a.groups[g].peer, kPhaseReady);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamp(a, epoch, kTraceReady);
    // What the copy engine copies into each peer's done flag after that peer's data: this run
    // only if every destination was ready (after a failed wait the peers keep waiting and time
    // out, as they do for an SM-engine run that stopped).
    if (!failed_here(a))
      store_relaxed(SignalLayout::ready_epoch(a.signals, a.n_pes), done_mark(epoch));
  }
  // Every peer's done flag is set whole this run (by the copy engine, or by the end kernel for
  // the SM share of a mixed run): a later SM-engine run adds to it from here.
  if (failed_here(a)) return;
  for (std::uint32_t g = threadIdx.x; g < a.group_count; g += blockDim.x) {
    const int peer = a.groups[g].peer;
    if (a.groups[g].remote_done != nullptr)
      *SignalLayout::signalled(a.signals, a.n_pes, peer) = epoch;
  }
}

__global__ void end_kernel(KernelArgs a) {
  // The next run's begin kernel may take its place on the GPU now; it waits for this one's end.
  let_next_grid_launch();
  const std::uint64_t epoch = this_run_epoch(a);
  // The copies before this kernel are complete (stream order). One thread raises done for the
  // groups the copy engine did not signal (the SM share of a mixed run) behind one system fence,
  // unless a wait of this PE failed (the device failure word: the pinned status, read over PCIe,
  // cost this step microseconds on every run). A releasing store per peer drained the memory
  // system once per peer.
  if (threadIdx.x == 0) {
    stamp(a, epoch, kTraceCopied);
    if (a.group_count > 0 && !failed_here(a)) {
      asm volatile("fence.acq_rel.sys;" ::: "memory");
      for (std::uint32_t g = 0; g < a.group_count; ++g) {
        if (a.groups[g].remote_done != nullptr)
          store_relaxed(a.groups[g].remote_done, done_mark(epoch));
      }
    }
    stamp(a, epoch, kTraceSignalled);
  }
  for (std::uint32_t s = threadIdx.x; s < a.source_count; s += blockDim.x) {
    wait_at_least(SignalLayout::done(a.signals, a.n_pes, a.sources[s]), done_mark(epoch), a,
                  a.sources[s], kPhaseDone);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    stamp(a, epoch, kTraceAllDone);
    complete_run(a, epoch);
  }
}

}  // namespace

namespace {

// With early_launch, the kernel may be put on the GPU while the stream's previous kernel ends
// (programmatic dependent launch); it calls wait_for_previous_grid() before it reads anything
// that kernel writes.
void launch_maybe_early(void (*kernel)(KernelArgs), const KernelArgs& args, unsigned int ctas,
                        unsigned int threads, cudaStream_t stream, bool early_launch) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(threads);
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = early_launch ? 1 : 0;
  RESHARD_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

}  // namespace

void launch_fused_copy(const KernelArgs& args, cudaStream_t stream, bool early_launch) {
  launch_maybe_early(fused_copy_kernel, args, args.cta_count == 0 ? 1 : args.cta_count,
                     kCopyThreads, stream, early_launch);
}

void launch_plain_copy(const KernelArgs& args, cudaStream_t stream) {
  if (args.cta_count == 0) return;
  plain_copy_kernel<<<args.cta_count, kCopyThreads, 0, stream>>>(args);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

void launch_flagged_copies(const KernelArgs& args, const FlaggedLaunch& launch,
                           cudaStream_t stream) {
  if (launch.count == 0) return;
  flagged_copy_kernel<<<launch.cta_count, kCopyThreads, 0, stream>>>(args, launch);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

int fused_copy_ctas_per_sm() {
  int ctas = 0;
  RESHARD_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, fused_copy_kernel, kCopyThreads, 0));
  return ctas;
}

int flagged_copy_ctas_per_sm() {
  int ctas = 0;
  RESHARD_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, flagged_copy_kernel, kCopyThreads, 0));
  return ctas;
}

void launch_begin(const KernelArgs& args, cudaStream_t stream, bool early_launch) {
  launch_maybe_early(begin_kernel, args, 1, 128, stream, early_launch);
}

void launch_end(const KernelArgs& args, cudaStream_t stream) {
  end_kernel<<<1, 128, 0, stream>>>(args);
  RESHARD_CUDA_CHECK(cudaGetLastError());
}

void load_copy_kernels() {
  load_kernel(fused_copy_kernel);
  load_kernel(plain_copy_kernel);
  load_kernel(flagged_copy_kernel);
  load_kernel(begin_kernel);
  load_kernel(end_kernel);
}

}  // namespace reshard::cuda

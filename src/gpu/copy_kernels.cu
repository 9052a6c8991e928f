#include <cstdint>

#include "gpu/copy_kernels.hpp"
#include "gpu/cuda_check.hpp"
#include "gpu/kernel_copies.cuh"
#include "gpu/kernel_waits.cuh"

namespace reshard::cuda {
namespace {

// Pieces averaging less than this in a CTA's slice are copied one warp per piece.
constexpr std::uint64_t kWarpPieceBytes = 16 << 10;

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

__device__ __forceinline__ void stamp(const KernelArgs& a, std::uint64_t epoch, TraceMark mark) {
  if (a.trace != nullptr) a.trace[(epoch % kTraceRuns) * kTraceMarks + mark] = global_timer_ns();
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
  if (a.stream_done_count == 0) return;
  // Every CTA's copies (counted in before the last CTA got here) and the copy engine's (joined
  // before the end kernel) are complete: a system fence publishes them, as the stream memory
  // operation's barrier would, before the peer's stream may go on. Raised after a failed wait
  // too, as the stream's end would: the peers learn of the failure from the device status.
  __threadfence_system();
  for (std::uint32_t f = 0; f < a.stream_done_count; ++f)
    *reinterpret_cast<volatile std::uint64_t*>(a.stream_done[f]) = 1;
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
      may_write = wait_at_least(g.local_ready, epoch, a, g.peer, kWaitArrival);
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
                       a.sources[s], kWaitData))
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
        go = wait_at_least(f.wait, f.wait_value, a, f.peer, f.wait_kind);
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
      wait_at_least(a.groups[g].local_ready, epoch, a, a.groups[g].peer, kWaitArrival);
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
                  a.sources[s], kWaitData);
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

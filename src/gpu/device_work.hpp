// Plain structs shared by the CUDA transport (host code) and its kernels: what one run() copies,
// where, and the flags that order it with the peers. Built once at schedule(), read by every run.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu/host_device.hpp"

namespace reshard::cuda {

// One copy: a contiguous run, or rows of `row_bytes` (a 2-D box: the rows of a strided range,
// `src_pitch` and `dst_pitch` apart). `offset` is where it starts in its group's byte stream.
struct CopyDescriptor {
  const unsigned char* src;
  unsigned char* dst;
  std::uint64_t bytes;  // all rows together
  std::uint64_t offset;
  std::uint64_t row_bytes = 0;  // 0: one contiguous run
  std::uint64_t src_pitch = 0;
  std::uint64_t dst_pitch = 0;

  RESHARD_HD bool has_rows() const { return row_bytes != 0 && row_bytes < bytes; }
};

// Appends a copy of `bytes` to the descriptors of a group (those from `group_first` on), whose
// byte stream is `stream_bytes` long so far. A copy that continues the last descriptor in both
// memories extends it; one as long as the last one's rows, one pitch further on in both, becomes
// its next row: a strided range's thousands of rows then cost one descriptor, and a kernel's
// threads spread over all of its rows instead of fetching a descriptor per row.
inline void append_copy(std::vector<CopyDescriptor>& list, std::size_t group_first,
                        std::uint64_t& stream_bytes, const unsigned char* src, unsigned char* dst,
                        std::uint64_t bytes) {
  if (bytes == 0) return;
  if (list.size() > group_first) {
    CopyDescriptor& last = list.back();
    if (!last.has_rows()) {
      if (last.src + last.bytes == src && last.dst + last.bytes == dst) {
        last.bytes += bytes;
        last.row_bytes = 0;
        stream_bytes += bytes;
        return;
      }
      if (last.bytes == bytes && src > last.src && dst > last.dst) {
        last.row_bytes = bytes;
        last.src_pitch = static_cast<std::uint64_t>(src - last.src);
        last.dst_pitch = static_cast<std::uint64_t>(dst - last.dst);
        last.bytes += bytes;
        stream_bytes += bytes;
        return;
      }
    } else if (bytes == last.row_bytes) {
      const std::uint64_t rows = last.bytes / last.row_bytes;
      if (src == last.src + rows * last.src_pitch && dst == last.dst + rows * last.dst_pitch) {
        last.bytes += bytes;
        stream_bytes += bytes;
        return;
      }
    }
  }
  list.push_back({src, dst, bytes, stream_bytes});
  stream_bytes += bytes;
}

// Everything this PE copies to one destination (a peer, or itself for local copies), and the CTAs
// of the SM engine that copy it.
struct PeerGroup {
  std::uint32_t first_descriptor;
  std::uint32_t descriptor_count;
  std::uint64_t bytes;
  std::uint32_t first_cta;
  std::uint32_t cta_count;
  std::int32_t peer;                 // -1: local copies
  std::uint64_t* remote_done;        // the peer's done[me], mapped here (null: not signalled)
  const std::uint64_t* local_ready;  // my ready[peer], raised by the peer when it may be written
                                     // (null: not waited for: local copies, same-GPU peers)
};

// Per-PE flags in device memory, mapped by every peer. Values only grow.
// ready[p]: PE p has reached run e (the value is e), so this PE may write into p's destinations.
// done[p]:  PE p finished writing this PE's destinations for run e: the value is done_mark(e).
// waiting_on: 1 + the PE a wait of this PE's kernels has been stuck on for a while (0: none), read
// by a peer whose own wait on this PE runs out, to name the PE at the end of the chain.
struct SignalLayout {
  RESHARD_HD static std::uint64_t* ready(std::uint64_t* base, int /*n*/, int pe) {
    return base + pe;
  }
  RESHARD_HD static std::uint64_t* done(std::uint64_t* base, int n, int pe) {
    return base + n + pe;
  }
  RESHARD_HD static std::uint64_t* run_count(std::uint64_t* base, int n) { return base + 2 * n; }
  RESHARD_HD static std::uint64_t* waiting_on(std::uint64_t* base, int n) {
    return base + 2 * n + 1;
  }
  // The run a copy-engine run's begin kernel found every destination ready for, as done_mark():
  // the copy engine copies it into a peer's done[me] right after that peer's data.
  RESHARD_HD static std::uint64_t* ready_epoch(std::uint64_t* base, int n) {
    return base + 2 * n + 2;
  }
  // signalled[p]: the last run in which this PE raised p's done[me] (p's flag holds its
  // done_mark). The SM engine's CTAs add to that flag rather than store it, so a run that follows
  // runs without p adds the runs it missed (see done_share).
  RESHARD_HD static std::uint64_t* signalled(std::uint64_t* base, int n, int pe) {
    return base + 2 * n + 3 + pe;
  }
  RESHARD_HD static unsigned int* grid_arrivals(std::uint64_t* base, int n) {
    return reinterpret_cast<unsigned int*>(base + 3 * n + 3);
  }
  // Set beside the pinned status when a wait of this PE's kernels fails (see KernelArgs).
  RESHARD_HD static unsigned int* failure(std::uint64_t* base, int n) {
    return grid_arrivals(base, n) + 1;
  }
  // Peers on this PE's own GPU are ordered by stream memory operations, not by kernels (see
  // same_device_order.hpp); each word is 1 while raised and reset to 0 by the stream that waited.
  // same_device_ready[p]: PE p's destinations may be written by this PE.
  RESHARD_HD static std::uint64_t* same_device_ready(std::uint64_t* base, int n, int pe) {
    return base + 3 * n + 4 + pe;
  }
  // same_device_done[p]: PE p's data for this PE has landed.
  RESHARD_HD static std::uint64_t* same_device_done(std::uint64_t* base, int n, int pe) {
    return base + 4 * n + 4 + pe;
  }
  static std::uint64_t bytes(int n) { return (5 * n + 4) * 8; }
};

// A done flag grows by one unit per run. The SM engine's CTAs each add their share of it straight
// into the peer's flag with a releasing reduction, so no CTA waits to count the others first (2x
// H200, 4 KiB exchange: signalling 2.8 -> 1.8 us, the run 6.4 -> 5.5 us). The copy engine and the
// end kernel store done_mark(e) whole.
inline constexpr int kDoneShift = 16;
RESHARD_HD std::uint64_t done_mark(std::uint64_t epoch) { return epoch << kDoneShift; }
// CTA `cta` of `ctas` (at most 2^kDoneShift) of a group: the shares of a run add up to one unit.
RESHARD_HD std::uint64_t done_share(std::uint32_t cta, std::uint32_t ctas) {
  constexpr std::uint64_t kUnit = std::uint64_t{1} << kDoneShift;
  const std::uint64_t share = kUnit / ctas;
  return cta == 0 ? kUnit - share * (ctas - 1) : share;
}

// Written by a kernel whose wait ran out (pinned host memory, read by the host after the run),
// and by kernels only: the wait that first claims the device failure word (KernelArgs::failure, a
// compare-and-swap in device memory) writes it, `code` last, after a system-scope fence, so a
// host that loads `code` with acquire ordering (run_failure) reads the rest whole. A failure the
// host finds goes to a record of its own (HostFailure); the host writes only `cancel` here.
struct DeviceStatus {
  unsigned int code;       // 0 ok, kStatus*
  int peer;                // whom it waited for
  int stuck_behind;        // where the chain of stuck waits from `peer` ends (`peer` if it was not)
  unsigned int wait_kind;  // kWait*
  unsigned int cancel;     // set by the host: stop waiting (a peer process died, or abort())
};
constexpr unsigned int kStatusTimeout = 1;
constexpr unsigned int kStatusCancelled = 2;
// What a wait waits for. kWaitArrival is a peer reaching this run: it may not have begun it (its
// trainer still in its step), so the wait has the arrival timeout. The CUDA transport's ready
// flags; on NVSHMEM, which has none, the first wait of a run on each peer (its first data, or its
// first acknowledgement: until then the peer may not have begun).
constexpr unsigned int kWaitArrival = 1;
constexpr unsigned int kWaitData = 2;   // waiting for a peer's data to land
constexpr unsigned int kWaitDrain = 3;  // NVSHMEM: waiting for a peer to drain its inbox slot

struct KernelArgs {
  const CopyDescriptor* descriptors;
  const PeerGroup* groups;
  std::uint32_t group_count;
  std::uint32_t cta_count;
  // Receive side: the PEs that write into this PE, and their ready[me] flags mapped here.
  const int* sources;
  std::uint64_t* const* source_ready;
  std::uint32_t source_count;
  std::uint64_t* signals;  // this PE's SignalLayout
  int n_pes;
  int me;
  // This PE's waiting_on word (SignalLayout), and each PE's as mapped here (null where a PE is
  // not mapped): a wait that runs out follows them from the PE it waited for. Both optional.
  std::uint64_t* waiting_on;
  const std::uint64_t* const* peer_waiting_on;
  DeviceStatus* status;  // device pointer of the pinned status
  // Device memory, nonzero once a wait failed (set with status->code). The copy kernels check
  // this, not the pinned status: a read of host memory from every CTA delayed each CTA's copy
  // by tens of microseconds (4 GPUs, 1 MiB all-to-all: 45 instead of 193 GB/s).
  unsigned int* failure;
  std::uint64_t timeout_ns;
  // A wait for a peer to reach this run (kWaitArrival: the peer has not begun it, its trainer may
  // still be in its step) has this long, where it is longer than timeout_ns.
  std::uint64_t arrival_timeout_ns;
  int unroll;  // 16-byte loads in flight per thread before the stores: 4 or 8
  // RESHARD_CUDA_TRACE: globaltimer stamps of each run (TraceMark), else null.
  std::uint64_t* trace;
  // The run counts (SignalLayout::run_count, mapped here) of the PEs on this GPU whose copies this
  // PE makes and that run no kernel of their own: each run ends by setting them to its epoch, so
  // their next kernel (for a peer on another GPU, in a later schedule) counts runs as every PE
  // does.
  std::uint64_t* const* follower_runs;
  std::uint32_t follower_count;
  // The same-GPU done flags (SameDeviceOrder::end_raises, mapped here) that the kernel completing
  // a run raises to 1 after its copies, where raising them is all its stream's end would do: one
  // stream memory operation fewer a run (without MPS, a CUDA graph of a run launched faster).
  std::uint64_t* const* stream_done;
  std::uint32_t stream_done_count;
};

// Where the fused kernel stamps a run: kTraceRuns records of kTraceMarks stamps, the
// record of run e at (e % kTraceRuns). CTA 0 stamps its start, the moment its peer was ready, the
// end of its copy and its done signal; the last CTA stamps when every source's data had landed.
// A copy-engine or mixed (SM + copy engine) run stamps the begin kernel's start and the moment
// every peer was ready, the end kernel's start (the copies and the copy engine's done flags are
// done), the moment it had raised done for the SM share, and the moment every source's data had
// landed.
inline constexpr int kTraceRuns = 1024;
inline constexpr int kTraceMarks = 5;
enum TraceMark : int { kTraceStart, kTraceReady, kTraceCopied, kTraceSignalled, kTraceAllDone };

}  // namespace reshard::cuda

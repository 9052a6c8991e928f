// Orders a run with the peers that share this PE's GPU (colocated trainer and engine processes),
// and with peers on other GPUs where a GPU of the pair is shared that way (see CudaTransport's
// stream_ordered_: a kernel's wait for another GPU would hold a shared GPU, and chain).
//
// Between GPUs the copy kernels wait for their peers' flags on the GPU. A kernel that spins for a
// kernel of another process on the *same* GPU waits a whole time slice (about 4.5 ms on an H100)
// unless MPS is on: without MPS, kernels of different processes take turns. The stream's own
// front end waits instead (stream memory operations: cuStreamWaitValue64 / cuStreamWriteValue64
// on the peers' IPC-mapped flags), which lets the other process's work run meanwhile.
//
// Each flag (SignalLayout::same_device_ready / same_device_done) is 1 while raised; the stream that
// waited for it resets it to 0 before anything it does next can let the peer raise it again, so a
// run needs no epoch from the host and a captured graph replays correctly.
//
// Even so, two processes that each run a kernel in every run hand the GPU to each other twice per
// run, and without MPS each hand-over costs about 125 us (tools/probes/same_gpu_handoff.cu, one
// H100, 2026-11-24: 4 KiB all-to-all of 2 processes 297 us with these flags, 257 us with the hosts
// synchronizing instead, 290 us with IPC events). When one process makes every copy among the
// PEs on its GPU and the others' streams only raise and wait for flags, no hand-over happens:
// 16 us (2 processes), 41 us (4). The transport delegates that way (follow / lead) unless told
// to order pairs.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "gpu/stream_memory_ops.hpp"

namespace reshard::cuda {

// Which of `me`'s peers its stream orders runs with (true), the others being ordered by the
// kernels' flags: given each PE's GPU (`gpus`, as physical_gpu names it) and whether it would
// order by its stream (`streams`: no MPS server, the driver's stream memory operations, the
// same-device mode), a pair is ordered by the streams where both PEs would and a GPU of the pair
// holds another PE that would too (a GPU shared without MPS). Every PE computes the same relation
// from the same inputs, so both ends of a pair agree.
std::vector<bool> stream_ordered_peers(const std::vector<std::string>& gpus,
                                       const std::vector<bool>& streams, int me);
// The same relation for one pair, given which PEs are on a GPU shared through the streams
// (`shared`, from stream_shared).
std::vector<bool> stream_shared(const std::vector<std::string>& gpus,
                                const std::vector<bool>& streams);
inline bool ordered_by_streams(const std::vector<bool>& streams, const std::vector<bool>& shared,
                               int p, int q) {
  return p != q && streams[p] && streams[q] && (shared[p] || shared[q]);
}

// Under MPS with the `auto` order (`per_schedule[p]`), which PEs delegate in a schedule whose
// sends are `sends[p][q]` (PE p sends to PE q): those of a GPU holding two or more such PEs of
// which no pair sends both ways. Their GPU's lowest such PE makes every copy among them, as a GPU
// without MPS does (SameDeviceOrder::lead); a GPU with a pair exchanging both ways keeps each
// pair's own order (the kernels' flags are faster there). Every PE computes the same from the
// same inputs.
std::vector<bool> delegating_per_schedule(const std::vector<std::string>& gpus,
                                          const std::vector<bool>& per_schedule,
                                          const std::vector<std::vector<std::uint8_t>>& sends);

// Which PEs' kernels wait for a peer's flags (`in_kernels(p, q)`: the kernels order the pair, on
// one GPU or across GPUs) for at least one peer: n * (n - 1) questions, asked once per ordering.
std::vector<bool> kernel_waiters(int n, const std::function<bool(int, int)>& in_kernels);
// The PEs on `me`'s GPU whose kernels wait (`waiters`, from kernel_waiters), where `me` is one of
// them and not alone on its GPU: `me` first, then the others; else empty. Every PE of the set
// computes the same set (in another order), so they can share the GPU among them: a kernel that
// waits must not be kept off the GPU by another that waits (a PE whose kernels never wait ends
// its kernel by itself).
std::vector<int> kernel_ordered_sharers(const std::vector<std::string>& gpus,
                                        const std::vector<bool>& waiters, int me);
// The same, asking `in_kernels` directly (for one PE; kernel_waiters once serves every PE).
std::vector<int> kernel_ordered_sharers(const std::vector<std::string>& gpus,
                                        const std::function<bool(int, int)>& in_kernels, int me);
// Whether some GPU holds two PEs whose kernels wait: whether kernel_ordered_sharers is non-empty
// for any PE, in one pass.
bool kernel_ordered_sharing_anywhere(const std::vector<std::string>& gpus,
                                     const std::vector<bool>& waiters);

// The CTAs of each of a launch's groups (its peers' copies): `want[g]` is what group g would take
// alone (at least 1), `bytes[g]` what it copies, `cap` the most the launch may have. Where the
// wants fit each gets its want; where they do not, the cap is shared in proportion to the bytes,
// none above its want nor below 1, so that every CTA has about as many bytes to copy (never more
// than `cap` in all, given one CTA for each group at least). Shared in proportion to the wants
// instead (each clamped to the per-peer most), a refit whose peers' bytes differ 2-3x ended on
// its largest peer's CTAs 0.5 ms after the others (FSDP2 -> TP 2, one H200).
std::vector<std::uint64_t> group_cta_counts(const std::vector<std::uint64_t>& bytes,
                                            const std::vector<std::uint64_t>& want,
                                            std::uint64_t cap);

// The CTAs one of the kernel-ordered PEs on a GPU may keep resident in a phase, so that all of
// their kernels are resident together: `wants[i]` is what sharer i's launches would take (at
// least 1), `wave` what the GPU holds at once. Where the wants fit, each gets its want and a
// part of what is left over in proportion to it; where they do not, each gets 1 and the rest in
// proportion to its want beyond 1. The shares never add up to more than `wave` (given at least
// one CTA of the wave for each sharer).
std::uint64_t resident_share(const std::vector<std::uint64_t>& wants, std::size_t mine,
                             std::uint64_t wave);

class SameDeviceOrder {
 public:
  // One stream memory operation of a run (no flush: the flags and data are on this machine).
  using MemoryOp = StreamMemoryOp;

  SameDeviceOrder() = default;
  // `signals`: this PE's SignalLayout; `peer_signals[p]`: PE p's, mapped here. `batch`: a run's
  // operations go to the stream in one cuStreamBatchMemOp call per begin() and end() (where the
  // driver has it) instead of one call each (CopyServiceOptions::debug.cuda_batch_memops).
  SameDeviceOrder(std::uint64_t* signals, std::vector<std::uint64_t*> peer_signals, int me,
                  bool batch = false);

  // Adds pairwise order: this PE's own kernels write into `destinations`, and `sources` write
  // into this PE (peers on this GPU or another). Adds to follow() or lead().
  void order_pairs(const std::vector<int>& destinations, const std::vector<int>& sources);
  // Delegated order (see CudaTransport): `leader`, a process on this GPU, moves every byte this PE
  // sends to the PEs its stream orders and receives from the PEs on its GPU, and its local copies;
  // this PE's stream tells the leader that its memory may be used (once its own destinations are
  // ready: begin) and waits until the leader is done with it (before its own done flags: end).
  void follow(int leader);
  // The leader's side: waits until every follower's memory may be used, and after the copies
  // tells each that its bytes have landed and its sources were read.
  void lead(const std::vector<int>& followers);
  // Adds `other`'s waits and signals (the union over a schedule's phases, for the watchdog).
  void merge(const SameDeviceOrder& other);
  bool empty() const { return peers_.empty(); }
  // Every PE this order raises a flag for or waits for, ascending.
  const std::vector<int>& peers() const { return peers_; }

  // Before this run's copies: raises the ready flags, then holds the stream until the peers' have
  // been raised.
  void begin(cudaStream_t stream) const;
  // After the copies: raises the done flags (after a memory barrier), then holds the stream until
  // the peers' have been raised.
  void end(cudaStream_t stream) const;
  // begin() and end() as one queue (one batch where batched), for a run that queues nothing
  // between them (a follower whose leader makes all its copies).
  void begin_and_end(cudaStream_t stream) const;
  // The flags end() raises where raising them is all it does (no wait), else none: the kernel
  // that completes a run may raise them itself (KernelArgs::stream_done) and the run skip end(),
  // one stream memory operation fewer (a graph node fewer in a captured run).
  std::vector<std::uint64_t*> end_raises() const;
  // Raises every flag this PE's stream could be waiting on (a peer died or did not answer in
  // time): queued on `side`, a stream of its own, and waited for.
  void release(cudaStream_t side) const noexcept;
  // What begin() and end() queue, in order.
  const std::vector<MemoryOp>& begin_ops() const { return begin_ops_; }
  const std::vector<MemoryOp>& end_ops() const { return end_ops_; }
  const std::vector<MemoryOp>& begin_and_end_ops() const { return begin_and_end_ops_; }

 private:
  std::uint64_t* signals_ = nullptr;
  std::vector<std::uint64_t*> peer_signals_;
  int me_ = 0;
  // PEs whose same_device_ready flag for this PE it raises before the copies, whose flags it
  // waits for before the copies, and the same for same_device_done after them.
  std::vector<int> raise_ready_, wait_ready_, raise_done_, wait_done_;
  int leader_ = -1;  // follow()
  bool batch_ = false;
  std::vector<int> peers_;
  std::vector<MemoryOp> begin_ops_, end_ops_, begin_and_end_ops_;
  // Collects peers_ and the operations of begin() and end().
  void build();
  void queue(cudaStream_t stream, const std::vector<MemoryOp>& ops) const;
};

}  // namespace reshard::cuda

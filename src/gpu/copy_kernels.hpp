// Launchers for the CUDA transport's kernels. Every wait on a peer inside them is bounded by
// KernelArgs::timeout_ns and reported through KernelArgs::status.
#pragma once

#include <cuda_runtime_api.h>

#include "gpu/device_work.hpp"

namespace reshard::cuda {

constexpr int kCopyThreads = 512;

// SM engine, one launch per run: raises ready for the sources, waits until each destination is
// ready, copies, each CTA adds its share to its destination's done flag, and the grid's last CTA
// waits until every source's data has landed. With early_launch (programmatic dependent launch) the
// kernel may be put on the GPU before the stream's previous kernel ends; it reads nothing but its
// own arguments until that kernel is done.
void launch_fused_copy(const KernelArgs& args, cudaStream_t stream, bool early_launch);
// Copies the groups' descriptors and nothing else (no flags): the SM share of a mixed run, and
// the copy out of a bounce buffer.
void launch_plain_copy(const KernelArgs& args, cudaStream_t stream);
// What one group of a flagged copy waits for before it copies, and raises once its CTAs have.
struct CopyFlags {
  const std::uint64_t* wait = nullptr;  // null: copy at once
  std::uint64_t wait_value = 0;         // copy once *wait >= wait_value
  int peer = -1;                        // whom the wait is for (named if it runs out)
  unsigned int wait_kind = 0;           // kWaitArrival, kWaitData or kWaitDrain
  std::uint64_t* raise = nullptr;       // null: nothing to raise
  std::uint64_t raise_units = 1;        // *raise grows by done_mark(raise_units) (done_share)
};
// Groups one flagged launch copies: each its own flags and CTAs.
constexpr int kMaxFlaggedGroups = 16;
struct FlaggedGroup {
  std::uint32_t group = 0;      // index into KernelArgs::groups; its cta_count CTAs copy it
  std::uint32_t first_cta = 0;  // where its CTAs start in the launch
  CopyFlags flags;
};
struct FlaggedLaunch {
  std::uint32_t count = 0;
  std::uint32_t cta_count = 0;
  FlaggedGroup groups[kMaxFlaggedGroups];

  // Appends args.groups[group]; `ctas` is that group's cta_count. False (nothing added) once the
  // launch holds kMaxFlaggedGroups groups.
  [[nodiscard]] bool add(std::uint32_t group, std::uint32_t ctas, const CopyFlags& flags) {
    if (count == kMaxFlaggedGroups) return false;
    groups[count++] = {group, cta_count, flags};
    cta_count += ctas;
    return true;
  }
};
// Every group of `launch` in one kernel: a group's CTAs wait for its flags.wait, copy their
// slices, and each adds its share of flags.raise_units to flags.raise (a releasing system-scope
// reduction after the CTA's stores; the flag reaches its mark when every CTA's share has landed).
// A group never waits on another group of the same launch, so they need not be resident
// together. Nothing is written once a wait of this PE failed.
void launch_flagged_copies(const KernelArgs& args, const FlaggedLaunch& launch,
                           cudaStream_t stream);
// How many CTAs of the flagged copy one SM of the current device holds at once.
int flagged_copy_ctas_per_sm();
// How many CTAs of launch_fused_copy's kernel one SM of the current device holds at once.
int fused_copy_ctas_per_sm();
// Copy-engine runs are framed by these single-CTA kernels: begin raises ready, waits until every
// destination group's peer is ready and then sets SignalLayout::ready_epoch, which the copy engine
// copies into each peer's done flag after its data; end raises done for the groups it is given
// (the SM share of a mixed run) and waits for every source. early_launch as for the fused kernel.
void launch_begin(const KernelArgs& args, cudaStream_t stream, bool early_launch);
void launch_end(const KernelArgs& args, cudaStream_t stream);

// Loads these kernels on the current device now. CUDA loads a kernel at its first launch (lazy
// loading, its default), and loading waits for the device's work: a first launch queued behind a
// stream wait on a peer that died does not return, and holds the driver's lock the watchdog needs
// to release that wait (2 PEs on one H200, 2026-11-29). Transports load them at init, before any
// run queues a wait.
void load_copy_kernels();

}  // namespace reshard::cuda

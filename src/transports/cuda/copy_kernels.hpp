// Launchers for the CUDA transport's kernels. Every wait on a peer inside them is bounded by
// KernelArgs::timeout_ns and reported through KernelArgs::status.
#pragma once

#include <cuda_runtime_api.h>

#include "transports/cuda/device_work.hpp"

namespace reshard::cuda {

constexpr int kCopyThreads = 512;

// SM engine, one launch per run: raises ready for the sources, waits until each destination is
// ready, copies, raises done per destination from its last CTA, and the grid's last CTA waits
// until every source's data has landed. With early_launch (programmatic dependent launch) the
// kernel may be put on the GPU before the stream's previous kernel ends; it reads nothing but its
// own arguments until that kernel is done.
void launch_fused_copy(const KernelArgs& args, cudaStream_t stream, bool early_launch);
// Copies the groups' descriptors and nothing else (no flags): the SM share of a mixed run, and
// the copy out of a bounce buffer.
void launch_plain_copy(const KernelArgs& args, cudaStream_t stream);
// What a flagged copy waits for before it copies and raises once every CTA has copied.
struct CopyFlags {
  const std::uint64_t* wait = nullptr;  // null: copy at once
  std::uint64_t wait_value = 0;         // copy once *wait >= wait_value
  int peer = -1;                        // whom the wait is for (named if it runs out)
  unsigned int phase = 0;               // kPhaseReady or kPhaseDone
  std::uint64_t* raise = nullptr;       // null: nothing to raise
  std::uint64_t raise_value = 0;
  unsigned int* arrivals = nullptr;  // device counter, zero between launches (needed with raise)
};
// One group (args.groups[0]) in one launch: every CTA waits for flags.wait, copies its slice, and
// the last CTA to finish raises flags.raise (system scope, after the CTAs' stores). It replaces a
// wait kernel, a copy kernel and a raise kernel in a row; nothing is written once a wait failed.
void launch_flagged_copy(const KernelArgs& args, const CopyFlags& flags, cudaStream_t stream);
// How many CTAs of the flagged copy one SM of the current device holds at once.
int flagged_copy_ctas_per_sm();
// Copy-engine runs are framed by these single-CTA kernels: begin raises ready and waits until every
// destination group's peer is ready; end raises done for every group and waits for every source.
void launch_begin(const KernelArgs& args, cudaStream_t stream);
void launch_end(const KernelArgs& args, cudaStream_t stream);

}  // namespace reshard::cuda

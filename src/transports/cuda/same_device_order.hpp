// Orders a run with the peers that share this PE's GPU (colocated trainer and engine processes).
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
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace reshard::cuda {

class SameDeviceOrder {
 public:
  // False where the driver lacks 64-bit stream memory operations: the kernels' flags order
  // same-GPU peers then, as they order every other peer.
  static bool supported(int device);
  // Whether an MPS server runs for this process (its control socket exists where the CUDA
  // driver looks for it): then kernels of different processes run side by side, and the kernels'
  // own flags order same-GPU peers faster than the streams (4 KiB all-to-all of 2 PEs on one
  // H100: 5.4 us against 19.2; without MPS 4,498 us against 302).
  static bool mps_server_found();

  SameDeviceOrder() = default;
  // `signals`: this PE's SignalLayout; `peer_signals[p]`: PE p's, mapped here.
  SameDeviceOrder(std::uint64_t* signals, std::vector<std::uint64_t*> peer_signals, int me);

  // This schedule's same-GPU peers: those this PE writes into, those that write into it.
  void set_peers(std::vector<int> destinations, std::vector<int> sources);
  bool empty() const { return destinations_.empty() && sources_.empty(); }
  const std::vector<int>& destinations() const { return destinations_; }
  const std::vector<int>& sources() const { return sources_; }

  // Before this run's copies: tells each source that this PE's destinations may be written, then
  // holds the stream until each destination peer has said the same.
  void begin(cudaStream_t stream) const;
  // After the copies: tells each destination peer that its data has landed (after a memory
  // barrier), then holds the stream until each source has said the same.
  void end(cudaStream_t stream) const;
  // Raises every flag this PE's stream could be waiting on (a peer died or did not answer in
  // time): queued on `side`, a stream of its own, and waited for.
  void release(cudaStream_t side) const noexcept;

 private:
  std::uint64_t* signals_ = nullptr;
  std::vector<std::uint64_t*> peer_signals_;
  int me_ = 0;
  std::vector<int> destinations_, sources_;
};

}  // namespace reshard::cuda

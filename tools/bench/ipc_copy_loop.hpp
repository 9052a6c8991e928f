// The refit loop frameworks write by hand for processes on one machine (colocated trainer and
// engine share each GPU; disaggregated ones reach each other over NVLink): every destination
// tensor is shared through CUDA IPC, each process copies its blocks of the plan into the
// receivers' tensors with one cudaMemcpy2DAsync per 2-D block (N-D blocks: one per outer index),
// synchronizes its stream, and a host barrier tells the receivers their data is there.
// reshard's benchmarks time it beside the transport, on the same tensors.
#pragma once

#include <cuda_runtime.h>

#include <map>
#include <vector>

#include "reshard/bootstrap.hpp"
#include "reshard/plan.hpp"
#include "reshard/resharder.hpp"

namespace reshard::bench {

class IpcCopyLoop {
 public:
  // Collective: exchanges and maps the destination tensors of `dst` (bf16 or any dtype of the
  // plan; a transform's FP8 destinations are not supported) and lists this PE's copies.
  IpcCopyLoop(Bootstrap& bootstrap, const ReshardPlan& plan, const TensorMap& src,
              const TensorMap& dst);
  ~IpcCopyLoop();
  IpcCopyLoop(const IpcCopyLoop&) = delete;
  IpcCopyLoop& operator=(const IpcCopyLoop&) = delete;

  // Collective: one refit, from a host barrier to the barrier after every stream is done.
  void run();
  std::size_t copies() const { return copies_.size(); }

 private:
  struct Copy2D {
    void* dst;
    std::size_t dst_pitch;
    const void* src;
    std::size_t src_pitch;
    std::size_t width;
    std::size_t height;
  };
  Bootstrap& bootstrap_;
  std::vector<Copy2D> copies_;
  std::vector<void*> mapped_;  // peers' allocations opened here, closed on destruction
  cudaStream_t stream_ = nullptr;
};

}  // namespace reshard::bench

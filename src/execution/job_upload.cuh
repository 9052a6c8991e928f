// Stream-ordered upload of job lists for the batched kernels (block copies, conversions): CUDA
// sources only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "transports/cuda/cuda_check.hpp"

namespace reshard::exec::cuda {

// Jobs of one kind in device memory: the jobs, then each job's first work item (ascending), so a
// warp or CTA finds its job by binary search.
template <typename Job>
struct JobList {
  const Job* jobs;
  const std::uint64_t* first;
  std::uint32_t count;
  std::uint64_t items;

  __device__ std::uint32_t find(std::uint64_t item) const {
    std::uint32_t low = 0, high = count - 1;
    while (low < high) {
      const std::uint32_t middle = (low + high + 1) / 2;
      if (first[middle] <= item) {
        low = middle;
      } else {
        high = middle - 1;
      }
    }
    return low;
  }
};

// Host-side job lists reach the device through pinned memory and a copy queued on the stream, so
// a flush never waits for the GPU; the previous copy must have left the pinned buffer first. A
// list equal to the one in device memory is not sent again: refits that queue the same jobs
// (the same tensors) upload nothing.
class JobUpload {
 public:
  ~JobUpload() {
    if (done_ != nullptr) cudaEventDestroy(done_);
    if (used_ != nullptr) cudaEventDestroy(used_);
    if (pinned_ != nullptr) cudaFreeHost(pinned_);
    if (device_memory_ != nullptr) cudaFree(device_memory_);
  }
  const std::byte* upload(const std::vector<std::byte>& bytes, cudaStream_t stream) {
    if (device_memory_ != nullptr && bytes == sent_) return current();
    if (done_ == nullptr)
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    RESHARD_CUDA_CHECK(cudaEventSynchronize(done_));  // the last upload has left pinned_
    if (bytes.size() > capacity_) {
      // cudaFree waits for the device, so no queued kernel still reads the old list.
      if (device_memory_ != nullptr) RESHARD_CUDA_CHECK(cudaFree(device_memory_));
      if (pinned_ != nullptr) RESHARD_CUDA_CHECK(cudaFreeHost(pinned_));
      capacity_ = std::max<std::size_t>(bytes.size(), 2 * capacity_);
      RESHARD_CUDA_CHECK(cudaMalloc(&device_memory_, capacity_));
      RESHARD_CUDA_CHECK(cudaMallocHost(&pinned_, capacity_));
    }
    std::memcpy(pinned_, bytes.data(), bytes.size());
    // A kernel queued on another stream may still read the list being replaced.
    if (used_ != nullptr) RESHARD_CUDA_CHECK(cudaStreamWaitEvent(stream, used_, 0));
    RESHARD_CUDA_CHECK(
        cudaMemcpyAsync(device_memory_, pinned_, bytes.size(), cudaMemcpyHostToDevice, stream));
    RESHARD_CUDA_CHECK(cudaEventRecord(done_, stream));
    sent_ = bytes;
    return static_cast<const std::byte*>(device_memory_);
  }
  // Call after queuing a kernel that reads the list on `stream`.
  void mark_used(cudaStream_t stream) {
    if (used_ == nullptr)
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&used_, cudaEventDisableTiming));
    RESHARD_CUDA_CHECK(cudaEventRecord(used_, stream));
  }
  // The list uploaded last (still in device memory).
  const std::byte* current() const { return static_cast<const std::byte*>(device_memory_); }

  // What the caller needs to launch on the list again without rebuilding it.
  std::uint64_t items = 0;
  std::size_t prefix_offset = 0;
  // The caller's scratch for building the next list (kept, so its pages are not faulted in anew
  // at every refit).
  std::vector<std::byte> scratch;

 private:
  void* pinned_ = nullptr;
  void* device_memory_ = nullptr;
  std::size_t capacity_ = 0;
  cudaEvent_t done_ = nullptr;
  cudaEvent_t used_ = nullptr;
  std::vector<std::byte> sent_;  // what device_memory_ holds
};

// The jobs followed by their first items (the prefix of `items_of`), as one byte array in `bytes`.
template <typename Job, typename ItemsOf>
inline void job_bytes(const std::vector<Job>& jobs, ItemsOf items_of, std::uint64_t& total,
                      std::size_t& prefix_offset, std::vector<std::byte>& bytes) {
  prefix_offset = (jobs.size() * sizeof(Job) + 7) / 8 * 8;
  bytes.assign(prefix_offset + (jobs.size() + 1) * sizeof(std::uint64_t), std::byte{0});
  std::memcpy(bytes.data(), jobs.data(), jobs.size() * sizeof(Job));
  auto* first = reinterpret_cast<std::uint64_t*>(bytes.data() + prefix_offset);
  first[0] = 0;
  for (std::size_t i = 0; i < jobs.size(); ++i) first[i + 1] = first[i] + items_of(jobs[i]);
  total = first[jobs.size()];
}

}  // namespace reshard::exec::cuda

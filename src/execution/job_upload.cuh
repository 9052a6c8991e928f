// Stream-ordered upload of job lists for the batched kernels (block copies, conversions): CUDA
// sources only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "execution/box_view.hpp"
#include "gpu/cuda_check.hpp"

namespace reshard::execution::cuda {

// Jobs of one kind in device memory: the jobs, then each job's first work item (ascending), so a
// warp or CTA finds its job by binary search.
template <typename Job>
struct JobList {
  const Job* jobs;
  const std::uint64_t* first;
  std::uint32_t count;
  std::uint64_t items;
  const BoxView* uneven = nullptr;  // views the jobs' RowWalks refer to
  std::uint64_t per_warp = 0;       // work items per warp, for kernels that give warps runs

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
// a flush never waits for the GPU: each kept list has a pinned buffer of its own, which its own
// previous copy (that of the list used longest ago) must have left first; a copy queued on a
// stream that waits for other work (a pipelined refit's conversions on arrival wait for the
// bytes) then holds up no upload for other work. The
// last few lists stay in device memory, each under its own, and a list equal to one of them is
// not sent again: refits that queue the same jobs (the same tensors) upload nothing, also when a
// refit runs in phases that each queue lists of their own.
class JobUpload {
 public:
  ~JobUpload() {
    for (Entry& entry : entries_) {
      if (entry.used != nullptr) cudaEventDestroy(entry.used);
      if (entry.device != nullptr) cudaFree(entry.device);
      if (entry.uploaded != nullptr) cudaEventDestroy(entry.uploaded);
      if (entry.pinned != nullptr) cudaFreeHost(entry.pinned);
    }
  }
  const std::byte* upload(const std::vector<std::byte>& bytes, cudaStream_t stream) {
    ++clock_;
    for (Entry& entry : entries_) {
      // memcmp, not vector<std::byte>'s ==: that compares byte by byte, and a refit's flushes
      // compare lists of 100+ KiB against every kept one (89 us a flush for 512 block copies
      // against two lists of 152 KiB on the development machine; 8 us with memcmp).
      if (entry.bytes.size() == bytes.size() &&
          std::memcmp(entry.bytes.data(), bytes.data(), bytes.size()) == 0) {
        entry.last_use = clock_;
        current_ = &entry;
        return current();
      }
    }
    Entry& entry = replaceable();
    if (entry.uploaded == nullptr)
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&entry.uploaded, cudaEventDisableTiming));
    RESHARD_CUDA_CHECK(cudaEventSynchronize(entry.uploaded));  // its last copy left `pinned`
    if (bytes.size() > entry.pinned_capacity) {
      if (entry.pinned != nullptr) RESHARD_CUDA_CHECK(cudaFreeHost(entry.pinned));
      entry.pinned_capacity = std::max<std::size_t>(bytes.size(), 2 * entry.pinned_capacity);
      RESHARD_CUDA_CHECK(cudaMallocHost(&entry.pinned, entry.pinned_capacity));
    }
    if (bytes.size() > entry.capacity) {
      // cudaFree waits for the device, so no queued kernel still reads the old list.
      if (entry.device != nullptr) RESHARD_CUDA_CHECK(cudaFree(entry.device));
      entry.capacity = std::max<std::size_t>(bytes.size(), 2 * entry.capacity);
      RESHARD_CUDA_CHECK(cudaMalloc(&entry.device, entry.capacity));
    } else if (entry.used != nullptr) {
      // A kernel queued on another stream may still read the list being replaced.
      RESHARD_CUDA_CHECK(cudaStreamWaitEvent(stream, entry.used, 0));
    }
    std::memcpy(entry.pinned, bytes.data(), bytes.size());
    RESHARD_CUDA_CHECK(
        cudaMemcpyAsync(entry.device, entry.pinned, bytes.size(), cudaMemcpyHostToDevice, stream));
    RESHARD_CUDA_CHECK(cudaEventRecord(entry.uploaded, stream));
    entry.bytes = bytes;
    entry.last_use = clock_;
    current_ = &entry;
    return current();
  }
  // Call after queuing a kernel that reads the list returned last on `stream`.
  void mark_used(cudaStream_t stream) {
    if (current_->used == nullptr)
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&current_->used, cudaEventDisableTiming));
    RESHARD_CUDA_CHECK(cudaEventRecord(current_->used, stream));
  }
  // The list returned last (still in device memory).
  const std::byte* current() const { return static_cast<const std::byte*>(current_->device); }

  // What the caller needs to launch on the list again without rebuilding it.
  std::uint64_t items = 0;
  std::size_t prefix_offset = 0;
  // The caller's scratch for building the next list (kept, so its pages are not faulted in anew
  // at every refit).
  std::vector<std::byte> scratch;

 private:
  // Lists kept: a refit in phases queues a few per phase.
  static constexpr std::size_t kKept = 64;
  struct Entry {
    void* device = nullptr;
    std::size_t capacity = 0;
    std::vector<std::byte> bytes;  // what `device` holds
    cudaEvent_t used = nullptr;    // after the last kernel queued on it
    std::uint64_t last_use = 0;
    void* pinned = nullptr;  // where `bytes` are copied from
    std::size_t pinned_capacity = 0;
    cudaEvent_t uploaded = nullptr;  // after the last copy from `pinned`
  };
  // A new entry while there are fewer than kKept, else the one used longest ago.
  Entry& replaceable() {
    if (entries_.size() < kKept) {
      entries_.reserve(kKept);  // entries never move: current_ points into them
      return entries_.emplace_back();
    }
    return *std::min_element(entries_.begin(), entries_.end(), [](const Entry& a, const Entry& b) {
      return a.last_use < b.last_use;
    });
  }

  std::vector<Entry> entries_;
  Entry* current_ = nullptr;
  std::uint64_t clock_ = 0;
};

// The jobs followed by their first items (the prefix of `items_of`) and then the `uneven` views,
// as one byte array in `bytes`.
template <typename Job, typename ItemsOf>
inline void job_bytes(const std::vector<Job>& jobs, ItemsOf items_of, std::uint64_t& total,
                      std::size_t& prefix_offset, std::vector<std::byte>& bytes,
                      const std::vector<BoxView>& uneven = {}) {
  // Lists are compared byte for byte with those kept in device memory (JobUpload): a job's bytes
  // must all be its fields' (padding holds whatever the stack held, so a list with padding never
  // equals the kept one, and every flush uploads it again and waits for the GPU).
  static_assert(std::has_unique_object_representations_v<Job>,
                "a job type with padding: name it as a field set to zero");
  static_assert(std::has_unique_object_representations_v<BoxView>,
                "BoxView with padding: name it as a field set to zero");
  prefix_offset = (jobs.size() * sizeof(Job) + 7) / 8 * 8;
  const std::size_t views_offset = prefix_offset + (jobs.size() + 1) * sizeof(std::uint64_t);
  bytes.resize(views_offset + uneven.size() * sizeof(BoxView));
  std::memcpy(bytes.data(), jobs.data(), jobs.size() * sizeof(Job));
  std::memset(bytes.data() + jobs.size() * sizeof(Job), 0,
              prefix_offset - jobs.size() * sizeof(Job));
  auto* first = reinterpret_cast<std::uint64_t*>(bytes.data() + prefix_offset);
  first[0] = 0;
  for (std::size_t i = 0; i < jobs.size(); ++i) first[i + 1] = first[i] + items_of(jobs[i]);
  total = first[jobs.size()];
  if (!uneven.empty()) {
    std::memcpy(bytes.data() + views_offset, uneven.data(), uneven.size() * sizeof(BoxView));
  }
}

}  // namespace reshard::execution::cuda

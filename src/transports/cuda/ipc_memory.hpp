// CUDA IPC for the CUDA transport: exporting the allocations that hold this PE's destination ranges
// and mapping the ones peers export. Sub-allocations (a caching allocator's blocks) are exported
// as (allocation handle, offset), so one handle serves every tensor in a block.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace reshard::cuda {

using HandleBytes = std::array<char, sizeof(cudaIpcMemHandle_t)>;

struct ExportedAddress {
  std::uint32_t handle = 0;  // index into IpcExporter::handles()
  std::uint64_t offset = 0;  // from the allocation's base
};

class IpcExporter {
 public:
  // The allocation holding `pointer` as a handle and offset, or nothing when the allocation
  // cannot be exported with cudaIpcGetMemHandle (stream-ordered pools, virtual-memory API).
  std::optional<ExportedAddress> export_pointer(const void* pointer);
  // Allocations to stage instead of exporting (by base address).
  void refuse(std::uintptr_t base) { by_base_.emplace(base, std::nullopt); }
  const std::vector<HandleBytes>& handles() const { return handles_; }
  std::uintptr_t base_of(std::uint32_t handle) const { return bases_.at(handle); }

 private:
  std::vector<HandleBytes> handles_;
  std::vector<std::uintptr_t> bases_;
  std::map<std::uintptr_t, std::optional<std::uint32_t>> by_base_;
  // The allocation the last pointer fell in: the rows of a strided range (thousands per tensor)
  // then cost one driver query per allocation, not one each.
  std::uintptr_t last_base_ = 0, last_end_ = 0;
};

// Peers' allocations mapped into this process now, over every IpcImports (a survivor's teardown
// after a failed run must bring this back to zero).
int open_ipc_mappings() noexcept;

// Mappings of peers' allocations, kept while a schedule uses them.
class IpcImports {
 public:
  ~IpcImports() { close_all(); }
  // Base address of the peer's allocation in this process; opens it on first use. Throws, or
  // with `may_fail` returns nullptr, when CUDA cannot map it (small allocations that share a
  // driver page with one already mapped are refused as "already mapped").
  using Key = std::pair<int, HandleBytes>;  // (peer, handle)

  unsigned char* map(int peer, const HandleBytes& handle, bool may_fail = false);
  // Closes every mapping not in `keep` (a new schedule's allocations).
  void retain(const std::set<Key>& keep);
  void close_all() noexcept;

 private:
  std::map<Key, void*> mappings_;
};

}  // namespace reshard::cuda

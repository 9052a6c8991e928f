// How a prepared refit knows that the tensors it is given are the ones it prepared for, cheaply
// enough to ask at every refit: each tensor's identity without the heap, the GPU allocations they
// live in (an address freed and allocated again is new memory), and a walk of the caller's map
// that prefetches its scattered entries.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_device.hpp"
#endif
#include "reshard/resharder.hpp"

namespace reshard::execution {

// What a prepared refit depends on of one tensor (its buffers, dtype and shape), without the
// heap: the per-refit check of thousands of tensors reads these and the names in turn and waits
// only on the caller's map. (Against the plan's names and LocalTensor copies, each shape on the
// heap: 4,734 tensors with cold caches 0.98-1.23 -> 0.66-0.87 ms, warm 0.23 -> 0.19 ms, a copy of
// the loop on the 2-core development machine, 2026-11-27.)
struct TensorIdentity {
  const void* data = nullptr;
  const void* scale = nullptr;
  std::size_t bytes = 0, scale_bytes = 0;
  std::int32_t device = -1, scale_device = -1;
  MemoryKind kind = MemoryKind::kHost, scale_kind = MemoryKind::kHost;
  DType dtype = DType::kBFloat16;
  std::uint32_t shape_at = 0, dims = 0;  // in Prepared::shapes

  // `tensor`'s, its shape appended to `shapes`.
  static TensorIdentity of(const LocalTensor& tensor, std::vector<std::int64_t>& shapes) {
    TensorIdentity id{tensor.data.data,
                      tensor.scale.data,
                      tensor.data.bytes,
                      tensor.scale.bytes,
                      tensor.data.device,
                      tensor.scale.device,
                      tensor.data.kind,
                      tensor.scale.kind,
                      tensor.dtype,
                      static_cast<std::uint32_t>(shapes.size()),
                      static_cast<std::uint32_t>(tensor.shape.size())};
    shapes.insert(shapes.end(), tensor.shape.begin(), tensor.shape.end());
    return id;
  }
  // Whether `tensor` is the one this was taken of (the same buffers, dtype and shape).
  bool matches(const LocalTensor& tensor, const std::vector<std::int64_t>& shapes) const {
    return tensor.data.data == data && tensor.data.bytes == bytes && tensor.dtype == dtype &&
           tensor.data.kind == kind && tensor.data.device == device && tensor.scale.data == scale &&
           tensor.scale.bytes == scale_bytes && tensor.scale.kind == scale_kind &&
           tensor.scale.device == scale_device && tensor.shape.size() == dims &&
           std::equal(tensor.shape.begin(), tensor.shape.end(), shapes.begin() + shape_at);
  }
};

// The GPU allocations a prepared refit's tensors live in, each with the driver's id of it
// (cuda::allocation_id): the same address in a new allocation (freed and allocated again) is
// other memory, and the peers' IPC mappings of the old one would receive its bytes. Checked per
// allocation, not per tensor: a PyTorch model's thousands of tensors live in a few of its
// allocator's segments (one driver query each, about 0.5 us). Only where peers map this PE's
// memory (`peers_map_memory`: the CUDA transport, alone or in a mixed one); NCCL and NVSHMEM take
// the buffers by address at every run, which a new allocation at the same address satisfies.
class GpuAllocations {
 public:
  void record(const std::vector<LocalTensor>& tensors, bool peers_map_memory) {
    bases_.clear();
    if (!peers_map_memory) return;
#ifdef RESHARD_WITH_CUDA
    std::map<const void*, std::uint64_t> seen;
    for (const LocalTensor& tensor : tensors) {
      for (const Buffer* buffer : {&tensor.data, &tensor.scale}) {
        if (buffer->kind != MemoryKind::kCuda || buffer->data == nullptr) continue;
        const void* base = reshard::cuda::allocation_base(buffer->data);
        if (!seen.count(base)) seen.emplace(base, reshard::cuda::allocation_id(base));
      }
    }
    bases_.assign(seen.begin(), seen.end());
#else
    (void)tensors;
#endif
  }
  // Whether every recorded allocation is still the one recorded.
  bool unchanged() const {
#ifdef RESHARD_WITH_CUDA
    for (const auto& [base, id] : bases_) {
      if (reshard::cuda::allocation_id(base) != id) return false;
    }
#endif
    return true;
  }

 private:
  std::vector<std::pair<const void*, std::uint64_t>> bases_;
};

// A tensor map's entries in the map's own order, as one refit gave them: the next refit's map
// holding the same entries in the same order (the caller's map unchanged, or built again the same
// way, as the Python binding builds it at every call) is checked by walking both, with no name
// looked up. A lookup per name hashed it, then read the bucket, the node and its key from wherever
// the caller's map put them; walking reads the nodes in turn and the names recorded here, one
// after the other.
//
// The caller's map kept from one refit to the next still has its entries, names and shapes where
// they were, scattered over the heap in the order its hash put them: walked cold (a refit leaves
// the host's caches to other work) each entry waits on a miss or three in turn. The walk therefore
// asks for the entries some way ahead at their recorded addresses before it reaches them. A
// prefetch never faults, and the walk itself reads only the map: an address that went stale
// (the map rebuilt, as the Python binding rebuilds it) costs a wasted prefetch, not a wrong
// answer, and the walk stops prefetching once the first entry shows the map is not the one
// recorded. (4,608 tensors named like Qwen3-30B-A3B's experts, after 256 MiB of other traffic,
// on the development machine: 0.69 -> 0.16 ms.)
class MapWalk {
 public:
  void record(const TensorMap& map) {
    names_.clear();
    name_ends_.clear();
    identities_.clear();
    shapes_.clear();
    addresses_.clear();
    for (const auto& entry : map) {
      const auto& [name, tensor] = entry;
      names_ += name;
      name_ends_.push_back(names_.size());
      identities_.push_back(TensorIdentity::of(tensor, shapes_));
      addresses_.push_back({reinterpret_cast<std::uintptr_t>(&entry),
                            reinterpret_cast<std::uintptr_t>(name.data()),
                            reinterpret_cast<std::uintptr_t>(tensor.shape.data())});
    }
    recorded_ = true;
  }
  void forget() { recorded_ = false; }
  // Whether `map` holds exactly the recorded entries, in the recorded order.
  bool matches(const TensorMap& map) const {
    if (!recorded_ || map.size() != name_ends_.size()) return false;
    const std::size_t count = name_ends_.size();
    const bool same_nodes =
        count > 0 && reinterpret_cast<std::uintptr_t>(&*map.begin()) == addresses_[0].entry;
    if (same_nodes) {
      for (std::size_t i = 0; i < std::min(kPrefetchAhead, count); ++i) prefetch(addresses_[i]);
    }
    std::size_t i = 0, start = 0;
    for (const auto& [name, tensor] : map) {
      if (same_nodes && i + kPrefetchAhead < count) prefetch(addresses_[i + kPrefetchAhead]);
      const std::string_view recorded(names_.data() + start, name_ends_[i] - start);
      if (name != recorded || !identities_[i].matches(tensor, shapes_)) return false;
      start = name_ends_[i++];
    }
    return true;
  }

 private:
  // Where an entry's parts were when it was recorded: numbers, not pointers, since the map may
  // be gone (the Python binding's maps live for one call); only compared, and prefetched (which
  // never faults).
  struct Addresses {
    std::uintptr_t entry;  // the key-value pair, inside the map's node
    std::uintptr_t name;   // the name's characters (on the heap unless short)
    std::uintptr_t shape;  // the shape's elements
  };
  // Entries asked for ahead of the walk: enough misses in flight to cover the memory's latency
  // (8, 16 and 32 measured alike on the development machine).
  static constexpr std::size_t kPrefetchAhead = 16;

  static void prefetch(const Addresses& at) {
    // The node: the pair with the link before it and the cached hash after it.
    const char* node = reinterpret_cast<const char*>(at.entry) - sizeof(void*);
    for (std::size_t offset = 0; offset < sizeof(TensorMap::value_type) + 2 * sizeof(void*);
         offset += 64)
      __builtin_prefetch(node + offset);
    __builtin_prefetch(reinterpret_cast<const void*>(at.name));
    __builtin_prefetch(reinterpret_cast<const void*>(at.shape));
  }

  bool recorded_ = false;
  std::string names_;  // the names one after the other
  std::vector<std::size_t> name_ends_;
  std::vector<TensorIdentity> identities_;
  std::vector<std::int64_t> shapes_;
  std::vector<Addresses> addresses_;
};

}  // namespace reshard::execution

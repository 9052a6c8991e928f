#include "transports/cuda/ipc_memory.hpp"

#include <cuda.h>

#include <atomic>
#include <cstring>
#include <string>

#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "reshard/log.hpp"

namespace reshard::cuda {
namespace {

using GetAddressRange = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
using GetPointerAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);

GetAddressRange get_address_range() {
  static const auto function =
      reinterpret_cast<GetAddressRange>(driver_entry_point("cuMemGetAddressRange"));
  if (function == nullptr) {
    throw_error(ErrorCode::kSystem, "the CUDA driver lacks cuMemGetAddressRange");
  }
  return function;
}

// Memory from the virtual-memory API (cuMemCreate + cuMemMap: XLA's allocator, PyTorch's
// expandable segments) and from stream-ordered pools is not legacy-IPC capable: the driver's own
// flag says so before cudaIpcGetMemHandle is asked (which refused XLA's memory on 2x H200 too).
bool legacy_ipc_capable(CUdeviceptr base) {
  int capable = 1;
  static const auto query =
      reinterpret_cast<GetPointerAttribute>(driver_entry_point("cuPointerGetAttribute"));
  if (query == nullptr ||
      query(&capable, CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, base) != CUDA_SUCCESS) {
    return true;  // older drivers: cudaIpcGetMemHandle is the only test
  }
  return capable != 0;
}

// Mappings open in this process, over every IpcImports (open_ipc_mappings()).
std::atomic<int> live_mappings{0};

void close_mapping(void* base) noexcept {
  if (cudaIpcCloseMemHandle(base) == cudaSuccess)
    live_mappings.fetch_sub(1);
  else
    cudaGetLastError();
}

}  // namespace

std::optional<ExportedAddress> IpcExporter::export_pointer(const void* pointer) {
  const auto address = reinterpret_cast<std::uintptr_t>(pointer);
  if (address >= last_base_ && address < last_end_) {
    const auto& known = by_base_.at(last_base_);
    if (!known) return std::nullopt;
    return ExportedAddress{*known, address - last_base_};
  }
  CUdeviceptr base = 0;
  std::size_t size = 0;
  const CUresult status = get_address_range()(&base, &size, reinterpret_cast<CUdeviceptr>(pointer));
  if (status == CUDA_SUCCESS) {
    last_base_ = static_cast<std::uintptr_t>(base);
    last_end_ = last_base_ + size;
  }
  if (status != CUDA_SUCCESS) {
    throw_error(ErrorCode::kInvalidArgument,
                "cuMemGetAddressRange does not know the device pointer " +
                    std::to_string(reinterpret_cast<std::uintptr_t>(pointer)) + " (error " +
                    std::to_string(static_cast<int>(status)) + ")");
  }
  auto [entry, inserted] = by_base_.try_emplace(static_cast<std::uintptr_t>(base));
  if (inserted) {
    cudaIpcMemHandle_t handle;
    if (legacy_ipc_capable(base) &&
        cudaIpcGetMemHandle(&handle, reinterpret_cast<void*>(base)) == cudaSuccess) {
      HandleBytes bytes;
      std::memcpy(bytes.data(), &handle, sizeof handle);
      entry->second = static_cast<std::uint32_t>(handles_.size());
      handles_.push_back(bytes);
      bases_.push_back(static_cast<std::uintptr_t>(base));
    } else {
      cudaGetLastError();  // not exportable: the caller stages through a bounce buffer
    }
  }
  if (!entry->second) return std::nullopt;
  return ExportedAddress{*entry->second, reinterpret_cast<std::uintptr_t>(pointer) -
                                             static_cast<std::uintptr_t>(base)};
}

int open_ipc_mappings() noexcept { return live_mappings.load(); }

unsigned char* IpcImports::map(int peer, const HandleBytes& handle, bool may_fail) {
  void*& base = mappings_[{peer, handle}];
  if (base == nullptr) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof h);
    const cudaError_t status = cudaIpcOpenMemHandle(&base, h, cudaIpcMemLazyEnablePeerAccess);
    if (status != cudaSuccess) {
      mappings_.erase({peer, handle});
      cudaGetLastError();
      if (may_fail) return nullptr;
      throw_error(ErrorCode::kSystem, "cannot map PE " + std::to_string(peer) +
                                          "'s memory through CUDA IPC (cudaIpcOpenMemHandle: " +
                                          cudaGetErrorString(status) +
                                          "); the cuda transport needs peer access between the "
                                          "PEs' GPUs, each of them visible to "
                                          "every PE of the node (CUDA_VISIBLE_DEVICES)");
    }
    live_mappings.fetch_add(1);
  }
  return static_cast<unsigned char*>(base);
}

void IpcImports::retain(const std::set<Key>& keep) {
  for (auto it = mappings_.begin(); it != mappings_.end();) {
    if (keep.count(it->first) != 0) {
      ++it;
      continue;
    }
    close_mapping(it->second);
    it = mappings_.erase(it);
  }
}

void IpcImports::close_all() noexcept {
  for (auto& [key, base] : mappings_) close_mapping(base);
  mappings_.clear();
}

}  // namespace reshard::cuda

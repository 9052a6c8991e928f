#include "bench/ipc_copy_loop.hpp"

#include <cuda.h>

#include <array>
#include <cstring>
#include <string>

#include "reshard/error.hpp"

namespace reshard::bench {
namespace {

void check(cudaError_t status, const char* call) {
  if (status != cudaSuccess)
    throw_error(ErrorCode::kSystem, std::string(call) + ": " + cudaGetErrorString(status));
}

using HandleBytes = std::array<std::byte, sizeof(cudaIpcMemHandle_t)>;

// What a PE tells the others about one destination tensor: the allocation holding it (small
// cudaMallocs can share one, which IPC maps only once per process) and the tensor's offset in it.
struct Exported {
  std::uint32_t param;
  std::uint32_t reserved;
  std::uint64_t offset;
  HandleBytes handle;
};

std::uintptr_t allocation_base(const void* pointer) {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found{};
  check(cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &function, 12000,
                                         cudaEnableDefault, &found),
        "cudaGetDriverEntryPointByVersion");
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  if (found != cudaDriverEntryPointSuccess ||
      reinterpret_cast<GetAddressRange>(function)(
          &base, &bytes, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS) {
    throw_error(ErrorCode::kSystem, "cuMemGetAddressRange failed");
  }
  return static_cast<std::uintptr_t>(base);
}

// Row-major element offset of `at` in a tensor of `shape`.
std::uint64_t linear(const Extents& at, const std::vector<std::int64_t>& shape) {
  std::uint64_t index = 0;
  for (std::size_t d = 0; d < shape.size(); ++d) index = index * shape[d] + at[d];
  return index;
}

}  // namespace

IpcCopyLoop::IpcCopyLoop(Bootstrap& bootstrap, const ReshardPlan& plan, const TensorMap& src,
                         const TensorMap& dst)
    : bootstrap_(bootstrap) {
  const PeId me = bootstrap.rank();
  std::vector<Exported> mine;
  for (std::uint32_t p = 0; p < plan.params().size(); ++p) {
    const auto it = dst.find(plan.params()[p].name);
    if (plan.dst_layout().find_shard(me, p) == nullptr || it == dst.end()) continue;
    const void* data = it->second.data.data;
    cudaIpcMemHandle_t handle{};
    check(cudaIpcGetMemHandle(&handle, const_cast<void*>(data)), "cudaIpcGetMemHandle");
    Exported e{p, 0, reinterpret_cast<std::uintptr_t>(data) - allocation_base(data), {}};
    std::memcpy(e.handle.data(), &handle, sizeof handle);
    mine.push_back(e);
  }
  const auto all = bootstrap.all_gather(std::as_bytes(std::span(mine)));

  std::map<std::pair<PeId, std::uint32_t>, unsigned char*> destination;  // (PE, param) -> tensor
  std::map<HandleBytes, unsigned char*> opened;
  for (PeId pe = 0; pe < static_cast<PeId>(all.size()); ++pe) {
    const std::size_t count = all[pe].size() / sizeof(Exported);
    for (std::size_t i = 0; i < count; ++i) {
      Exported e;
      std::memcpy(&e, all[pe].data() + i * sizeof e, sizeof e);
      if (pe == me) {
        destination[{pe, e.param}] =
            static_cast<unsigned char*>(dst.at(plan.params()[e.param].name).data.data);
        continue;
      }
      auto [at, fresh] = opened.try_emplace(e.handle, nullptr);
      if (fresh) {
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, e.handle.data(), sizeof handle);
        void* base = nullptr;
        check(cudaIpcOpenMemHandle(&base, handle, cudaIpcMemLazyEnablePeerAccess),
              "cudaIpcOpenMemHandle");
        at->second = static_cast<unsigned char*>(base);
        mapped_.push_back(base);
      }
      destination[{pe, e.param}] = at->second + e.offset;
    }
  }

  for (const TransferOp& op : plan.ops()) {
    if (op.src_pe != me) continue;
    const ParamSpec& param = plan.params()[op.param];
    const auto target = destination.find({op.dst_pe, op.param});
    if (target == destination.end()) {
      throw_error(ErrorCode::kInvalidArgument, "IPC copy loop: PE " + std::to_string(op.dst_pe) +
                                                   " shared no tensor for " + param.name);
    }
    const std::size_t element = dtype_size(param.dtype);
    const auto& src_shape = plan.src_layout().find_shard(me, op.param)->local_shape;
    const auto& dst_shape = plan.dst_layout().find_shard(op.dst_pe, op.param)->local_shape;
    const auto* source = static_cast<const unsigned char*>(src.at(param.name).data.data);
    const Box from = op.src_box(), to = op.dst_box();
    const int n = from.ndim;
    if (n == 1) {
      const std::size_t bytes = from.extent[0] * element;
      copies_.push_back({target->second + to.offset[0] * element, bytes,
                         source + from.offset[0] * element, bytes, bytes, 1});
      continue;
    }
    // One 2-D copy per index of the dimensions before the last two.
    Extents outer{};
    std::int64_t outer_count = 1;
    for (int d = 0; d + 2 < n; ++d) outer_count *= from.extent[d];
    for (std::int64_t o = 0; o < outer_count; ++o) {
      Extents a = from.offset, b = to.offset;
      for (int d = 0; d + 2 < n; ++d) {
        a[d] += outer[d];
        b[d] += outer[d];
      }
      copies_.push_back({target->second + linear(b, dst_shape) * element,
                         static_cast<std::size_t>(dst_shape[n - 1]) * element,
                         source + linear(a, src_shape) * element,
                         static_cast<std::size_t>(src_shape[n - 1]) * element,
                         static_cast<std::size_t>(from.extent[n - 1]) * element,
                         static_cast<std::size_t>(from.extent[n - 2])});
      for (int d = n - 3; d >= 0; --d) {
        if (++outer[d] < from.extent[d]) break;
        outer[d] = 0;
      }
    }
  }
  check(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
  bootstrap.barrier();
}

IpcCopyLoop::~IpcCopyLoop() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  // Peers keep their tensors until every PE has closed its mappings of them.
  try {
    bootstrap_.barrier();
  } catch (const Error&) {
  }
  for (void* base : mapped_) cudaIpcCloseMemHandle(base);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  cudaGetLastError();
}

void IpcCopyLoop::run() {
  bootstrap_.barrier();  // every receiver is done with its destinations
  for (const Copy2D& c : copies_) {
    check(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.height,
                            cudaMemcpyDeviceToDevice, stream_),
          "cudaMemcpy2DAsync");
  }
  check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize");
  bootstrap_.barrier();  // every sender's data has landed
}

}  // namespace reshard::bench

#include "transports/cuda/same_device_order.hpp"

#include <cuda.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#include "gpu/device_work.hpp"
#include "reshard/error.hpp"

namespace reshard::cuda {
namespace {

using WaitValue = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using DeviceAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

struct MemoryOps {
  WaitValue wait = reinterpret_cast<WaitValue>(driver_entry_point("cuStreamWaitValue64"));
  WriteValue write = reinterpret_cast<WriteValue>(driver_entry_point("cuStreamWriteValue64"));
  BatchMemOp batch = reinterpret_cast<BatchMemOp>(driver_entry_point("cuStreamBatchMemOp"));
};

const MemoryOps& memory_ops() {
  static const MemoryOps ops;
  return ops;
}

void check(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  const char* name = "unknown";
  const auto get_name =
      reinterpret_cast<CUresult (*)(CUresult, const char**)>(driver_entry_point("cuGetErrorName"));
  if (get_name != nullptr) get_name(status, &name);
  throw_error(ErrorCode::kSystem, std::string(call) + " failed: " + name);
}

CUdeviceptr address(const std::uint64_t* flag) { return reinterpret_cast<CUdeviceptr>(flag); }

// Writes keep the default flags, which put a memory barrier before the write: the copies before
// a raised flag are visible to the peer that sees it. (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER
// would spare the barrier of a reset, but the driver's v2 entry points refuse it:
// CUDA_ERROR_INVALID_VALUE.)
CUstreamBatchMemOpParams batch_param(const SameDeviceOrder::MemoryOp& op) {
  CUstreamBatchMemOpParams param{};
  if (op.wait) {
    param.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    param.waitValue.address = address(op.flag);
    param.waitValue.value64 = op.value;
    param.waitValue.flags = CU_STREAM_WAIT_VALUE_GEQ;
  } else {
    param.writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
    param.writeValue.address = address(op.flag);
    param.writeValue.value64 = op.value;
    param.writeValue.flags = CU_STREAM_WRITE_VALUE_DEFAULT;
  }
  return param;
}

// The most operations one cuStreamBatchMemOp call takes ("must be less than 256").
constexpr std::size_t kMaxBatch = 255;

void add(std::vector<int>& into, const std::vector<int>& from) {
  into.insert(into.end(), from.begin(), from.end());
  std::sort(into.begin(), into.end());
  into.erase(std::unique(into.begin(), into.end()), into.end());
}

}  // namespace

std::vector<bool> stream_ordered_peers(const std::vector<std::string>& gpus,
                                       const std::vector<bool>& streams, int me) {
  const int n = static_cast<int>(gpus.size());
  std::vector<bool> shared(n, false);  // on a GPU shared through the streams
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b)
      if (gpus[a] == gpus[b] && streams[a] && streams[b]) shared[a] = shared[b] = true;
  std::vector<bool> ordered(n, false);
  for (int pe = 0; pe < n; ++pe)
    ordered[pe] = pe != me && streams[me] && streams[pe] && (shared[me] || shared[pe]);
  return ordered;
}

bool SameDeviceOrder::supported(int device) {
  const auto get_attribute =
      reinterpret_cast<DeviceAttribute>(driver_entry_point("cuDeviceGetAttribute"));
  if (get_attribute == nullptr || memory_ops().wait == nullptr || memory_ops().write == nullptr)
    return false;
  int can = 0;
  return get_attribute(&can, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device) ==
             CUDA_SUCCESS &&
         can != 0;
}

bool SameDeviceOrder::mps_server_found() {
  const char* directory = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string control =
      std::string(directory != nullptr && *directory != 0 ? directory : "/tmp/nvidia-mps") +
      "/control";
  struct stat info{};
  return ::stat(control.c_str(), &info) == 0 && (S_ISSOCK(info.st_mode) || S_ISFIFO(info.st_mode));
}

SameDeviceOrder::SameDeviceOrder(std::uint64_t* signals, std::vector<std::uint64_t*> peer_signals,
                                 int me, bool batch)
    : signals_(signals), peer_signals_(std::move(peer_signals)), me_(me), batch_(batch) {}

void SameDeviceOrder::order_pairs(const std::vector<int>& destinations,
                                  const std::vector<int>& sources) {
  // Every flag is raised before any is waited for (begin, end): two PEs that write into each
  // other each wait for the other's.
  add(raise_ready_, sources);
  add(wait_ready_, destinations);
  add(raise_done_, destinations);
  add(wait_done_, sources);
  build();
}

void SameDeviceOrder::follow(int leader) {
  leader_ = leader;
  build();
}

void SameDeviceOrder::lead(const std::vector<int>& followers) {
  add(wait_ready_, followers);
  add(raise_done_, followers);
  build();
}

void SameDeviceOrder::merge(const SameDeviceOrder& other) {
  if (other.leader_ >= 0) leader_ = other.leader_;
  add(raise_ready_, other.raise_ready_);
  add(wait_ready_, other.wait_ready_);
  add(raise_done_, other.raise_done_);
  add(wait_done_, other.wait_done_);
  build();
}

void SameDeviceOrder::build() {
  peers_.clear();
  for (const auto* list : {&raise_ready_, &wait_ready_, &raise_done_, &wait_done_})
    peers_.insert(peers_.end(), list->begin(), list->end());
  if (leader_ >= 0) peers_.push_back(leader_);
  std::sort(peers_.begin(), peers_.end());
  peers_.erase(std::unique(peers_.begin(), peers_.end()), peers_.end());

  // Each flag waited for is reset by the stream that waited, before anything it does next can
  // let the peer raise it again.
  const int n = static_cast<int>(peer_signals_.size());
  auto raise = [](std::vector<MemoryOp>& ops, std::uint64_t* flag) {
    ops.push_back({flag, 1, false});
  };
  auto wait_and_reset = [](std::vector<MemoryOp>& ops, std::uint64_t* flag) {
    ops.push_back({flag, 1, true});
    ops.push_back({flag, 0, false});
  };
  begin_ops_.clear();
  end_ops_.clear();
  if (n == 0) return;
  for (int pe : raise_ready_)
    raise(begin_ops_, SignalLayout::same_device_ready(peer_signals_[pe], n, me_));
  for (int pe : wait_ready_)
    wait_and_reset(begin_ops_, SignalLayout::same_device_ready(signals_, n, pe));
  // Only now may the leader write this PE's destinations (on other GPUs too).
  if (leader_ >= 0)
    raise(begin_ops_, SignalLayout::same_device_ready(peer_signals_[leader_], n, me_));
  // The leader's copies of this PE's sends have landed before this PE says so.
  if (leader_ >= 0) wait_and_reset(end_ops_, SignalLayout::same_device_done(signals_, n, leader_));
  for (int pe : raise_done_)
    raise(end_ops_, SignalLayout::same_device_done(peer_signals_[pe], n, me_));
  for (int pe : wait_done_)
    wait_and_reset(end_ops_, SignalLayout::same_device_done(signals_, n, pe));
}

void SameDeviceOrder::queue(cudaStream_t stream, const std::vector<MemoryOp>& ops) const {
  if (batch_ && memory_ops().batch != nullptr) {
    std::vector<CUstreamBatchMemOpParams> params;
    params.reserve(ops.size());
    for (const MemoryOp& op : ops) params.push_back(batch_param(op));
    for (std::size_t first = 0; first < params.size(); first += kMaxBatch) {
      const auto count = static_cast<unsigned int>(std::min(kMaxBatch, params.size() - first));
      check(memory_ops().batch(stream, count, params.data() + first, 0), "cuStreamBatchMemOp");
    }
    return;
  }
  for (const MemoryOp& op : ops) {
    if (op.wait) {
      check(memory_ops().wait(stream, address(op.flag), op.value, CU_STREAM_WAIT_VALUE_GEQ),
            "cuStreamWaitValue64");
    } else {
      check(memory_ops().write(stream, address(op.flag), op.value, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue64");
    }
  }
}

void SameDeviceOrder::begin(cudaStream_t stream) const { queue(stream, begin_ops_); }

void SameDeviceOrder::end(cudaStream_t stream) const { queue(stream, end_ops_); }

void SameDeviceOrder::release(cudaStream_t side) const noexcept {
  const int n = static_cast<int>(peer_signals_.size());
  if (signals_ == nullptr || memory_ops().write == nullptr) return;
  for (int pe = 0; pe < n; ++pe) {
    memory_ops().write(side, address(SignalLayout::same_device_ready(signals_, n, pe)), 1, 0);
    memory_ops().write(side, address(SignalLayout::same_device_done(signals_, n, pe)), 1, 0);
  }
  cudaStreamSynchronize(side);
  cudaGetLastError();
}

}  // namespace reshard::cuda

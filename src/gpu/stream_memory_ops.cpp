#include "gpu/stream_memory_ops.hpp"

#include <cuda.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "gpu/cuda_device.hpp"
#include "reshard/error.hpp"

namespace reshard::cuda {
namespace {

using WaitValue = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using WriteValue = CUresult (*)(CUstream, CUdeviceptr, cuuint64_t, unsigned int);
using BatchMemOp = CUresult (*)(CUstream, unsigned int, CUstreamBatchMemOpParams*, unsigned int);
using DeviceAttribute = CUresult (*)(int*, CUdevice_attribute, CUdevice);

struct DriverCalls {
  WaitValue wait = reinterpret_cast<WaitValue>(driver_entry_point("cuStreamWaitValue64"));
  WriteValue write = reinterpret_cast<WriteValue>(driver_entry_point("cuStreamWriteValue64"));
  BatchMemOp batch = reinterpret_cast<BatchMemOp>(driver_entry_point("cuStreamBatchMemOp"));
  DeviceAttribute attribute =
      reinterpret_cast<DeviceAttribute>(driver_entry_point("cuDeviceGetAttribute"));
};

const DriverCalls& driver() {
  static const DriverCalls calls;
  return calls;
}

void check(CUresult status, const char* call) {
  if (status == CUDA_SUCCESS) return;
  const char* name = "unknown";
  const auto get_name =
      reinterpret_cast<CUresult (*)(CUresult, const char**)>(driver_entry_point("cuGetErrorName"));
  if (get_name != nullptr) get_name(status, &name);
  throw_error(ErrorCode::kSystem, std::string(call) + " failed: " + name);
}

bool attribute(CUdevice_attribute which, int device) {
  int value = 0;
  return driver().attribute != nullptr &&
         driver().attribute(&value, which, device) == CUDA_SUCCESS && value != 0;
}

CUdeviceptr address(const std::uint64_t* flag) { return reinterpret_cast<CUdeviceptr>(flag); }

unsigned int wait_flags(const StreamMemoryOp& op) {
  return static_cast<unsigned int>(CU_STREAM_WAIT_VALUE_GEQ) |
         (op.flush ? static_cast<unsigned int>(CU_STREAM_WAIT_VALUE_FLUSH) : 0u);
}

// (CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER would spare the barrier of a reset, but the driver's
// v2 entry points refuse it: CUDA_ERROR_INVALID_VALUE.)
CUstreamBatchMemOpParams batch_param(const StreamMemoryOp& op) {
  CUstreamBatchMemOpParams param{};
  if (op.wait) {
    param.waitValue.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64;
    param.waitValue.address = address(op.flag);
    param.waitValue.value64 = op.value;
    param.waitValue.flags = wait_flags(op);
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

}  // namespace

bool stream_memory_ops_supported(int device) {
  return driver().wait != nullptr && driver().write != nullptr &&
         attribute(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, device);
}

bool can_flush_remote_writes(int device) {
  return attribute(CU_DEVICE_ATTRIBUTE_CAN_FLUSH_REMOTE_WRITES, device);
}

bool mps_server_found() {
  const char* directory = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  const std::string control =
      std::string(directory != nullptr && *directory != 0 ? directory : "/tmp/nvidia-mps") +
      "/control";
  struct stat info{};
  return ::stat(control.c_str(), &info) == 0 && (S_ISSOCK(info.st_mode) || S_ISFIFO(info.st_mode));
}

void queue_stream_memory_ops(cudaStream_t stream, std::span<const StreamMemoryOp> ops, bool batch) {
  const auto cu_stream = reinterpret_cast<CUstream>(stream);
  if (batch && driver().batch != nullptr) {
    std::vector<CUstreamBatchMemOpParams> params;
    params.reserve(ops.size());
    for (const StreamMemoryOp& op : ops) params.push_back(batch_param(op));
    for (std::size_t first = 0; first < params.size(); first += kMaxBatch) {
      const auto count = static_cast<unsigned int>(std::min(kMaxBatch, params.size() - first));
      check(driver().batch(cu_stream, count, params.data() + first, 0), "cuStreamBatchMemOp");
    }
    return;
  }
  for (const StreamMemoryOp& op : ops) {
    if (op.wait) {
      check(driver().wait(cu_stream, address(op.flag), op.value, wait_flags(op)),
            "cuStreamWaitValue64");
    } else {
      check(driver().write(cu_stream, address(op.flag), op.value, CU_STREAM_WRITE_VALUE_DEFAULT),
            "cuStreamWriteValue64");
    }
  }
}

void write_value_noexcept(cudaStream_t stream, std::uint64_t* flag, std::uint64_t value) noexcept {
  if (driver().write != nullptr)
    driver().write(reinterpret_cast<CUstream>(stream), address(flag), value, 0);
}

}  // namespace reshard::cuda

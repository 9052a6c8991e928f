#include "transports/cuda/cuda_device.hpp"

#include <signal.h>

#include <cerrno>

#include "core/env.hpp"
#include "core/transport.hpp"
#include "reshard/error.hpp"
#include "transports/cuda/cuda_check.hpp"

namespace reshard {

int visible_cuda_devices() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error here
    return 0;
  }
  return count;
}

namespace cuda {

int select_device(const Bootstrap& bootstrap) {
  const int count = visible_cuda_devices();
  if (count == 0) {
    throw_error(ErrorCode::kUnsupported,
                "PE " + std::to_string(bootstrap.rank()) +
                    " sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver); use the "
                    "host transport for CPU memory");
  }
  const int device = env::device().value_or(bootstrap.local_rank() % count);
  if (device < 0 || device >= count) {
    throw_error(ErrorCode::kInvalidArgument, "RESHARD_DEVICE=" + std::to_string(device) +
                                                 " but PE " + std::to_string(bootstrap.rank()) +
                                                 " sees devices 0.." + std::to_string(count - 1));
  }
  RESHARD_CUDA_CHECK(cudaSetDevice(device));
  return device;
}

void check_device_buffer(const Buffer& buffer, int device, const char* transport) {
  const std::string prefix = std::string("the ") + transport +
                             " transport moves memory of CUDA device " + std::to_string(device) +
                             ", but this is a ";
  if (buffer.kind != MemoryKind::kCuda) {
    throw_error(ErrorCode::kInvalidArgument,
                prefix + describe(buffer) + " (use the host transport for CPU memory)");
  }
  if (buffer.device != device) {
    throw_error(ErrorCode::kInvalidArgument, prefix + describe(buffer));
  }
  if (buffer.bytes == 0) return;
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, buffer.data) != cudaSuccess) {
    cudaGetLastError();
    throw_error(ErrorCode::kInvalidArgument,
                prefix + describe(buffer) + " whose pointer CUDA does not know");
  }
  const bool on_device =
      attributes.type == cudaMemoryTypeDevice || attributes.type == cudaMemoryTypeManaged;
  if (!on_device || attributes.device != device) {
    throw_error(ErrorCode::kInvalidArgument,
                prefix + describe(buffer) + " whose pointer is " +
                    (on_device ? "memory of CUDA device " + std::to_string(attributes.device)
                               : std::string("not device memory")));
  }
}

int first_exited_process(std::span<const pid_t> pids) {
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] > 0 && ::kill(pids[i], 0) != 0 && errno == ESRCH) return static_cast<int>(i);
  }
  return -1;
}

bool record_run_unless_capturing(cudaEvent_t event, cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  RESHARD_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) return false;
  RESHARD_CUDA_CHECK(cudaEventRecord(event, stream));
  return true;
}

}  // namespace cuda
}  // namespace reshard

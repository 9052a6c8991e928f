#include "gpu/cuda_device.hpp"

#include <cuda.h>
#include <unistd.h>

#include <chrono>
#include <thread>

#include "core/interrupt.hpp"
#include "core/message.hpp"
#include "core/processes.hpp"
#include "core/transport.hpp"
#include "gpu/cuda_check.hpp"
#include "reshard/error.hpp"

namespace reshard {

std::string cuda_versions() {
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  if (cudaDriverGetVersion(&driver) != cudaSuccess) cudaGetLastError();
  // No driver (a machine without a GPU): say so rather than "driver 0".
  return ", CUDA runtime " + std::to_string(runtime) +
         (driver > 0 ? ", driver " + std::to_string(driver) : ", no CUDA driver");
}

int visible_cuda_devices() noexcept {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error here
    return 0;
  }
  return count;
}

void copy_device_to_host(void* dst, const void* src, std::size_t bytes, int device) {
  cuda::DeviceScope scope(device);
  RESHARD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost));
}

void copy_host_to_device(void* dst, const void* src, std::size_t bytes, int device) {
  cuda::DeviceScope scope(device);
  RESHARD_CUDA_CHECK(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice));
}

namespace cuda {

int select_device(const Bootstrap& bootstrap, std::optional<int> chosen) {
  const int count = visible_cuda_devices();
  if (count == 0) {
    throw_error(ErrorCode::kUnsupported,
                "PE " + std::to_string(bootstrap.rank()) +
                    " sees no CUDA device (check CUDA_VISIBLE_DEVICES and the driver); use the "
                    "host transport for CPU memory");
  }
  const int device = chosen.value_or(bootstrap.local_rank() % count);
  if (device < 0 || device >= count) {
    throw_error(ErrorCode::kInvalidArgument, "device " + std::to_string(device) +
                                                 " (CopyServiceOptions::device / RESHARD_DEVICE)" +
                                                 " but PE " + std::to_string(bootstrap.rank()) +
                                                 " sees devices 0.." + std::to_string(count - 1));
  }
  return device;
}

namespace {

using GetContext = CUresult (*)(CUcontext*);
using SetContext = CUresult (*)(CUcontext);

}  // namespace

void* driver_entry_point(const char* name) {
  void* pointer = nullptr;
  cudaDriverEntryPointQueryResult found{};
  if (cudaGetDriverEntryPointByVersion(name, &pointer, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return pointer;
}

DeviceScope::DeviceScope(int device) {
  static const auto get_current =
      reinterpret_cast<GetContext>(driver_entry_point("cuCtxGetCurrent"));
  CUcontext current = nullptr;
  if (get_current != nullptr && get_current(&current) == CUDA_SUCCESS) saved_ = current;
  RESHARD_CUDA_CHECK(cudaSetDevice(device));
}

std::optional<DeviceScope> DeviceScope::try_enter(int device) noexcept {
  try {
    return std::optional<DeviceScope>(std::in_place, device);
  } catch (const Error&) {
    return std::nullopt;
  }
}

DeviceScope::~DeviceScope() {
  static const auto set_current =
      reinterpret_cast<SetContext>(driver_entry_point("cuCtxSetCurrent"));
  if (saved_ != nullptr && set_current != nullptr) set_current(static_cast<CUcontext>(saved_));
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

std::vector<pid_t> local_peer_pids(Bootstrap& bootstrap) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  message::Writer mine;
  mine.put<std::int32_t>(::getpid());
  mine.put_string(host);
  const auto all = bootstrap.all_gather(mine.bytes());
  std::vector<pid_t> pids(all.size(), 0);
  for (std::size_t pe = 0; pe < all.size(); ++pe) {
    message::Reader reader(all[pe]);
    const auto pid = reader.get<std::int32_t>();
    if (reader.get_string() == host && static_cast<int>(pe) != bootstrap.rank()) pids[pe] = pid;
  }
  return pids;
}

std::string physical_gpu(int device) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char bus[32] = {};
  RESHARD_CUDA_CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, device));
  return std::string(host) + "/" + bus;
}

int pes_on_this_gpu(Bootstrap& bootstrap, int device) {
  message::Writer mine;
  mine.put_string(physical_gpu(device));
  const auto all = bootstrap.all_gather(mine.bytes());
  const std::string me = message::Reader(all[bootstrap.rank()]).get_string();
  int count = 0;
  for (const auto& part : all) count += message::Reader(part).get_string() == me;
  return count;
}

std::string stuck_behind_clause(const RunFailure& failure) {
  if (failure.code != kStatusTimeout || failure.stuck_behind == failure.peer) return {};
  return "; PE " + std::to_string(failure.peer) + " is itself stuck waiting, behind PE " +
         std::to_string(failure.stuck_behind);
}

bool HostFailure::record(unsigned int code, int peer, unsigned int wait_kind) noexcept {
  if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
  peer_ = peer;
  wait_kind_ = wait_kind;
  code_.store(code, std::memory_order_release);
  return true;
}

void HostFailure::clear() noexcept {
  code_.store(0, std::memory_order_relaxed);
  peer_ = -1;
  wait_kind_ = 0;
  claimed_.store(false, std::memory_order_release);
}

std::optional<RunFailure> HostFailure::get() const noexcept {
  const unsigned int code = code_.load(std::memory_order_acquire);
  if (code == 0) return std::nullopt;
  return RunFailure{code, peer_, peer_, wait_kind_};
}

std::optional<RunFailure> run_failure(const DeviceStatus* status,
                                      const HostFailure& host) noexcept {
  if (status != nullptr) {
    // Pinned memory a kernel writes over the bus: `code` is stored last, after a system fence.
    auto& code = const_cast<unsigned int&>(status->code);
    const unsigned int device_code =
        std::atomic_ref<unsigned int>(code).load(std::memory_order_acquire);
    if (device_code != 0) {
      const volatile DeviceStatus& seen = *status;
      return RunFailure{device_code, seen.peer, seen.stuck_behind, seen.wait_kind};
    }
  }
  return host.get();
}

void cancel_waits(DeviceStatus* status) noexcept {
  if (status == nullptr) return;
  std::atomic_ref<unsigned int>(status->cancel).store(1, std::memory_order_release);
}

std::string waiting_on_clause(std::span<const pid_t> pids, std::span<const int> peers) {
  if (const int stopped = first_stopped_process(pids); stopped >= 0) {
    return ": PE " + std::to_string(stopped) + " (pid " + std::to_string(pids[stopped]) +
           ") is stopped";
  }
  if (peers.empty()) return {};
  std::string text = "; this run waits on PE";
  for (std::size_t i = 0; i < peers.size(); ++i)
    text += (i == 0 ? " " : ", ") + std::to_string(peers[i]);
  return text + " (is every PE calling run()?)";
}

std::string wait_until(const std::function<bool()>& finished, std::span<const pid_t> pids,
                       const std::string& what, int* dead, std::chrono::milliseconds limit,
                       const std::function<std::string()>& transport_problem,
                       std::span<const int> peers) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  *dead = -1;
  for (;;) {
    if (finished()) return {};
    // Spin for the first 2 ms: most waits end within microseconds, and a sleep costs 50+ us.
    if (Clock::now() - start < std::chrono::milliseconds(2)) continue;
    if (transport_problem) {
      if (std::string problem = transport_problem(); !problem.empty()) return problem;
    }
    if ((*dead = first_exited_process(pids, true)) >= 0) {
      return "PE " + std::to_string(*dead) + " (pid " + std::to_string(pids[*dead]) +
             ") exited mid-run";
    }
    if (Clock::now() - start > limit) {
      return what + " did not finish within " + std::to_string(limit.count() / 1000) + " s" +
             waiting_on_clause(pids, peers) +
             " (CopyServiceOptions::timeout / RESHARD_TIMEOUT_S sets the limit)";
    }
    throw_if_interrupted(what.c_str(), start);
    std::this_thread::sleep_for(std::chrono::microseconds(
        Clock::now() - start > std::chrono::milliseconds(100) ? 1000 : 20));
  }
}

std::string wait_for_run(cudaEvent_t event, std::span<const pid_t> pids, const char* what,
                         int* dead, std::chrono::milliseconds limit,
                         const std::function<std::string()>& transport_problem,
                         std::span<const int> peers) {
  const auto finished = [event] {
    const cudaError_t status = cudaEventQuery(event);
    if (status == cudaSuccess) return true;
    if (status != cudaErrorNotReady) throw_cuda_error(status, "cudaEventQuery");
    return false;
  };
  return wait_until(finished, pids, std::string("the ") + what + " transfers", dead, limit,
                    transport_problem, peers);
}

void wait_for_default_stream(cudaStream_t own) {
  cudaEvent_t queued = nullptr;
  RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&queued, cudaEventDisableTiming));
  cudaError_t status = cudaEventRecord(queued, cudaStreamLegacy);
  if (status == cudaSuccess) status = cudaStreamWaitEvent(own, queued, 0);
  cudaEventDestroy(queued);  // released once the wait has passed it
  if (status != cudaSuccess) throw_cuda_error(status, "waiting for the default stream");
}

std::uint64_t allocation_id(const void* pointer) noexcept {
  using GetPointerAttribute = CUresult (*)(void*, CUpointer_attribute, CUdeviceptr);
  static const auto query =
      reinterpret_cast<GetPointerAttribute>(driver_entry_point("cuPointerGetAttribute"));
  unsigned long long id = 0;
  if (query == nullptr || pointer == nullptr ||
      query(&id, CU_POINTER_ATTRIBUTE_BUFFER_ID, reinterpret_cast<CUdeviceptr>(pointer)) !=
          CUDA_SUCCESS) {
    return 0;
  }
  return id;
}

const void* allocation_base(const void* pointer) noexcept {
  using GetAddressRange = CUresult (*)(CUdeviceptr*, std::size_t*, CUdeviceptr);
  static const auto query =
      reinterpret_cast<GetAddressRange>(driver_entry_point("cuMemGetAddressRange"));
  CUdeviceptr base = 0;
  std::size_t bytes = 0;
  if (query == nullptr || pointer == nullptr ||
      query(&base, &bytes, reinterpret_cast<CUdeviceptr>(pointer)) != CUDA_SUCCESS) {
    return pointer;
  }
  return reinterpret_cast<const void*>(base);
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

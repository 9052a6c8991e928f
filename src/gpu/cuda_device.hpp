// Device selection and buffer checks shared by the GPU transports.
#pragma once

#include <cuda_runtime_api.h>
#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpu/device_work.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/types.hpp"

namespace reshard::cuda {

// `chosen` (CopyServiceOptions::device), else the local rank modulo the visible devices.
int select_device(const Bootstrap& bootstrap, std::optional<int> chosen);

// A CUDA driver function by name through the runtime (reshard links no libcuda), or nullptr when
// the driver lacks it.
void* driver_entry_point(const char* name);

// Makes `device`'s primary context current on this thread for a transport call and restores the
// caller's context afterwards. Every transport entry point holds one: a framework that keeps its
// own context current (XLA does) would otherwise receive reshard's allocations and IPC mappings
// in that context, which the transport's kernels, in the primary context, cannot touch.
class DeviceScope {
 public:
  explicit DeviceScope(int device);
  ~DeviceScope();
  // For teardown, which must not throw: the scope, or none where the device cannot be entered.
  static std::optional<DeviceScope> try_enter(int device) noexcept;
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  void* saved_ = nullptr;  // CUcontext
};
// Throws kInvalidArgument unless `buffer` is CUDA memory of `device`, and says what it is instead.
void check_device_buffer(const Buffer& buffer, int device, const char* transport);
// Collective: every PE's process id where it shares this host (0 for this PE and for PEs on other
// hosts), so a waiting PE can tell a peer that died from one that is slow.
std::vector<pid_t> local_peer_pids(Bootstrap& bootstrap);
// The GPU `device` as every process names it, whatever CUDA_VISIBLE_DEVICES each sees (so device
// ordinals may differ, or name different GPUs): the host's name and the GPU's PCI bus id.
std::string physical_gpu(int device);
// Collective: how many PEs (this one included) run on this PE's GPU `device` (physical_gpu):
// colocated processes sharing it.
int pes_on_this_gpu(Bootstrap& bootstrap, int device);
// What stopped a run: a kernel's failed wait (DeviceStatus) or a failure the host found.
struct RunFailure {
  unsigned int code = 0;  // kStatus*
  int peer = -1;          // whom it waited for
  int stuck_behind = -1;  // where the chain of stuck waits from `peer` ends
  unsigned int wait_kind = 0;
};
// A failure a host thread found (a watchdog, a dead peer): recorded apart from the kernels'
// DeviceStatus, each record by one side only, so neither can hold half of the other's. The first
// call records; later ones leave it (the watchdog thread and the caller's thread may both try).
class HostFailure {
 public:
  // True where this call recorded it.
  bool record(unsigned int code, int peer, unsigned int wait_kind) noexcept;
  std::optional<RunFailure> get() const noexcept;
  // Forgets the record (recover(): no run pending, the watchdog's lock held).
  void clear() noexcept;

 private:
  std::atomic<bool> claimed_{false};
  std::atomic<unsigned int> code_{0};  // stored last (release): peer_ and wait_kind_ are whole then
  int peer_ = -1;
  unsigned int wait_kind_ = 0;
};
// The failure that stopped the runs, if any: the kernels' record where a wait failed, else the
// host's. `status` may be null.
std::optional<RunFailure> run_failure(const DeviceStatus* status, const HostFailure& host) noexcept;
// Tells the kernels' waits to stop (each records kStatusCancelled unless a failure was claimed).
void cancel_waits(DeviceStatus* status) noexcept;
// "; PE p is itself stuck waiting, behind PE q" for a timed-out device wait whose peer p was
// itself stuck (see SignalLayout::waiting_on), else empty.
std::string stuck_behind_clause(const RunFailure& failure);
// What a wait that ran too long says of whom it waited on: ": PE p (pid n) is stopped" for a
// stopped local peer, else "; this run waits on PE a, b (is every PE calling run()?)", else empty.
std::string waiting_on_clause(std::span<const pid_t> pids, std::span<const int> peers);
// Polls `finished` until it returns true: an empty string then, else what went wrong:
// `transport_problem` (asked between polls), a local peer exiting (*dead = its PE), or
// `limit` (the service's timeout, plus any grace) passing while `what` is unfinished — naming a
// stopped local peer, else the PEs this run exchanges with (`peers`).
std::string wait_until(const std::function<bool()>& finished, std::span<const pid_t> pids,
                       const std::string& what, int* dead, std::chrono::milliseconds limit,
                       const std::function<std::string()>& transport_problem = {},
                       std::span<const int> peers = {});
// wait_until for `event` (the end of a run), "the <what> transfers".
std::string wait_for_run(cudaEvent_t event, std::span<const pid_t> pids, const char* what,
                         int* dead, std::chrono::milliseconds limit,
                         const std::function<std::string()>& transport_problem = {},
                         std::span<const int> peers = {});
// A run given no stream goes on `own`, a stream of the transport's (non-blocking, so CUDA orders
// nothing between it and the caller's work): `own` first waits for what the caller queued on the
// legacy default stream, as CUDA's own synchronous calls do. PyTorch's and CuPy's default stream is
// that stream; without the wait a run read send buffers that work on it had not finished
// writing.
void wait_for_default_stream(cudaStream_t own);
// Records `event` on `stream` after a run and returns true, unless the stream is being captured
// into a graph (then the run only exists in the graph and there is nothing to wait for).
bool record_run_unless_capturing(cudaEvent_t event, cudaStream_t stream);
// The driver's id of the allocation holding `pointer` (CU_POINTER_ATTRIBUTE_BUFFER_ID): unique
// in the process's life, so memory freed and allocated again at the same address has another.
// 0 where the driver cannot tell.
std::uint64_t allocation_id(const void* pointer) noexcept;
// Where the allocation holding `pointer` starts (cuMemGetAddressRange), or `pointer` itself where
// the driver cannot tell.
const void* allocation_base(const void* pointer) noexcept;

}  // namespace reshard::cuda

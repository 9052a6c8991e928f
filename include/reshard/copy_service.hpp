// The copy service: register byte ranges to send and receive under task ids, schedule() once,
// run() as many times as needed. Mirrors Megatron's RemoteCopyService so its users recognise it.
#pragma once

#include <memory>
#include <span>
#include <string>
#include <vector>

#include "reshard/bootstrap.hpp"
#include "reshard/log.hpp"
#include "reshard/options.hpp"
#include "reshard/types.hpp"

namespace reshard {

namespace test_hooks {
struct ServiceProbe;  // the tests' fault injection (not part of the API)
}
namespace execution {
struct ServiceSlot;  // execute_reshard_plan's state kept with a service (not part of the API)
}
// The transports compiled into this build, by name ("host" always; "cuda", "nccl", "nvshmem" when
// built).
std::vector<std::string> available_transports();
// What this build runs on, as found at run time: "reshard 0.1.0, CUDA runtime 13000, driver 13000,
// NCCL 22809, NVSHMEM 3.4.5" (components not built in are left out). Benchmarks record it.
std::string component_versions();

// What schedule() reports about the plan it built.
struct ScheduleReport {
  std::uint64_t transfers = 0;  // matched requests in the whole job
  std::uint64_t batches = 0;    // remote batches in the whole job
  std::uint32_t rounds = 0;
  std::uint64_t lower_bound_bytes = 0;
  std::uint64_t makespan_bytes = 0;  // simulated; see Schedule
  std::uint64_t bytes_sent = 0;      // by this PE, local copies excluded
  std::uint64_t bytes_received = 0;  // by this PE, local copies excluded
  std::uint64_t bytes_local = 0;     // copied inside this PE
  std::uint32_t phases = 1;          // see CopyService::set_phase
  double bound_ratio() const {
    return lower_bound_bytes == 0 ? 1.0 : static_cast<double>(makespan_bytes) / lower_bound_bytes;
  }
};

class CopyService {
 public:
  // Configured by `options` as given (start from CopyServiceOptions::from_environment() to honour
  // the RESHARD_* variables); a value out of range is refused here, naming the field. Without a
  // bootstrap, bootstraps from the environment (torchrun variables, MPI, or a single PE).
  explicit CopyService(const CopyServiceOptions& options);
  CopyService(std::shared_ptr<Bootstrap> bootstrap, const CopyServiceOptions& options);
  // CopyServiceOptions::from_environment() with `transport`, unless RESHARD_TRANSPORT overrides
  // it.
  explicit CopyService(TransportKind transport = TransportKind::kAuto);
  CopyService(std::shared_ptr<Bootstrap> bootstrap, TransportKind transport = TransportKind::kAuto);
  ~CopyService();
  CopyService(const CopyService&) = delete;
  CopyService& operator=(const CopyService&) = delete;

  // Collective: sets up the transport, logging at the options' level.
  void init();
  // The same at `log_level`, unless RESHARD_LOG_LEVEL overrides it.
  void init(LogLevel log_level);
  void init(const std::string& log_level) { init(parse_log_level(log_level)); }
  const CopyServiceOptions& options() const;

  int my_pe() const;
  int n_pes() const;
  int device() const;  // CUDA device of this PE, -1 on the host transport
  bool initialized() const;
  TransportKind transport() const;     // as requested (kAuto stays kAuto)
  std::string transport_name() const;  // the transport in use after init(): "host", "cuda", ...

  // Byte ranges [pos, pos + size) of caller-owned buffers. Arguments that are wrong on their own
  // (PE out of range, range outside the buffer) are refused here; the rest at schedule().
  void register_send(TaskId task_id, const Buffer& src, std::size_t src_pos, std::size_t size,
                     PeId dest_pe);
  void register_receive(TaskId task_id, const Buffer& dst, std::size_t dst_pos, std::size_t size,
                        PeId src_pe);
  // Strided ranges (a column block of a matrix, any box of a row-major tensor): the rows travel
  // in order and land in the receiver's rows, which may be cut differently (sizes must agree).
  // No staging: the host and CUDA transports copy each row in place, NVSHMEM gathers the rows
  // into its symmetric buffers. A receive's rows must not overlap each other or other receives.
  void register_send(TaskId task_id, const Buffer& src, const StridedRange& range, PeId dest_pe);
  void register_receive(TaskId task_id, const Buffer& dst, const StridedRange& range, PeId src_pe);
  // Phases: one schedule in parts that run one after the other, e.g. a refit streamed through
  // staging memory that every part reuses. Requests registered after set_phase(p) belong to phase
  // p (phase 0 until then, and again after clear_requests()). A task's send and receive must be in
  // the same phase; receives of different phases may overlap, since they never land at once, and a
  // phase's bytes land only after every earlier phase has finished on the receiving PE, so memory
  // one phase received into may be sent from or written again by the next. run() runs every
  // phase in order.
  void set_phase(std::uint32_t phase);
  // After schedule(): how many phases the schedule has (1 + the highest any PE registered).
  std::uint32_t phases() const;
  // Runs one phase (as run() does, on a stream or not). Every PE must run the same phases in the
  // same order, each phase even where it has nothing to move on this PE. Phase 0 begins a run:
  // where the last one failed and can be retried, the PEs meet there.
  void run_phase(std::uint32_t phase, void* cuda_stream = nullptr);

  // Deprecated: how the transport works inside, which the executor asks itself. Whether it moves
  // strided ranges row by row in place (every transport but NCCL, which sends each row as a
  // message: many short rows are better packed), and whether it waits for its peers in its
  // stream's front end (GPU transports where processes share a GPU without MPS).
  [[deprecated("a transport internal: the executor packs rows for NCCL itself")]]
  bool moves_rows_in_place() const;
  [[deprecated("a transport internal; work beside a GPU transport belongs on its stream")]]
  bool waits_in_stream_front_end() const;

  // Collective: validates every request on every PE (before any byte moves) and builds the plan.
  ScheduleReport schedule();
  // Executes the plan: returns once this PE's sends have been read and its receives have landed.
  // No re-planning and no collective besides the data movement. Every PE calls run() the same
  // number of times. Where a run fails because a peer was late or stalled (a timeout) and every PE
  // is alive, the host transport keeps the service usable: the error says so, and the next run()
  // on every PE meets the others first (within the arrival timeout) and moves every byte again.
  // On GPUs it first waits for the work queued on the legacy default stream (as
  // cudaMemcpy does): buffers written there, as PyTorch and CuPy write by default, are read after
  // those writes.
  void run();
  // GPU transports: enqueues the plan on a CUDA stream (a cudaStream_t) and returns at once. The
  // copies start after the work already queued on the stream, and work queued later sees their
  // result. Capturable in a CUDA graph. A failure on the device (a peer that never arrives)
  // is reported by the next run() or by synchronize(). The host transport runs synchronously.
  // A null stream (handle 0, the legacy default stream's) is run() above.
  void run(void* cuda_stream);
  // Waits for every run enqueued so far and reports a device-side failure, if any.
  void synchronize();
  // Verify mode (also RESHARD_VERIFY=1 at init()): after every run(), each PE checksums the ranges
  // it sent and received, and one all-gather compares them; a mismatch throws kIntegrity on every
  // PE, naming the tasks. Costs the checksums and that collective (see docs/reliability.md); GPU
  // ranges are read through host memory, and a run on a stream is waited for before they are.
  // Every PE must choose the same.
  void set_verify(bool on);
  bool verify() const;
  // Forgets requests and plan, and what execute_reshard_plan kept on the service (its executor
  // and staging); the service stays initialised.
  void clear_requests();
  // Releases everything. Safe to call twice; the destructor calls it.
  void finalize();

  // Collective: every PE's `mine`, in PE order, over the service's bootstrap (small agreements
  // between PEs, e.g. that they all hold the same reshard plan).
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine);

 private:
  friend struct test_hooks::ServiceProbe;
  friend struct execution::ServiceSlot;
  struct Impl;
  static void forget_requests(Impl& self);
  std::unique_ptr<Impl> impl_;
};

}  // namespace reshard

// What execute_reshard_plan keeps with a copy service (not installed, not part of the API): its
// executors live as long as the service's transport, which finalize() releases after them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "reshard/copy_service.hpp"

namespace reshard::execution {

struct ServiceSlot {
  // Changes whenever a request is registered on `service` or its requests are cleared: an
  // executor that registered a set of requests knows whether its schedule is still the service's.
  static std::uint64_t generation(const CopyService& service);
  // The executors of the plans run on `service` (execute_reshard_plan's cache); emptied by
  // finalize() before the transport goes, since they may hold staging on its device.
  static std::shared_ptr<void>& executors(CopyService& service);
  // The all-gather that opens a collective call (`call` names it): waits the arrival timeout, and
  // fails on every PE alike, naming the PEs that did not come, with nothing done (the call may be
  // made again), as schedule()'s meeting does.
  static std::vector<std::vector<std::byte>> meet(CopyService& service,
                                                  std::span<const std::byte> mine,
                                                  const std::string& call);
  // A refit's runs: begin_run() where it begins (the PEs meet there to run again after a run
  // that failed and can be retried), then run_phase() for each phase it runs, whichever they are.
  static void begin_run(CopyService& service);
  static void run_phase(CopyService& service, std::uint32_t phase, void* cuda_stream);
  // CopyService::clear_requests() without dropping the executors: what an executor calls before
  // registering its own requests.
  static void clear_requests(CopyService& service);
  // Whether the transport moves strided ranges row by row in place at full speed (host, CUDA,
  // NVSHMEM); NCCL sends each row as its own message, so the executor packs slices with many
  // short rows into staging for it.
  static bool moves_rows_in_place(const CopyService& service);
  // Whether the transport waits for its peers in its stream's front end (stream memory
  // operations) rather than in kernels: what the GPU transports choose where processes share a
  // GPU without MPS (CUDA: peers on this GPU taken in turn; NVSHMEM: RESHARD_NVSHMEM_WAITS=auto or
  // stream). Work beside such a transport belongs on the same stream.
  static bool waits_in_stream_front_end(const CopyService& service);
};

}  // namespace reshard::execution

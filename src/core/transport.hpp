// The seam between the copy service and the engines that move bytes. Each transport lives in its
// own folder under src/transports/ and is created through a factory declared here.
#pragma once

#include <cstdint>
#include <memory>

#include "core/execution_plan.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/types.hpp"

namespace reshard {

struct TransportCaps {
  std::uint64_t chunk_bytes = 1 << 20;  // largest batch it moves at once
  int max_peers_per_round = 1;          // the scheduler's k
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual const char* name() const = 0;
  virtual TransportCaps caps() const = 0;
  virtual int device() const = 0;
  // Throws kInvalidArgument when the transport cannot read or write this buffer.
  virtual void check_buffer(const Buffer& buffer) const = 0;
  // Collective, at schedule(): anything the plan needs before the first run (mappings, handles).
  virtual void prepare(const ExecutionPlan& plan) = 0;
  // Moves the plan's bytes once. Returns when this PE's sends are read and receives have landed.
  virtual void run(const ExecutionPlan& plan) = 0;
  // Tells peers this PE has failed, so they stop waiting for it at once.
  virtual void abort(const std::string& reason) noexcept = 0;
  virtual void finalize() noexcept = 0;
};

std::unique_ptr<Transport> make_host_transport(Bootstrap& bootstrap);

}  // namespace reshard

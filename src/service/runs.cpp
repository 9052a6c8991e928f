// The runs: each phase handed to the transport, verify mode's check after it, a run that fails
// (for good, or given up and met again at the next run's start).
#include <algorithm>
#include <sstream>
#include <unordered_map>

#include "core/checksum.hpp"
#include "core/message.hpp"
#include "service/copy_service_impl.hpp"
#include "service/test_hooks.hpp"

namespace reshard {

void CopyService::Impl::fail(const Error& error) {
  state = State::kFailed;
  if (transport) transport->abort(error.what());
  throw error;
}

void CopyService::Impl::offer_retry(const Error& error) {
  retry_pending = true;
  transport->offer_retry(error.what());
  Error retry = error.with_message(
      std::string(error.what()) +
      "; the service is usable: run again on every PE (the next run meets every PE "
      "first, within the arrival timeout, then moves every byte; a PE that died "
      "fails that meeting)");
  retry.set_retryable(true);
  throw retry;
}

void CopyService::Impl::begin_run() {
  if (state != State::kScheduled) return;  // run_phase() says why it cannot run
  if (!retry_pending && !transport->retry_requested()) return;
  try {
    meet(*bootstrap, options, {}, "run()");
  } catch (const CollectiveAbandoned&) {
    retry_pending = true;  // every PE gave the meeting up alike: the next run meets again
    throw;
  } catch (const Error& error) {
    fail(error);
  }
  try {
    transport->recover();
  } catch (const Error& error) {
    fail(error);
  }
  retry_pending = false;
  RESHARD_LOG(kInfo,
              "PE " << bootstrap->rank() << ": every PE met to run again after a failed run");
}

void CopyService::set_verify(bool on) { impl_->verify = on; }
bool CopyService::verify() const { return impl_->verify; }

// Collective, after a completed run: every PE checksums the ranges it sent and received and one
// all-gather hands every PE all of them, so every PE reaches the same verdict.
void CopyService::Impl::verify_run(std::uint32_t phase) {
  struct Sum {
    TaskId task;
    std::uint64_t checksum;
    std::uint64_t bytes;
    PeId src, dst;
  };
  const PeId me = bootstrap->rank();
  std::vector<std::byte> chunk;
  // GPU ranges are read through a host chunk, CPU ranges in place.
  auto checksum_of = [&](const Registration& r) {
    Checksum64 sum(r.size);
    if (r.buffer.kind == MemoryKind::kHost) {
      r.for_each_row([&](const std::byte* row, std::uint64_t bytes) { sum.update(row, bytes); });
    } else if (r.range.dims == 0) {
      chunk.resize(std::min<std::size_t>(r.size, 16 << 20));
      for (std::size_t at = 0; at < r.size; at += chunk.size()) {
        const std::size_t n = std::min(chunk.size(), r.size - at);
        copy_device_to_host(chunk.data(), r.start() + at, n, r.buffer.device);
        sum.update(chunk.data(), n);
      }
    } else {
      // One copy of everything the rows span, then the rows from it: a copy per row costs a
      // synchronisation each.
      chunk.resize(r.range.reach());
      copy_device_to_host(chunk.data(), r.start(), chunk.size(), r.buffer.device);
      r.for_each_row([&](const std::byte* row, std::uint64_t bytes) {
        sum.update(chunk.data() + (row - r.start()), bytes);
      });
    }
    return sum.digest();
  };
  std::vector<Sum> sent, received;
  for (const Registration& r : sends) {
    if (r.phase == phase) sent.push_back({r.task, checksum_of(r), r.size, me, r.peer});
  }
  for (const Registration& r : receives) {
    if (r.phase == phase) received.push_back({r.task, checksum_of(r), r.size, r.peer, me});
  }
  message::Writer mine;
  mine.put_array(std::span<const Sum>(sent));
  mine.put_array(std::span<const Sum>(received));
  std::unordered_map<TaskId, Sum> sent_by_task;
  std::vector<Sum> all_received;
  for (const auto& part : bootstrap->all_gather(mine.bytes())) {
    message::Reader reader(part);
    for (const Sum& s : reader.get_array<Sum>()) sent_by_task.emplace(s.task, s);
    for (const Sum& s : reader.get_array<Sum>()) all_received.push_back(s);
  }
  std::vector<TaskId> bad;
  std::ostringstream detail;
  for (const Sum& r : all_received) {
    const Sum& s = sent_by_task.at(r.task);  // schedule() matched every receive to a send
    if (s.checksum == r.checksum) continue;
    if (bad.size() < 8) {
      detail << "\n  - task " << r.task << " (PE " << r.src << " -> PE " << r.dst << ", " << r.bytes
             << " bytes): sent checksum " << std::hex << s.checksum << ", received " << r.checksum
             << std::dec;
    }
    bad.push_back(r.task);
  }
  if (!bad.empty()) {
    throw Error(ErrorCode::kIntegrity,
                "reshard: verify: " + std::to_string(bad.size()) +
                    " transfer(s) arrived different from what was sent:" + detail.str() +
                    (bad.size() > 8 ? "\n  - ..." : ""),
                bad);
  }
}

void CopyService::run() { run(nullptr); }

void CopyService::synchronize() {
  Impl& self = *impl_;
  self.require(self.state == State::kScheduled || self.state == State::kInitialized,
               "synchronize()");
  try {
    self.transport->synchronize();
  } catch (const Error& error) {
    // A run queued on a stream that failed on every PE alike (see run_phase).
    if (self.state == State::kScheduled && self.transport->can_retry() && !self.verify)
      self.offer_retry(error);
    self.fail(error);
  }
}

void CopyService::run(void* cuda_stream) {
  const std::uint32_t count = impl_->state == State::kScheduled ? phases() : 1;
  for (std::uint32_t phase = 0; phase < count; ++phase) run_phase(phase, cuda_stream);
}

void CopyService::run_phase(std::uint32_t phase, void* cuda_stream) {
  impl_->run_phase(phase, cuda_stream, /*begins=*/phase == 0);
}

void CopyService::Impl::run_phase(std::uint32_t phase, void* cuda_stream, bool begins) {
  Impl& self = *this;
  if (self.state == State::kInitialized) {
    if (self.scheduled_since_clear) {
      throw_error(ErrorCode::kInvalidState,
                  "run(): requests were registered since the last schedule(), and a new request "
                  "invalidates the schedule: call schedule() again (on every PE) before run()");
    }
    throw_error(ErrorCode::kInvalidState,
                "run() before schedule(): register the requests, then call schedule() once");
  }
  self.require(self.state == State::kScheduled, "run()");
  if (phase >= self.plans.size()) {
    throw_error(ErrorCode::kInvalidArgument, "run_phase(" + std::to_string(phase) +
                                                 "): the schedule has " +
                                                 std::to_string(self.plans.size()) + " phase(s)");
  }
  if (begins) self.begin_run();
  if (self.retry_pending) {
    throw_error(ErrorCode::kInvalidState,
                "run_phase(" + std::to_string(phase) +
                    "): the last run failed and is to be run again from its first phase, "
                    "where every PE meets first");
  }
  try {
    self.transport->run(self.plans[phase], phase, cuda_stream);
    if (self.verify) {
      // Verify mode waits for a run queued on a stream: the checksums need its bytes.
      if (cuda_stream != nullptr) self.transport->synchronize();
      if (self.after_transfer) self.after_transfer(phase);
      self.verify_run(phase);
    }
  } catch (const Error& error) {
    // A call the transport refuses before queuing anything (a stream it cannot work on) leaves
    // the service usable; anything else may have left peers waiting.
    // Verify mode's verdict is the same on every PE and leaves the protocol in step.
    if (error.code() == ErrorCode::kUnsupported || error.code() == ErrorCode::kInvalidArgument ||
        error.code() == ErrorCode::kIntegrity)
      throw;
    // Verify mode's all-gather after each run would meet a retry's meeting out of step.
    if (self.transport->can_retry() && !self.verify) self.offer_retry(error);
    self.fail(error);
  }
}

}  // namespace reshard

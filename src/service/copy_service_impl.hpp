// The copy service's state, shared by its files: the registered requests, the schedule's plans,
// the transport, and the steps each file implements (the PEs' meeting, the checks of requests,
// the schedule, the runs).
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/execution_plan.hpp"
#include "core/transport.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"
#include "reshard/types.hpp"

namespace reshard {

enum class State { kCreated, kInitialized, kScheduled, kFailed, kFinalized };

// Where the PEs meet at the start of a collective call (`call`: "schedule()", "bind()"):
// one may come minutes after the others (a trainer finishing its step), so this all-gather waits
// the arrival timeout, and the transfer timeout applies again after it. A PE that does not come in
// time is named as a PE (the service's PEs are its bootstrap's ranks), and every PE fails the call
// alike with nothing done, so it may be made again on every PE.
// Each PE's part names its call: PEs in different collective calls at the same point (a program
// that calls them in a different order on some PE) all fail the meeting alike, naming both.
std::vector<std::vector<std::byte>> meet(Bootstrap& bootstrap, const CopyServiceOptions& options,
                                         std::span<const std::byte> mine, const std::string& call);

struct Registration {
  TaskId task;
  Buffer buffer;
  StridedRange range;  // simplified: dims == 0 when contiguous
  std::size_t size;    // range.bytes()
  PeId peer;
  std::uint32_t phase;
  std::byte* start() const { return static_cast<std::byte*>(buffer.data) + range.pos; }
  // RequestClaim::row_bytes: where this side's rows end in the transfer's byte stream.
  std::uint64_t row_bytes() const { return range.dims == 0 ? 0 : range.row_bytes; }
  // Byte `offset` of the range's stream.
  std::byte* at(std::uint64_t offset) const {
    if (range.dims == 0) return start() + offset;
    return start() + range.row_offset(offset / range.row_bytes) + offset % range.row_bytes;
  }
  // Calls visit(pointer, bytes) for every row, in stream order.
  template <typename Visit>
  void for_each_row(Visit visit) const {
    if (size == 0) return;
    if (range.dims == 0) {
      visit(start(), size);
      return;
    }
    for (std::uint64_t row = 0, rows = range.rows(); row < rows; ++row)
      visit(start() + range.row_offset(row), range.row_bytes);
  }
};

// The pieces of bytes [offset, offset + bytes) of a transfer's stream that are contiguous on
// both sides: cut wherever a row of the send (`src_row`) or of the receive (`dst_row`) ends (0:
// contiguous). Both PEs cut alike, so their span lists match one to one.
template <typename Visit>
void for_each_piece(std::uint64_t offset, std::uint64_t bytes, std::uint64_t src_row,
                    std::uint64_t dst_row, Visit visit) {
  const std::uint64_t end = offset + bytes;
  for (std::uint64_t at = offset; at < end;) {
    std::uint64_t next = end;
    if (src_row != 0) next = std::min(next, (at / src_row + 1) * src_row);
    if (dst_row != 0) next = std::min(next, (at / dst_row + 1) * dst_row);
    visit(at, next - at);
    at = next;
  }
}

// Why a call is not allowed in this state, for the caller's error.
const char* state_hint(State state);

// What one PE finds wrong with its own requests, and the tasks involved.
struct LocalProblem {
  TaskId first, second;
  std::string text;
};

// Receive ranges of one PE that overlap would make the result depend on arrival order. Strided
// ranges are compared row by row (interleaved column blocks of one matrix do not overlap).
std::vector<LocalProblem> find_overlapping_receives(const std::vector<Registration>& receives);

struct CopyService::Impl {
  std::shared_ptr<Bootstrap> bootstrap;
  CopyServiceOptions options;
  std::unique_ptr<Transport> transport;
  State state = State::kCreated;
  std::vector<Registration> sends;
  std::vector<Registration> receives;
  std::vector<ExecutionPlan> plans;  // one per phase
  std::uint32_t phase = 0;           // of the requests registered next
  std::uint64_t generation = 0;
  bool scheduled_since_clear = false;  // schedule() succeeded since the last clear_requests()
  std::shared_ptr<void> attachment;    // execution::ServiceSlot::executors
  bool verify = false;
  // test_hooks::ServiceProbe: called after each phase's transfer, before verify mode's check.
  std::function<void(std::uint32_t phase)> after_transfer;

  void require(bool ok, const char* call) const {
    if (!ok) {
      throw_error(ErrorCode::kInvalidState,
                  std::string(call) + " is not allowed now: " + state_hint(state));
    }
  }
  void require_usable(const char* call) const {
    require(state == State::kInitialized || state == State::kScheduled, call);
  }
  // The range, simplified, once it is known to lie inside the buffer.
  StridedRange check_request(const char* call, TaskId task, const Buffer& buffer,
                             const StridedRange& range, PeId peer, const char* peer_role) const;
  // A checked request, registered for the next schedule().
  void add_request(bool sending, TaskId task, const Buffer& buffer, const StridedRange& range,
                   PeId peer);
  ExecutionPlan build_plan(const Schedule& schedule) const;
  void verify_run(std::uint32_t phase);
  [[noreturn]] void fail(const Error& error);
  // After a run that failed where every PE can run again: peers are told, the error says so.
  [[noreturn]] void offer_retry(const Error& error);
  // At the start of a run: where a run failed on some PE and can be retried, the PEs meet and the
  // transport starts afresh first.
  void begin_run();
  // `begins`: the phase begins a run (phase 0 of run(), or the first a refit runs).
  void run_phase(std::uint32_t phase, void* cuda_stream, bool begins);
  // A run failed here and can be retried: the next run begins with a meeting.
  bool retry_pending = false;
};

}  // namespace reshard

#include "reshard/copy_service.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>

#include "core/checksum.hpp"
#include "core/env.hpp"
#include "core/execution_plan.hpp"
#include "core/message.hpp"
#include "core/transport.hpp"
#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"
#include "reshard/types.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"
#include "service/transport_table.hpp"

namespace reshard {
namespace {

enum class State { kCreated, kInitialized, kScheduled, kFailed, kFinalized };

// Where the PEs meet at the start of a collective call (`call`: "schedule()", "bind()"):
// one may come minutes after the others (a trainer finishing its step), so this all-gather waits
// the arrival timeout, and the transfer timeout applies again after it. A PE that does not come in
// time is named as a PE (the service's PEs are its bootstrap's ranks), and every PE fails the call
// alike with nothing done, so it may be made again on every PE.
// Each PE's part names its call: PEs in different collective calls at the same point (a program
// that calls them in a different order on some PE) all fail the meeting alike, naming both.
std::vector<std::vector<std::byte>> meet(Bootstrap& bootstrap, const CopyServiceOptions& options,
                                         std::span<const std::byte> mine, const std::string& call) {
  const auto what = [&] {
    return call + " on PE " + std::to_string(bootstrap.rank()) + ": every PE must call " + call +
           ", and not every one did within the arrival timeout (" +
           format_seconds(options.arrival_timeout) +
           "; arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)";
  };
  message::Writer tagged;
  tagged.put_string(call);
  tagged.put_array(mine);
  std::vector<std::vector<std::byte>> all;
  bootstrap.set_timeout(options.arrival_timeout);
  try {
    all = bootstrap.all_gather(tagged.bytes());
    bootstrap.set_timeout(options.timeout);
  } catch (const CollectiveAbandoned& abandoned) {
    bootstrap.set_timeout(options.timeout);
    std::string late;
    for (const int pe : abandoned.late())
      late += (late.empty() ? "PE " : ", PE ") + std::to_string(pe);
    const std::string who =
        late.empty() ? abandoned.what() : late + " did not call " + call + " in time";
    throw CollectiveAbandoned(abandoned.code(),
                              what() + ": " + who +
                                  "; nothing took effect and the service is usable: call " + call +
                                  " again on every PE",
                              abandoned.late());
  } catch (const Error& error) {
    bootstrap.set_timeout(options.timeout);
    if (error.code() != ErrorCode::kTimeout && error.code() != ErrorCode::kPeerFailure) throw;
    // The bootstrap names the ranks it waited for; say what they were to do.
    throw Error(error.code(),
                what() + " or stayed (the bootstrap's rank N is PE N): " + error.what());
  }
  std::string other_calls;
  for (std::size_t pe = 0; pe < all.size(); ++pe) {
    message::Reader reader(all[pe]);
    const std::string theirs = reader.get_string();
    if (theirs != call)
      other_calls += (other_calls.empty() ? "PE " : ", PE ") + std::to_string(pe) + " " + theirs;
    all[pe] = reader.get_array<std::byte>();
  }
  if (!other_calls.empty()) {
    CollectiveAbandoned mismatch(ErrorCode::kInvalidState,
                                 call + " on PE " + std::to_string(bootstrap.rank()) +
                                     " met other calls: " + other_calls +
                                     " (every PE must make the same collective calls in the same "
                                     "order); nothing took effect");
    mismatch.set_retryable(false);  // the program's order is to be mended, not retried
    throw mismatch;
  }
  return all;
}

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

const char* state_hint(State state) {
  switch (state) {
    case State::kCreated:
      return "call init() first";
    case State::kFailed:
      return "an earlier error left the service unusable; finalize() it";
    case State::kFinalized:
      return "the service was finalized";
    default:
      return "";
  }
}

// What one PE finds wrong with its own requests, and the tasks involved.
struct LocalProblem {
  TaskId first, second;
  std::string text;
};

// Receive ranges of one PE that overlap would make the result depend on arrival order. Strided
// ranges are compared row by row (interleaved column blocks of one matrix do not overlap).
std::vector<LocalProblem> find_overlapping_receives(const std::vector<Registration>& receives) {
  struct Piece {
    int kind, device;
    const std::byte* start;
    std::uint64_t bytes;
    const Registration* owner;
  };
  std::vector<Piece> pieces;
  for (const Registration& r : receives) {
    r.for_each_row([&](const std::byte* row, std::uint64_t bytes) {
      pieces.push_back({static_cast<int>(r.buffer.kind), r.buffer.device, row, bytes, &r});
    });
  }
  auto key = [](const Piece& p) { return std::make_tuple(p.kind, p.device, p.start); };
  std::sort(pieces.begin(), pieces.end(),
            [&](const Piece& a, const Piece& b) { return key(a) < key(b); });
  std::vector<LocalProblem> problems;
  std::set<std::pair<const Registration*, const Registration*>> reported;
  for (std::size_t i = 1; i < pieces.size(); ++i) {
    const Piece& a = pieces[i - 1];
    const Piece& b = pieces[i];
    if (a.kind != b.kind || a.device != b.device || a.start + a.bytes <= b.start) continue;
    if (!reported.insert({a.owner, b.owner}).second) continue;
    std::ostringstream text;
    const auto overlap = std::min(a.start + a.bytes, b.start + b.bytes) - b.start;
    if (a.owner == b.owner) {
      text << "the rows of the destination range of task " << a.owner->task
           << " overlap each other by " << overlap << " bytes (a row stride shorter than a row?)";
    } else {
      text << "destination ranges of task " << a.owner->task << " (" << a.owner->size
           << " bytes) and task " << b.owner->task << " (" << b.owner->size << " bytes) overlap by "
           << overlap << " bytes";
    }
    problems.push_back({a.owner->task, b.owner->task, text.str()});
  }
  return problems;
}

}  // namespace

#ifndef RESHARD_WITH_CUDA
int visible_cuda_devices() noexcept { return 0; }
void copy_device_to_host(void*, const void*, std::size_t, int) {
  throw_error(ErrorCode::kUnsupported, "this build has no CUDA support");
}
void copy_host_to_device(void*, const void*, std::size_t, int) {
  throw_error(ErrorCode::kUnsupported, "this build has no CUDA support");
}
#endif

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

StridedRange CopyService::Impl::check_request(const char* call, TaskId task, const Buffer& buffer,
                                              const StridedRange& range, PeId peer,
                                              const char* peer_role) const {
  require_usable(call);
  const int n = bootstrap->size();
  std::ostringstream where;
  where << call << " of task " << task << " on PE " << bootstrap->rank() << ": ";
  // Every refusal names the task, in the message and in Error::tasks().
  auto refuse = [&](const std::string& why) {
    throw Error(ErrorCode::kInvalidArgument, where.str() + why, {task});
  };
  if (peer < 0 || peer >= n) {
    refuse(std::string(peer_role) + " " + std::to_string(peer) + " is outside 0.." +
           std::to_string(n - 1));
  }
  if (buffer.data == nullptr && buffer.bytes > 0) refuse("the buffer pointer is null");
  const std::size_t pos = range.pos;
  if (range.dims == 0) {
    const std::size_t size = range.row_bytes;
    if (pos > buffer.bytes || size > buffer.bytes - pos) {
      refuse("range [" + std::to_string(pos) + ", " + std::to_string(pos) + " + " +
             std::to_string(size) + ") lies outside its " + describe(buffer));
    }
  } else {
    if (range.dims < 0 || range.dims > StridedRange::kMaxOuterDims) {
      refuse("a strided range has " + std::to_string(range.dims) + " dimensions (0.." +
             std::to_string(StridedRange::kMaxOuterDims) + " allowed)");
    }
    // In 128 bits, so that extents whose product wraps around are refused, not believed.
    using Wide = unsigned __int128;
    Wide rows = 1, reach = 0;
    for (int d = 0; d < range.dims; ++d) {
      rows *= range.extent[d];
      if (range.extent[d] > 0) reach += Wide{range.extent[d] - 1} * range.stride[d];
      if (rows > UINT64_MAX || reach > UINT64_MAX) refuse("a strided range's extents overflow");
    }
    const unsigned __int128 bytes = rows * range.row_bytes;
    if (bytes > UINT64_MAX) refuse("a strided range's extents overflow");
    std::ostringstream shape;
    shape << "strided range at " << pos << " (" << static_cast<std::uint64_t>(rows) << " rows of "
          << range.row_bytes << " bytes, strides";
    for (int d = 0; d < range.dims; ++d) shape << " " << range.stride[d];
    shape << ")";
    if (bytes > 0 && (pos > buffer.bytes || reach + range.row_bytes > buffer.bytes - pos)) {
      refuse(shape.str() + " reaches byte " +
             std::to_string(static_cast<std::uint64_t>(pos + reach + range.row_bytes)) +
             ", outside its " + describe(buffer));
    }
  }
  try {
    transport->check_buffer(buffer);
  } catch (const Error& error) {
    throw Error(error.code(), where.str() + error.what(), {task});
  }
  return range.simplified();
}

ExecutionPlan CopyService::Impl::build_plan(const Schedule& schedule) const {
  const PeId me = bootstrap->rank();
  std::unordered_map<TaskId, const Registration*> my_sends, my_receives;
  my_sends.reserve(sends.size());
  my_receives.reserve(receives.size());
  for (const Registration& r : sends) my_sends.emplace(r.task, &r);
  for (const Registration& r : receives) my_receives.emplace(r.task, &r);

  ExecutionPlan plan;
  plan.rounds = schedule.rounds;
  for (std::uint32_t index : schedule.local) {
    const Transfer& t = schedule.transfers[index];
    if (t.src != me || t.bytes == 0) continue;
    const Registration* from = my_sends.at(t.task);
    const Registration* to = my_receives.at(t.task);
    for_each_piece(0, t.bytes, t.src_row_bytes, t.dst_row_bytes,
                   [&](std::uint64_t at, std::uint64_t bytes) {
                     plan.local_copies.push_back({from->at(at), to->at(at), bytes});
                   });
  }
  for (const Batch& batch : schedule.batches) {
    const bool sending = batch.src == me;
    if (!sending && batch.dst != me) continue;
    PlannedBatch planned{sending ? batch.dst : batch.src, batch.round, batch.bytes,
                         static_cast<std::uint32_t>(plan.spans.size()), 0};
    const auto& mine = sending ? my_sends : my_receives;
    for (std::uint32_t s = 0; s < batch.segment_count; ++s) {
      const Segment& segment = schedule.segments[batch.first_segment + s];
      const Transfer& transfer = schedule.transfers[segment.transfer];
      const bool contiguous = transfer.src_row_bytes == 0 && transfer.dst_row_bytes == 0;
      // Consecutive pieces of one contiguous transfer are contiguous on both PEs: both sides
      // merge them the same way, so span i of a send batch still matches span i of its receive
      // batch.
      if (s > 0 && contiguous) {
        const Segment& previous = schedule.segments[batch.first_segment + s - 1];
        if (previous.transfer == segment.transfer &&
            previous.offset + previous.bytes == segment.offset) {
          plan.spans.back().bytes += segment.bytes;
          continue;
        }
      }
      const Registration* r = mine.at(transfer.task);
      for_each_piece(segment.offset, segment.bytes, transfer.src_row_bytes, transfer.dst_row_bytes,
                     [&](std::uint64_t at, std::uint64_t bytes) {
                       plan.spans.push_back({r->at(at), bytes});
                       ++planned.span_count;
                     });
    }
    (sending ? plan.sends : plan.receives).push_back(planned);
  }
  return plan;
}

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

namespace {

// The environment's options, with the transport named in code: RESHARD_TRANSPORT chooses only
// where the code leaves it to the job (kAuto).
CopyServiceOptions environment_with(TransportKind transport) {
  CopyServiceOptions options = CopyServiceOptions::from_environment();
  if (transport != TransportKind::kAuto) options.transport = transport;
  return options;
}

}  // namespace

// The options are checked before the bootstrap connects to the other PEs.
CopyService::CopyService(const CopyServiceOptions& options)
    : CopyService((options.validate(), std::shared_ptr<Bootstrap>(make_default_bootstrap())),
                  options) {}

CopyService::CopyService(std::shared_ptr<Bootstrap> bootstrap, const CopyServiceOptions& options)
    : impl_(std::make_unique<Impl>()) {
  if (!bootstrap) throw_error(ErrorCode::kInvalidArgument, "CopyService needs a bootstrap");
  options.validate();
  impl_->bootstrap = std::move(bootstrap);
  impl_->options = options;
}

CopyService::CopyService(TransportKind transport) : CopyService(environment_with(transport)) {}

CopyService::CopyService(std::shared_ptr<Bootstrap> bootstrap, TransportKind transport)
    : CopyService(std::move(bootstrap), environment_with(transport)) {}

CopyService::~CopyService() { finalize(); }

const CopyServiceOptions& CopyService::options() const { return impl_->options; }

void CopyService::init(LogLevel log_level) {
  impl_->require(impl_->state == State::kCreated, "init()");
  impl_->options.log_level = env::log_level().value_or(log_level);
  init();
}

void CopyService::init() {
  impl_->require(impl_->state == State::kCreated, "init()");
  set_log_level(impl_->options.log_level);
  set_log_pe(impl_->bootstrap->rank());
  impl_->bootstrap->set_timeout(impl_->options.timeout);
  impl_->transport = make_transport(*impl_->bootstrap, impl_->options);
  impl_->verify = impl_->verify || impl_->options.verify;
  impl_->state = State::kInitialized;
  // Once for the job at INFO (PE 0), each PE's own line at DEBUG.
  if (my_pe() == 0) {
    RESHARD_LOG(kInfo, "copy service ready: " << n_pes() << " PE" << (n_pes() > 1 ? "s" : "")
                                              << ", transport " << impl_->transport->name());
  }
  RESHARD_LOG(kDebug, "copy service ready: PE " << my_pe() << " of " << n_pes() << ", transport "
                                                << impl_->transport->name());
}

int CopyService::my_pe() const { return impl_->bootstrap->rank(); }
int CopyService::n_pes() const { return impl_->bootstrap->size(); }
int CopyService::device() const { return impl_->transport ? impl_->transport->device() : -1; }
bool CopyService::initialized() const {
  return impl_->state == State::kInitialized || impl_->state == State::kScheduled;
}
TransportKind CopyService::transport() const { return impl_->options.transport; }
std::string CopyService::transport_name() const {
  return impl_->transport ? impl_->transport->name() : "none";
}

void CopyService::register_send(TaskId task_id, const Buffer& src, std::size_t src_pos,
                                std::size_t size, PeId dest_pe) {
  register_send(task_id, src, StridedRange::contiguous(src_pos, size), dest_pe);
}

void CopyService::register_receive(TaskId task_id, const Buffer& dst, std::size_t dst_pos,
                                   std::size_t size, PeId src_pe) {
  register_receive(task_id, dst, StridedRange::contiguous(dst_pos, size), src_pe);
}

void CopyService::register_send(TaskId task_id, const Buffer& src, const StridedRange& range,
                                PeId dest_pe) {
  const StridedRange checked =
      impl_->check_request("register_send", task_id, src, range, dest_pe, "destination PE");
  impl_->sends.push_back({task_id, src, checked, checked.bytes(), dest_pe, impl_->phase});
  ++impl_->generation;
  impl_->state = State::kInitialized;  // a new request invalidates an existing plan
}

void CopyService::register_receive(TaskId task_id, const Buffer& dst, const StridedRange& range,
                                   PeId src_pe) {
  const StridedRange checked =
      impl_->check_request("register_receive", task_id, dst, range, src_pe, "source PE");
  impl_->receives.push_back({task_id, dst, checked, checked.bytes(), src_pe, impl_->phase});
  ++impl_->generation;
  impl_->state = State::kInitialized;
}

void CopyService::set_phase(std::uint32_t phase) {
  impl_->require_usable("set_phase()");
  // Phases are cheap only while they are few: each is prepared and launched on its own.
  constexpr std::uint32_t kMaxPhases = 1 << 16;
  if (phase >= kMaxPhases) {
    throw_error(ErrorCode::kInvalidArgument, "set_phase(" + std::to_string(phase) + "): at most " +
                                                 std::to_string(kMaxPhases) + " phases");
  }
  impl_->phase = phase;
}

std::uint32_t CopyService::phases() const {
  impl_->require(impl_->state == State::kScheduled, "phases()");
  return static_cast<std::uint32_t>(impl_->plans.size());
}

bool CopyService::moves_rows_in_place() const {
  impl_->require_usable("moves_rows_in_place()");
  return impl_->transport->caps().strided_rows;
}

bool CopyService::waits_in_stream_front_end() const {
  impl_->require_usable("waits_in_stream_front_end()");
  return impl_->transport->caps().front_end_waits;
}

ScheduleReport CopyService::schedule() {
  impl_->require_usable("schedule()");
  Impl& self = *impl_;
  const PeId me = my_pe();
  const int n = n_pes();
  try {
    std::vector<RequestClaim> my_sends, my_receives;
    for (const Registration& r : self.sends)
      my_sends.push_back({r.task, me, r.peer, r.size, r.row_bytes(), r.phase});
    std::map<std::uint32_t, std::vector<Registration>> receives_by_phase;
    for (const Registration& r : self.receives) {
      my_receives.push_back({r.task, me, r.peer, r.size, r.row_bytes(), r.phase});
      receives_by_phase[r.phase].push_back(r);
    }
    // Receives of different phases never land at once: they may share memory.
    std::vector<LocalProblem> local_problems;
    for (const auto& [phase, receives] : receives_by_phase) {
      for (LocalProblem& problem : find_overlapping_receives(receives))
        local_problems.push_back(std::move(problem));
    }

    message::Writer summary;
    summary.put_array(std::span<const RequestClaim>(my_sends));
    summary.put_array(std::span<const RequestClaim>(my_receives));
    summary.put<std::uint64_t>(local_problems.size());
    for (const LocalProblem& problem : local_problems) {
      summary.put<std::uint64_t>(problem.first);
      summary.put<std::uint64_t>(problem.second);
      summary.put_string(problem.text);
    }
    // Every PE must build the same schedule: the batch sizes and peers per round are the
    // smallest any PE allows (its transport, or RESHARD_CHUNK_BYTES set on that PE alone).
    const TransportCaps caps = self.transport->caps();
    summary.put<std::uint64_t>(
        std::min(caps.chunk_bytes, self.options.chunk_bytes.value_or(UINT64_MAX)));
    summary.put<std::uint64_t>(caps.min_chunk_bytes);
    summary.put<std::int64_t>(caps.max_peers_per_round);
    const auto gathered = meet(*self.bootstrap, self.options, summary.bytes(), "schedule()");

    std::vector<RequestClaim> all_sends, all_receives;
    std::ostringstream problems;
    std::size_t problem_count = 0;
    std::vector<TaskId> problem_tasks;
    std::uint64_t chunk_bytes = UINT64_MAX, min_chunk_bytes = UINT64_MAX;
    std::int64_t peers_per_round = INT64_MAX;
    for (int pe = 0; pe < n; ++pe) {
      message::Reader reader(gathered[pe]);
      for (const RequestClaim& c : reader.get_array<RequestClaim>()) all_sends.push_back(c);
      for (const RequestClaim& c : reader.get_array<RequestClaim>()) all_receives.push_back(c);
      const auto count = reader.get<std::uint64_t>();
      for (std::uint64_t i = 0; i < count; ++i) {
        problem_tasks.push_back(reader.get<std::uint64_t>());
        problem_tasks.push_back(reader.get<std::uint64_t>());
        const std::string text = reader.get_string();
        if (++problem_count <= 8) problems << "\n  - PE " << pe << ": " << text;
      }
      chunk_bytes = std::min(chunk_bytes, reader.get<std::uint64_t>());
      min_chunk_bytes = std::min(min_chunk_bytes, reader.get<std::uint64_t>());
      peers_per_round = std::min(peers_per_round, reader.get<std::int64_t>());
    }
    if (problem_count > 0) {
      if (problem_count > 8) problems << "\n  - ... and " << problem_count - 8 << " more";
      throw Error(ErrorCode::kValidation,
                  "schedule() refused: " + std::to_string(problem_count) +
                      (problem_count == 1 ? " problem" : " problems") +
                      " with the registered requests:" + problems.str(),
                  problem_tasks);
    }
    const std::vector<Transfer> transfers = match_requests(all_sends, all_receives, n);
    SchedulerOptions options;
    options.chunk_bytes = chunk_bytes;
    options.min_chunk_bytes = std::min(min_chunk_bytes, options.chunk_bytes);
    options.max_peers_per_round = static_cast<int>(std::clamp<std::int64_t>(peers_per_round, 1, n));
    // Each phase is scheduled on its own: its batches never wait for another phase's.
    std::uint32_t phases = 1;
    for (const auto* claims : {&all_sends, &all_receives}) {
      for (const RequestClaim& c : *claims) phases = std::max(phases, c.phase + 1);
    }
    std::vector<std::vector<Transfer>> by_phase(phases);
    for (const Transfer& t : transfers) by_phase[t.phase].push_back(t);
    ScheduleReport report;
    report.phases = phases;
    self.plans.clear();
    for (const std::vector<Transfer>& phase : by_phase) {
      const Schedule schedule = build_schedule(phase, n, options);
      self.plans.push_back(self.build_plan(schedule));
      report.transfers += schedule.transfers.size();
      report.batches += schedule.batches.size();
      report.rounds += schedule.rounds;
      report.lower_bound_bytes += schedule.lower_bound_bytes;
      report.makespan_bytes += schedule.makespan_bytes;
    }
    self.transport->prepare(self.plans);
    self.retry_pending = false;  // prepare() started the transport afresh on every PE
    for (const ExecutionPlan& plan : self.plans) {
      for (const PlannedBatch& b : plan.sends) report.bytes_sent += b.bytes;
      for (const PlannedBatch& b : plan.receives) report.bytes_received += b.bytes;
      for (const LocalCopy& c : plan.local_copies) report.bytes_local += c.bytes;
    }
    self.state = State::kScheduled;
    self.scheduled_since_clear = true;
    RESHARD_LOG(kDebug, "scheduled " << report.transfers << " transfers in " << report.rounds
                                     << " rounds of " << phases << " phase(s), makespan/bound "
                                     << report.bound_ratio());
    return report;
  } catch (const CollectiveAbandoned&) {
    throw;  // every PE failed the meeting alike, nothing was prepared: schedule() may run again
  } catch (const Error& error) {
    // Validation errors are raised identically on every PE; the service stays usable so the
    // caller may clear_requests() and try again.
    if (error.code() == ErrorCode::kValidation) throw;
    self.fail(error);
  }
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

void CopyService::clear_requests() {
  impl_->require_usable("clear_requests()");
  forget_requests(*impl_);
  // execute_reshard_plan's executor goes too, with its staging (on GPUs device memory).
  impl_->attachment.reset();
}

void CopyService::forget_requests(Impl& self) {
  if (self.transport && self.state == State::kScheduled) self.transport->forget_schedule();
  self.scheduled_since_clear = false;
  self.sends.clear();
  self.receives.clear();
  self.plans.clear();
  self.phase = 0;
  self.state = State::kInitialized;
  ++self.generation;
}

std::vector<std::vector<std::byte>> CopyService::all_gather(std::span<const std::byte> mine) {
  return impl_->bootstrap->all_gather(mine);
}

void CopyService::finalize() {
  if (!impl_ || impl_->state == State::kFinalized) return;
  impl_->attachment.reset();  // executors may hold staging that needs the transport's device
  if (impl_->transport) impl_->transport->finalize();
  impl_->transport.reset();
  impl_->sends.clear();
  impl_->receives.clear();
  impl_->plans.clear();
  impl_->state = State::kFinalized;
}

}  // namespace reshard

namespace reshard::test_hooks {

void ServiceProbe::corrupt_receives_after_run(CopyService& service, std::optional<TaskId> victim) {
  CopyService::Impl& self = *service.impl_;
  self.after_transfer = nullptr;
  if (!victim) return;
  self.after_transfer = [&self, task = *victim](std::uint32_t phase) {
    for (const Registration& r : self.receives) {
      if (r.task != task || r.size == 0 || r.phase != phase) continue;
      if (r.buffer.kind == MemoryKind::kHost) {
        *r.start() ^= std::byte{1};
      } else {
        std::byte value;
        copy_device_to_host(&value, r.start(), 1, r.buffer.device);
        value ^= std::byte{1};
        copy_host_to_device(r.start(), &value, 1, r.buffer.device);
      }
    }
  };
}

}  // namespace reshard::test_hooks

namespace reshard::execution {

std::uint64_t ServiceSlot::generation(const CopyService& service) {
  return service.impl_->generation;
}

std::shared_ptr<void>& ServiceSlot::executors(CopyService& service) {
  return service.impl_->attachment;
}

std::vector<std::vector<std::byte>> ServiceSlot::meet(CopyService& service,
                                                      std::span<const std::byte> mine,
                                                      const std::string& call) {
  return reshard::meet(*service.impl_->bootstrap, service.impl_->options, mine, call);
}

void ServiceSlot::begin_run(CopyService& service) { service.impl_->begin_run(); }

void ServiceSlot::run_phase(CopyService& service, std::uint32_t phase, void* cuda_stream) {
  service.impl_->run_phase(phase, cuda_stream, /*begins=*/false);
}

void ServiceSlot::clear_requests(CopyService& service) {
  service.impl_->require_usable("clear_requests()");
  CopyService::forget_requests(*service.impl_);
}

}  // namespace reshard::execution

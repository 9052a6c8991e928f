// The requests a PE registers: each checked against its buffer and peer as it comes, the
// receives checked against each other at schedule().
#include <algorithm>
#include <set>
#include <sstream>

#include "service/copy_service_impl.hpp"

namespace reshard {

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
  impl_->add_request(/*sending=*/true, task_id, src, range, dest_pe);
}

void CopyService::register_receive(TaskId task_id, const Buffer& dst, const StridedRange& range,
                                   PeId src_pe) {
  impl_->add_request(/*sending=*/false, task_id, dst, range, src_pe);
}

void CopyService::Impl::add_request(bool sending, TaskId task, const Buffer& buffer,
                                    const StridedRange& range, PeId peer) {
  const StridedRange checked =
      check_request(sending ? "register_send" : "register_receive", task, buffer, range, peer,
                    sending ? "destination PE" : "source PE");
  (sending ? sends : receives).push_back({task, buffer, checked, checked.bytes(), peer, phase});
  ++generation;
  state = State::kInitialized;  // a new request invalidates an existing plan
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

}  // namespace reshard

// Host transport: PEs are processes on one machine. Each PE owns a shared-memory inbox with one
// channel per source PE; a channel is a ring of slots with a head counter (advanced by the sender
// once a slot is filled) and a tail counter (advanced by the receiver once it has emptied one).
// Counters only grow from one schedule on (schedule() and recover() zero them with every PE
// outside run()), so run() needs no barrier: both ends walk the same batches in the same order.
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <sstream>
#include <thread>

#include "core/env.hpp"
#include "core/host_copy.hpp"
#include "core/interrupt.hpp"
#include "core/message.hpp"
#include "core/processes.hpp"
#include "core/transport.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "reshard/types.hpp"
#include "transports/host/shm_segment.hpp"

namespace reshard {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::uint64_t kMagic = 0x7265736861726431ull;  // "reshard1"
constexpr std::size_t kPage = 4096;
constexpr std::uint64_t kSlotsPerChannel = 4;
constexpr std::uint64_t kMinSlotBytes = 4096;
constexpr std::uint64_t kMaxSlotBytes = 4ull << 20;

// InboxHeader::aborted: why the PE stopped taking part.
enum Aborted : std::uint32_t {
  kRunning = 0,
  kFailed = 1,     // for good: its service is failed
  kWillRetry = 2,  // a run it can retry: it is alive and will meet the others at its next run
};

struct InboxHeader {
  std::uint64_t magic;
  std::int32_t pe;
  std::int32_t pid;
  std::atomic<std::uint32_t> aborted;  // Aborted
  // Why the PE failed, whole: the rest of the header's page (its peers repeat it in their errors;
  // a timeout's reason names the PEs behind and the setting, which 244 bytes used to cut off).
  char abort_reason[4032];
  // Calls of run() the PE has begun: a peer that timed out names the PE that is behind.
  std::atomic<std::uint64_t> runs;
};
static_assert(sizeof(InboxHeader) <= kPage);

struct ChannelCounters {
  alignas(64) std::atomic<std::uint64_t> head;  // slots filled by the sender
  alignas(64) std::atomic<std::uint64_t> tail;  // slots emptied by the receiver
};
static_assert(std::atomic<std::uint64_t>::is_always_lock_free);

std::size_t round_up(std::size_t value, std::size_t to) { return (value + to - 1) / to * to; }

std::string make_job_id() {
  if (auto id = env::job_id()) return *id;
  std::random_device device;
  std::ostringstream text;
  text << std::hex << ::getpid() << "x" << device();
  return text.str();
}

class HostTransport final : public Transport {
 public:
  HostTransport(Bootstrap& bootstrap, const CopyServiceOptions& options);
  ~HostTransport() override { finalize(); }

  const char* name() const override { return "host"; }
  TransportCaps caps() const override { return {slot_bytes_, 1, 64 << 10}; }
  int device() const override { return -1; }
  void check_buffer(const Buffer& buffer) const override;
  void schedule(std::span<const ExecutionPlan> phases) override;
  void run(const ExecutionPlan& plan, std::size_t phase, void* stream) override;
  void abort(const std::string& reason) noexcept override { set_aborted(reason, kFailed); }
  void offer_retry(const std::string& reason) noexcept override { set_aborted(reason, kWillRetry); }
  bool can_retry() const override { return can_retry_; }
  bool retry_requested() const override;
  void recover() override;
  void finalize() noexcept override;

 private:
  // Inbox layout: header page, counters for every source PE, then each source's slots.
  std::size_t counters_offset() const { return kPage; }
  std::size_t slots_offset() const {
    return round_up(kPage + n_pes_ * sizeof(ChannelCounters), kPage);
  }
  std::size_t inbox_bytes() const {
    return slots_offset() + n_pes_ * kSlotsPerChannel * slot_bytes_;
  }
  InboxHeader& header(PeId pe) const {
    return *reinterpret_cast<InboxHeader*>(inboxes_[pe].data());
  }
  ChannelCounters& counters(PeId receiver, PeId sender) const {
    return reinterpret_cast<ChannelCounters*>(inboxes_[receiver].data() +
                                              counters_offset())[sender];
  }
  std::byte* slot(PeId receiver, PeId sender, std::uint64_t sequence) const {
    return inboxes_[receiver].data() + slots_offset() +
           (sender * kSlotsPerChannel + sequence % kSlotsPerChannel) * slot_bytes_;
  }
  // Throws where `peer` failed or exited (can_retry_: whether it only failed a run it retries).
  void check_peer(PeId peer, const char* waiting_for);
  // Throws where some PE asks to retry a run: this one must not go on without it.
  void check_no_retry_requested();
  void set_aborted(const std::string& reason, Aborted how) noexcept;
  // Zeroes this PE's inbox (its channels' counters, runs begun, abort): with every PE outside
  // run(), which the barrier after it keeps them until every inbox is zeroed.
  void reset_inbox();
  // For a timeout: the PEs that have begun fewer run() calls than the others, named (else empty).
  std::string behind_peers() const;

  Bootstrap& bootstrap_;
  PeId my_pe_;
  int n_pes_;
  std::uint64_t slot_bytes_ = 0;
  std::chrono::milliseconds timeout_;
  std::chrono::milliseconds arrival_timeout_;  // for peers that have not begun this run
  std::vector<host::ShmSegment> inboxes_;
  bool finalized_ = false;
  // The last run() threw, and every PE can meet and run again: false from each run's start until
  // a throw that leaves it so (a timeout on live peers, a peer's retry).
  bool can_retry_ = false;
  // Per peer, in round order, the batches that share each slot: consecutive batches to one peer
  // are packed into a slot while they fit. Sender and receiver derive the same grouping from the
  // same batch sequence, so slots carry no header.
  struct SlotFill {
    std::vector<std::uint32_t> batches;
  };
  static void group_into_slots(const std::vector<PlannedBatch>& batches, int n_pes,
                               std::uint64_t slot_bytes, std::vector<std::vector<SlotFill>>& out);
  // Visits the spans of a slot's batches in the order their bytes sit in the slot.
  template <typename Visit>
  static void for_each_span(const ExecutionPlan& plan, const std::vector<PlannedBatch>& batches,
                            const SlotFill& fill, Visit visit) {
    for (std::uint32_t b : fill.batches) {
      const PlannedBatch& batch = batches[b];
      for (std::uint32_t s = 0; s < batch.span_count; ++s) visit(plan.spans[batch.first_span + s]);
    }
  }
  // Per phase of the schedule: per peer, the slots of its sends and of its receives.
  struct PhaseSlots {
    std::vector<std::vector<SlotFill>> sends_by_peer, receives_by_peer;
  };
  std::vector<PhaseSlots> phases_;
};

HostTransport::HostTransport(Bootstrap& bootstrap, const CopyServiceOptions& options)
    : bootstrap_(bootstrap),
      my_pe_(bootstrap.rank()),
      n_pes_(bootstrap.size()),
      timeout_(options.timeout),
      arrival_timeout_(options.arrival_timeout) {
  // Every PE must use the same slot size: take the smallest any PE asked for.
  const std::uint64_t budget = options.host.staging_bytes;
  std::uint64_t wanted = budget / (std::max(n_pes_ - 1, 1) * kSlotsPerChannel);
  wanted = std::clamp(wanted / kPage * kPage, kMinSlotBytes, kMaxSlotBytes);
  message::Writer mine;
  mine.put(wanted);
  // The creator's pid too: a mixed schedule runs one host transport per node, each with its own
  // PE 0, under one job id.
  std::string job_id =
      bootstrap.rank() == 0 ? make_job_id() + "-" + std::to_string(::getpid()) : std::string();
  mine.put_string(job_id);
  const auto all = bootstrap.all_gather(mine.bytes());
  slot_bytes_ = wanted;
  for (std::size_t pe = 0; pe < all.size(); ++pe) {
    message::Reader reader(all[pe]);
    slot_bytes_ = std::min(slot_bytes_, reader.get<std::uint64_t>());
    std::string id = reader.get_string();
    if (pe == 0) job_id = std::move(id);
  }

  // Every PE creates its services in the same order, so the generation agrees across PEs and
  // a new service never meets the names of an earlier one.
  static std::atomic<int> generation{0};
  const std::string prefix = "/reshard-" + job_id + "-" + std::to_string(generation++) + "-pe";
  auto inbox_name = [&](PeId pe) { return prefix + std::to_string(pe); };
  inboxes_.resize(n_pes_);
  inboxes_[my_pe_] = host::ShmSegment::create(inbox_name(my_pe_), inbox_bytes());
  InboxHeader& mine_header = header(my_pe_);
  mine_header.magic = kMagic;
  mine_header.pe = my_pe_;
  mine_header.pid = static_cast<std::int32_t>(::getpid());
  mine_header.aborted.store(0);
  try {
    bootstrap.barrier();  // every inbox exists
    for (PeId pe = 0; pe < n_pes_; ++pe) {
      if (pe == my_pe_) continue;
      inboxes_[pe] = host::ShmSegment::open(inbox_name(pe), inbox_bytes());
      if (header(pe).magic != kMagic || header(pe).pe != pe) {
        throw_error(ErrorCode::kSystem, "shared memory " + inbox_name(pe) + " is not PE " +
                                            std::to_string(pe) + "'s inbox");
      }
    }
    bootstrap.barrier();  // every inbox is mapped by everyone: the names can go
  } catch (...) {
    inboxes_[my_pe_].unlink();
    throw;
  }
  inboxes_[my_pe_].unlink();
  RESHARD_LOG(kDebug, "host transport: " << n_pes_ << " PEs, " << kSlotsPerChannel << " slots of "
                                         << format_bytes(slot_bytes_) << " per channel, inbox "
                                         << format_bytes(inbox_bytes()));
}

void HostTransport::check_buffer(const Buffer& buffer) const {
  if (buffer.kind != MemoryKind::kHost) {
    throw_error(ErrorCode::kInvalidArgument, "the host transport moves host memory only, not a " +
                                                 describe(buffer) +
                                                 " (choose a GPU transport for device memory)");
  }
}

void HostTransport::group_into_slots(const std::vector<PlannedBatch>& batches, int n_pes,
                                     std::uint64_t slot_bytes,
                                     std::vector<std::vector<SlotFill>>& out) {
  out.assign(n_pes, {});
  std::vector<std::uint64_t> filled(n_pes, 0);
  for (std::uint32_t i = 0; i < batches.size(); ++i) {
    const PlannedBatch& batch = batches[i];
    if (batch.bytes > slot_bytes) {
      throw_error(ErrorCode::kInvalidState, "a batch exceeds the host transport's slot size");
    }
    auto& slots = out[batch.peer];
    if (slots.empty() || filled[batch.peer] + batch.bytes > slot_bytes) {
      slots.emplace_back();
      filled[batch.peer] = 0;
    }
    slots.back().batches.push_back(i);
    filled[batch.peer] += batch.bytes;
  }
}

void HostTransport::schedule(std::span<const ExecutionPlan> phases) {
  // Counters only grow, so phases need nothing between them: a later phase's bytes reach a
  // receiver's memory only through its own copies out of its inbox, after its earlier phases.
  phases_.assign(phases.size(), {});
  for (std::size_t p = 0; p < phases.size(); ++p) {
    group_into_slots(phases[p].sends, n_pes_, slot_bytes_, phases_[p].sends_by_peer);
    group_into_slots(phases[p].receives, n_pes_, slot_bytes_, phases_[p].receives_by_peer);
  }
  // A run that failed under the last schedule may have left bytes in flight: the new schedule
  // starts from empty channels (schedule() has met every PE, so none is in run()).
  recover();
}

void HostTransport::reset_inbox() {
  InboxHeader& mine = header(my_pe_);
  for (PeId sender = 0; sender < n_pes_; ++sender) {
    counters(my_pe_, sender).head.store(0, std::memory_order_relaxed);
    counters(my_pe_, sender).tail.store(0, std::memory_order_relaxed);
  }
  mine.runs.store(0, std::memory_order_relaxed);
  mine.abort_reason[0] = '\0';
  mine.aborted.store(kRunning, std::memory_order_release);
  can_retry_ = false;
}

void HostTransport::recover() {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "recover() after finalize()");
  reset_inbox();
  bootstrap_.barrier();  // no PE sends before every inbox is zeroed
}

bool HostTransport::retry_requested() const {
  if (finalized_) return false;
  for (PeId pe = 0; pe < n_pes_; ++pe) {
    if (header(pe).aborted.load(std::memory_order_acquire) == kWillRetry) return true;
  }
  return false;
}

void HostTransport::check_no_retry_requested() {
  for (PeId pe = 0; pe < n_pes_; ++pe) {
    if (pe != my_pe_ && header(pe).aborted.load(std::memory_order_acquire) == kWillRetry)
      check_peer(pe, "to begin this run");
  }
}

void HostTransport::check_peer(PeId peer, const char* waiting_for) {
  const InboxHeader& peer_header = header(peer);
  // A zombie counts as exited: a launcher that polls its children may reap it seconds later.
  const pid_t pid = peer_header.pid;
  const bool exited = first_exited_process(std::span(&pid, 1), /*count_zombies=*/true) == 0;
  if (const std::uint32_t aborted = peer_header.aborted.load(std::memory_order_acquire);
      aborted != kRunning) {
    // A peer that will retry and is alive: this PE retries too, at its next run.
    can_retry_ = aborted == kWillRetry && !exited;
    throw_error(
        ErrorCode::kPeerFailure,
        "PE " + std::to_string(peer) + " failed while PE " + std::to_string(my_pe_) +
            " was waiting " + waiting_for + ": " +
            std::string(peer_header.abort_reason,
                        strnlen(peer_header.abort_reason, sizeof peer_header.abort_reason)));
  }
  if (exited) {
    throw_error(ErrorCode::kPeerFailure,
                "PE " + std::to_string(peer) + " (pid " + std::to_string(peer_header.pid) +
                    ") exited while PE " + std::to_string(my_pe_) + " was waiting " + waiting_for);
  }
}

void HostTransport::run(const ExecutionPlan& plan, std::size_t phase,
                        void* /*stream: host memory needs none*/) {
  if (finalized_) throw_error(ErrorCode::kInvalidState, "run() after finalize()");
  const auto& sends_by_peer = phases_.at(phase).sends_by_peer;
  const auto& receives_by_peer = phases_.at(phase).receives_by_peer;
  can_retry_ = false;
  // A PE that failed a run and waits for the others to meet it: this run would wait for it.
  check_no_retry_requested();
  const std::uint64_t my_runs = header(my_pe_).runs.fetch_add(1, std::memory_order_release) + 1;
  for (const LocalCopy& copy : plan.local_copies) {
    // A PE's own ranges may overlap (a buffer shifted within itself): those need memmove.
    const bool apart = copy.dst + copy.bytes <= copy.src || copy.src + copy.bytes <= copy.dst;
    if (apart) {
      copy_bytes(copy.dst, copy.src, copy.bytes);
    } else {
      std::memmove(copy.dst, copy.src, copy.bytes);
    }
  }

  std::vector<std::size_t> next_send(n_pes_, 0), next_receive(n_pes_, 0);
  std::size_t remaining = 0;
  for (PeId peer = 0; peer < n_pes_; ++peer) {
    remaining += sends_by_peer[peer].size() + receives_by_peer[peer].size();
  }
  auto last_progress = Clock::now();
  auto next_check = last_progress;
  unsigned idle_rounds = 0;
  bool was_late = false;  // some peer had not begun this run at the last check
  while (remaining > 0) {
    bool progressed = false;
    for (PeId peer = 0; peer < n_pes_; ++peer) {
      const auto& sends = sends_by_peer[peer];
      std::size_t& next = next_send[peer];
      if (next < sends.size()) {
        ChannelCounters& channel = counters(peer, my_pe_);
        std::uint64_t head = channel.head.load(std::memory_order_relaxed);
        const std::uint64_t tail = channel.tail.load(std::memory_order_acquire);
        while (next < sends.size() && head - tail < kSlotsPerChannel) {
          std::byte* out = slot(peer, my_pe_, head);
          for_each_span(plan, plan.sends, sends[next], [&](const CopySpan& span) {
            copy_bytes(out, span.data, span.bytes);
            out += span.bytes;
          });
          channel.head.store(++head, std::memory_order_release);
          ++next;
          --remaining;
          progressed = true;
        }
      }
      const auto& receives = receives_by_peer[peer];
      std::size_t& next_in = next_receive[peer];
      if (next_in < receives.size()) {
        ChannelCounters& channel = counters(my_pe_, peer);
        std::uint64_t tail = channel.tail.load(std::memory_order_relaxed);
        const std::uint64_t head = channel.head.load(std::memory_order_acquire);
        while (next_in < receives.size() && tail < head) {
          const std::byte* in = slot(my_pe_, peer, tail);
          for_each_span(plan, plan.receives, receives[next_in], [&](const CopySpan& span) {
            copy_bytes(span.data, in, span.bytes);
            in += span.bytes;
          });
          channel.tail.store(++tail, std::memory_order_release);
          ++next_in;
          --remaining;
          progressed = true;
        }
      }
    }
    if (progressed) {
      idle_rounds = 0;
      last_progress = Clock::now();
      continue;
    }
    // Idle: back off from spinning to yielding to sleeping, and look after the peers.
    ++idle_rounds;
    if (idle_rounds < 64) continue;
    if (idle_rounds < 256) {
      std::this_thread::yield();
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
    const auto now = Clock::now();
    if (now < next_check) continue;
    next_check = now + std::chrono::milliseconds(2);
    throw_if_interrupted("a run of the host transport", last_progress);
    std::string waiting;  // every peer this PE still waits for, for the timeout message
    std::string late;     // those of them that have not begun this run
    bool can_progress = false;
    for (PeId peer = 0; peer < n_pes_ && !can_progress; ++peer) {
      const bool sending = next_send[peer] < sends_by_peer[peer].size();
      const bool receiving = next_receive[peer] < receives_by_peer[peer].size();
      if (!sending && !receiving) continue;
      // Look at the channel once more: the peer may have written its last bytes and exited.
      const ChannelCounters& inbound = counters(my_pe_, peer);
      can_progress = receiving && inbound.head.load(std::memory_order_acquire) >
                                      inbound.tail.load(std::memory_order_relaxed);
      if (can_progress) break;
      const char* what = receiving ? "to receive from it" : "for it to drain its inbox";
      check_peer(peer, what);
      waiting += (waiting.empty() ? "PE " : ", PE ") + std::to_string(peer) + " (" +
                 (receiving ? "receiving" : "sending") + ")";
      if (header(peer).runs.load(std::memory_order_acquire) < my_runs)
        late += (late.empty() ? "PE " : ", PE ") + std::to_string(peer);
    }
    // A peer that has not begun this run is arriving (its trainer may still be in its step), not
    // stuck in a transfer: it has the arrival timeout.
    // The transfer's clock starts when the last of them arrives, not when this PE began.
    if (late.empty() && was_late) last_progress = now;
    was_late = !late.empty();
    const auto limit = late.empty() ? timeout_ : arrival_timeout_;
    if (can_progress || now - last_progress <= limit) continue;
    can_retry_ = true;  // every peer this PE waits for is alive: all may meet and run again
    if (!late.empty()) {
      throw_error(ErrorCode::kTimeout,
                  "PE " + std::to_string(my_pe_) + " waited " + format_seconds(limit) + " for " +
                      late + " to begin run() " + std::to_string(my_runs) +
                      " (the arrival timeout: arrival_timeout, RESHARD_ARRIVAL_TIMEOUT_S)" +
                      behind_peers());
    }
    throw_error(ErrorCode::kTimeout,
                "PE " + std::to_string(my_pe_) + " made no progress for " + format_seconds(limit) +
                    "; still waiting for " + waiting + behind_peers() +
                    " (a peer stopped or is stuck; RESHARD_TIMEOUT_S sets the limit)");
  }
  // A peer that gave up on this run before this PE came (its arrival timeout ran out) may have
  // left its bytes all the same, so the run went through here; that peer failed, so this PE fails
  // now too, not at its next call.
  for (PeId peer = 0; peer < n_pes_; ++peer) {
    if (sends_by_peer[peer].empty() && receives_by_peer[peer].empty()) continue;
    if (header(peer).aborted.load(std::memory_order_acquire) != 0)
      check_peer(peer, "for this run to end");
  }
}

std::string HostTransport::behind_peers() const {
  std::vector<std::uint64_t> runs(n_pes_);
  for (PeId pe = 0; pe < n_pes_; ++pe) runs[pe] = header(pe).runs.load(std::memory_order_acquire);
  const auto [least, most] = std::minmax_element(runs.begin(), runs.end());
  if (*least == *most) return {};  // all in the same run: the wait above says who is missing
  std::string behind, ahead;
  bool ahead_agree = true;
  for (PeId pe = 0; pe < n_pes_; ++pe) {
    std::string& list = runs[pe] == *least ? behind : ahead;
    list += (list.empty() ? "PE " : ", PE ") + std::to_string(pe);
    ahead_agree = ahead_agree && (runs[pe] == *least || runs[pe] == *most);
  }
  return "; " + behind + (behind.find(',') == std::string::npos ? " is" : " are") +
         " behind: begun run() " + std::to_string(*least) + " times where " + ahead + " did " +
         (ahead_agree ? "" : "up to ") + std::to_string(*most) +
         " (every PE must call run() as often as its peers)";
}

void HostTransport::set_aborted(const std::string& reason, Aborted how) noexcept {
  if (finalized_ || inboxes_.empty() || inboxes_[my_pe_].data() == nullptr) return;
  InboxHeader& mine = header(my_pe_);
  const std::size_t length = std::min(reason.size(), sizeof mine.abort_reason - 1);
  std::memcpy(mine.abort_reason, reason.data(), length);
  mine.abort_reason[length] = '\0';
  mine.aborted.store(how, std::memory_order_release);
}

void HostTransport::finalize() noexcept {
  if (finalized_) return;
  finalized_ = true;
  inboxes_.clear();
}

}  // namespace

std::unique_ptr<Transport> make_host_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options) {
  return std::make_unique<HostTransport>(bootstrap, options);
}

}  // namespace reshard

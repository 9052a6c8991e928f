#include "gpu/run_board.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "core/message.hpp"

namespace reshard::cuda {

RunBoard::RunBoard(int me, int n_pes) : me_(me), segments_(static_cast<std::size_t>(n_pes)) {
  // The pid makes the name unique on the machine; the count, among this process's services.
  static std::atomic<int> created{0};
  name_ = "/reshard-runs-" + std::to_string(::getpid()) + "-" + std::to_string(created++);
  segments_[static_cast<std::size_t>(me)] = host::ShmSegment::create(name_, sizeof(Entry));
  reset();
}

RunBoard RunBoard::of_this_machine(Bootstrap& bootstrap, std::span<const pid_t> local_pids) {
  RunBoard board(bootstrap.rank(), bootstrap.size());
  message::Writer name;
  name.put_string(board.name());
  const auto names = bootstrap.all_gather(name.bytes());
  for (int pe = 0; pe < bootstrap.size(); ++pe) {
    if (pe != bootstrap.rank() && local_pids[static_cast<std::size_t>(pe)] != 0)
      board.open(pe, message::Reader(names[static_cast<std::size_t>(pe)]).get_string());
  }
  bootstrap.barrier();  // every PE of this machine has mapped every other's entry
  board.unlink();
  return board;
}

void RunBoard::open(int pe, const std::string& name) {
  segments_[static_cast<std::size_t>(pe)] = host::ShmSegment::open(name, sizeof(Entry));
}

void RunBoard::unlink() noexcept {
  if (me_ >= 0) segments_[static_cast<std::size_t>(me_)].unlink();
}

std::uint64_t RunBoard::begin_run() noexcept {
  return entry(me_)->runs_begun.fetch_add(1, std::memory_order_release) + 1;
}

std::uint64_t RunBoard::runs_begun(int pe) const noexcept {
  return entry(pe)->runs_begun.load(std::memory_order_acquire);
}

void RunBoard::mark(State state, const std::string& reason) noexcept {
  if (me_ < 0) return;
  Entry& mine = *entry(me_);
  const std::size_t length = std::min(reason.size(), sizeof mine.reason - 1);
  std::memcpy(mine.reason, reason.data(), length);
  mine.reason[length] = '\0';
  mine.state.store(state, std::memory_order_release);  // the reason is whole before the state
}

void RunBoard::mark_will_retry(const std::string& reason) noexcept {
  if (me_ < 0) return;
  if (state(me_) == kRunning) return mark(kWillRetry, reason);
  entry(me_)->state.store(kWillRetry, std::memory_order_release);
}

RunBoard::State RunBoard::state(int pe) const noexcept {
  return static_cast<State>(entry(pe)->state.load(std::memory_order_acquire));
}

std::string RunBoard::reason(int pe) const {
  const Entry& peer = *entry(pe);
  return std::string(peer.reason, strnlen(peer.reason, sizeof peer.reason));
}

int RunBoard::first_peer_gone(State* state) const noexcept {
  for (int pe = 0; pe < static_cast<int>(segments_.size()); ++pe) {
    if (pe == me_ || segments_[static_cast<std::size_t>(pe)].data() == nullptr) continue;
    if (const State seen = this->state(pe); seen != kRunning) {
      *state = seen;
      return pe;
    }
  }
  return -1;
}

std::string RunBoard::gone_message(int peer, State state, const char* waiting_for) const {
  return "PE " + std::to_string(peer) + (state == kFailed ? " failed" : " gave its last run up") +
         " while PE " + std::to_string(me_) + " was waiting " + waiting_for + ": " + reason(peer);
}

std::string RunBoard::gone_clause(int peer, State state) const {
  return "PE " + std::to_string(peer) + (state == kFailed ? " failed" : " gave this run up") +
         " (" + reason(peer) + ")";
}

bool RunBoard::retry_asked() const noexcept {
  for (int pe = 0; pe < static_cast<int>(segments_.size()); ++pe) {
    if (!has(pe)) continue;
    if (const State seen = state(pe); seen == kWillRetry || seen == kGivingUp) return true;
  }
  return false;
}

void RunBoard::reset() noexcept {
  Entry& mine = *entry(me_);
  mine.runs_begun.store(0, std::memory_order_relaxed);
  mine.reason[0] = '\0';
  mine.state.store(kRunning, std::memory_order_release);
}

}  // namespace reshard::cuda

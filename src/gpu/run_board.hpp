// How each PE's runs stand, in shared host memory that every PE of the machine maps: the runs it
// has begun and whether it gave a run up (failed for good, or alive and meeting the others to run
// again). The CUDA, NVSHMEM and NCCL transports read it where the host decides (a run's start,
// while it waits for a run's end, the same-GPU watchdog) without a round trip to any GPU: a peer
// that has not begun this run is late, not stuck; a peer that gave its run up ends this PE's wait
// at once.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "reshard/bootstrap.hpp"
#include "transports/host/shm_segment.hpp"

namespace reshard::cuda {

class RunBoard {
 public:
  // kGivingUp: this PE's run failed (its flags released, copies skipped) and its service has not
  // yet said whether it runs again; peers whose run depended on it must not take it as done.
  enum State : std::uint32_t { kRunning = 0, kFailed = 1, kWillRetry = 2, kGivingUp = 3 };

  RunBoard() = default;
  // This PE's entry, under a name no other process on the machine uses; peers open() it.
  RunBoard(int me, int n_pes);
  // Collective over `bootstrap`: this PE's entry, and every entry of the PEs of this machine
  // (`local_pids`: nonzero for those) mapped, the names gone once every PE mapped them.
  static RunBoard of_this_machine(Bootstrap& bootstrap, std::span<const pid_t> local_pids);
  const std::string& name() const { return name_; }
  // Maps PE `pe`'s entry (a peer on this machine), created under `name`. Peers on other machines
  // stay unmapped: first_peer_gone() passes them over, and nothing else may ask for them.
  void open(int pe, const std::string& name);
  // Once every PE has opened every entry: the names go, the mappings stay.
  void unlink() noexcept;

  bool has(int pe) const noexcept {
    return segments_[static_cast<std::size_t>(pe)].data() != nullptr;
  }
  // A run of this PE begins: the count every peer reads.
  std::uint64_t begin_run() noexcept;
  std::uint64_t runs_begun(int pe) const noexcept;
  // Tells the peers this PE gave its run up (kFailed also overrides an earlier kWillRetry).
  void mark(State state, const std::string& reason) noexcept;
  // This PE meets the others to run again (offer_retry()). A reason it gave when it gave its run
  // up stays: that one says why (a peer it timed out on), `reason` only what this PE was told.
  void mark_will_retry(const std::string& reason) noexcept;
  State state(int pe) const noexcept;
  std::string reason(int pe) const;
  // The first PE other than this one that gave its run up, or -1.
  int first_peer_gone(State* state) const noexcept;
  // What that PE's mark tells this PE, which was waiting `waiting_for` ("for its data").
  std::string gone_message(int peer, State state, const char* waiting_for) const;
  // "PE p failed (its reason)" / "PE p gave this run up (its reason)": a PE that gives its run up
  // because a peer did passes the peer's reason on, so the first cause reaches every PE however
  // the marks chain (PE 3 saw PE 1 die, PE 2 gave up on PE 3, PE 0 on PE 2).
  std::string gone_clause(int peer, State state) const;
  // Whether some PE of the board, this one too, gave its run up and meets the others to run it
  // again ("giving up" or "will retry"): what retry_requested() asks at each run's start.
  bool retry_asked() const noexcept;
  // Back to no runs begun, running (recover(): every PE at once, outside run()).
  void reset() noexcept;

 private:
  struct Entry {
    std::atomic<std::uint32_t> state;
    std::atomic<std::uint64_t> runs_begun;
    char reason[496];
  };
  Entry* entry(int pe) const noexcept {
    return reinterpret_cast<Entry*>(segments_[static_cast<std::size_t>(pe)].data());
  }

  int me_ = -1;
  std::string name_;
  std::vector<host::ShmSegment> segments_;  // [pe]: PE pe's entry
};

}  // namespace reshard::cuda

// Matching sends to receives. Megatron's service logs unmatched task ids and carries on, which
// silently leaves stale bytes in the destination; here any inconsistency refuses the whole job.
#include <algorithm>
#include <sstream>

#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"

namespace reshard {
namespace {

constexpr std::size_t kMaxListedProblems = 8;

class ProblemList {
 public:
  template <typename... Parts>
  void add_for(TaskId task, const Parts&... parts) {
    tasks_.push_back(task);
    add(parts...);
  }
  template <typename... Parts>
  void add(const Parts&... parts) {
    ++count_;
    if (count_ > kMaxListedProblems) return;
    std::ostringstream line;
    (line << ... << parts);
    text_ += "\n  - " + line.str();
  }
  void throw_if_any() const {
    if (count_ == 0) return;
    std::ostringstream message;
    message << "schedule() refused: " << count_ << " problem" << (count_ == 1 ? "" : "s")
            << " with the registered requests:" << text_;
    if (count_ > kMaxListedProblems) {
      message << "\n  - ... and " << count_ - kMaxListedProblems << " more";
    }
    throw Error(ErrorCode::kValidation, message.str(), tasks_);
  }

 private:
  std::vector<TaskId> tasks_;
  std::size_t count_ = 0;
  std::string text_;
};

std::vector<RequestClaim> sorted_by_task(std::span<const RequestClaim> claims) {
  std::vector<RequestClaim> sorted(claims.begin(), claims.end());
  std::sort(sorted.begin(), sorted.end(), [](const RequestClaim& a, const RequestClaim& b) {
    return a.task != b.task ? a.task < b.task : a.owner < b.owner;
  });
  return sorted;
}

void check_pes(std::span<const RequestClaim> claims, int n_pes, const char* side,
               ProblemList& problems) {
  for (const RequestClaim& claim : claims) {
    const bool owner_ok = claim.owner >= 0 && claim.owner < n_pes;
    const bool peer_ok = claim.peer >= 0 && claim.peer < n_pes;
    if (!owner_ok || !peer_ok) {
      problems.add_for(claim.task, side, " of task ", claim.task, " on PE ", claim.owner,
                       " names PE ", claim.peer, ", outside 0..", n_pes - 1);
    }
  }
}

void check_duplicates(const std::vector<RequestClaim>& sorted, const char* side,
                      ProblemList& problems) {
  for (std::size_t i = 1; i < sorted.size(); ++i) {
    if (sorted[i].task != sorted[i - 1].task) continue;
    if (sorted[i].owner == sorted[i - 1].owner) {
      problems.add_for(sorted[i].task, "task ", sorted[i].task, " has more than one ", side,
                       " (PE ", sorted[i].owner,
                       " registered it twice; each range needs its own task id)");
    } else {
      problems.add_for(sorted[i].task, "task ", sorted[i].task, " has more than one ", side,
                       " (on PE ", sorted[i - 1].owner, " and PE ", sorted[i].owner, ")");
    }
  }
}

}  // namespace

std::vector<Transfer> match_requests(std::span<const RequestClaim> sends,
                                     std::span<const RequestClaim> receives, int n_pes) {
  ProblemList problems;
  check_pes(sends, n_pes, "send", problems);
  check_pes(receives, n_pes, "receive", problems);
  const std::vector<RequestClaim> send_list = sorted_by_task(sends);
  const std::vector<RequestClaim> recv_list = sorted_by_task(receives);
  check_duplicates(send_list, "send", problems);
  check_duplicates(recv_list, "receive", problems);
  problems.throw_if_any();

  std::vector<Transfer> transfers;
  transfers.reserve(send_list.size());
  std::size_t s = 0;
  std::size_t r = 0;
  while (s < send_list.size() || r < recv_list.size()) {
    if (r == recv_list.size() || (s < send_list.size() && send_list[s].task < recv_list[r].task)) {
      const RequestClaim& send = send_list[s++];
      problems.add_for(send.task, "task ", send.task, ": send of ", send.bytes, " bytes from PE ",
                       send.owner, " to PE ", send.peer, " has no matching receive");
      continue;
    }
    if (s == send_list.size() || recv_list[r].task < send_list[s].task) {
      const RequestClaim& recv = recv_list[r++];
      problems.add_for(recv.task, "task ", recv.task, ": receive of ", recv.bytes, " bytes on PE ",
                       recv.owner, " from PE ", recv.peer, " has no matching send");
      continue;
    }
    const RequestClaim& send = send_list[s++];
    const RequestClaim& recv = recv_list[r++];
    if (send.peer != recv.owner || recv.peer != send.owner) {
      problems.add_for(send.task, "task ", send.task, ": PE ", send.owner, " sends to PE ",
                       send.peer, " but the receive is registered on PE ", recv.owner, " from PE ",
                       recv.peer);
    } else if (send.bytes != recv.bytes) {
      problems.add_for(send.task, "task ", send.task, ": PE ", send.owner, " sends ", send.bytes,
                       " bytes but PE ", recv.owner, " expects ", recv.bytes, " bytes");
    } else if (send.phase != recv.phase) {
      problems.add_for(send.task, "task ", send.task, ": PE ", send.owner, " sends it in phase ",
                       send.phase, " but PE ", recv.owner, " receives it in phase ", recv.phase);
    } else {
      transfers.push_back({send.task, send.owner, recv.owner, send.bytes, send.row_bytes,
                           recv.row_bytes, send.phase});
    }
  }
  problems.throw_if_any();
  return transfers;
}

}  // namespace reshard

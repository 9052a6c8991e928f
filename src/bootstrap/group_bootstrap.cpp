#include "bootstrap/group_bootstrap.hpp"

#include <algorithm>
#include <string>

#include "core/message.hpp"
#include "reshard/error.hpp"

namespace reshard {

GroupBootstrap::GroupBootstrap(Bootstrap& parent, std::vector<int> members)
    : parent_(parent), members_(std::move(members)) {
  const auto me = std::find(members_.begin(), members_.end(), parent.rank());
  if (me == members_.end() || !std::is_sorted(members_.begin(), members_.end())) {
    throw_error(ErrorCode::kInvalidArgument,
                "internal: a group bootstrap's members must be ascending and include rank " +
                    std::to_string(parent.rank()));
  }
  rank_ = static_cast<int>(me - members_.begin());
}

// Gathered at the group's rank 0, which hands everyone the whole list.
std::vector<std::vector<std::byte>> GroupBootstrap::all_gather(std::span<const std::byte> mine) {
  const int n = size();
  std::vector<std::vector<std::byte>> all(n);
  if (rank_ == 0) {
    all[0].assign(mine.begin(), mine.end());
    for (int r = 1; r < n; ++r) all[r] = parent_.recv(members_[r]);
    message::Writer packed;
    for (const auto& part : all) packed.put_array(std::span<const std::byte>(part));
    for (int r = 1; r < n; ++r) parent_.send(members_[r], packed.bytes());
    return all;
  }
  parent_.send(members_[0], mine);
  const std::vector<std::byte> packed = parent_.recv(members_[0]);
  message::Reader reader(packed);
  for (int r = 0; r < n; ++r) all[r] = reader.get_array<std::byte>();
  return all;
}

void GroupBootstrap::broadcast(std::vector<std::byte>& data, int root) {
  if (root < 0 || root >= size()) {
    throw_error(ErrorCode::kInvalidArgument, "broadcast root " + std::to_string(root) +
                                                 " outside a group of " + std::to_string(size()));
  }
  data = all_gather(rank_ == root ? std::span<const std::byte>(data)
                                  : std::span<const std::byte>())[root];
}

void GroupBootstrap::barrier() { all_gather({}); }

void GroupBootstrap::send(int peer, std::span<const std::byte> data) {
  parent_.send(members_.at(peer), data);
}

std::vector<std::byte> GroupBootstrap::recv(int peer) { return parent_.recv(members_.at(peer)); }

}  // namespace reshard

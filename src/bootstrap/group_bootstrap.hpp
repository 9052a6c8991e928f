// A bootstrap over some of another bootstrap's ranks (one node's PEs), renumbered from 0 in the
// parent's rank order. Collectives go through the members' point-to-point channels only, so the
// ranks outside the group never take part and several groups can work at the same time.
#pragma once

#include <memory>
#include <vector>

#include "reshard/bootstrap.hpp"

namespace reshard {

class GroupBootstrap final : public Bootstrap {
 public:
  // `members`: the parent ranks of the group, ascending, including the parent's own rank.
  GroupBootstrap(Bootstrap& parent, std::vector<int> members);

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(members_.size()); }
  // The machine-local index stays the parent's: it picks this process's GPU.
  int local_rank() const override { return parent_.local_rank(); }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  void broadcast(std::vector<std::byte>& data, int root) override;
  void barrier() override;
  void send(int peer, std::span<const std::byte> data) override;
  std::vector<std::byte> recv(int peer) override;
  void set_timeout(std::chrono::milliseconds timeout) override { parent_.set_timeout(timeout); }

  int parent_rank(int rank) const { return members_.at(rank); }

 private:
  Bootstrap& parent_;
  std::vector<int> members_;
  int rank_ = 0;
};

}  // namespace reshard

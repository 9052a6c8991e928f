// Which PEs share a node (an NVLink domain: one machine), so a schedule can move bytes inside a
// node on one transport and between nodes on another.
#pragma once

#include <optional>
#include <vector>

#include "reshard/bootstrap.hpp"

namespace reshard {

struct NodeMap {
  std::vector<int> node_of;  // per PE, numbered in order of each node's first PE
  int nodes = 0;
  bool one_machine = true;  // every PE on one host, however RESHARD_NODE_SIZE splits them

  bool same_node(int a, int b) const { return node_of.at(a) == node_of.at(b); }
  // The PEs of `node`, ascending.
  std::vector<int> members(int node) const;
};

// Collective. PEs on one host form a node; `node_size` = N (CopyServiceOptions::node_size)
// further splits the PEs into groups of N consecutive ones, so a single machine runs what a
// cluster of N-GPU nodes runs.
NodeMap map_nodes(Bootstrap& bootstrap, std::optional<int> node_size);

}  // namespace reshard

#include "core/nodes.hpp"

#include <unistd.h>

#include <map>
#include <string>
#include <utility>

#include "core/message.hpp"

namespace reshard {

std::vector<int> NodeMap::members(int node) const {
  std::vector<int> pes;
  for (int pe = 0; pe < static_cast<int>(node_of.size()); ++pe) {
    if (node_of[pe] == node) pes.push_back(pe);
  }
  return pes;
}

NodeMap map_nodes(Bootstrap& bootstrap, std::optional<int> node_size) {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  message::Writer mine;
  mine.put_string(host);
  const auto all = bootstrap.all_gather(mine.bytes());
  const int split = node_size.value_or(static_cast<int>(all.size()));
  NodeMap map;
  std::map<std::pair<std::string, int>, int> numbers;
  std::string first_host;
  for (int pe = 0; pe < static_cast<int>(all.size()); ++pe) {
    const std::string name = message::Reader(all[pe]).get_string();
    if (pe == 0) first_host = name;
    map.one_machine = map.one_machine && name == first_host;
    const auto [it, added] = numbers.try_emplace({name, pe / split}, map.nodes);
    if (added) ++map.nodes;
    map.node_of.push_back(it->second);
  }
  return map;
}

}  // namespace reshard

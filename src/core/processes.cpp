#include "core/processes.hpp"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace reshard {
namespace {

// The state letter of /proc/<pid>/stat (R, S, T, Z, ...), or 0 when the process is gone.
char process_state(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return 0;
  // "pid (command) state ...": the command may hold spaces and parentheses.
  const auto close = line.rfind(')');
  return close != std::string::npos && close + 2 < line.size() ? line[close + 2] : '?';
}

}  // namespace

int first_exited_process(std::span<const pid_t> pids, bool count_zombies) {
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] <= 0) continue;
    if (::kill(pids[i], 0) != 0 && errno == ESRCH) return static_cast<int>(i);
    if (!count_zombies) continue;
    const char state = process_state(pids[i]);
    if (state == 'Z' || state == 'X') return static_cast<int>(i);
  }
  return -1;
}

int first_stopped_process(std::span<const pid_t> pids) {
  for (std::size_t i = 0; i < pids.size(); ++i) {
    if (pids[i] <= 0) continue;
    const char state = process_state(pids[i]);
    if (state == 'T' || state == 't') return static_cast<int>(i);
  }
  return -1;
}

}  // namespace reshard

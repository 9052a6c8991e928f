// Whether peer processes on this host are still there: how a waiting PE tells a peer that died or
// stopped from one that is slow (every transport's dead-peer checks).
#pragma once

#include <sys/types.h>

#include <span>

namespace reshard {

// Index of the first process in `pids` that no longer exists (entries <= 0 are not checked), or -1.
// With `count_zombies`, also one that has exited and awaits its parent's wait (reads /proc: for
// slow paths), whose sockets are already closed: a peer's "connection refused" arrives before
// kill() says it is gone, and a launcher that polls its children (torchrun's agent) may leave it a
// zombie for seconds.
int first_exited_process(std::span<const pid_t> pids, bool count_zombies = false);
// Index of the first process in `pids` that is stopped (SIGSTOP, a debugger), or -1.
int first_stopped_process(std::span<const pid_t> pids);

}  // namespace reshard

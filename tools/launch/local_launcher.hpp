// Starts N local processes of one command with the torchrun variables set, forwards their output
// with a rank prefix, and stops the job when one of them fails. Used by reshard-run, by
// `reshard bench` when it is started without a launcher, and by the multi-process tests.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

namespace reshard {

struct LaunchOptions {
  int n_procs = 1;
  std::vector<std::string> command;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                         // 0: pick a free port
  bool kill_on_failure = true;                 // stop the others as soon as one fails
  std::chrono::milliseconds kill_grace{3000};  // SIGTERM first, SIGKILL after this
  // Receives each output line, already prefixed; writes to stdout when empty.
  std::function<void(const std::string&)> output;
};

struct LaunchResult {
  int exit_code = 0;  // 0, or the first failure's (128 + signal for a signal)
  int first_failed_rank = -1;
  std::vector<int> exit_codes;  // per rank
  std::string summary;          // one line saying what failed, empty on success
};

LaunchResult launch_local(const LaunchOptions& options);

// Removes /dev/shm entries a job with this id left behind (only a crash during set-up can).
void remove_job_leftovers(const std::string& job_id);

}  // namespace reshard

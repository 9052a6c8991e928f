// Starts N local processes of one command with the torchrun variables set, forwards their output
// with a rank prefix, and stops the job when one of them fails or it runs past its time limit.
// The one launcher: reshard-run, `reshard bench` started without a launcher, the multi-process
// tests, and Python's `python -m reshard.launch` (through the extension module) all use it.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace reshard {

struct LaunchOptions {
  int n_procs = 1;
  std::vector<std::string> command;  // the program (found on PATH) and its arguments
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                         // 0: pick a free port
  bool kill_on_failure = true;                 // stop the others as soon as one fails
  std::chrono::milliseconds kill_grace{3000};  // SIGTERM first, SIGKILL after this
  std::chrono::milliseconds time_limit{0};     // 0: none; past it the job stops with code 124
  // The processes' environment as NAME=value entries (the torchrun variables are added);
  // this process's own when unset.
  std::optional<std::vector<std::string>> environment;
  std::string name = "reshard-run";  // how the launcher's own messages begin
  // Receives each line, already prefixed, and whether it belongs on stderr (the launcher's own
  // lines do); when empty, lines go to this process's stdout and stderr.
  std::function<void(const std::string& line, bool to_stderr)> output;
};

struct LaunchResult {
  int exit_code = 0;  // 0, or the first failure's (128 + signal for a signal, 124 past the limit)
  int first_failed_rank = -1;
  std::vector<int> exit_codes;  // per rank
  std::string summary;          // one line saying what failed, empty on success
};

// Throws reshard::Error (invalid argument) for a bad count or a command that cannot start; no
// process is left running then.
LaunchResult launch_local(const LaunchOptions& options);

// Removes /dev/shm entries a job with this id left behind (only a crash during set-up can).
void remove_job_leftovers(const std::string& job_id);

}  // namespace reshard

// reshard-run -n N <command...>: a local launcher that sets the torchrun variables.
#include <CLI/CLI.hpp>
#include <cstdio>

#include "launch/local_launcher.hpp"
#include "reshard/error.hpp"

int main(int argc, char** argv) {
  CLI::App app{
      "Start N local processes of a command with RANK, WORLD_SIZE, LOCAL_RANK, "
      "MASTER_ADDR and MASTER_PORT set; output is prefixed with the rank, and the job "
      "stops as soon as one process fails.",
      "reshard-run"};
  reshard::LaunchOptions options;
  app.add_option("-n,--nprocs", options.n_procs, "number of processes")
      ->required()
      ->check(CLI::Range(1, 4096));
  app.add_option("--master-port", options.master_port, "rank 0's port (default: a free one)")
      ->check(CLI::Range(0, 65535));
  double timeout_s = 0;
  app.add_option("--timeout", timeout_s,
                 "stop the job after this many seconds (exit code 124; default: no limit)")
      ->check(CLI::NonNegativeNumber);
  // The program is the first positional; everything after it is its own, options included, in
  // the order given (prefix_command hands it over untouched).
  std::string program;
  app.add_option("command", program, "the program and its arguments")->required();
  app.prefix_command();
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> command{program};
  std::vector<std::string> rest = app.remaining();
  // A "--" that ended reshard-run's own options stays behind in the remainder: not the program's.
  if (!rest.empty() && rest.front() == "--" && argc > 1) {
    for (int i = 1; i < argc && argv[i] != program; ++i) {
      if (std::string(argv[i]) == "--") {
        rest.erase(rest.begin());
        break;
      }
    }
  }
  command.insert(command.end(), rest.begin(), rest.end());
  options.command = command;
  options.time_limit = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000));
  try {
    const reshard::LaunchResult result = reshard::launch_local(options);
    if (result.exit_code != 0) {
      std::fprintf(stderr, "reshard-run: job failed: %s\n", result.summary.c_str());
    }
    return result.exit_code;
  } catch (const reshard::Error& error) {
    std::fprintf(stderr, "reshard-run: %s\n", error.what());
    return 2;
  }
}

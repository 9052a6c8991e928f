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
  std::vector<std::string> command;
  app.add_option("command", command, "the program and its arguments")->required();
  app.prefix_command();
  CLI11_PARSE(app, argc, argv);
  for (const std::string& extra : app.remaining()) command.push_back(extra);
  options.command = command;
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

// A PE that dies or stalls mid-run makes the others fail, in bounded time, with an error naming
// it; and the launcher stops a job as soon as one process fails.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <mutex>
#include <regex>

#include "core/transport.hpp"
#include "launch/local_launcher.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "transports/host/shm_segment.hpp"

namespace reshard {
namespace {

using namespace std::chrono_literals;

struct Outcome {
  LaunchResult result;
  std::vector<std::string> lines;
  double seconds = 0;
};

Outcome launch(int n, std::vector<std::string> command, bool kill_on_failure) {
  Outcome outcome;
  std::mutex mutex;
  LaunchOptions options;
  options.n_procs = n;
  options.command = std::move(command);
  options.kill_on_failure = kill_on_failure;
  options.kill_grace = 1s;
  options.output = [&](const std::string& line, bool /*to_stderr*/) {
    std::lock_guard lock(mutex);
    outcome.lines.push_back(line);
  };
  const auto start = std::chrono::steady_clock::now();
  outcome.result = launch_local(options);
  outcome.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return outcome;
}

std::string line_of(const Outcome& outcome, int rank, const std::string& marker) {
  const std::string prefix = "[rank " + std::to_string(rank) + "] ";
  for (const auto& line : outcome.lines) {
    if (line.rfind(prefix, 0) == 0 && line.find(marker) != std::string::npos) return line;
  }
  return {};
}

// Both limits, for transfers and for PEs arriving: a fault test waits for either.
void set_timeouts(const char* seconds) {
  ::setenv("RESHARD_TIMEOUT_S", seconds, 1);
  ::setenv("RESHARD_ARRIVAL_TIMEOUT_S", seconds, 1);
}

std::string all_lines(const Outcome& outcome) {
  std::string text;
  for (const auto& line : outcome.lines) text += line + "\n";
  return text;
}

// Every PE of a retry scenario reported RETRIED-DONE, and PE `pe` gave `failures(pe)` runs up
// (-1: not checked), each naming PE 1, the PE every scenario makes late or stops.
void expect_runs_given_up(const Outcome& outcome, int pes, const std::string& scenario,
                          const std::function<int(int)>& failures) {
  for (int pe = 0; pe < pes; ++pe) {
    const std::string line = line_of(outcome, pe, "RETRIED-DONE");
    ASSERT_FALSE(line.empty()) << scenario << "\n" << all_lines(outcome);
    const int expected = failures(pe);
    if (expected < 0) continue;
    EXPECT_NE(line.find("failures=" + std::to_string(expected)), std::string::npos)
        << scenario << ": " << line << "\n"
        << all_lines(outcome);
    if (expected > 0) EXPECT_NE(line.find("PE 1"), std::string::npos) << scenario << ": " << line;
  }
}

TEST(Faults, PeKilledMidRunFailsTheOthersQuicklyAndCleanly) {
  set_timeouts("10");
  const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, "die"}, false);
  EXPECT_LT(outcome.seconds, 30.0) << all_lines(outcome);
  EXPECT_EQ(outcome.result.exit_codes[1], 128 + SIGKILL);
  for (int rank : {0, 2}) {
    const std::string line = line_of(outcome, rank, "ERROR-SEEN");
    ASSERT_FALSE(line.empty()) << all_lines(outcome);
    EXPECT_NE(line.find("PE 1"), std::string::npos) << line;
    EXPECT_NE(line.find("shm-entries=0"), std::string::npos) << line;
    EXPECT_NE(line.find("retryable=0"), std::string::npos)
        << line;  // a dead peer fails the service
    EXPECT_EQ(outcome.result.exit_codes[rank], 1);
  }
}

// The errors PEs 0 and 2 reported, of a job whose launcher stops the others once the first
// survivor failed (so one of them may not have reported).
std::vector<std::string> survivor_errors(const Outcome& outcome) {
  std::vector<std::string> lines;
  for (int rank : {0, 2}) {
    std::string line = line_of(outcome, rank, "ERROR-SEEN");
    if (!line.empty()) lines.push_back(std::move(line));
  }
  return lines;
}

TEST(Faults, PeStoppedMidRunTimesTheOthersOutNamingIt) {
  set_timeouts("2");
  const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, "stall"}, true);
  EXPECT_LT(outcome.seconds, 30.0) << all_lines(outcome);
  const std::vector<std::string> errors = survivor_errors(outcome);
  for (const std::string& line : errors) {
    EXPECT_NE(line.find("PE 1"), std::string::npos) << line;
    EXPECT_TRUE(line.find("code=timeout") != std::string::npos ||
                line.find("code=peer failure") != std::string::npos)
        << line;
  }
  EXPECT_GE(errors.size(), 1u) << all_lines(outcome);
  EXPECT_NE(outcome.result.exit_code, 0);
}

// PE 1 stops calling run() after two runs and stays alive: whoever times out names PE 1 as the
// one behind (by the run() calls each PE has begun), not the peer it happened to wait for.
TEST(Faults, PeThatCallsRunLessOftenIsNamedBehindByTheOthers) {
  set_timeouts("2");
  const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, "behind"}, true);
  EXPECT_LT(outcome.seconds, 30.0) << all_lines(outcome);
  const std::vector<std::string> errors = survivor_errors(outcome);
  for (const std::string& line : errors) {
    EXPECT_NE(line.find("code=timeout"), std::string::npos) << line;
    EXPECT_NE(line.find("PE 1 is behind: begun run() 2 times where PE 0, PE 2 did"),
              std::string::npos)
        << line;
    // Whole, also where a survivor repeats the other's reason: to its last words.
    EXPECT_NE(line.find("as often as its peers)"), std::string::npos) << line;
  }
  EXPECT_GE(errors.size(), 1u) << all_lines(outcome);
}

// PE 1 is killed, or stopped, instead of calling schedule(), which the others are in: they fail
// naming PE 1 (at once when it died: its pid is watched; within the arrival timeout when it
// stopped), and a job started next on the same machine runs.
TEST(Faults, PeKilledOrStoppedInScheduleFailsTheOthersNamingIt) {
  set_timeouts("3");
  for (const char* scenario : {"die-in-schedule", "stall-in-schedule"}) {
    // A killed PE's launcher would stop the survivors before they report; a stopped one's must.
    const bool stopped = std::string(scenario) == "stall-in-schedule";
    const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, scenario}, stopped);
    EXPECT_LT(outcome.seconds, 30.0) << scenario << "\n" << all_lines(outcome);
    const std::vector<std::string> errors = survivor_errors(outcome);
    for (const std::string& line : errors) {
      // Stopped: PE 1 named as late; killed: the lost connection to the bootstrap's rank 1.
      EXPECT_TRUE(line.find("PE 1 did not call schedule()") != std::string::npos ||
                  line.find("lost the connection to rank 1") != std::string::npos)
          << scenario << ": " << line;
      // (No count of the job's shared memory here: a survivor that fails at once may count a
      // live peer's inbox that peer is about to unlink.)
    }
    EXPECT_GE(errors.size(), 1u) << scenario << "\n" << all_lines(outcome);
  }
  const Outcome next = launch(3, {RESHARD_FAULT_WORKER, "healthy"}, true);
  EXPECT_EQ(next.result.exit_code, 0) << all_lines(next);
  for (int rank = 0; rank < 3; ++rank)
    EXPECT_FALSE(line_of(next, rank, "HEALTHY-DONE").empty()) << all_lines(next);
}

// A run given up because PE 1 came late, or stopped in it for longer than the timeout, leaves every
// service usable: the PEs whose run failed run again, PE 1 meets them at its next run, and every
// run after that moves every byte (patterns that change per run: no byte of the failed run lands).
TEST(Faults, ARunGivenUpOnALateOrStoppedPeIsRunAgainByEveryPe) {
  set_timeouts("6");  // PE 1 is 9 s late or stopped: 3 s either side of what the others wait
  for (const char* scenario : {"late-then-retry", "stall-then-retry"}) {
    const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, scenario}, true);
    EXPECT_LT(outcome.seconds, 60.0) << scenario << "\n" << all_lines(outcome);
    EXPECT_EQ(outcome.result.exit_code, 0) << scenario << "\n" << all_lines(outcome);
    // PE 1 is told at its next run's meeting, or by a peer's error; each of the others gave one
    // run up, naming PE 1 (late, or what the other one saw).
    expect_runs_given_up(outcome, 3, scenario, [](int pe) { return pe == 1 ? -1 : 1; });
  }
}

// PE 1 comes to a run 5 s late: later than the transfer timeout (2 s), within the arrival timeout
// (20 s): no PE's run fails, and every byte lands. (The GPU transports: GpuFaults below.)
TEST(Faults, APeLaterThanTheTransferTimeoutButWithinTheArrivalTimeoutFailsNoRun) {
  ::setenv("RESHARD_TIMEOUT_S", "2", 1);
  ::setenv("RESHARD_ARRIVAL_TIMEOUT_S", "20", 1);
  const Outcome outcome = launch(3, {RESHARD_FAULT_WORKER, "late-within-arrival"}, true);
  EXPECT_LT(outcome.seconds, 60.0) << all_lines(outcome);
  EXPECT_EQ(outcome.result.exit_code, 0) << all_lines(outcome);
  expect_runs_given_up(outcome, 3, "late-within-arrival", [](int) { return 0; });
}

// The same in a mixed schedule (two declared nodes of two PEs, host memory on both transports):
// PE 0 gives the run up inside the node, PEs 2 and 3 between the nodes (or on a peer's mark);
// every PE meets at its next run, both parts recover, and every byte of the runs after lands.
TEST(Faults, ARunGivenUpInAMixedScheduleIsRunAgainByEveryPe) {
  set_timeouts("6");
  ::setenv("RESHARD_NODE_SIZE", "2", 1);
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);  // auto stays on CPU memory on a GPU machine too
  for (const char* scenario : {"late-then-retry", "stall-then-retry"}) {
    const Outcome outcome = launch(4, {RESHARD_FAULT_WORKER, scenario, "auto"}, true);
    EXPECT_LT(outcome.seconds, 60.0) << scenario << "\n" << all_lines(outcome);
    EXPECT_EQ(outcome.result.exit_code, 0) << scenario << "\n" << all_lines(outcome);
    expect_runs_given_up(outcome, 4, scenario, [](int pe) { return pe == 1 ? -1 : 1; });
  }
  ::unsetenv("RESHARD_NODE_SIZE");
  ::unsetenv("CUDA_VISIBLE_DEVICES");
}

// A mixed schedule (two declared nodes of two PEs, host memory on both transports): PE 1 dies;
// its node mate fails inside the node, the other node when its inter-node part meets the dead PE
// (or its failed mate, whichever it notices first) — every survivor in bounded time.
TEST(Faults, PeKilledInAMixedScheduleFailsEveryNode) {
  set_timeouts("10");
  ::setenv("RESHARD_NODE_SIZE", "2", 1);
  ::setenv("CUDA_VISIBLE_DEVICES", "", 1);  // auto stays on CPU memory on a GPU machine too
  const Outcome outcome = launch(4, {RESHARD_FAULT_WORKER, "die", "auto"}, false);
  ::unsetenv("RESHARD_NODE_SIZE");
  ::unsetenv("CUDA_VISIBLE_DEVICES");
  EXPECT_LT(outcome.seconds, 40.0) << all_lines(outcome);
  EXPECT_EQ(outcome.result.exit_codes[1], 128 + SIGKILL) << all_lines(outcome);
  const std::string mate = line_of(outcome, 0, "ERROR-SEEN");
  ASSERT_FALSE(mate.empty()) << all_lines(outcome);
  // Its mate names PE 1: in the node's numbering spelled out when it noticed the death itself,
  // or as the other node reports it when that report came first.
  EXPECT_TRUE(mate.find("is PE 1") != std::string::npos ||
              mate.find("PE 1 (pid") != std::string::npos)
      << mate;
  for (int rank : {2, 3}) {
    const std::string line = line_of(outcome, rank, "ERROR-SEEN");
    ASSERT_FALSE(line.empty()) << all_lines(outcome);
    EXPECT_TRUE(line.find("PE 1") != std::string::npos || line.find("PE 0") != std::string::npos)
        << line;
    EXPECT_EQ(outcome.result.exit_codes[rank], 1);
  }
}

// The same faults on the GPU transports, at 2 and 4 PEs (one GPU each, or sharing the GPUs there
// are: same-device peers), and in a mixed schedule
// (4 PEs declared as two nodes of two: CUDA inside a node, NVSHMEM or NCCL between them). Every
// survivor's device-side or host-side waits end within the timeout with an error naming a failed
// PE, and its teardown neither hangs nor leaves a peer's memory mapped. Skipped without enough
// GPUs or without the transport in this build.
struct GpuFaultCase {
  std::string transport;
  int pes;
  std::string nvshmem_waits = "auto";  // RESHARD_NVSHMEM_WAITS: "stream" on every GPU too
  std::string engine = "auto";         // RESHARD_CUDA_ENGINE: "ce", the copy engine, too
};

class GpuFaults : public testing::TestWithParam<GpuFaultCase> {
 protected:
  void SetUp() override {
    const auto names = available_transports();
    const std::string needed = GetParam().transport == "auto" ? "cuda" : GetParam().transport;
    if (std::find(names.begin(), names.end(), needed) == names.end())
      GTEST_SKIP() << "this build has no " << needed << " transport";
    // PEs share a GPU where there are fewer (same-device peers), except under NCCL, which
    // refuses two ranks on one GPU.
    const int devices = visible_cuda_devices();
    if (devices == 0) GTEST_SKIP() << "no CUDA device";
    if (GetParam().transport == "nccl" && devices < GetParam().pes)
      GTEST_SKIP() << "NCCL needs a CUDA device per rank: " << GetParam().pes << " PEs, " << devices
                   << " device(s)";
    ::setenv("NCCL_NVLS_ENABLE", "0", 1);  // NVLink multicast stays off on shared machines
    ::setenv("NVSHMEM_DISABLE_NVLS", "1", 1);
    if (GetParam().transport == "auto") ::setenv("RESHARD_NODE_SIZE", "2", 1);
    ::setenv("RESHARD_NVSHMEM_WAITS", GetParam().nvshmem_waits.c_str(), 1);
    ::setenv("RESHARD_CUDA_ENGINE", GetParam().engine.c_str(), 1);
  }
  void TearDown() override {
    ::unsetenv("RESHARD_NODE_SIZE");
    ::unsetenv("RESHARD_NVSHMEM_WAITS");
    ::unsetenv("RESHARD_CUDA_ENGINE");
  }

  // Every survivor's report: a failed PE named (PE 1, or a survivor that failed before it
  // noticed PE 1), a bounded teardown, no IPC mapping left.
  void expect_survivors_reported(const Outcome& outcome, bool all_of_them) {
    int reported = 0;
    for (int rank = 0; rank < GetParam().pes; ++rank) {
      if (rank == 1) continue;
      const std::string line = line_of(outcome, rank, "ERROR-SEEN");
      if (line.empty()) {
        EXPECT_FALSE(all_of_them) << "PE " << rank << " reported nothing\n" << all_lines(outcome);
        continue;
      }
      ++reported;
      EXPECT_TRUE(std::regex_search(line, std::regex("PE [0-9]+"))) << line;
      // PE 1, or a survivor that failed first and exited (PEs sharing a GPU see a local peer's
      // exit at once: PE 3 named PE 2, which had timed out waiting for the stalled PE 1). In
      // schedule()'s meeting the bootstrap names a PE that left by its rank (the same number).
      bool names_a_failed_pe = false;
      const std::regex pe_number("(?:PE|connection to rank) ([0-9]+)");
      for (auto it = std::sregex_iterator(line.begin(), line.end(), pe_number);
           it != std::sregex_iterator(); ++it) {
        const int named = std::stoi((*it)[1]);
        names_a_failed_pe =
            names_a_failed_pe || named == 1 ||
            (named != rank && named < GetParam().pes && outcome.result.exit_codes[named] != 0);
      }
      EXPECT_TRUE(names_a_failed_pe) << line << "\n" << all_lines(outcome);
      EXPECT_NE(line.find("ipc-mappings=0"), std::string::npos) << line;
      std::smatch teardown;
      ASSERT_TRUE(std::regex_search(line, teardown, std::regex("teardown=([0-9.]+)s"))) << line;
      EXPECT_LT(std::stod(teardown[1]), 30.0) << line;
    }
    EXPECT_GE(reported, 1) << all_lines(outcome);
  }
};

TEST_P(GpuFaults, PeKilledMidRunFailsTheOthersNamingIt) {
  set_timeouts("10");
  const Outcome outcome =
      launch(GetParam().pes, {RESHARD_FAULT_WORKER, "die", GetParam().transport}, false);
  EXPECT_LT(outcome.seconds, 90.0) << all_lines(outcome);
  EXPECT_EQ(outcome.result.exit_codes[1], 128 + SIGKILL) << all_lines(outcome);
  expect_survivors_reported(outcome, true);
  for (int rank = 0; rank < GetParam().pes; ++rank) {
    if (rank != 1) EXPECT_EQ(outcome.result.exit_codes[rank], 1) << all_lines(outcome);
  }
  // PE 0 shares every schedule with PE 1 and is the first to notice it; it names PE 1 itself.
  EXPECT_NE(line_of(outcome, 0, "ERROR-SEEN").find("PE 1"), std::string::npos)
      << all_lines(outcome);
}

TEST_P(GpuFaults, PeStoppedMidRunTimesTheOthersOutNamingIt) {
  set_timeouts("3");
  const Outcome outcome =
      launch(GetParam().pes, {RESHARD_FAULT_WORKER, "stall", GetParam().transport}, true);
  EXPECT_LT(outcome.seconds, 90.0) << all_lines(outcome);
  // The launcher stops the job once the first survivor fails: later ones may not report.
  expect_survivors_reported(outcome, false);
  for (int rank = 0; rank < GetParam().pes; ++rank) {
    const std::string line = line_of(outcome, rank, "ERROR-SEEN");
    if (line.empty()) continue;
    EXPECT_TRUE(line.find("code=timeout") != std::string::npos ||
                line.find("code=peer failure") != std::string::npos)
        << line;
  }
  EXPECT_NE(outcome.result.exit_code, 0);
}

// A run given up on a late or stopped PE 1 (see the host memory test above), on the CUDA, NVSHMEM
// and NCCL transports: the others' kernels or stream waits give up, every PE meets at its next
// run, zeroes its flags (NVSHMEM: its pair counters and signal words; NCCL: a new communicator on
// every PE) and runs again, and every byte of the runs after that lands; the mixed transport
// recovers both of its parts.
TEST_P(GpuFaults, ARunGivenUpOnALateOrStoppedPeIsRunAgainByEveryPe) {
  set_timeouts("6");
  for (const char* scenario : {"late-then-retry", "stall-then-retry"}) {
    const Outcome outcome =
        launch(GetParam().pes, {RESHARD_FAULT_WORKER, scenario, GetParam().transport}, true);
    EXPECT_LT(outcome.seconds, 90.0) << scenario << "\n" << all_lines(outcome);
    EXPECT_EQ(outcome.result.exit_code, 0) << scenario << "\n" << all_lines(outcome);
    // PE 0 waits on PE 1 in every run of the uniform workload.
    expect_runs_given_up(outcome, GetParam().pes, scenario,
                         [](int pe) { return pe == 0 ? 1 : -1; });
  }
}

// PE 1 comes to a run 5 s late: later than the transfer timeout (2 s), within the arrival timeout
// (20 s). A peer that has not begun a run is arriving, not stuck: no PE's run fails (the CUDA
// transport's ready flags; NVSHMEM: a run's first word from each peer; NCCL: the run board of this
// machine's PEs), and every byte lands.
TEST_P(GpuFaults, APeLaterThanTheTransferTimeoutButWithinTheArrivalTimeoutFailsNoRun) {
  ::setenv("RESHARD_TIMEOUT_S", "2", 1);
  ::setenv("RESHARD_ARRIVAL_TIMEOUT_S", "20", 1);
  const Outcome outcome = launch(
      GetParam().pes, {RESHARD_FAULT_WORKER, "late-within-arrival", GetParam().transport}, true);
  EXPECT_LT(outcome.seconds, 60.0) << all_lines(outcome);
  EXPECT_EQ(outcome.result.exit_code, 0) << all_lines(outcome);
  expect_runs_given_up(outcome, GetParam().pes, "late-within-arrival", [](int) { return 0; });
}

// PE 1 killed or stopped instead of calling schedule() (the others are in it, exchanging the
// IPC handles and device addresses of the GPU transports): the survivors fail naming it, leave
// no mapping behind, and the next job on the same GPUs runs.
TEST_P(GpuFaults, PeKilledOrStoppedInScheduleFailsTheOthersAndTheNextJobRuns) {
  set_timeouts("5");
  for (const char* scenario : {"die-in-schedule", "stall-in-schedule"}) {
    const bool stopped = std::string(scenario) == "stall-in-schedule";
    const Outcome outcome =
        launch(GetParam().pes, {RESHARD_FAULT_WORKER, scenario, GetParam().transport}, stopped);
    EXPECT_LT(outcome.seconds, 90.0) << scenario << "\n" << all_lines(outcome);
    expect_survivors_reported(outcome, false);
    EXPECT_NE(outcome.result.exit_code, 0);
  }
  const Outcome next =
      launch(GetParam().pes, {RESHARD_FAULT_WORKER, "healthy", GetParam().transport}, true);
  EXPECT_EQ(next.result.exit_code, 0) << all_lines(next);
  for (int rank = 0; rank < GetParam().pes; ++rank)
    EXPECT_FALSE(line_of(next, rank, "HEALTHY-DONE").empty()) << all_lines(next);
}

INSTANTIATE_TEST_SUITE_P(
    Transports, GpuFaults,
    testing::Values(GpuFaultCase{"cuda", 2}, GpuFaultCase{"nccl", 2}, GpuFaultCase{"nvshmem", 2},
                    GpuFaultCase{"cuda", 4}, GpuFaultCase{"nccl", 4}, GpuFaultCase{"nvshmem", 4},
                    GpuFaultCase{"auto", 4}, GpuFaultCase{"nvshmem", 4, "stream"},
                    GpuFaultCase{"auto", 4, "stream"}, GpuFaultCase{"cuda", 4, "auto", "ce"}),
    [](const auto& info) {
      const std::string name = info.param.transport == "auto" ? "mixed" : info.param.transport;
      const std::string waits = info.param.nvshmem_waits == "stream" ? "_stream_waits" : "";
      const std::string engine = info.param.engine == "auto" ? "" : "_" + info.param.engine;
      return name + engine + waits + "_" + std::to_string(info.param.pes) + "_pes";
    });

TEST(Launcher, PrefixesOutputAndSetsTheTorchrunVariables) {
  const Outcome outcome = launch(
      3, {"sh", "-c", "echo rank=$RANK world=$WORLD_SIZE local=$LOCAL_RANK port=$MASTER_PORT"},
      true);
  EXPECT_EQ(outcome.result.exit_code, 0);
  for (int rank = 0; rank < 3; ++rank) {
    const std::string line = line_of(outcome, rank, "rank=");
    EXPECT_NE(line.find("rank=" + std::to_string(rank) + " world=3 local=" + std::to_string(rank)),
              std::string::npos)
        << all_lines(outcome);
    EXPECT_TRUE(std::regex_search(line, std::regex("port=[0-9]+"))) << line;
  }
}

TEST(Launcher, StopsTheJobWhenOneProcessFails) {
  const Outcome outcome =
      launch(3, {"sh", "-c", "if [ $RANK = 1 ]; then exit 3; fi; sleep 60"}, true);
  EXPECT_EQ(outcome.result.exit_code, 3);
  EXPECT_EQ(outcome.result.first_failed_rank, 1);
  EXPECT_LT(outcome.seconds, 20.0);
  EXPECT_NE(outcome.result.summary.find("rank 1 exited with status 3"), std::string::npos);
}

TEST(Launcher, RefusesACommandThatCannotStartNamingIt) {
  try {
    launch(2, {"/nonexistent/program"}, true);
    FAIL() << "a command that cannot start was launched";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(error.what()).find("cannot start '/nonexistent/program'"),
              std::string::npos)
        << error.what();
  }
}

TEST(Launcher, StopsAJobPastItsTimeLimit) {
  Outcome outcome;
  LaunchOptions options;
  options.n_procs = 2;
  options.command = {"sh", "-c", "echo up; exec sleep 60"};
  options.time_limit = 1500ms;
  options.kill_grace = 500ms;
  options.output = [&](const std::string& line, bool to_stderr) {
    outcome.lines.push_back((to_stderr ? "E " : "O ") + line);
  };
  const auto start = std::chrono::steady_clock::now();
  outcome.result = launch_local(options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(outcome.result.exit_code, 124);
  EXPECT_EQ(outcome.result.first_failed_rank, -1);
  EXPECT_GE(seconds, 1.4);
  EXPECT_LT(seconds, 10.0);
  EXPECT_NE(outcome.result.summary.find("time limit of 1.5"), std::string::npos)
      << outcome.result.summary;
  EXPECT_NE(all_lines(outcome).find("O [rank 1] up"), std::string::npos) << all_lines(outcome);
}

TEST(Launcher, FinishesWhereTheHostIgnoresSigchld) {
  // The kernel reaps the children itself then: the job must still end (statuses read as 0).
  struct sigaction ignore{};
  struct sigaction previous{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGCHLD, &ignore, &previous);
  const Outcome outcome = launch(2, {"sh", "-c", "echo done-$RANK"}, true);
  ::sigaction(SIGCHLD, &previous, nullptr);
  EXPECT_EQ(outcome.result.exit_code, 0);
  EXPECT_LT(outcome.seconds, 10.0);
  EXPECT_FALSE(line_of(outcome, 1, "done-1").empty()) << all_lines(outcome);
}

TEST(Launcher, KeepsEachRanksStderrApartFromItsStdout) {
  Outcome outcome;
  LaunchOptions options;
  options.n_procs = 2;
  options.command = {"sh", "-c", "echo out-$RANK; echo err-$RANK >&2; printf tail-$RANK"};
  options.output = [&](const std::string& line, bool to_stderr) {
    outcome.lines.push_back((to_stderr ? "E " : "O ") + line);
  };
  outcome.result = launch_local(options);
  EXPECT_EQ(outcome.result.exit_code, 0);
  for (const std::string rank : {"0", "1"}) {
    for (const std::string expected :
         {"O [rank " + rank + "] out-" + rank, "E [rank " + rank + "] err-" + rank,
          "O [rank " + rank + "] tail-" + rank}) {
      EXPECT_NE(std::find(outcome.lines.begin(), outcome.lines.end(), expected),
                outcome.lines.end())
          << expected << " missing from\n"
          << all_lines(outcome);
    }
  }
}

}  // namespace
}  // namespace reshard

namespace reshard {
namespace {

// A peer's shared memory that is smaller than expected (not sized yet, or left by another step)
// is refused with an error instead of mapped: touching it past its end would raise SIGBUS.
TEST(SharedMemory, UndersizedPeerSegmentIsRefusedNotMapped) {
  const std::string name = "/reshard-test-undersized-" + std::to_string(::getpid());
  const int fd = ::shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::ftruncate(fd, 4096), 0);
  ::close(fd);
  try {
    host::ShmSegment::open(name, 1 << 20);
    ADD_FAILURE() << "an undersized segment was mapped";
  } catch (const Error& error) {
    EXPECT_EQ(error.code(), ErrorCode::kPeerFailure);
    EXPECT_NE(std::string(error.what()).find("4096"), std::string::npos) << error.what();
  }
  EXPECT_NO_THROW(host::ShmSegment::open(name, 4096));
  ::shm_unlink(name.c_str());
}

}  // namespace
}  // namespace reshard

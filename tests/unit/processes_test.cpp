// How a waiting PE tells a dead or stopped peer process from a slow one (core/processes.hpp), on
// real child processes.
#include "core/processes.hpp"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

namespace reshard {
namespace {

// The state letter of /proc/<pid>/stat, read independently of the code under test.
char state_of(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(stat, line);
  const auto close = line.rfind(')');
  return close == std::string::npos ? 0 : line[close + 2];
}

// Waits up to 5 s for `pid` to reach `state`.
bool reaches(pid_t pid, char state) {
  for (int i = 0; i < 500; ++i) {
    if (state_of(pid) == state) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

pid_t child_that_sleeps() {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::pause();
    ::_exit(0);
  }
  return pid;
}

TEST(Processes, AnExitedChildNotYetReapedCountsAsExitedOnlyWhenZombiesCount) {
  const pid_t alive = child_that_sleeps();
  const pid_t zombie = ::fork();
  if (zombie == 0) ::_exit(0);
  ASSERT_TRUE(reaches(zombie, 'Z'));
  const std::vector<pid_t> pids{0, alive, zombie};
  // kill(pid, 0) still finds a zombie: without the /proc look it seems alive.
  EXPECT_EQ(first_exited_process(pids), -1);
  EXPECT_EQ(first_exited_process(pids, /*count_zombies=*/true), 2);
  ::waitpid(zombie, nullptr, 0);
  EXPECT_EQ(first_exited_process(pids), 2);  // gone altogether once reaped
  ::kill(alive, SIGKILL);
  ::waitpid(alive, nullptr, 0);
}

TEST(Processes, AStoppedChildIsFoundAndARunningOneIsNot) {
  const pid_t running = child_that_sleeps();
  const pid_t stopped = child_that_sleeps();
  ::kill(stopped, SIGSTOP);
  ASSERT_TRUE(reaches(stopped, 'T'));
  EXPECT_EQ(first_stopped_process(std::vector<pid_t>{running}), -1);
  EXPECT_EQ(first_stopped_process(std::vector<pid_t>{-1, running, stopped}), 2);
  EXPECT_EQ(first_exited_process(std::vector<pid_t>{running, stopped}, true), -1);
  for (pid_t pid : {running, stopped}) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
}

}  // namespace
}  // namespace reshard

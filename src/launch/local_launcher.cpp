#include "launch/local_launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>

#include "bootstrap/socket.hpp"
#include "reshard/error.hpp"

extern char** environ;

namespace reshard {
namespace {

volatile sig_atomic_t g_forward_signal = 0;

void remember_signal(int signal) { g_forward_signal = signal; }

using Clock = std::chrono::steady_clock;

// One rank's process: its two output pipes and, where the kernel has pidfds, a descriptor that
// becomes readable the moment it exits (so exits are seen in the order they happen).
struct Child {
  pid_t pid = -1;
  int output_fd[2] = {-1, -1};  // stdout, stderr
  std::string partial_line[2];
  int exit_fd = -1;
  bool running = true;
};

int decode_status(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

std::string describe_exit(int rank, int code) {
  std::ostringstream text;
  text << "rank " << rank;
  if (code > 128) {
    text << " was killed by signal " << code - 128 << " (" << strsignal(code - 128) << ")";
  } else {
    text << " exited with status " << code;
  }
  return text.str();
}

std::string make_job_id() {
  std::random_device device;
  std::ostringstream text;
  text << std::hex << ::getpid() << "r" << (device() & 0xffffff);
  return text.str();
}

int open_exit_fd(pid_t pid) {
#ifdef SYS_pidfd_open
  const long fd = ::syscall(SYS_pidfd_open, pid, 0);
  if (fd >= 0) {
    ::fcntl(static_cast<int>(fd), F_SETFD, FD_CLOEXEC);
    return static_cast<int>(fd);
  }
#endif
  return -1;  // an old kernel: exits are polled for instead
}

bool is_launch_variable(const std::string& entry) {
  static const char* const names[] = {
      "RANK=",        "LOCAL_RANK=",  "WORLD_SIZE=",    "LOCAL_WORLD_SIZE=",
      "MASTER_ADDR=", "MASTER_PORT=", "RESHARD_JOB_ID="};
  return std::any_of(std::begin(names), std::end(names),
                     [&](const char* name) { return entry.rfind(name, 0) == 0; });
}

// The environment of one rank, built before the process starts: posix_spawn touches no heap in
// the child, so the launcher is safe inside a multi-threaded host (the Python module).
std::vector<std::string> rank_environment(const LaunchOptions& options, int rank, int port,
                                          const std::string& job_id) {
  std::vector<std::string> entries;
  if (options.environment) {
    entries = *options.environment;
  } else {
    for (char** entry = environ; *entry != nullptr; ++entry) entries.emplace_back(*entry);
  }
  std::erase_if(entries, is_launch_variable);
  const std::string n = std::to_string(options.n_procs);
  for (const std::string& entry :
       {"RANK=" + std::to_string(rank), "LOCAL_RANK=" + std::to_string(rank), "WORLD_SIZE=" + n,
        "LOCAL_WORLD_SIZE=" + n, "MASTER_ADDR=" + options.master_addr,
        "MASTER_PORT=" + std::to_string(port), "RESHARD_JOB_ID=" + job_id}) {
    entries.push_back(entry);
  }
  return entries;
}

std::vector<char*> pointers_to(std::vector<std::string>& strings) {
  std::vector<char*> pointers;
  for (std::string& text : strings) pointers.push_back(text.data());
  pointers.push_back(nullptr);
  return pointers;
}

// Starts one rank in its own process group (stopping a rank stops whatever it started), its
// output into the two pipes, with default signal handling (a host such as Python ignores
// SIGPIPE, and an ignored signal would stay ignored across exec). Returns 0 or an errno value.
int spawn(const LaunchOptions& options, std::vector<std::string> environment, const int out[2],
          pid_t* pid) {
  posix_spawn_file_actions_t actions;
  posix_spawnattr_t attributes;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, out[0], STDOUT_FILENO);
  posix_spawn_file_actions_adddup2(&actions, out[1], STDERR_FILENO);
  posix_spawnattr_init(&attributes);
  sigset_t defaults, none;
  sigemptyset(&defaults);
  for (int signal : {SIGPIPE, SIGINT, SIGTERM, SIGQUIT, SIGXFSZ}) sigaddset(&defaults, signal);
  sigemptyset(&none);
  posix_spawnattr_setsigdefault(&attributes, &defaults);
  posix_spawnattr_setsigmask(&attributes, &none);
  posix_spawnattr_setpgroup(&attributes, 0);
  posix_spawnattr_setflags(&attributes,
                           POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETSIGMASK);
  std::vector<std::string> arguments = options.command;
  std::vector<char*> argv = pointers_to(arguments);
  std::vector<char*> envp = pointers_to(environment);
  const int status = ::posix_spawnp(pid, argv[0], &actions, &attributes, argv.data(), envp.data());
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attributes);
  return status;
}

// Runs the job once its processes exist: forwards output, watches exits, stops the job on the
// first failure, a forwarded signal, or the time limit.
class Job {
 public:
  Job(const LaunchOptions& options, std::vector<Child>& children)
      : options_(options), children_(children) {
    result_.exit_codes.assign(children.size(), 0);
    running_ = static_cast<int>(children.size());
    if (options.time_limit.count() > 0) time_limit_at_ = Clock::now() + options.time_limit;
  }

  LaunchResult run() {
    while (running_ > 0 || has_open_output()) {
      wait_for_events();
      reap_exited();
      if (g_forward_signal != 0 && !stopping_) {
        fail(128 + g_forward_signal, -1,
             "interrupted by signal " + std::to_string(g_forward_signal));
        stop(g_forward_signal);
      }
      if (!stopping_ && Clock::now() > time_limit_at_) {
        std::ostringstream summary;
        summary << "the job ran past its time limit of " << options_.time_limit.count() / 1000.0
                << " s";
        fail(124, -1, summary.str());
        stop(SIGTERM);
      }
      if (stopping_ && Clock::now() > kill_at_) {
        signal_all(SIGKILL);
        kill_at_ = Clock::time_point::max();
      }
    }
    return result_;
  }

 private:
  bool has_open_output() const {
    return std::any_of(children_.begin(), children_.end(), [](const Child& child) {
      return child.output_fd[0] >= 0 || child.output_fd[1] >= 0;
    });
  }

  void emit(const std::string& line, bool to_stderr) {
    if (options_.output) {
      options_.output(line, to_stderr);
      return;
    }
    std::FILE* stream = to_stderr ? stderr : stdout;
    std::fwrite(line.data(), 1, line.size(), stream);
    std::fputc('\n', stream);
    std::fflush(stream);
  }

  // Waits for output or an exit; with pidfds an exit wakes the loop at once, without them it is
  // found by the next round (50 ms).
  void wait_for_events() {
    std::vector<pollfd> polls;
    std::vector<std::pair<int, int>> sources;  // (rank, stream); stream 2 = the exit descriptor
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank) {
      Child& child = children_[rank];
      for (int stream = 0; stream < 2; ++stream) {
        if (child.output_fd[stream] < 0) continue;
        polls.push_back({child.output_fd[stream], POLLIN, 0});
        sources.emplace_back(rank, stream);
      }
      if (child.running && child.exit_fd >= 0) {
        polls.push_back({child.exit_fd, POLLIN, 0});
        sources.emplace_back(rank, 2);
      }
    }
    ::poll(polls.data(), polls.size(), 50);
    for (std::size_t i = 0; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      const auto [rank, stream] = sources[i];
      if (stream == 2) {
        reap(rank, /*blocking=*/true);
      } else {
        read_output(rank, stream);
      }
    }
  }

  void read_output(int rank, int stream) {
    Child& child = children_[rank];
    char buffer[65536];
    const ssize_t n = ::read(child.output_fd[stream], buffer, sizeof buffer);
    std::string& pending = child.partial_line[stream];
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    if (n > 0) {
      pending.append(buffer, static_cast<std::size_t>(n));
      std::size_t newline;
      while ((newline = pending.find('\n')) != std::string::npos) {
        emit(prefix + pending.substr(0, newline), stream == 1);
        pending.erase(0, newline + 1);
      }
    } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
      if (!pending.empty()) emit(prefix + pending, stream == 1);
      pending.clear();
      ::close(child.output_fd[stream]);
      child.output_fd[stream] = -1;
    }
  }

  // Children without an exit descriptor (a kernel without pidfds) are polled for here; the others
  // are reaped as their descriptor fires, in the order they exit.
  void reap_exited() {
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank) {
      if (children_[rank].running && children_[rank].exit_fd < 0) reap(rank, /*blocking=*/false);
    }
  }

  void reap(int rank, bool blocking) {
    Child& child = children_[rank];
    int status = 0;
    const pid_t reaped = ::waitpid(child.pid, &status, blocking ? 0 : WNOHANG);
    // ECHILD: the host ignores SIGCHLD, so the kernel reaped the child and its status is lost.
    if (reaped == -1 && errno == ECHILD)
      status = 0;
    else if (reaped != child.pid)
      return;
    child.running = false;
    if (child.exit_fd >= 0) ::close(child.exit_fd);
    child.exit_fd = -1;
    --running_;
    const int code = decode_status(status);
    result_.exit_codes[rank] = code;
    if (code == 0 || stopping_ || result_.first_failed_rank >= 0) return;
    const std::string summary = describe_exit(rank, code);
    fail(code, rank, summary);
    if (options_.kill_on_failure && running_ > 0) {
      emit(options_.name + ": " + summary + "; stopping the other ranks", true);
      stop(SIGTERM);
    }
  }

  // Records the job's failure (the first one only); the caller reports its summary.
  void fail(int code, int rank, const std::string& summary) {
    if (result_.exit_code != 0) return;
    result_.exit_code = code;
    result_.first_failed_rank = rank;
    result_.summary = summary;
  }

  void stop(int signal) {
    stopping_ = true;
    signal_all(signal);
    kill_at_ = Clock::now() + options_.kill_grace;
  }

  void signal_all(int signal) {
    for (const Child& child : children_) {
      if (child.running) ::kill(-child.pid, signal);
    }
  }

  const LaunchOptions& options_;
  std::vector<Child>& children_;
  LaunchResult result_;
  int running_ = 0;
  bool stopping_ = false;
  Clock::time_point kill_at_ = Clock::time_point::max();
  Clock::time_point time_limit_at_ = Clock::time_point::max();
};

void close_all(std::vector<Child>& children) {
  for (Child& child : children) {
    for (int& fd : child.output_fd) {
      if (fd >= 0) ::close(fd);
      fd = -1;
    }
    if (child.exit_fd >= 0) ::close(child.exit_fd);
    child.exit_fd = -1;
  }
}

}  // namespace

void remove_job_leftovers(const std::string& job_id) {
  std::error_code ignored;
  const std::string prefix = "reshard-" + job_id + "-";
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    if (entry.path().filename().string().rfind(prefix, 0) == 0) {
      std::filesystem::remove(entry.path(), ignored);
    }
  }
}

LaunchResult launch_local(const LaunchOptions& options) {
  if (options.n_procs < 1) {
    throw_error(ErrorCode::kInvalidArgument, "the number of processes must be at least 1, got " +
                                                 std::to_string(options.n_procs));
  }
  if (options.command.empty() || options.command.front().empty()) {
    throw_error(ErrorCode::kInvalidArgument, "no command to launch");
  }
  if (options.time_limit.count() < 0) {
    throw_error(ErrorCode::kInvalidArgument, "the time limit must not be negative");
  }
  int port = options.master_port;
  if (port == 0) port = net::local_port(net::listen_on(0, 1));
  const std::string job_id = make_job_id();

  std::vector<Child> children(options.n_procs);
  for (int rank = 0; rank < options.n_procs; ++rank) {
    Child& child = children[rank];
    int write_ends[2];
    for (int stream = 0; stream < 2; ++stream) {
      int fds[2];
      if (::pipe2(fds, O_CLOEXEC) != 0) {
        const int error = errno;
        for (int s = 0; s < stream; ++s) ::close(write_ends[s]);
        close_all(children);
        errno = error;
        throw_system_error("pipe()");
      }
      child.output_fd[stream] = fds[0];
      write_ends[stream] = fds[1];
    }
    const int error =
        spawn(options, rank_environment(options, rank, port, job_id), write_ends, &child.pid);
    ::close(write_ends[0]);
    ::close(write_ends[1]);
    if (error != 0) {
      // Nothing of this job may outlive the error: stop the ranks already started.
      for (int started = 0; started < rank; ++started) {
        ::kill(-children[started].pid, SIGKILL);
        ::waitpid(children[started].pid, nullptr, 0);
      }
      close_all(children);
      throw_error(ErrorCode::kInvalidArgument,
                  "cannot start '" + options.command.front() + "': " + std::strerror(error));
    }
    child.exit_fd = open_exit_fd(child.pid);
  }

  struct sigaction forward{};
  forward.sa_handler = remember_signal;
  struct sigaction old_int{};
  struct sigaction old_term{};
  g_forward_signal = 0;
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  LaunchResult result = Job(options, children).run();
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  close_all(children);
  remove_job_leftovers(job_id);
  return result;
}

}  // namespace reshard

#include "launch/local_launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
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

namespace reshard {
namespace {

volatile sig_atomic_t g_forward_signal = 0;

void remember_signal(int signal) { g_forward_signal = signal; }

struct Child {
  pid_t pid = -1;
  int output_fd = -1;
  std::string partial_line;
  bool running = true;
  int exit_code = 0;
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
    text << " exited with code " << code;
  }
  return text.str();
}

std::string make_job_id() {
  std::random_device device;
  std::ostringstream text;
  text << std::hex << ::getpid() << "r" << (device() & 0xffffff);
  return text.str();
}

pid_t spawn(const LaunchOptions& options, int rank, int port, const std::string& job_id,
            int output_fd) {
  const pid_t pid = ::fork();
  if (pid < 0) throw_system_error("fork()");
  if (pid > 0) return pid;
  // Its own process group, so stopping a rank also stops whatever it started.
  ::setpgid(0, 0);
  ::dup2(output_fd, STDOUT_FILENO);
  ::dup2(output_fd, STDERR_FILENO);
  ::setenv("RANK", std::to_string(rank).c_str(), 1);
  ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
  ::setenv("WORLD_SIZE", std::to_string(options.n_procs).c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", std::to_string(options.n_procs).c_str(), 1);
  ::setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  ::setenv("RESHARD_JOB_ID", job_id.c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& arg : options.command) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "reshard-run: cannot start '%s': %s\n", argv[0], std::strerror(errno));
  ::_exit(127);
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
    throw_error(ErrorCode::kInvalidArgument, "the number of processes must be at least 1");
  }
  if (options.command.empty()) throw_error(ErrorCode::kInvalidArgument, "no command to launch");
  const auto emit = [&](const std::string& line) {
    if (options.output) {
      options.output(line);
    } else {
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
    }
  };
  int port = options.master_port;
  if (port == 0) port = net::local_port(net::listen_on(0, 1));
  const std::string job_id = make_job_id();

  struct sigaction forward {};
  forward.sa_handler = remember_signal;
  struct sigaction old_int {
  }, old_term{};
  ::sigaction(SIGINT, &forward, &old_int);
  ::sigaction(SIGTERM, &forward, &old_term);
  g_forward_signal = 0;

  std::vector<Child> children(options.n_procs);
  for (int rank = 0; rank < options.n_procs; ++rank) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw_system_error("pipe()");
    children[rank].pid = spawn(options, rank, port, job_id, fds[1]);
    ::close(fds[1]);
    children[rank].output_fd = fds[0];
  }

  LaunchResult result;
  result.exit_codes.assign(options.n_procs, 0);
  int running = options.n_procs;
  bool stopping = false;
  auto kill_deadline = std::chrono::steady_clock::time_point::max();
  auto stop_all = [&](int signal) {
    for (Child& child : children) {
      if (child.running) ::kill(-child.pid, signal);
    }
  };
  auto flush_line = [&](int rank, const std::string& line) {
    emit("[rank " + std::to_string(rank) + "] " + line);
  };

  while (running > 0 || std::any_of(children.begin(), children.end(),
                                    [](const Child& c) { return c.output_fd >= 0; })) {
    std::vector<pollfd> polls;
    std::vector<int> ranks;
    for (int rank = 0; rank < options.n_procs; ++rank) {
      if (children[rank].output_fd >= 0) {
        polls.push_back({children[rank].output_fd, POLLIN, 0});
        ranks.push_back(rank);
      }
    }
    ::poll(polls.data(), polls.size(), 50);
    for (std::size_t i = 0; i < polls.size(); ++i) {
      if (polls[i].revents == 0) continue;
      Child& child = children[ranks[i]];
      char buffer[65536];
      const ssize_t n = ::read(child.output_fd, buffer, sizeof buffer);
      if (n > 0) {
        child.partial_line.append(buffer, static_cast<std::size_t>(n));
        std::size_t newline;
        while ((newline = child.partial_line.find('\n')) != std::string::npos) {
          flush_line(ranks[i], child.partial_line.substr(0, newline));
          child.partial_line.erase(0, newline + 1);
        }
      } else if (n == 0 || (errno != EINTR && errno != EAGAIN)) {
        if (!child.partial_line.empty()) flush_line(ranks[i], child.partial_line);
        child.partial_line.clear();
        ::close(child.output_fd);
        child.output_fd = -1;
      }
    }
    for (int rank = 0; rank < options.n_procs; ++rank) {
      Child& child = children[rank];
      if (!child.running) continue;
      int status = 0;
      if (::waitpid(child.pid, &status, WNOHANG) != child.pid) continue;
      child.running = false;
      --running;
      result.exit_codes[rank] = decode_status(status);
      if (result.exit_codes[rank] != 0 && result.first_failed_rank < 0 && !stopping) {
        result.first_failed_rank = rank;
        result.exit_code = result.exit_codes[rank];
        result.summary = describe_exit(rank, result.exit_codes[rank]);
        if (options.kill_on_failure && running > 0) {
          emit("reshard-run: " + result.summary + "; stopping the other ranks");
          stopping = true;
          stop_all(SIGTERM);
          kill_deadline = std::chrono::steady_clock::now() + options.kill_grace;
        }
      }
    }
    if (g_forward_signal != 0 && !stopping) {
      stopping = true;
      stop_all(g_forward_signal);
      kill_deadline = std::chrono::steady_clock::now() + options.kill_grace;
      if (result.exit_code == 0) {
        result.exit_code = 128 + g_forward_signal;
        result.summary = "interrupted";
      }
    }
    if (stopping && std::chrono::steady_clock::now() > kill_deadline) {
      stop_all(SIGKILL);
      kill_deadline = std::chrono::steady_clock::time_point::max();
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  remove_job_leftovers(job_id);
  return result;
}

}  // namespace reshard

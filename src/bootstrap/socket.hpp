// Thin, deadline-aware wrappers over TCP sockets for the bootstrap. Every blocking call takes a
// deadline and a description of whom it waits for, so a silent peer becomes a named error.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace reshard::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& other) noexcept : fd_(other.release()) {}
  Socket& operator=(Socket&& other) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int fd = fd_;
    fd_ = -1;
    return fd;
  }

 private:
  int fd_ = -1;
};

// Listens on every interface; port 0 picks a free one.
Socket listen_on(int port, int backlog);
int local_port(const Socket& socket);
std::string peer_address(const Socket& socket);
// Whether `fd` is a TCP connection from a port to that same port of the same address: a connect to
// a port of this machine that nobody listens on can open a connection with itself.
bool connected_to_itself(int fd);
// Retries until the deadline: the listener may not be up yet when a rank starts (a connection a
// retry opened with itself is dropped: it would hold the port the listener is about to take).
Socket connect_to(const std::string& host, int port, Deadline deadline, const std::string& whom);
// Waits for one incoming connection.
Socket accept_one(const Socket& listener, Deadline deadline, const std::string& whom);

// Waits until `fd` is readable; false on timeout.
bool wait_readable(int fd, Deadline deadline);

void send_all(const Socket& socket, std::span<const std::byte> data, Deadline deadline,
              const std::string& whom);
// Throws kPeerFailure naming `whom` on EOF, kTimeout on the deadline.
void recv_all(const Socket& socket, std::span<std::byte> data, Deadline deadline,
              const std::string& whom);

// Length-prefixed messages with a kind, so an abort notice can travel where data was expected.
// kGiveUp: rank 0 gave up on one collective (a rank was late) and tells every rank, so all of them
// fail it alike and go on to the next.
enum class FrameKind : std::uint32_t { kData = 1, kAbort = 2, kHello = 3, kGiveUp = 4 };

struct Frame {
  FrameKind kind = FrameKind::kData;
  std::vector<std::byte> payload;
};

void send_frame(const Socket& socket, FrameKind kind, std::span<const std::byte> payload,
                Deadline deadline, const std::string& whom);
Frame recv_frame(const Socket& socket, Deadline deadline, const std::string& whom);

}  // namespace reshard::net

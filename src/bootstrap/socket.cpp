#include "bootstrap/socket.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "core/interrupt.hpp"
#include "reshard/error.hpp"

namespace reshard::net {
namespace {

int remaining_ms(Deadline deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return left.count() <= 0 ? 0 : static_cast<int>(std::min<long long>(left.count(), 1 << 30));
}

// One poll of a wait: until the deadline, but no longer than a check for interruption allows.
int slice_ms(Deadline deadline) {
  return std::min<int>(remaining_ms(deadline), static_cast<int>(kInterruptCheckPeriod.count()));
}

[[noreturn]] void throw_timeout(const std::string& whom) {
  throw_error(ErrorCode::kTimeout,
              "timed out waiting for " + whom + " (raise RESHARD_TIMEOUT_S if it is only slow)");
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}
}  // namespace

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket& Socket::operator=(Socket&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.release();
  }
  return *this;
}

Socket listen_on(int port, int backlog) {
  Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!socket.valid()) throw_system_error("socket()");
  int one = 1;
  ::setsockopt(socket.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_ANY);
  address.sin_port = htons(static_cast<std::uint16_t>(port));
  if (::bind(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
    throw_system_error("cannot listen on port " + std::to_string(port));
  }
  if (::listen(socket.fd(), backlog) != 0) throw_system_error("listen()");
  return socket;
}

int local_port(const Socket& socket) {
  sockaddr_in address{};
  socklen_t length = sizeof address;
  if (::getsockname(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw_system_error("getsockname()");
  }
  return ntohs(address.sin_port);
}

std::string peer_address(const Socket& socket) {
  sockaddr_in address{};
  socklen_t length = sizeof address;
  if (::getpeername(socket.fd(), reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw_system_error("getpeername()");
  }
  char text[INET_ADDRSTRLEN] = {};
  ::inet_ntop(AF_INET, &address.sin_addr, text, sizeof text);
  return text;
}

bool connected_to_itself(int fd) {
  sockaddr_in local{}, peer{};
  socklen_t local_size = sizeof local, peer_size = sizeof peer;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &local_size) != 0 ||
      ::getpeername(fd, reinterpret_cast<sockaddr*>(&peer), &peer_size) != 0)
    return false;
  return local.sin_port == peer.sin_port && local.sin_addr.s_addr == peer.sin_addr.s_addr;
}

Socket connect_to(const std::string& host, int port, Deadline deadline, const std::string& whom) {
  const auto started = Clock::now();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  if (int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &found); rc != 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "cannot resolve bootstrap address '" + host + "': " + ::gai_strerror(rc));
  }
  sockaddr_in address{};
  std::memcpy(&address, found->ai_addr, sizeof address);
  ::freeaddrinfo(found);
  auto pause = std::chrono::milliseconds(5);
  while (true) {
    Socket socket(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (!socket.valid()) throw_system_error("socket()");
    if (::connect(socket.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address) == 0) {
      if (!connected_to_itself(socket.fd())) {
        set_nodelay(socket.fd());
        return socket;
      }
      // Connecting again and again to a port of this machine that nobody listens on yet (rank 0
      // still starting), the kernel may give the socket that very port as its own and connect it
      // to itself: it then holds the port rank 0 is about to listen on ("Address already in use"
      // there). Such a connection is dropped and tried again.
      errno = ECONNREFUSED;
    }
    if (Clock::now() + pause >= deadline) {
      throw_error(ErrorCode::kTimeout, "timed out connecting to " + whom + " at " + host + ":" +
                                           service + " (" + std::strerror(errno) + ")");
    }
    throw_if_interrupted(("connecting to " + whom).c_str(), started);
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::milliseconds(kInterruptCheckPeriod));
  }
}

bool wait_readable(int fd, Deadline deadline) {
  const auto started = Clock::now();
  while (true) {
    pollfd entry{fd, POLLIN, 0};
    const int rc = ::poll(&entry, 1, slice_ms(deadline));
    if (rc > 0) return true;
    if (rc < 0 && errno != EINTR) throw_system_error("poll()");
    if (rc == 0 && Clock::now() >= deadline) return false;
    throw_if_interrupted("a bootstrap's exchange with its peers", started);
  }
}

Socket accept_one(const Socket& listener, Deadline deadline, const std::string& whom) {
  if (!wait_readable(listener.fd(), deadline)) throw_timeout(whom);
  Socket socket(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC));
  if (!socket.valid()) throw_system_error("accept()");
  set_nodelay(socket.fd());
  return socket;
}

void send_all(const Socket& socket, std::span<const std::byte> data, Deadline deadline,
              const std::string& whom) {
  const auto started = Clock::now();
  std::size_t sent = 0;
  while (sent < data.size()) {
    ssize_t n =
        ::send(socket.fd(), data.data() + sent, data.size() - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (n > 0) {
      sent += static_cast<std::size_t>(n);
      continue;
    }
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
      pollfd entry{socket.fd(), POLLOUT, 0};
      if (::poll(&entry, 1, slice_ms(deadline)) == 0) {
        if (Clock::now() >= deadline) throw_timeout(whom);
        throw_if_interrupted(("sending to " + whom).c_str(), started);
      }
      continue;
    }
    throw_error(ErrorCode::kPeerFailure,
                "lost the connection to " + whom + " (" + std::strerror(errno) + "); did it exit?");
  }
}

void recv_all(const Socket& socket, std::span<std::byte> data, Deadline deadline,
              const std::string& whom) {
  std::size_t received = 0;
  while (received < data.size()) {
    ssize_t n = ::recv(socket.fd(), data.data() + received, data.size() - received, MSG_DONTWAIT);
    if (n > 0) {
      received += static_cast<std::size_t>(n);
      continue;
    }
    if (n == 0) {
      throw_error(ErrorCode::kPeerFailure, "lost the connection to " + whom + "; did it exit?");
    }
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
      if (!wait_readable(socket.fd(), deadline)) throw_timeout(whom);
      continue;
    }
    throw_error(ErrorCode::kPeerFailure,
                "lost the connection to " + whom + " (" + std::strerror(errno) + "); did it exit?");
  }
}

namespace {
struct FrameHeader {
  std::uint32_t kind;
  std::uint32_t reserved;
  std::uint64_t bytes;
};
}  // namespace

void send_frame(const Socket& socket, FrameKind kind, std::span<const std::byte> payload,
                Deadline deadline, const std::string& whom) {
  FrameHeader header{static_cast<std::uint32_t>(kind), 0, payload.size()};
  send_all(socket, std::as_bytes(std::span(&header, 1)), deadline, whom);
  send_all(socket, payload, deadline, whom);
}

Frame recv_frame(const Socket& socket, Deadline deadline, const std::string& whom) {
  FrameHeader header{};
  recv_all(socket, std::as_writable_bytes(std::span(&header, 1)), deadline, whom);
  if (header.kind < 1 || header.kind > 4 || header.bytes > (std::uint64_t{1} << 40)) {
    throw_error(ErrorCode::kPeerFailure, "malformed bootstrap message from " + whom);
  }
  Frame frame;
  frame.kind = static_cast<FrameKind>(header.kind);
  frame.payload.resize(header.bytes);
  recv_all(socket, frame.payload, deadline, whom);
  return frame;
}

}  // namespace reshard::net

// Star-shaped TCP bootstrap. Rank 0 relays collectives: it knows which rank is missing, so its
// wait is a little shorter than everyone else's and it tells the others who failed.
#include <poll.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>

#include "bootstrap/socket.hpp"
#include "core/env.hpp"
#include "core/interrupt.hpp"
#include "core/message.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "reshard/types.hpp"

namespace reshard {
namespace {

std::string rank_name(int rank) { return "rank " + std::to_string(rank); }

// An abort frame's reason: its payload as text.
std::string text_of(const net::Frame& frame) {
  return std::string(reinterpret_cast<const char*>(frame.payload.data()), frame.payload.size());
}

// The reason of an abort frame waiting on `link`, if one comes within a moment.
std::optional<std::string> pending_abort(const net::Socket& link) {
  try {
    const net::Frame frame =
        net::recv_frame(link, net::Clock::now() + std::chrono::milliseconds(200), "rank 0");
    if (frame.kind == net::FrameKind::kAbort) return text_of(frame);
  } catch (const Error&) {
    // Nothing came: the link's own error stands.
  }
  return std::nullopt;
}

struct Endpoint {
  std::string host;
  int port = 0;
};

}  // namespace

struct TcpBootstrap::Impl {
  TcpBootstrapOptions options;
  net::Socket root_listener;          // rank 0 only
  std::vector<net::Socket> to_ranks;  // rank 0 only: index r holds the link to rank r
  net::Socket to_root;                // other ranks
  net::Socket p2p_listener;
  std::vector<Endpoint> p2p_endpoints;
  std::map<int, net::Socket> p2p_out;
  std::map<int, net::Socket> p2p_in;
  // Collectives begun, the same count on every rank: each one's frames carry it, so a late rank's
  // contribution to a collective rank 0 gave up on is told from its next one and dropped.
  std::uint64_t collectives = 0;

  bool is_root() const { return options.rank == 0; }
  net::Deadline root_deadline() const { return net::Clock::now() + options.timeout; }
  // Non-root ranks wait longer than rank 0, so rank 0's message naming the culprit arrives first.
  net::Deadline member_deadline() const {
    return net::Clock::now() + options.timeout + std::chrono::seconds(5);
  }

  void connect_all();
  std::vector<std::vector<std::byte>> gather_and_share(std::span<const std::byte> mine,
                                                       const char* what);
  void abort_members(const std::string& reason, int skip_rank);
  [[noreturn]] void give_up(std::uint64_t collective, const std::string& reason,
                            const std::vector<int>& late);
  const net::Socket& outgoing(int peer);
  const net::Socket& incoming(int peer);
};

void TcpBootstrap::Impl::abort_members(const std::string& reason, int skip_rank) {
  const std::span<const std::byte> text = std::as_bytes(std::span(reason));
  for (int r = 1; r < options.size; ++r) {
    if (r == skip_rank || !to_ranks[r].valid()) continue;
    try {
      send_frame(to_ranks[r], net::FrameKind::kAbort, text,
                 net::Clock::now() + std::chrono::milliseconds(500), rank_name(r));
    } catch (const Error&) {
      // That rank is gone too; the others still get the message.
    }
  }
}

// Rank 0 ends a collective in which a rank is late: every rank that is there gets the give-up
// now, a late one when it arrives (before it would wait for the reply), so all fail it alike.
void TcpBootstrap::Impl::give_up(std::uint64_t collective, const std::string& reason,
                                 const std::vector<int>& late) {
  message::Writer frame;
  frame.put<std::uint64_t>(collective);
  frame.put_string(reason);
  frame.put_array(std::span<const int>(late));
  for (int r = 1; r < options.size; ++r) {
    try {
      send_frame(to_ranks[r], net::FrameKind::kGiveUp, frame.bytes(),
                 net::Clock::now() + std::chrono::milliseconds(500), rank_name(r));
    } catch (const Error&) {
      // That rank is gone: its next collective fails on the broken link.
    }
  }
  throw CollectiveAbandoned(ErrorCode::kTimeout, reason, late);
}

void TcpBootstrap::Impl::connect_all() {
  p2p_listener = net::listen_on(0, 64);
  const int my_p2p_port = net::local_port(p2p_listener);
  if (is_root()) {
    to_ranks.resize(options.size);
    const auto deadline = root_deadline();
    std::vector<Endpoint> endpoints(options.size);
    endpoints[0] = {options.address, my_p2p_port};
    int joined = 1;
    try {
      while (joined < options.size) {
        std::string missing;
        for (int r = 1; r < options.size; ++r) {
          if (!to_ranks[r].valid()) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        }
        net::Socket link =
            net::accept_one(root_listener, deadline, "rank(s) " + missing + " to join the job");
        net::Frame hello = net::recv_frame(link, deadline, "a joining rank");
        message::Reader reader(hello.payload);
        const int rank = reader.get<int>();
        const int port = reader.get<int>();
        const int size = reader.get<int>();
        if (rank <= 0 || rank >= options.size || to_ranks[rank].valid() || size != options.size) {
          throw_error(ErrorCode::kInvalidArgument,
                      "a process joined as rank " + std::to_string(rank) + " of " +
                          std::to_string(size) + ", which does not fit this job of " +
                          std::to_string(options.size) + " ranks");
        }
        endpoints[rank] = {net::peer_address(link), port};
        to_ranks[rank] = std::move(link);
        ++joined;
      }
    } catch (const Error& error) {
      abort_members(error.what(), -1);
      throw;
    }
    root_listener = net::Socket();
    message::Writer table;
    for (const Endpoint& e : endpoints) {
      table.put_string(e.host);
      table.put<int>(e.port);
    }
    for (int r = 1; r < options.size; ++r) {
      send_frame(to_ranks[r], net::FrameKind::kData, table.bytes(), deadline, rank_name(r));
    }
    p2p_endpoints = std::move(endpoints);
  } else {
    const auto deadline = member_deadline();
    to_root = net::connect_to(options.address, options.port, deadline, "rank 0");
    message::Writer hello;
    hello.put<int>(options.rank);
    hello.put<int>(my_p2p_port);
    hello.put<int>(options.size);
    send_frame(to_root, net::FrameKind::kHello, hello.bytes(), deadline, "rank 0");
    net::Frame table = net::recv_frame(to_root, deadline, "rank 0 (waiting for all ranks to join)");
    if (table.kind == net::FrameKind::kAbort) {
      throw_error(ErrorCode::kPeerFailure, text_of(table));
    }
    message::Reader reader(table.payload);
    for (int r = 0; r < options.size; ++r) {
      Endpoint e;
      e.host = reader.get_string();
      e.port = reader.get<int>();
      p2p_endpoints.push_back(e);
    }
    // Rank 0 knows itself only by the address we were given.
    p2p_endpoints[0].host = options.address;
  }
}

std::vector<std::vector<std::byte>> TcpBootstrap::Impl::gather_and_share(
    std::span<const std::byte> mine, const char* what) {
  const int n = options.size;
  if (n == 1) return {std::vector<std::byte>(mine.begin(), mine.end())};
  const std::uint64_t collective = ++collectives;
  if (!is_root()) {
    const auto deadline = member_deadline();
    message::Writer contribution;
    contribution.put<std::uint64_t>(collective);
    contribution.put_array(mine);
    try {
      send_frame(to_root, net::FrameKind::kData, contribution.bytes(), deadline, "rank 0");
    } catch (const Error&) {
      // Rank 0 may have closed the link after telling every rank why: that reason, if it came.
      if (const auto reason = pending_abort(to_root))
        throw_error(ErrorCode::kPeerFailure, std::string(what) + " failed: " + *reason);
      throw;
    }
    for (;;) {
      net::Frame reply =
          net::recv_frame(to_root, deadline,
                          std::string("rank 0 to complete ") + what + " (it waits for every rank)");
      if (reply.kind == net::FrameKind::kAbort) {
        throw_error(ErrorCode::kPeerFailure, std::string(what) + " failed: " + text_of(reply));
      }
      message::Reader reader(reply.payload);
      // Older: the end of a collective this rank stopped waiting for on its own.
      if (reader.get<std::uint64_t>() < collective) continue;
      if (reply.kind == net::FrameKind::kGiveUp) {
        const std::string reason = reader.get_string();
        throw CollectiveAbandoned(ErrorCode::kTimeout,
                                  "rank 0 gave up on this " + std::string(what) + ": " + reason,
                                  reader.get_array<int>());
      }
      std::vector<std::vector<std::byte>> all(n);
      for (int r = 0; r < n; ++r) all[r] = reader.get_array<std::byte>();
      return all;
    }
  }
  std::vector<std::vector<std::byte>> all(n);
  all[0].assign(mine.begin(), mine.end());
  std::vector<bool> arrived(n, false);
  arrived[0] = true;
  int pending = n - 1;
  const auto deadline = root_deadline();
  const auto started = net::Clock::now();
  try {
    while (pending > 0) {
      std::vector<pollfd> polls;
      std::vector<int> ranks;
      for (int r = 1; r < n; ++r) {
        if (!arrived[r]) {
          polls.push_back({to_ranks[r].fd(), POLLIN, 0});
          ranks.push_back(r);
        }
      }
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - net::Clock::now());
      const int rc =
          left.count() > 0
              ? ::poll(
                    polls.data(), polls.size(),
                    static_cast<int>(
                        std::min(left, std::chrono::milliseconds(kInterruptCheckPeriod)).count()))
              : 0;
      if (rc == 0 && left > kInterruptCheckPeriod) {
        throw_if_interrupted(what, started);
        continue;
      }
      if (rc == 0) {
        std::string missing;
        for (int r : ranks) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        give_up(collective,
                std::string("timed out in ") + what + " after " + format_seconds(options.timeout) +
                    " waiting for rank(s) " + missing +
                    " (every rank failed it alike; raise the timeout if they are "
                    "only slow)",
                ranks);
      }
      if (rc < 0) {
        if (errno == EINTR) continue;
        throw_system_error("poll()");
      }
      for (std::size_t i = 0; i < polls.size(); ++i) {
        if (polls[i].revents == 0) continue;
        const int r = ranks[i];
        net::Frame frame = net::recv_frame(to_ranks[r], deadline, rank_name(r));
        if (frame.kind == net::FrameKind::kAbort) {
          throw_error(ErrorCode::kPeerFailure, rank_name(r) + " aborted: " + text_of(frame));
        }
        message::Reader reader(frame.payload);
        const std::uint64_t tag = reader.get<std::uint64_t>();
        if (tag < collective) continue;  // its part of a collective given up on: dropped
        if (tag > collective) {
          throw_error(ErrorCode::kInvalidState, rank_name(r) + " is in collective " +
                                                    std::to_string(tag) + " where rank 0 is in " +
                                                    std::to_string(collective) +
                                                    ": the ranks called different collectives");
        }
        all[r] = reader.get_array<std::byte>();
        arrived[r] = true;
        --pending;
      }
    }
  } catch (const CollectiveAbandoned&) {
    throw;  // every rank told already
  } catch (const Error& error) {
    abort_members(error.what(), -1);
    throw;
  }
  message::Writer reply;
  reply.put<std::uint64_t>(collective);
  for (const auto& part : all) reply.put_array(std::span<const std::byte>(part));
  for (int r = 1; r < n; ++r) {
    send_frame(to_ranks[r], net::FrameKind::kData, reply.bytes(), deadline, rank_name(r));
  }
  return all;
}

const net::Socket& TcpBootstrap::Impl::outgoing(int peer) {
  auto found = p2p_out.find(peer);
  if (found != p2p_out.end()) return found->second;
  const auto deadline = member_deadline();
  net::Socket link = net::connect_to(p2p_endpoints[peer].host, p2p_endpoints[peer].port, deadline,
                                     rank_name(peer));
  message::Writer hello;
  hello.put<int>(options.rank);
  send_frame(link, net::FrameKind::kHello, hello.bytes(), deadline, rank_name(peer));
  return p2p_out.emplace(peer, std::move(link)).first->second;
}

const net::Socket& TcpBootstrap::Impl::incoming(int peer) {
  const auto deadline = member_deadline();
  while (p2p_in.find(peer) == p2p_in.end()) {
    net::Socket link = net::accept_one(p2p_listener, deadline, rank_name(peer) + " to connect");
    net::Frame hello = net::recv_frame(link, deadline, "a connecting rank");
    message::Reader reader(hello.payload);
    const int from = reader.get<int>();
    p2p_in.emplace(from, std::move(link));
  }
  return p2p_in.at(peer);
}

TcpBootstrap::TcpBootstrap(const TcpBootstrapOptions& options) : impl_(std::make_unique<Impl>()) {
  if (options.size < 1 || options.rank < 0 || options.rank >= options.size) {
    throw_error(ErrorCode::kInvalidArgument, "rank " + std::to_string(options.rank) +
                                                 " is outside a world of " +
                                                 std::to_string(options.size));
  }
  if (options.port < 0 || options.port > 65535) {
    throw_error(ErrorCode::kInvalidArgument,
                "port " + std::to_string(options.port) + " is invalid");
  }
  impl_->options = options;
  if (options.size == 1) return;
  if (impl_->is_root()) impl_->root_listener = net::listen_on(options.port, options.size + 16);
  impl_->connect_all();
  RESHARD_LOG(kDebug, "bootstrap: rank " << options.rank << " of " << options.size << " joined via "
                                         << options.address << ":" << options.port);
}

TcpBootstrap::~TcpBootstrap() = default;

std::unique_ptr<TcpBootstrap> TcpBootstrap::from_environment() {
  TcpBootstrapOptions options;
  options.rank = env::get_int("RANK", 0);
  options.size = env::get_int("WORLD_SIZE", 1);
  options.local_rank = env::get_int("LOCAL_RANK", options.rank);
  options.address = env::get("MASTER_ADDR").value_or("127.0.0.1");
  options.port = env::get_int("MASTER_PORT", 29500);
  options.timeout = env::timeout();
  return std::make_unique<TcpBootstrap>(options);
}

std::unique_ptr<TcpBootstrap> TcpBootstrap::from_unique_id(const std::string& unique_id, int rank,
                                                           int size) {
  return std::make_unique<TcpBootstrap>(options_from_unique_id(unique_id, rank, size));
}

TcpBootstrapOptions TcpBootstrap::options_from_unique_id(const std::string& unique_id, int rank,
                                                         int size) {
  const auto colon = unique_id.rfind(':');
  if (colon == std::string::npos) {
    throw_error(ErrorCode::kInvalidArgument,
                "unique id '" + unique_id + "' is not of the form host:port");
  }
  TcpBootstrapOptions options;
  options.rank = rank;
  options.size = size;
  options.local_rank = rank;
  options.address = unique_id.substr(0, colon);
  try {
    options.port = std::stoi(unique_id.substr(colon + 1));
  } catch (const std::exception&) {
    throw_error(ErrorCode::kInvalidArgument, "unique id '" + unique_id + "' has no valid port");
  }
  options.timeout = env::timeout();
  return options;
}

std::string TcpBootstrap::make_unique_id(const std::string& host) {
  net::Socket probe = net::listen_on(0, 1);
  return host + ":" + std::to_string(net::local_port(probe));
}

void TcpBootstrap::set_timeout(std::chrono::milliseconds timeout) {
  impl_->options.timeout = timeout;
}

int TcpBootstrap::rank() const { return impl_->options.rank; }
int TcpBootstrap::size() const { return impl_->options.size; }
int TcpBootstrap::local_rank() const { return impl_->options.local_rank; }

std::vector<std::vector<std::byte>> TcpBootstrap::all_gather(std::span<const std::byte> mine) {
  return impl_->gather_and_share(mine, "all_gather");
}

void TcpBootstrap::broadcast(std::vector<std::byte>& data, int root) {
  if (root < 0 || root >= size()) {
    throw_error(ErrorCode::kInvalidArgument, "broadcast root " + std::to_string(root) +
                                                 " is outside 0.." + std::to_string(size() - 1));
  }
  const bool mine = rank() == root;
  auto all = impl_->gather_and_share(
      mine ? std::span<const std::byte>(data) : std::span<const std::byte>(), "broadcast");
  if (!mine) data = std::move(all[root]);
}

void TcpBootstrap::barrier() { impl_->gather_and_share({}, "barrier"); }

void TcpBootstrap::send(int peer, std::span<const std::byte> data) {
  if (peer < 0 || peer >= size() || peer == rank()) {
    throw_error(ErrorCode::kInvalidArgument, "cannot send to rank " + std::to_string(peer));
  }
  send_frame(impl_->outgoing(peer), net::FrameKind::kData, data, impl_->member_deadline(),
             rank_name(peer));
}

std::vector<std::byte> TcpBootstrap::recv(int peer) {
  if (peer < 0 || peer >= size() || peer == rank()) {
    throw_error(ErrorCode::kInvalidArgument, "cannot receive from rank " + std::to_string(peer));
  }
  return net::recv_frame(impl_->incoming(peer), impl_->member_deadline(), rank_name(peer)).payload;
}

}  // namespace reshard

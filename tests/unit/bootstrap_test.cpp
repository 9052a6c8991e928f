// The TCP bootstrap with each rank on its own thread of this process: the sockets are real.
#include "reshard/bootstrap.hpp"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <functional>
#include <thread>

#include "bootstrap/socket.hpp"
#include "reshard/error.hpp"

namespace reshard {
namespace {

using namespace std::chrono_literals;

TcpBootstrapOptions options_for(const std::string& unique_id, int rank, int size,
                                std::chrono::milliseconds timeout = 10s) {
  TcpBootstrapOptions options;
  options.rank = rank;
  options.size = size;
  options.address = unique_id.substr(0, unique_id.rfind(':'));
  options.port = std::stoi(unique_id.substr(unique_id.rfind(':') + 1));
  options.timeout = timeout;
  return options;
}

// Runs body(rank) on `size` threads; returns each rank's error message ("" when it succeeded).
std::vector<std::string> run_ranks(int size, const std::function<void(int)>& body) {
  std::vector<std::string> errors(size);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        body(rank);
      } catch (const std::exception& error) {
        errors[rank] = error.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

std::vector<std::byte> bytes_of(const std::string& text) {
  const auto* p = reinterpret_cast<const std::byte*>(text.data());
  return {p, p + text.size()};
}

std::string text_of(const std::vector<std::byte>& bytes) {
  return {reinterpret_cast<const char*>(bytes.data()), bytes.size()};
}

TEST(TcpBootstrap, CollectivesAndPointToPoint) {
  const std::string id = TcpBootstrap::make_unique_id();
  const int size = 4;
  const auto errors = run_ranks(size, [&](int rank) {
    TcpBootstrap bootstrap(options_for(id, rank, size));
    ASSERT_EQ(bootstrap.rank(), rank);
    ASSERT_EQ(bootstrap.size(), size);
    // Contributions of different lengths, one empty.
    const std::string mine = rank == 2 ? "" : std::string(rank + 1, static_cast<char>('a' + rank));
    const auto all = bootstrap.all_gather(bytes_of(mine));
    ASSERT_EQ(all.size(), static_cast<std::size_t>(size));
    EXPECT_EQ(text_of(all[0]), "a");
    EXPECT_EQ(text_of(all[1]), "bb");
    EXPECT_EQ(text_of(all[2]), "");
    EXPECT_EQ(text_of(all[3]), "dddd");
    std::vector<std::byte> data = rank == 3 ? bytes_of("from three") : std::vector<std::byte>{};
    bootstrap.broadcast(data, 3);
    EXPECT_EQ(text_of(data), "from three");
    bootstrap.barrier();
    // A ring of point-to-point messages.
    const int next = (rank + 1) % size;
    const int previous = (rank + size - 1) % size;
    bootstrap.send(next, bytes_of("hello " + std::to_string(next)));
    EXPECT_EQ(text_of(bootstrap.recv(previous)), "hello " + std::to_string(rank));
    bootstrap.barrier();
  });
  for (int rank = 0; rank < size; ++rank) EXPECT_EQ(errors[rank], "") << "rank " << rank;
}

TEST(TcpBootstrap, NamesTheRankThatNeverJoins) {
  const std::string id = TcpBootstrap::make_unique_id();
  const auto start = std::chrono::steady_clock::now();
  // Three ranks expected, rank 2 never starts.
  const auto errors = run_ranks(2, [&](int rank) {
    TcpBootstrap bootstrap(options_for(id, rank, 3, 1s));
    bootstrap.barrier();
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s);
  EXPECT_NE(errors[0].find("rank(s) 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank(s) 2"), std::string::npos) << errors[1];
}

TEST(TcpBootstrap, NamesTheRankThatLeavesDuringACollective) {
  const std::string id = TcpBootstrap::make_unique_id();
  const auto errors = run_ranks(3, [&](int rank) {
    TcpBootstrap bootstrap(options_for(id, rank, 3, 5s));
    bootstrap.barrier();
    if (rank == 1) return;  // leaves: its sockets close
    bootstrap.barrier();
  });
  EXPECT_EQ(errors[1], "");
  EXPECT_NE(errors[0].find("rank 1"), std::string::npos) << errors[0];
  EXPECT_NE(errors[2].find("rank 1"), std::string::npos) << errors[2];
}

// Rank 2 comes to collectives 0 and 2 after rank 0 gave up on them (3 s late, 2 s timeout):
// every rank fails those alike (CollectiveAbandoned, naming rank 2), and collectives 1 and 3, which
// rank 2 joins in time, gather every rank's part of them (its part of the abandoned ones dropped).
TEST(TcpBootstrap, ACollectiveGivenUpOnFailsEveryRankAlikeAndTheNextOneWorks) {
  const std::string id = TcpBootstrap::make_unique_id();
  const int size = 3;
  std::vector<std::vector<std::string>> abandoned(size), gathered(size);
  const auto errors = run_ranks(size, [&](int rank) {
    TcpBootstrap bootstrap(options_for(id, rank, size, 2s));
    bootstrap.barrier();
    for (int round = 0; round < 4; ++round) {
      if (rank == 2 && round % 2 == 0) std::this_thread::sleep_for(3s);
      try {
        const auto all =
            bootstrap.all_gather(bytes_of(std::to_string(rank) + "." + std::to_string(round)));
        std::string joined;
        for (const auto& part : all) joined += text_of(part) + " ";
        gathered[rank].push_back(joined);
      } catch (const CollectiveAbandoned& error) {
        EXPECT_EQ(error.code(), ErrorCode::kTimeout);
        EXPECT_TRUE(error.retryable());  // the same collective again works (the next rounds)
        EXPECT_EQ(error.late(), std::vector<int>{2}) << "rank " << rank;  // for the layer above
        abandoned[rank].push_back(std::to_string(round) + ": " + error.what());
      }
    }
  });
  for (int rank = 0; rank < size; ++rank) {
    EXPECT_EQ(errors[rank], "") << "rank " << rank;
    ASSERT_EQ(abandoned[rank].size(), 2u) << "rank " << rank;
    EXPECT_EQ(abandoned[rank][0].substr(0, 3), "0: ") << abandoned[rank][0];
    EXPECT_EQ(abandoned[rank][1].substr(0, 3), "2: ") << abandoned[rank][1];
    for (const std::string& why : abandoned[rank])
      EXPECT_NE(why.find("rank(s) 2"), std::string::npos) << why;
    EXPECT_EQ(gathered[rank], (std::vector<std::string>{"0.1 1.1 2.1 ", "0.3 1.3 2.3 "}))
        << "rank " << rank;
  }
}

// A connect to a port of this machine that nobody listens on may be given that same port and open
// a connection with itself (a rank retrying while rank 0 starts then held rank 0's port: "cannot
// listen on port ...: Address already in use"). Made here on purpose, it is told apart from a
// connection to a listener.
TEST(Sockets, AConnectionWithItselfIsToldApartFromOneToAListener) {
  net::Socket self(::socket(AF_INET, SOCK_STREAM, 0));
  ASSERT_TRUE(self.valid());
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(self.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  socklen_t size = sizeof address;
  ASSERT_EQ(::getsockname(self.fd(), reinterpret_cast<sockaddr*>(&address), &size), 0);
  ASSERT_EQ(::connect(self.fd(), reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  EXPECT_TRUE(net::connected_to_itself(self.fd()));

  const net::Socket listener = net::listen_on(0, 1);
  const net::Socket client = net::connect_to("127.0.0.1", net::local_port(listener),
                                             std::chrono::steady_clock::now() + 5s, "the listener");
  EXPECT_FALSE(net::connected_to_itself(client.fd()));
  EXPECT_FALSE(net::connected_to_itself(listener.fd()));  // not connected at all
}

TEST(TcpBootstrap, RefusesBadArguments) {
  TcpBootstrapOptions bad;
  bad.rank = 3;
  bad.size = 2;
  EXPECT_THROW(TcpBootstrap{bad}, Error);
  EXPECT_THROW(TcpBootstrap::from_unique_id("no-port-here", 0, 1), Error);
  TcpBootstrap single(TcpBootstrapOptions{});
  EXPECT_THROW(single.send(0, {}), Error);
  std::vector<std::byte> data;
  EXPECT_THROW(single.broadcast(data, 1), Error);
}

}  // namespace
}  // namespace reshard

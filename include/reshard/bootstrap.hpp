// Out-of-band coordination between PEs: exchanging request summaries, IPC handles and unique ids.
// Never on the data path. Every wait is bounded by a timeout and fails with an error that names the
// rank that did not answer.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace reshard {

class Bootstrap {
 public:
  virtual ~Bootstrap() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Index of this process among those on its machine, and how many share the machine.
  virtual int local_rank() const = 0;

  // Every rank contributes `mine` (any length, may differ per rank); every rank receives all
  // contributions in rank order.
  virtual std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) = 0;
  // `data` from `root` is copied into every rank's `data` (resized to match).
  virtual void broadcast(std::vector<std::byte>& data, int root) = 0;
  virtual void barrier() = 0;
  virtual void send(int peer, std::span<const std::byte> data) = 0;
  virtual std::vector<std::byte> recv(int peer) = 0;
  // How long a collective or receive waits for the other ranks before it fails naming them. A
  // copy service sets its own timeout here at init(), so CopyServiceOptions::timeout bounds its
  // schedule() too. Bootstraps without timeouts of their own (MPI) ignore it.
  virtual void set_timeout(std::chrono::milliseconds timeout) { (void)timeout; }
};

struct TcpBootstrapOptions {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  std::string address = "127.0.0.1";  // where rank 0 listens
  int port = 29500;
  std::chrono::milliseconds timeout{30000};
};

// Star-shaped TCP bootstrap: rank 0 listens, the others connect to it; point-to-point messages use
// direct connections made on first use.
class TcpBootstrap : public Bootstrap {
 public:
  explicit TcpBootstrap(const TcpBootstrapOptions& options);
  ~TcpBootstrap() override;

  // From the torchrun variables RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT; the timeout
  // from RESHARD_TIMEOUT_S (30 s by default).
  static std::unique_ptr<TcpBootstrap> from_environment();
  // From a unique id ("host:port", as made by make_unique_id) for programs that launch their own
  // way.
  static std::unique_ptr<TcpBootstrap> from_unique_id(const std::string& unique_id, int rank,
                                                      int size);
  // The options from_unique_id() uses (local_rank: the rank; timeout: RESHARD_TIMEOUT_S).
  static TcpBootstrapOptions options_from_unique_id(const std::string& unique_id, int rank,
                                                    int size);
  // A "host:port" with a port that is free now on this machine, to hand to every rank.
  static std::string make_unique_id(const std::string& host = "127.0.0.1");

  int rank() const override;
  int size() const override;
  int local_rank() const override;
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override;
  void broadcast(std::vector<std::byte>& data, int root) override;
  void barrier() override;
  void send(int peer, std::span<const std::byte> data) override;
  std::vector<std::byte> recv(int peer) override;
  void set_timeout(std::chrono::milliseconds timeout) override;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when this build includes the MPI bootstrap.
bool mpi_bootstrap_available();
// Bootstrap for MPI_COMM_WORLD's ranks (initialising MPI if nobody has): MPI names the ranks and
// carries rank 0's rendezvous; the collectives go over TCP as TcpBootstrap's (timeouts, meetings
// that a late rank missed failing alike on every rank). Throws kUnsupported when reshard was
// built without MPI.
std::unique_ptr<Bootstrap> make_mpi_bootstrap();

// The bootstrap a process started by reshard-run, torchrun or mpirun should use: torchrun variables
// when RANK is set, MPI when launched by an MPI launcher and available, a single PE otherwise.
std::unique_ptr<Bootstrap> make_default_bootstrap();

}  // namespace reshard

// Bootstrap for jobs started by mpirun/srun. MPI starts the job and names the ranks; the
// collectives then go over reshard's TCP bootstrap, whose rendezvous rank 0 broadcasts over MPI
// once. MPI's own collectives cannot be given up: one abandoned on a timeout stays pending, and
// every later collective of the communicator is out of step. Over TCP a meeting that a late
// rank missed fails alike on every rank and the next one works (a retryable error), the
// service's timeouts apply (set_timeout), and Ctrl-C ends a wait, as under reshard-run or
// torchrun.
#include "core/env.hpp"
#include "core/interrupt.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/error.hpp"

#ifdef RESHARD_WITH_MPI
#include <arpa/inet.h>
#include <mpi.h>
#include <netdb.h>
#include <unistd.h>

#include <array>
#include <cstring>
#include <thread>

namespace reshard {
namespace {

// Where rank 0's TCP bootstrap listens, as the other ranks reach it: MASTER_ADDR where set; the
// loopback where every rank is on this machine; else this machine's name resolved (as reshard's
// Python bootstrap from an MPI communicator does).
std::string rendezvous_host(bool one_machine) {
  if (auto address = env::get("MASTER_ADDR")) return *address;
  if (one_machine) return "127.0.0.1";
  std::array<char, 256> name{};
  if (gethostname(name.data(), name.size() - 1) != 0) return "127.0.0.1";
  addrinfo hints{};
  hints.ai_family = AF_INET;
  addrinfo* found = nullptr;
  if (getaddrinfo(name.data(), nullptr, &hints, &found) != 0 || found == nullptr)
    return "127.0.0.1";
  std::array<char, INET_ADDRSTRLEN> text{};
  inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(found->ai_addr)->sin_addr, text.data(),
            text.size());
  freeaddrinfo(found);
  return text.data();
}

class MpiBootstrap : public Bootstrap {
 public:
  MpiBootstrap() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      owns_mpi_ = true;
    }
    MPI_Comm comm;
    MPI_Comm_dup(MPI_COMM_WORLD, &comm);
    TcpBootstrapOptions options;
    MPI_Comm_rank(comm, &options.rank);
    MPI_Comm_size(comm, &options.size);
    MPI_Comm local;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, options.rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &options.local_rank);
    int local_size = 0;
    MPI_Comm_size(local, &local_size);
    MPI_Comm_free(&local);
    options.timeout = env::timeout();
    // Rank 0's unique id ("host:port", a port free now), to every rank: MPI's one collective.
    std::array<char, 512> id{};
    if (options.rank == 0) {
      const std::string mine =
          TcpBootstrap::make_unique_id(rendezvous_host(local_size == options.size));
      std::strncpy(id.data(), mine.c_str(), id.size() - 1);
    }
    MPI_Request request;
    MPI_Ibcast(id.data(), static_cast<int>(id.size()), MPI_CHAR, 0, comm, &request);
    wait(request, options.timeout);
    MPI_Comm_free(&comm);
    const std::string unique_id(id.data());
    const auto colon = unique_id.rfind(':');
    options.address = unique_id.substr(0, colon);
    options.port = std::stoi(unique_id.substr(colon + 1));
    tcp_ = std::make_unique<TcpBootstrap>(options);
  }
  ~MpiBootstrap() override {
    tcp_.reset();
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return tcp_->rank(); }
  int size() const override { return tcp_->size(); }
  int local_rank() const override { return tcp_->local_rank(); }
  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override {
    return tcp_->all_gather(mine);
  }
  void broadcast(std::vector<std::byte>& data, int root) override { tcp_->broadcast(data, root); }
  void barrier() override { tcp_->barrier(); }
  void send(int peer, std::span<const std::byte> data) override { tcp_->send(peer, data); }
  std::vector<std::byte> recv(int peer) override { return tcp_->recv(peer); }
  void set_timeout(std::chrono::milliseconds timeout) override { tcp_->set_timeout(timeout); }

 private:
  static void wait(MPI_Request& request, std::chrono::milliseconds timeout) {
    const auto since = std::chrono::steady_clock::now();
    int done = 0;
    while (true) {
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() - since > timeout) {
        throw_error(ErrorCode::kTimeout,
                    "timed out in the MPI broadcast of the bootstrap's rendezvous (a rank did not "
                    "start; raise RESHARD_TIMEOUT_S if it is only slow)");
      }
      throw_if_interrupted("the MPI bootstrap's rendezvous", since);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::unique_ptr<TcpBootstrap> tcp_;
  bool owns_mpi_ = false;
};

}  // namespace

bool mpi_bootstrap_available() { return true; }
std::unique_ptr<Bootstrap> make_mpi_bootstrap() { return std::make_unique<MpiBootstrap>(); }

}  // namespace reshard

#else

namespace reshard {
bool mpi_bootstrap_available() { return false; }
std::unique_ptr<Bootstrap> make_mpi_bootstrap() {
  throw_error(ErrorCode::kUnsupported,
              "this build of reshard has no MPI bootstrap (MPI was not found at build time)");
}
}  // namespace reshard

#endif

namespace reshard {

std::unique_ptr<Bootstrap> make_default_bootstrap() {
  if (env::get("RANK")) return TcpBootstrap::from_environment();
  const bool under_mpi = env::get("OMPI_COMM_WORLD_SIZE") || env::get("PMI_SIZE") ||
                         env::get("PMIX_RANK") || env::get("MPI_LOCALNRANKS");
  if (under_mpi && mpi_bootstrap_available()) return make_mpi_bootstrap();
  return std::make_unique<TcpBootstrap>(TcpBootstrapOptions{});
}

}  // namespace reshard

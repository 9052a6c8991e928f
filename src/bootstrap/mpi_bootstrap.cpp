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

// MPI for as long as the bootstrap lives: initialised here unless the program already did.
class MpiSession {
 public:
  MpiSession() {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) return;
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
    owns_mpi_ = true;
  }
  ~MpiSession() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && owns_mpi_) MPI_Finalize();
  }
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

 private:
  bool owns_mpi_ = false;
};

void wait(MPI_Request& request, std::chrono::milliseconds timeout) {
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

// Collective over MPI_COMM_WORLD: the TCP bootstrap's options, with rank 0's unique id
// ("host:port", a port free now) broadcast to every rank, MPI's one collective, and the ranks and
// machine-local ranks as MPI numbers them.
TcpBootstrapOptions options_from_mpi() {
  MPI_Comm comm;
  MPI_Comm_dup(MPI_COMM_WORLD, &comm);
  int rank = 0, size = 1, local_rank = 0, local_size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  MPI_Comm local;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &local_rank);
  MPI_Comm_size(local, &local_size);
  MPI_Comm_free(&local);
  std::array<char, 512> id{};
  if (rank == 0) {
    const std::string mine = TcpBootstrap::make_unique_id(rendezvous_host(local_size == size));
    std::strncpy(id.data(), mine.c_str(), id.size() - 1);
  }
  MPI_Request request;
  MPI_Ibcast(id.data(), static_cast<int>(id.size()), MPI_CHAR, 0, comm, &request);
  wait(request, env::timeout());
  MPI_Comm_free(&comm);
  TcpBootstrapOptions options = TcpBootstrap::options_from_unique_id(id.data(), rank, size);
  options.local_rank = local_rank;
  return options;
}

// MPI starts the job and names the ranks; the collectives are the TCP bootstrap's.
class MpiBootstrap final : private MpiSession, public TcpBootstrap {
 public:
  MpiBootstrap() : MpiSession(), TcpBootstrap(options_from_mpi()) {}
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

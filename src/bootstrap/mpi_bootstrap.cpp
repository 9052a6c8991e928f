// Bootstrap over MPI for jobs started by mpirun/srun. Collectives are non-blocking and polled, so
// even here a rank that never arrives becomes a timeout instead of a hang.
#include "core/env.hpp"
#include "core/interrupt.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/error.hpp"

#ifdef RESHARD_WITH_MPI
#include <mpi.h>

#include <thread>

namespace reshard {
namespace {

class MpiBootstrap : public Bootstrap {
 public:
  MpiBootstrap() : timeout_(env::timeout()) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized) {
      int provided = 0;
      MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
      owns_mpi_ = true;
    }
    MPI_Comm_dup(MPI_COMM_WORLD, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm local;
    MPI_Comm_split_type(comm_, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &local_rank_);
    MPI_Comm_free(&local);
  }
  ~MpiBootstrap() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MPI_Comm_free(&comm_);
    if (owns_mpi_) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int local_rank() const override { return local_rank_; }

  std::vector<std::vector<std::byte>> all_gather(std::span<const std::byte> mine) override {
    long long my_bytes = static_cast<long long>(mine.size());
    std::vector<long long> sizes(size_);
    MPI_Request request;
    MPI_Iallgather(&my_bytes, 1, MPI_LONG_LONG, sizes.data(), 1, MPI_LONG_LONG, comm_, &request);
    wait(request, "all_gather");
    std::vector<int> counts(size_), displacements(size_);
    long long total = 0;
    for (int r = 0; r < size_; ++r) {
      if (sizes[r] > (1ll << 31) - 1 || total > (1ll << 31) - 1) {
        throw_error(ErrorCode::kUnsupported, "MPI bootstrap messages are limited to 2 GiB");
      }
      counts[r] = static_cast<int>(sizes[r]);
      displacements[r] = static_cast<int>(total);
      total += sizes[r];
    }
    std::vector<std::byte> flat(total);
    MPI_Iallgatherv(mine.data(), static_cast<int>(mine.size()), MPI_BYTE, flat.data(),
                    counts.data(), displacements.data(), MPI_BYTE, comm_, &request);
    wait(request, "all_gather");
    std::vector<std::vector<std::byte>> all(size_);
    for (int r = 0; r < size_; ++r) {
      all[r].assign(flat.begin() + displacements[r], flat.begin() + displacements[r] + counts[r]);
    }
    return all;
  }

  void broadcast(std::vector<std::byte>& data, int root) override {
    long long bytes = static_cast<long long>(data.size());
    MPI_Request request;
    MPI_Ibcast(&bytes, 1, MPI_LONG_LONG, root, comm_, &request);
    wait(request, "broadcast");
    data.resize(bytes);
    MPI_Ibcast(data.data(), static_cast<int>(bytes), MPI_BYTE, root, comm_, &request);
    wait(request, "broadcast");
  }

  void barrier() override {
    MPI_Request request;
    MPI_Ibarrier(comm_, &request);
    wait(request, "barrier");
  }

  void send(int peer, std::span<const std::byte> data) override {
    long long bytes = static_cast<long long>(data.size());
    MPI_Request request;
    MPI_Isend(&bytes, 1, MPI_LONG_LONG, peer, kTag, comm_, &request);
    wait(request, "send to rank " + std::to_string(peer));
    MPI_Isend(data.data(), static_cast<int>(data.size()), MPI_BYTE, peer, kTag, comm_, &request);
    wait(request, "send to rank " + std::to_string(peer));
  }

  std::vector<std::byte> recv(int peer) override {
    long long bytes = 0;
    MPI_Request request;
    MPI_Irecv(&bytes, 1, MPI_LONG_LONG, peer, kTag, comm_, &request);
    wait(request, "receive from rank " + std::to_string(peer));
    std::vector<std::byte> data(bytes);
    MPI_Irecv(data.data(), static_cast<int>(bytes), MPI_BYTE, peer, kTag, comm_, &request);
    wait(request, "receive from rank " + std::to_string(peer));
    return data;
  }

 private:
  static constexpr int kTag = 0x5e5a;

  void wait(MPI_Request& request, const std::string& what) {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    int done = 0;
    while (true) {
      MPI_Test(&request, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (std::chrono::steady_clock::now() > deadline) {
        throw_error(ErrorCode::kTimeout, "timed out in MPI " + what +
                                             " (a rank did not arrive; raise RESHARD_TIMEOUT_S "
                                             "if it is only slow)");
      }
      throw_if_interrupted(what.c_str(), deadline - timeout_);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::chrono::milliseconds timeout_;
  MPI_Comm comm_{};
  int rank_ = 0;
  int size_ = 1;
  int local_rank_ = 0;
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

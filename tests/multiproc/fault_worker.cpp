// A PE for the fault tests: exchanges a uniform workload in a loop until PE 1 misbehaves
// ("die": killed mid-run; "stall": stopped mid-run; "behind": stops calling run() after two runs
// and waits, alive; "die-in-schedule" / "stall-in-schedule": killed or stopped instead of calling
// schedule(), which the others are in), then reports what this PE saw and what its teardown left
// behind (shared-memory segments of the job, CUDA IPC mappings of peers' memory). "healthy": every
// PE schedules, runs three times and prints HEALTHY-DONE (a job after a failed one).
// Retries (host memory, the CUDA, NVSHMEM and NCCL transports): "late-then-retry": PE 1 comes to
// its third run 9 s late; "stall-then-retry": PE 1 is stopped for 9 s while it runs. With both
// timeouts at 6 s, the others give the run up and still wait in the meeting of their next run when
// PE 1 comes. A PE whose run fails runs again; every PE then runs three more times, checking every
// received byte, and prints RETRIED-DONE with the failures it saw, or ERROR-SEEN where it could not
// go on. "late-within-arrival": PE 1 comes to its third run 5 s late, later than a short transfer
// timeout but within the arrival timeout (the test sets them): no run fails.
//
//     fault_worker SCENARIO [host|cuda|nccl|nvshmem|auto]   (GPU transports move GPU memory)
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#ifdef RESHARD_WITH_CUDA
#include <cuda_runtime_api.h>

#include "transports/cuda/ipc_memory.hpp"
#endif

#include "bench/workloads.hpp"
#include "reshard/reshard.hpp"

namespace {

int shm_entries_of_this_job() {
  const char* job = std::getenv("RESHARD_JOB_ID");
  int count = 0;
  std::error_code ignored;
  for (const auto& entry : std::filesystem::directory_iterator("/dev/shm", ignored)) {
    if (job && entry.path().filename().string().find(job) != std::string::npos) ++count;
  }
  return count;
}

}  // namespace

// The buffers of one PE, in host memory or on the service's GPU.
class Memory {
 public:
  Memory(std::size_t bytes, int device) : host_(device < 0 ? bytes : 0), device_(device) {
#ifdef RESHARD_WITH_CUDA
    if (device >= 0 && cudaMalloc(&gpu_, std::max<std::size_t>(bytes, 1)) != cudaSuccess) {
      std::fprintf(stderr, "cudaMalloc failed\n");
      std::exit(3);
    }
#endif
    bytes_ = bytes;
    if (device >= 0) staging_.resize(bytes);
  }
  std::span<std::byte> host() { return host_; }
  // Host memory as is; GPU memory through `staging` (its size), copied in or out.
  void upload(std::span<const std::byte> staging) {
    if (device_ < 0) return;
#ifdef RESHARD_WITH_CUDA
    if (cudaMemcpy(gpu_, staging.data(), staging.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      std::exit(3);
#endif
  }
  void download(std::span<std::byte> staging) {
    if (device_ < 0) return;
#ifdef RESHARD_WITH_CUDA
    if (cudaMemcpy(staging.data(), gpu_, staging.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      std::exit(3);
#endif
  }
  // What the workload's helpers fill and check: the memory itself, or the host copy of it.
  std::span<std::byte> view() { return device_ < 0 ? std::span<std::byte>(host_) : staging_; }
  reshard::Buffer buffer() {
    return device_ < 0 ? reshard::Buffer::host(host_.data(), bytes_)
                       : reshard::Buffer::cuda(gpu_, bytes_, device_);
  }

 private:
  std::vector<std::byte> host_;
  std::vector<std::byte> staging_;  // GPU memory's contents, on the host
  void* gpu_ = nullptr;             // left to the process exit: a failed transport may still use it
  int device_;
  std::size_t bytes_ = 0;
};

// The retry scenarios, after schedule(). Patterns change with each run this PE means to make
// (iteration), so bytes of a failed run that arrived late would be caught; in "late-then-retry"
// PE 1 skips the run the others gave up, so every PE's retry moves the same pattern. A PE
// stopped mid-run (its peers' runs fail at different runs) moves pattern 0 every time: the
// receive buffer is poisoned before each run, so each byte checked arrived in it.
template <typename Report>
int run_and_retry(const std::string& scenario, reshard::CopyService& service,
                  const reshard::bench::Workload& w, Memory& send_memory, Memory& recv_memory,
                  Report report) {
  const std::span<std::byte> send = send_memory.view(), recv = recv_memory.view();
  const reshard::PeId me = service.my_pe();
  const bool within_arrival = scenario == "late-within-arrival";
  const bool late = scenario == "late-then-retry" || within_arrival;
  static std::atomic<bool> in_run{false};
  if (me == 1 && !late) {
    // Stop this process mid-run for 9 s: a child continues it (fork from a threaded process: the
    // child only sleeps and signals).
    const pid_t self = ::getpid();
    if (::fork() == 0) {
      ::sleep(9);
      ::kill(self, SIGCONT);
      ::_exit(0);
    }
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      while (!in_run.load()) {
      }  // most likely still in it when the signal lands
      ::raise(SIGSTOP);
    }).detach();
  }
  std::uint32_t iteration = 0;
  int failures = 0, runs_since = 0;
  bool met = false;  // this PE failed a run, or met the others at the start of one
  std::string reasons;
  const auto start = std::chrono::steady_clock::now();
  auto last_end = start;
  for (int run = 0; !met || runs_since < 3; ++run) {
    if (me == 1 && late && run == 2) {
      // The others give this run up, or (within the arrival timeout) wait for it.
      std::this_thread::sleep_for(std::chrono::seconds(within_arrival ? 5 : 9));
      if (!within_arrival) ++iteration;
      met = true;  // this run begins with the meeting the others wait in, or is the awaited one
    }
    reshard::bench::prepare_buffers(w, me, late ? iteration : 0, send, recv);
    send_memory.upload(send);
    recv_memory.upload(recv);
    try {
      in_run = true;
      service.run();
      in_run = false;
    } catch (const reshard::Error& error) {
      in_run = false;
      const std::string what = error.what();
      if (!error.retryable() || what.find("run again on every PE") == std::string::npos ||
          ++failures > 3)
        return report(error);
      reasons += " | " + what;
      ++iteration;
      met = true;
      runs_since = 0;
      last_end = std::chrono::steady_clock::now();
      continue;
    }
    // Seconds since the last run ended and no error: this PE was stopped, and this run held the
    // meeting.
    const auto ended = std::chrono::steady_clock::now();
    if (ended - last_end > std::chrono::seconds(2)) met = true;
    last_end = ended;
    recv_memory.download(recv);
    const std::uint64_t wrong =
        reshard::bench::verify_receive_buffer(w, me, late ? iteration : 0, recv);
    if (wrong != 0) {
      std::printf("WRONG-BYTES %llu in run %d\n", static_cast<unsigned long long>(wrong), run);
      return 3;
    }
    ++iteration;
    if (met) ++runs_since;
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(60)) {
      std::printf("NO-ERROR after %d runs\n", run);
      return 2;
    }
  }
  service.finalize();
  std::printf("RETRIED-DONE failures=%d%s\n", failures, reasons.c_str());
  return 0;
}

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "die";
  const std::string transport = argc > 2 ? argv[2] : "host";
  std::shared_ptr<reshard::Bootstrap> bootstrap = reshard::make_default_bootstrap();
  reshard::CopyService service(bootstrap, reshard::parse_transport_kind(transport));
  const char* log_level = std::getenv("RESHARD_LOG_LEVEL");  // to look into a failing scenario
  service.init(log_level != nullptr ? reshard::parse_log_level(log_level)
                                    : reshard::LogLevel::kWarn);
  const auto w = reshard::bench::make_workload("uniform", service.n_pes(), 256 << 10, 1);
  Memory send(w.send_buffer_bytes[service.my_pe()], service.device());
  Memory recv(w.recv_buffer_bytes[service.my_pe()], service.device());
  for (const auto& item : w.items) {
    if (item.src == service.my_pe())
      service.register_send(item.task, send.buffer(), item.src_offset, item.bytes, item.dst);
    if (item.dst == service.my_pe())
      service.register_receive(item.task, recv.buffer(), item.dst_offset, item.bytes, item.src);
  }
  const bool in_schedule = scenario == "die-in-schedule" || scenario == "stall-in-schedule";
  if (service.my_pe() == 1 && in_schedule) {
    ::raise(scenario == "stall-in-schedule" ? SIGSTOP : SIGKILL);
    return 4;  // a stopped PE is killed by the launcher; a killed one never gets here
  }
  const auto start = std::chrono::steady_clock::now();
  const auto report = [&](const reshard::Error& error) {
    const auto failed = std::chrono::steady_clock::now();
    const double seconds = std::chrono::duration<double>(failed - start).count();
    service.finalize();  // the survivor's teardown: must not hang nor leave mappings behind
    const double teardown =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - failed).count();
    int ipc_mappings = 0;
#ifdef RESHARD_WITH_CUDA
    ipc_mappings = reshard::cuda::open_ipc_mappings();
#endif
    std::printf(
        "ERROR-SEEN code=%s retryable=%d after=%.1fs teardown=%.1fs shm-entries=%d "
        "ipc-mappings=%d: %s\n",
        reshard::error_code_name(error.code()), error.retryable() ? 1 : 0, seconds, teardown,
        shm_entries_of_this_job(), ipc_mappings, error.what());
    std::fflush(stdout);
    return 1;
  };
  try {
    service.schedule();
  } catch (const reshard::Error& error) {
    return report(error);
  }
  if (in_schedule) {
    std::printf("NO-ERROR from schedule()\n");
    return 2;
  }
  bootstrap->barrier();
  if (scenario == "late-then-retry" || scenario == "stall-then-retry" ||
      scenario == "late-within-arrival")
    return run_and_retry(scenario, service, w, send, recv, report);
  if (scenario == "healthy") {
    for (int i = 0; i < 3; ++i) service.run();
    service.finalize();
    std::printf("HEALTHY-DONE\n");
    return 0;
  }
  if (service.my_pe() == 1 && scenario == "behind") {
    service.run();
    service.run();
    std::this_thread::sleep_for(std::chrono::seconds(20));  // the others time out meanwhile
    std::printf("BEHIND-DONE\n");
    return 0;
  }
  if (service.my_pe() == 1) {
    // Strike from another thread while the main thread is inside run().
    std::thread([scenario] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ::raise(scenario == "stall" ? SIGSTOP : SIGKILL);
    }).detach();
  }
  try {
    for (long i = 0;; ++i) {
      service.run();
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120)) {
        std::printf("NO-ERROR after %ld runs\n", i);
        return 2;
      }
    }
  } catch (const reshard::Error& error) {
    return report(error);
  }
}

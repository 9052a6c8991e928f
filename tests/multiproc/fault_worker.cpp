// A PE for the fault tests: exchanges a uniform workload in a loop until PE 1 misbehaves
// ("die": killed mid-run; "stall": stopped mid-run), then reports what this PE saw.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>

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

int main(int argc, char** argv) {
  const std::string scenario = argc > 1 ? argv[1] : "die";
  std::shared_ptr<reshard::Bootstrap> bootstrap = reshard::make_default_bootstrap();
  reshard::CopyService service(bootstrap, reshard::TransportKind::kHost);
  service.init(reshard::LogLevel::kWarn);
  const auto w = reshard::bench::make_workload("uniform", service.n_pes(), 256 << 10, 1);
  std::vector<std::byte> send(w.send_buffer_bytes[service.my_pe()]);
  std::vector<std::byte> recv(w.recv_buffer_bytes[service.my_pe()]);
  for (const auto& item : w.items) {
    if (item.src == service.my_pe()) {
      service.register_send(item.task, reshard::Buffer::host(send.data(), send.size()),
                            item.src_offset, item.bytes, item.dst);
    }
    if (item.dst == service.my_pe()) {
      service.register_receive(item.task, reshard::Buffer::host(recv.data(), recv.size()),
                               item.dst_offset, item.bytes, item.src);
    }
  }
  service.schedule();
  bootstrap->barrier();
  if (service.my_pe() == 1) {
    // Strike from another thread while the main thread is inside run().
    std::thread([scenario] {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));
      ::raise(scenario == "stall" ? SIGSTOP : SIGKILL);
    }).detach();
  }
  const auto start = std::chrono::steady_clock::now();
  try {
    for (long i = 0;; ++i) {
      service.run();
      if (std::chrono::steady_clock::now() - start > std::chrono::seconds(120)) {
        std::printf("NO-ERROR after %ld runs\n", i);
        return 2;
      }
    }
  } catch (const reshard::Error& error) {
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("ERROR-SEEN code=%s after=%.1fs shm-entries=%d: %s\n",
                reshard::error_code_name(error.code()), seconds, shm_entries_of_this_job(),
                error.what());
    std::fflush(stdout);
    return 1;
  }
}

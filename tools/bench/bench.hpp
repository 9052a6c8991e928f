// The benchmarks behind `reshard bench` and `reshard bench-scheduler`.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "reshard/bootstrap.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/model_layouts.hpp"

namespace reshard::bench {

// Collective: every PE's `value`, in PE order.
template <typename T>
std::vector<T> gather_from_pes(Bootstrap& bootstrap, T value) {
  std::vector<T> values;
  for (const auto& part : bootstrap.all_gather(std::as_bytes(std::span(&value, 1)))) {
    T v;
    std::memcpy(&v, part.data(), sizeof v);
    values.push_back(v);
  }
  return values;
}

// "1.23 s", "45.6 ms", "7.89 us": small timings stay readable.
inline std::string format_seconds(double seconds) {
  char text[32];
  if (seconds >= 1.0)
    std::snprintf(text, sizeof text, "%.3g s", seconds);
  else if (seconds >= 1e-3)
    std::snprintf(text, sizeof text, "%.3g ms", seconds * 1e3);
  else
    std::snprintf(text, sizeof text, "%.3g us", seconds * 1e6);
  return text;
}

// Progress of a long benchmark on stderr, for terminals and logs alike: note() prints a line
// only once `every` has passed since the start or the last line, so short runs print nothing.
class Progress {
 public:
  explicit Progress(std::string what, bool enabled = true,
                    std::chrono::duration<double> every = std::chrono::seconds(3))
      : what_(std::move(what)), enabled_(enabled), every_(every) {}
  void note(const std::string& where) {
    const auto now = std::chrono::steady_clock::now();
    if (!enabled_ || now - last_ < every_) return;
    last_ = now;
    std::fprintf(stderr, "%s: %s (%.0f s)\n", what_.c_str(), where.c_str(),
                 std::chrono::duration<double>(now - start_).count());
    std::fflush(stderr);
  }

 private:
  std::string what_;
  bool enabled_;
  std::chrono::duration<double> every_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point last_ = start_;
};

template <typename T>
T max_over_pes(Bootstrap& bootstrap, T value) {
  const std::vector<T> values = gather_from_pes(bootstrap, value);
  return *std::max_element(values.begin(), values.end());
}

struct CopyBenchOptions {
  std::vector<std::string> workloads;
  std::uint64_t size = 1 << 20;
  int iterations = 20;
  int warmup = 3;
  std::uint64_t seed = 1;
  TransportKind transport = TransportKind::kAuto;
  std::string json_path;  // JSON lines appended here when set (rank 0)
  bool verify = false;    // also time every workload in verify mode and report its cost
};

// Runs on every PE; rank 0 prints the table. Returns the number of wrong bytes found anywhere.
std::uint64_t run_copy_bench(std::shared_ptr<Bootstrap> bootstrap, const CopyBenchOptions& options);

struct GpuBenchOptions {
  std::vector<std::uint64_t> sizes;  // per-peer bytes
  std::vector<std::string> engines = {"sm", "ce", "auto", "nvshmem", "nccl"};
  // "all-to-all" (the size sweep) and any of workload_kinds(): random sparse pairs, many small
  // requests, a refit-shaped pattern (each at every size, as their scale).
  std::vector<std::string> workloads = {"all-to-all"};
  int warmup = 5;
  int repeats = 5;
  int max_iterations = 200;
  // CUDA-transport runs are timed as replays of one run(stream) captured in a CUDA graph (the
  // host cost per run is then the replay's); NCCL and NVSHMEM runs stay plain.
  bool graph = false;
  std::string json_path;
  std::string commit;
};

// Builds with CUDA only. Runs on every PE (one GPU each); rank 0 prints the table. Returns the
// number of wrong bytes found anywhere.
std::uint64_t run_gpu_bench(std::shared_ptr<Bootstrap> bootstrap, const GpuBenchOptions& options);

struct SchedulerBenchOptions {
  std::uint64_t requests = 1'000'000;
  int pes = 1024;
  std::uint64_t chunk_bytes = 1 << 20;
  int max_peers_per_round = 1;
  int repeats = 3;
  std::uint64_t seed = 1;
};

// Times build_schedule on one core and prints time and makespan/bound; returns the best seconds.
double run_scheduler_bench(const SchedulerBenchOptions& options);

// Today's date in UTC ("2026-11-21"), for the JSON records.
std::string utc_date();

// What the benchmarks' services run with: the environment's options with `transport`, except
// that NCCL makes blocking calls unless RESHARD_NCCL_NONBLOCKING says otherwise — the NCCL
// baseline is NCCL as hand-wired code runs it (reshard's NCCL transport defaults to nonblocking
// calls, which bound a lost peer but cost host time); the benchmarks say so where NCCL runs.
CopyServiceOptions bench_service_options(TransportKind transport);

struct RefitBenchOptions {
  std::string model = "llama3-8b";  // or "qwen3-30b-a3b"
  int layers = 0;                   // 0: the model's own count
  std::string transform = "none";   // or "mxfp8" (sender side: FP8 + scales on the wire)
  std::string transform_only;       // the transform applies to parameters whose name has this
  TransportKind transport = TransportKind::kAuto;
  // Timed after the transport under test, on the same tensors and process group: "auto"
  // ("ipc-loop" where PEs share a GPU, else NCCL where the transport under test is another GPU
  // transport and NCCL is built), "none", "ipc-loop" (IpcCopyLoop), or a transport name.
  std::string baseline = "auto";
  // ReshardOptions::staging_budget: a byte count ("512MiB"), "unlimited", or empty for the
  // default (RESHARD_STAGING_BUDGET, else 2 GiB).
  std::string staging_budget;
  // ReshardOptions::quantize_colocated_on_sender (false: quantized-on-arrival slices between PEs
  // on one GPU stay on the receiver, as between GPUs).
  bool quantize_colocated_on_sender = true;
  int iterations = 5;
  int warmup = 2;
  std::string json_path;
  std::string commit;  // source revision recorded in the JSON lines
};

// Times refits of a model through make_reshard_plan and execute_reshard_plan; returns the wrong
// bytes found in a sample of the destination (0 when all is well).
std::uint64_t run_refit_bench(std::shared_ptr<Bootstrap> bootstrap,
                              const RefitBenchOptions& options);

// `reshard bench-soak`: one bound refit of a model run many times, as an RL job refits for
// hours: per window of refits, the slowest PE's median time, host RSS, device memory in use and
// the /dev/shm segments it maps (the most on any PE); every so many refits, one more into cleared destinations,
// checked. Passes when the last window's median is within max_slowdown of the first's, memory
// grew by no more than the noise allowed, and every checked byte is right.
struct SoakBenchOptions {
  RefitBenchOptions refit;  // model, layers, transform, transport, staging budget, json, commit
  int refits = 2000;
  int window = 100;
  int warmup = 20;         // refits before the first window
  int verify_every = 500;  // 0: never
  double max_slowdown = 1.05;
  // Growth from the first window to the last allowed as noise: device memory comes in 2 MiB
  // pages; the host allocator and the Python-free bench keep RSS within a few MiB.
  std::int64_t max_device_growth = 2 << 20;
  std::int64_t max_rss_growth = 8 << 20;
  std::int64_t max_shm_growth = 1 << 20;
};

// Runs the soak; returns the number of checks that failed (0: time, memory and bytes held).
int run_soak_bench(std::shared_ptr<Bootstrap> bootstrap, const SoakBenchOptions& options);

struct PlanBenchOptions {
  int layers = 61;
  int experts = 384;
  // A 1,024-GPU trainer (PP 16, TP 8, DP 8, EP 64) feeding a 512-GPU engine (16 replicas of TP 32,
  // EP 32) on other GPUs.
  Parallelism src{.tp = 8, .dp = 8, .pp = 16, .ep = 64};
  Parallelism dst{.tp = 32, .replicas = 16, .ep = 32, .first_pe = 1024};
  int repeats = 3;
};

// Times make_reshard_plan on a 1-trillion-parameter MoE layout change; returns the best seconds.
double run_plan_bench(const PlanBenchOptions& options);

struct ScaleBenchOptions {
  std::vector<int> total_gpus = {1024, 2048, 4096};  // trainer and engine get half each
  int layers = 61;
  int experts = 384;
  std::string wire = "bf16";           // or "mxfp8"
  std::vector<int> domains = {8, 72};  // NVLink domain sizes to model (8: HGX, 72: NVL72)
  bool kimi = true;  // also the published reference case: Kimi-K2, 256 -> 128 GPUs
};

// Plans a 1-trillion-parameter MoE refit at scale and estimates its time on HGX H200 (NVLink
// domain 8, 8 x 400 Gb/s per node) and GB200 NVL72 (domain 72) clusters; prints a table.
void run_scale_bench(const ScaleBenchOptions& options);

struct ConvertBenchOptions {
  // "ROWSxCOLS" one matrix, "ROWSxCOLSxCOUNT" that many (converted in one launch).
  std::vector<std::string> shapes = {"14336x4096", "4096x14336", "8192x8192",
                                     "65536x128",  "128x65536",  "256x1024x512"};
  std::string model = "llama3-8b";  // its weight matrices, all in one launch; "none" for none
  int layers = 16;
  std::vector<std::string> conversions = {"mxfp8",     "mxfp8-round-up", "mxfp8-megatron",
                                          "fp8-block", "cast-bf16-fp32", "cast-fp32-bf16",
                                          "pack",      "unpack"};
  // Whole matrices (false) and their left half of the columns (true: rows a full row apart).
  std::vector<bool> column_block = {false, true};
  int iterations = 20;
  int repeats = 5;
  int warmup = 3;
  std::string json_path;
  std::string commit;
};

// Builds with CUDA only. Times the executor's conversion kernels on one GPU against a
// device-to-device copy of the same bytes; returns the wrong bytes found against the host
// reference.
std::uint64_t run_convert_bench(const ConvertBenchOptions& options);

}  // namespace reshard::bench

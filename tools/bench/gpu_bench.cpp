// `reshard bench-gpu`: the all-to-all per-peer size sweep on the GPU transports, with NCCL (through
// reshard's NCCL transport) and the copy-engine ceiling for one peer measured in the same run.
// Times are CUDA-event times of many back-to-back run(stream) calls, the slowest PE's, as medians
// over repeats; every destination byte is verified after the timed runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>

#include "bench/bench.hpp"
#include "bench/bench_cuda.hpp"
#include "bench/workloads.hpp"
#include "core/env.hpp"
#include "gpu/stream_memory_ops.hpp"
#include "reshard/error.hpp"
#include "service/service_slot.hpp"

namespace reshard::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct Timing {
  double seconds = 0;       // median over repeats of the slowest PE's time per run
  double spread = 0;        // (max - min) / median over repeats
  double host_us = 0;       // host time to enqueue one run()
  std::uint64_t wrong = 0;  // wrong destination bytes, all PEs
};

struct DeviceMemory {
  explicit DeviceMemory(std::size_t bytes) {
    BENCH_CUDA(cudaMalloc(&data, std::max<std::size_t>(bytes, 1)));
  }
  ~DeviceMemory() { cudaFree(data); }
  void* data = nullptr;
};

// Times `body` (which enqueues `count` runs on `stream`) as the slowest PE's event time per run.
template <typename Body>
std::vector<double> time_repeats(Bootstrap& bootstrap, cudaStream_t stream, int repeats, int count,
                                 double* host_us, Body&& body) {
  cudaEvent_t start, stop;
  BENCH_CUDA(cudaEventCreate(&start));
  BENCH_CUDA(cudaEventCreate(&stop));
  std::vector<double> per_repeat;
  double host_total = 0;
  for (int r = 0; r < repeats; ++r) {
    BENCH_CUDA(cudaStreamSynchronize(stream));
    bootstrap.barrier();
    BENCH_CUDA(cudaEventRecord(start, stream));
    const auto host_start = std::chrono::steady_clock::now();
    body(count);
    host_total +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - host_start).count();
    BENCH_CUDA(cudaEventRecord(stop, stream));
    BENCH_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    BENCH_CUDA(cudaEventElapsedTime(&ms, start, stop));
    per_repeat.push_back(max_over_pes(bootstrap, static_cast<double>(ms) / 1000.0 / count));
  }
  if (host_us) *host_us = host_total / (repeats * count) * 1e6;
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return per_repeat;
}

// `runs` runs, then as many more as fill 50 ms: an idle GPU needs that long to reach its clocks,
// and a fixed count of short runs would leave the first engine measured at a disadvantage.
// Collective: every PE must run the same number of times, so the count is agreed on.
template <typename Run>
void warm_up(Bootstrap& bootstrap, cudaStream_t stream, int runs, Run&& run) {
  runs = std::max(runs, 1);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < runs; ++i) run();
  BENCH_CUDA(cudaStreamSynchronize(stream));
  const double each =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / runs;
  const double slowest = max_over_pes(bootstrap, each);
  const int more = static_cast<int>(std::min(0.05 / std::max(slowest, 1e-7), 5000.0));
  for (int i = 0; i < more; ++i) {
    run();
    if (i % 32 == 31) BENCH_CUDA(cudaStreamSynchronize(stream));
  }
  BENCH_CUDA(cudaStreamSynchronize(stream));
}

Timing summarize(std::vector<double> per_repeat) {
  Timing t;
  t.seconds = median(per_repeat);
  const auto [lo, hi] = std::minmax_element(per_repeat.begin(), per_repeat.end());
  t.spread = t.seconds > 0 ? (*hi - *lo) / t.seconds : 0;
  return t;
}

// Whether --graph replays a captured run on this service (only the CUDA transport can be
// captured); the JSON label says so from the same fact.
bool replays_graph(const GpuBenchOptions& options, const CopyService& service) {
  return options.graph && service.transport_name() == "cuda";
}

// Warms up, then times `iterations` back-to-back run(stream) calls per repeat on a scheduled
// service; returns with every run finished.
Timing time_scheduled_runs(Bootstrap& bootstrap, CopyService& service,
                           const GpuBenchOptions& options, cudaStream_t stream, int iterations) {
  cudaGraphExec_t replay = nullptr;
  if (replays_graph(options, service)) {
    cudaGraph_t graph = nullptr;
    BENCH_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    service.run(stream);
    BENCH_CUDA(cudaStreamEndCapture(stream, &graph));
    BENCH_CUDA(cudaGraphInstantiate(&replay, graph, 0));
    BENCH_CUDA(cudaGraphDestroy(graph));
  }
  auto run = [&] {
    if (replay != nullptr)
      BENCH_CUDA(cudaGraphLaunch(replay, stream));
    else
      service.run(stream);
  };
  warm_up(bootstrap, stream, options.warmup, run);
  double host_us = 0;
  Timing t = summarize(
      time_repeats(bootstrap, stream, options.repeats, iterations, &host_us, [&](int count) {
        for (int i = 0; i < count; ++i) run();
      }));
  t.host_us = host_us;
  BENCH_CUDA(cudaStreamSynchronize(stream));
  if (replay != nullptr) BENCH_CUDA(cudaGraphExecDestroy(replay));
  service.synchronize();
  return t;
}

// All-to-all: every PE sends `size` bytes to every other PE. Source range for peer j at j*size,
// destination range from peer i at i*size.
Timing time_all_to_all(std::shared_ptr<Bootstrap> bootstrap, CopyService& service,
                       std::uint64_t size, const GpuBenchOptions& options, cudaStream_t stream,
                       int iterations) {
  service.clear_requests();
  const int n = service.n_pes(), me = service.my_pe(), device = service.device();
  DeviceMemory send(size * n), recv(size * n);
  std::vector<std::byte> host(size * n);
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    const TaskId out = static_cast<TaskId>(me) * n + peer, in = static_cast<TaskId>(peer) * n + me;
    fill_pattern(std::span(host).subspan(peer * size, size), out, 0, 1);
    service.register_send(out, Buffer::cuda(send.data, size * n, device), peer * size, size, peer);
    service.register_receive(in, Buffer::cuda(recv.data, size * n, device), peer * size, size,
                             peer);
  }
  BENCH_CUDA(cudaMemcpy(send.data, host.data(), host.size(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemset(recv.data, 0, size * n));
  service.schedule();
  Timing t = time_scheduled_runs(*bootstrap, service, options, stream, iterations);
  BENCH_CUDA(cudaMemcpy(host.data(), recv.data, host.size(), cudaMemcpyDeviceToHost));
  std::uint64_t wrong = 0;
  for (int peer = 0; peer < n; ++peer) {
    if (peer == me) continue;
    wrong += count_pattern_mismatches(std::span(host).subspan(peer * size, size),
                                      static_cast<TaskId>(peer) * n + me, 0, 1);
  }
  for (std::uint64_t w : gather_from_pes(*bootstrap, wrong)) t.wrong += w;
  service.clear_requests();
  return t;
}

// One of bench::make_workload's patterns at `size`: the busiest PE's bytes (the schedule's lower
// bound) over the time per run, every byte verified after the timed runs.
Timing time_workload(std::shared_ptr<Bootstrap> bootstrap, CopyService& service,
                     const Workload& workload, const GpuBenchOptions& options, cudaStream_t stream,
                     std::uint64_t* bound_bytes) {
  service.clear_requests();
  const PeId me = service.my_pe();
  const int device = service.device();
  DeviceMemory send(workload.send_buffer_bytes[me]), recv(workload.recv_buffer_bytes[me]);
  const Buffer src = Buffer::cuda(send.data, workload.send_buffer_bytes[me], device);
  const Buffer dst = Buffer::cuda(recv.data, workload.recv_buffer_bytes[me], device);
  for (const WorkItem& item : workload.items) {
    if (item.src == me)
      service.register_send(item.task, src, item.src_offset, item.bytes, item.dst);
    if (item.dst == me)
      service.register_receive(item.task, dst, item.dst_offset, item.bytes, item.src);
  }
  std::vector<std::byte> host_send(workload.send_buffer_bytes[me]);
  std::vector<std::byte> host_recv(workload.recv_buffer_bytes[me]);
  prepare_buffers(workload, me, 1, host_send, host_recv);
  BENCH_CUDA(cudaMemcpy(send.data, host_send.data(), host_send.size(), cudaMemcpyHostToDevice));
  BENCH_CUDA(cudaMemcpy(recv.data, host_recv.data(), host_recv.size(), cudaMemcpyHostToDevice));
  *bound_bytes = service.schedule().lower_bound_bytes;
  const int iterations = static_cast<int>(std::clamp<std::uint64_t>(
      (4ull << 30) / std::max<std::uint64_t>(*bound_bytes, 1), 10, options.max_iterations));
  Timing t = time_scheduled_runs(*bootstrap, service, options, stream, iterations);
  BENCH_CUDA(cudaMemcpy(host_recv.data(), recv.data, host_recv.size(), cudaMemcpyDeviceToHost));
  const std::uint64_t wrong = verify_receive_buffer(workload, me, 1, host_recv);
  for (std::uint64_t w : gather_from_pes(*bootstrap, wrong)) t.wrong += w;
  service.clear_requests();
  return t;
}

// The copy-engine ceiling: PE 0 copies `size` bytes into PE 1's memory with one cudaMemcpyAsync,
// nobody else moving data.
Timing time_copy_engine_ceiling(Bootstrap& bootstrap, std::uint64_t size,
                                const GpuBenchOptions& options, cudaStream_t stream,
                                int iterations) {
  const int me = bootstrap.rank();
  DeviceMemory buffer(size);
  cudaIpcMemHandle_t handle{};
  BENCH_CUDA(cudaIpcGetMemHandle(&handle, buffer.data));
  const auto handles = gather_from_pes(bootstrap, handle);
  void* peer = nullptr;
  if (me == 0) BENCH_CUDA(cudaIpcOpenMemHandle(&peer, handles[1], cudaIpcMemLazyEnablePeerAccess));
  auto body = [&](int count) {
    if (me != 0) return;
    for (int i = 0; i < count; ++i)
      BENCH_CUDA(cudaMemcpyAsync(peer, buffer.data, size, cudaMemcpyDeviceToDevice, stream));
  };
  warm_up(bootstrap, stream, options.warmup, [&] { body(1); });
  Timing t = summarize(time_repeats(bootstrap, stream, options.repeats, iterations, nullptr, body));
  if (peer) cudaIpcCloseMemHandle(peer);
  bootstrap.barrier();  // PE 1 keeps its buffer until PE 0 is done with it
  return t;
}

}  // namespace

std::uint64_t run_gpu_bench(std::shared_ptr<Bootstrap> bootstrap, const GpuBenchOptions& options) {
  // One service per engine for the whole sweep, each with the environment's options (read once)
  // and its own transport and CUDA engine.
  std::vector<std::unique_ptr<CopyService>> services;
  const CopyServiceOptions base = bench_service_options(TransportKind::kCuda);
  GpuBenchOptions chosen = options;
  const auto built = available_transports();
  int devices = 0;
  BENCH_CUDA(cudaGetDeviceCount(&devices));
  const bool shared_gpus = bootstrap->size() > devices;
  std::erase_if(chosen.engines, [&](const std::string& engine) {
    const bool missing = (engine == "nccl" || engine == "nvshmem") &&
                         std::find(built.begin(), built.end(), engine) == built.end();
    if (missing && bootstrap->rank() == 0)
      std::printf("(no %s transport in this build: left out)\n", engine.c_str());
    // NCCL refuses two ranks on one GPU.
    const bool refused = engine == "nccl" && shared_gpus;
    if (refused && bootstrap->rank() == 0)
      std::printf("(PEs share GPUs: NCCL, which needs a GPU per rank, left out)\n");
    return missing || refused;
  });
  if (bootstrap->rank() == 0 && !base.nccl.nonblocking &&
      std::find(chosen.engines.begin(), chosen.engines.end(), "nccl") != chosen.engines.end())
    std::printf("(NCCL with blocking calls: RESHARD_NCCL_NONBLOCKING=0 unless set)\n");
  for (const std::string& engine : chosen.engines) {
    const bool cuda_engine = engine != "nccl" && engine != "nvshmem";
    CopyServiceOptions service_options = base;
    if (cuda_engine) {
      service_options.cuda.engine = engine;
    } else {
      service_options.transport = parse_transport_kind(engine);
    }
    services.push_back(std::make_unique<CopyService>(bootstrap, service_options));
    services.back()->init(LogLevel::kWarn);
  }
  const int n = bootstrap->size(), me = bootstrap->rank();
  if (n < 2) throw_error(ErrorCode::kInvalidArgument, "bench-gpu needs at least 2 PEs");
  cudaStream_t stream;
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  // PEs sharing GPUs (colocated processes): how many per GPU and whether MPS runs, in every
  // record, since both change what the numbers mean.
  int visible_gpus = 1;
  BENCH_CUDA(cudaGetDeviceCount(&visible_gpus));
  std::string colocation;
  if (n > visible_gpus) {
    colocation = ",\"pes_per_gpu\":" + std::to_string((n + visible_gpus - 1) / visible_gpus) +
                 ",\"mps\":" + (cuda::mps_server_found() ? "true" : "false") +
                 ",\"same_device_order\":\"" + base.cuda.same_device + "\"" +
                 ",\"batch_memops\":" + (base.advanced.cuda_batch_memops ? "true" : "false") +
                 ",\"nvshmem_waits\":\"" + base.nvshmem.waits + "\"";
  }
  // Declared nodes (RESHARD_NODE_SIZE) change the NVSHMEM and NCCL engines' paths (NVSHMEM puts
  // between nodes); the CUDA engines run the CUDA transport alone and ignore them.
  const std::string nodes =
      base.node_size ? ",\"node_size\":" + std::to_string(*base.node_size) : std::string();
  std::ofstream json;
  if (me == 0 && !options.json_path.empty()) json.open(options.json_path, std::ios::app);

  if (me == 0) {
    std::printf(
        "reshard bench-gpu: all-to-all, %d x %s, per-GPU egress GB/s (us per all-to-all), "
        "median of %d repeats%s\n",
        n, prop.name, options.repeats,
        options.graph ? "; CUDA engines replay one captured run (CUDA graph)" : "");
    std::printf("%-9s", "per-peer");
    for (const std::string& e : chosen.engines) std::printf(" | %-17s", e.c_str());
    std::printf(" | %-10s | best/nccl | best/ceil | host us/run\n", "CE 1-peer");
  }
  std::uint64_t wrong_total = 0;
  const bool sweep = std::find(options.workloads.begin(), options.workloads.end(), "all-to-all") !=
                     options.workloads.end();
  for (std::uint64_t size : sweep ? options.sizes : std::vector<std::uint64_t>{}) {
    const std::uint64_t egress = size * (n - 1);
    const int iterations = static_cast<int>(std::clamp<std::uint64_t>(
        (4ull << 30) / std::max<std::uint64_t>(egress, 1), 10, options.max_iterations));
    std::vector<Timing> timings;
    for (auto& service : services)
      timings.push_back(time_all_to_all(bootstrap, *service, size, options, stream, iterations));
    const Timing ceiling = time_copy_engine_ceiling(*bootstrap, size, options, stream, iterations);
    if (me != 0) continue;
    auto gbps = [&](const Timing& t, std::uint64_t bytes) { return bytes / t.seconds / 1e9; };
    std::printf("%-9s", format_bytes(size).c_str());
    double best = 0, nccl = 0, host_us = 0;
    for (std::size_t e = 0; e < timings.size(); ++e) {
      const double rate = gbps(timings[e], egress);
      char cell[64];
      std::snprintf(cell, sizeof cell, "%.1f (%.1f)%s", rate, timings[e].seconds * 1e6,
                    timings[e].wrong ? " WRONG" : "");
      std::printf(" | %-17s", cell);
      if (chosen.engines[e] == "nccl")
        nccl = rate;
      else if (rate > best) {
        best = rate;
        host_us = timings[e].host_us;
      }
      wrong_total += timings[e].wrong;
      if (json.is_open()) {
        json << "{\"bench\":\"all_to_all\",\"date\":\"" << utc_date() << "\",\"versions\":\""
             << component_versions() << "\",\"device\":\"" << prop.name << "\",\"gpus\":" << n
             << ",\"engine\":\"" << chosen.engines[e]
             << (replays_graph(options, *services[e]) ? "+graph" : "")
             << "\",\"per_peer_bytes\":" << size << ",\"seconds\":" << timings[e].seconds
             << ",\"gbps_per_gpu\":" << rate << ",\"spread\":" << timings[e].spread
             << ",\"host_us_per_run\":" << timings[e].host_us
             << ",\"wrong_bytes\":" << timings[e].wrong << colocation
             << (colocation.empty() ? ""
                 : reshard::execution::ServiceSlot::waits_in_stream_front_end(*services[e])
                     ? ",\"front_end_waits\":true"
                     : ",\"front_end_waits\":false")
             << (chosen.engines[e] == "nvshmem" || chosen.engines[e] == "nccl" ? nodes : "")
             << ",\"commit\":\"" << options.commit << "\"}\n";
      }
    }
    const double ceiling_rate = gbps(ceiling, size);
    std::printf(" | %-10.1f | %9s | %9.2f | %.1f\n", ceiling_rate,
                nccl > 0 ? (std::to_string(best / nccl).substr(0, 4) + "x").c_str() : "-",
                best / ceiling_rate, host_us);
    if (json.is_open()) {
      json << "{\"bench\":\"ce_ceiling_one_peer\",\"date\":\"" << utc_date() << "\",\"device\":\""
           << prop.name << "\",\"gpus\":" << n << ",\"per_peer_bytes\":" << size
           << ",\"seconds\":" << ceiling.seconds << ",\"gbps\":" << ceiling_rate << colocation
           << ",\"commit\":\"" << options.commit << "\"}\n";
    }
    std::fflush(stdout);
  }
  // The other patterns: the busiest PE's rate (the schedule's lower bound over the time).
  for (const std::string& kind : options.workloads) {
    if (kind == "all-to-all") continue;
    if (me == 0) {
      std::printf("\n%s: busiest-PE GB/s (us per run), median of %d repeats\n%-9s", kind.c_str(),
                  options.repeats, "size");
      for (const std::string& e : chosen.engines) std::printf(" | %-17s", e.c_str());
      std::printf(" | best/nccl\n");
    }
    for (std::uint64_t size : options.sizes) {
      const Workload workload = make_workload(kind, n, size, 1);
      std::vector<Timing> timings;
      std::uint64_t bound = 0;
      for (auto& service : services) {
        timings.push_back(time_workload(bootstrap, *service, workload, options, stream, &bound));
      }
      if (me != 0) continue;
      std::printf("%-9s", format_bytes(size).c_str());
      double best = 0, nccl = 0;
      for (std::size_t e = 0; e < timings.size(); ++e) {
        const double rate = bound / timings[e].seconds / 1e9;
        char cell[64];
        std::snprintf(cell, sizeof cell, "%.1f (%.1f)%s", rate, timings[e].seconds * 1e6,
                      timings[e].wrong ? " WRONG" : "");
        std::printf(" | %-17s", cell);
        if (chosen.engines[e] == "nccl") {
          nccl = rate;
        } else {
          best = std::max(best, rate);
        }
        wrong_total += timings[e].wrong;
        if (json.is_open()) {
          json << "{\"bench\":\"workload\",\"date\":\"" << utc_date() << "\",\"versions\":\""
               << component_versions() << "\",\"device\":\"" << prop.name << "\",\"gpus\":" << n
               << ",\"workload\":\"" << kind << "\",\"engine\":\"" << chosen.engines[e]
               << "\",\"size\":" << size << ",\"bound_bytes\":" << bound
               << ",\"seconds\":" << timings[e].seconds << ",\"busiest_pe_gbps\":" << rate
               << ",\"spread\":" << timings[e].spread << ",\"wrong_bytes\":" << timings[e].wrong
               << ",\"commit\":\"" << options.commit << "\"}\n";
        }
      }
      std::printf(" | %s\n",
                  nccl > 0 ? (std::to_string(best / nccl).substr(0, 4) + "x").c_str() : "-");
      std::fflush(stdout);
    }
  }
  cudaStreamDestroy(stream);
  return wrong_total;
}

}  // namespace reshard::bench

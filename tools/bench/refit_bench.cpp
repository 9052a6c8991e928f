// `reshard bench-refit`: one refit of a real model shape (Llama-3-8B TP 4 -> TP 2 x 2 replicas,
// or Qwen3-30B-A3B EP 4 -> EP 2 x expert-TP 2) through the planner and the executor, timed per
// refit on the slowest PE, against the plan's lower bound. PEs that share a GPU (colocated) are
// timed beside the hand-written IPC copy loop and the one-process copy of the same bytes.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "bench/bench.hpp"
#include "core/env.hpp"
#include "reshard/reshard.hpp"
#include "service/service_slot.hpp"

#ifdef RESHARD_WITH_CUDA
#include <cuda_runtime.h>

#include "bench/ipc_copy_loop.hpp"
#include "gpu/stream_memory_ops.hpp"
#endif

namespace reshard::bench {
namespace {

std::uint16_t pattern(std::int64_t global) {
  return static_cast<std::uint16_t>(((static_cast<std::uint64_t>(global) * 0x9e3779b1u) >> 7) &
                                    0x3fff);
}

struct Tensor {
  Buffer buffer;
  std::vector<std::byte> host;  // host transport: the memory itself
  ~Tensor() {
#ifdef RESHARD_WITH_CUDA
    if (buffer.kind == MemoryKind::kCuda) cudaFree(buffer.data);
#endif
  }
};

std::unique_ptr<Tensor> allocate(std::size_t bytes, bool gpu) {
  auto t = std::make_unique<Tensor>();
  if (!gpu) {
    t->host.resize(bytes);
    t->buffer = Buffer::host(t->host.data(), bytes);
    return t;
  }
#ifdef RESHARD_WITH_CUDA
  void* p = nullptr;
  int device = 0;
  cudaGetDevice(&device);
  if (cudaMalloc(&p, bytes == 0 ? 1 : bytes) != cudaSuccess) {
    throw_error(ErrorCode::kSystem, "cudaMalloc of " + format_bytes(bytes) + " failed");
  }
  cudaMemset(p, 0, bytes);
  t->buffer = Buffer::cuda(p, bytes, device);
#endif
  return t;
}

void upload(Tensor& t, const std::vector<std::uint16_t>& values) {
  const std::size_t bytes = values.size() * 2;
  if (t.buffer.kind == MemoryKind::kHost) {
    std::memcpy(t.buffer.data, values.data(), bytes);
    return;
  }
#ifdef RESHARD_WITH_CUDA
  cudaMemcpy(t.buffer.data, values.data(), bytes, cudaMemcpyHostToDevice);
#endif
}

// Zeroes a destination, so a baseline run cannot pass on the bytes an earlier run left.
void clear(Tensor& t) {
  if (t.buffer.kind == MemoryKind::kHost) {
    std::fill(t.host.begin(), t.host.end(), std::byte{0});
    return;
  }
#ifdef RESHARD_WITH_CUDA
  cudaMemset(t.buffer.data, 0, t.buffer.bytes);
  cudaDeviceSynchronize();
#endif
}

std::vector<std::byte> download(const Tensor& t) {
  if (t.buffer.kind == MemoryKind::kHost) return t.host;
  std::vector<std::byte> out(t.buffer.bytes);
#ifdef RESHARD_WITH_CUDA
  cudaMemcpy(out.data(), t.buffer.data, out.size(), cudaMemcpyDeviceToHost);
#endif
  return out;
}

// The shard's local tensor filled with the pattern of its elements' global indices, row by row.
std::vector<std::uint16_t> source_values(const ParamSpec& param, const Shard& shard) {
  std::vector<std::uint16_t> values(Box::whole(shard.local_shape).elements());
  const int n = static_cast<int>(param.shape.size());
  for (const Piece& piece : shard.pieces) {
    const Box& g = piece.global;
    const std::int64_t cols = g.extent[n - 1];
    Box rows = g;
    rows.extent[n - 1] = 1;
    Extents at = rows.offset;
    for (std::int64_t r = 0; r < rows.elements(); ++r) {
      std::int64_t global = 0, local = 0;
      for (int d = 0; d < n; ++d) {
        global = global * param.shape[d] + at[d];
        local = local * shard.local_shape[d] + (at[d] - g.offset[d] + piece.local_at[d]);
      }
      for (std::int64_t c = 0; c < cols; ++c) values[local + c] = pattern(global + c);
      for (int d = n - 2; d >= 0; --d) {
        if (++at[d] < g.offset[d] + g.extent[d]) break;
        at[d] = g.offset[d];
      }
    }
  }
  return values;
}

// Checks every 4099th element of the shard (all of small ones); returns the wrong ones.
std::uint64_t verify_sample(const ParamSpec& param, const Shard& shard,
                            const std::vector<std::byte>& bytes) {
  const auto* got = reinterpret_cast<const std::uint16_t*>(bytes.data());
  const int n = static_cast<int>(param.shape.size());
  const std::int64_t total = Box::whole(shard.local_shape).elements();
  std::uint64_t wrong = 0;
  for (std::int64_t li = 0; li < total; li += 4099) {
    Extents l{};
    for (std::int64_t rest = li, d = n - 1; d >= 0; --d) {
      l[d] = rest % shard.local_shape[d];
      rest /= shard.local_shape[d];
    }
    Box element{n, l, {}};  // the one element at l
    for (int d = 0; d < n; ++d) element.extent[d] = 1;
    for (const Piece& piece : shard.pieces) {
      if (!shard.local_box(piece).contains(element)) continue;
      std::int64_t global = 0;
      for (int d = 0; d < n; ++d) {
        global = global * param.shape[d] + (l[d] - piece.local_at[d] + piece.global.offset[d]);
      }
      if (got[li] != pattern(global)) ++wrong;
    }
  }
  return wrong;
}

#ifdef RESHARD_WITH_CUDA
// The copy-engine ceiling in this run: PE 0 copies 256 MiB into PE 1's memory with one
// cudaMemcpyAsync while nobody else moves data; the best of 5, in GB/s, known to every PE.
double copy_engine_ceiling_gbps(Bootstrap& bootstrap) {
  constexpr std::size_t kBytes = std::size_t{256} << 20;
  const int me = bootstrap.rank();
  void* mine = nullptr;
  cudaIpcMemHandle_t handle{};
  bool ok =
      cudaMalloc(&mine, kBytes) == cudaSuccess && cudaIpcGetMemHandle(&handle, mine) == cudaSuccess;
  const auto handles =
      bootstrap.all_gather({reinterpret_cast<const std::byte*>(&handle), sizeof handle});
  double best = 0;
  if (me == 0 && ok) {
    cudaIpcMemHandle_t peer_handle;
    std::memcpy(&peer_handle, handles[1].data(), sizeof peer_handle);
    void* peer = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t start = nullptr, stop = nullptr;
    ok = cudaIpcOpenMemHandle(&peer, peer_handle, cudaIpcMemLazyEnablePeerAccess) == cudaSuccess &&
         cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) == cudaSuccess &&
         cudaEventCreate(&start) == cudaSuccess && cudaEventCreate(&stop) == cudaSuccess;
    for (int i = 0; ok && i < 6; ++i) {
      cudaEventRecord(start, stream);
      cudaMemcpyAsync(peer, mine, kBytes, cudaMemcpyDeviceToDevice, stream);
      cudaEventRecord(stop, stream);
      float ms = 0;
      ok = cudaEventSynchronize(stop) == cudaSuccess &&
           cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
      if (ok && i > 0) best = std::max(best, kBytes / (ms * 1e-3) / 1e9);  // the first warms up
    }
    if (peer != nullptr) cudaIpcCloseMemHandle(peer);
    if (stream != nullptr) cudaStreamDestroy(stream);
    if (start != nullptr) cudaEventDestroy(start);
    if (stop != nullptr) cudaEventDestroy(stop);
  }
  std::vector<std::byte> result(sizeof best);
  std::memcpy(result.data(), &best, sizeof best);
  bootstrap.broadcast(result, 0);  // PE 1's buffer is freed only after PE 0 is done with it
  std::memcpy(&best, result.data(), sizeof best);
  if (mine != nullptr) cudaFree(mine);
  cudaGetLastError();
  return best;
}
#endif

// The GPU's name ("NVIDIA H200"), or "host".
std::string device_name() {
#ifdef RESHARD_WITH_CUDA
  int device = 0;
  cudaDeviceProp properties{};
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaGetDeviceProperties(&properties, device) == cudaSuccess) {
    return properties.name;
  }
  cudaGetLastError();
#endif
  return "host";
}

std::pair<Parallelism, Parallelism> layouts_for(const std::string& model, int n) {
  if (n < 2 || n % 2 != 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "bench-refit needs an even number of PEs, got " + std::to_string(n));
  }
  if (model == "qwen3-30b-a3b") {
    return {{.tp = n / 2, .dp = 2, .ep = n}, {.tp = n, .ep = n / 2, .etp = 2}};
  }
  return {{.tp = n}, {.tp = n / 2, .replicas = 2}};
}

// The transform a bench option names ("none": null), applied to parameters whose name holds
// `only` (all where empty).
std::shared_ptr<ReshardTransform> bench_transform(const std::string& name,
                                                  const std::string& only) {
  if (name == "mxfp8")
    return make_mxfp8_transform(QuantizeSide::kSender, MxScaleRounding::kOcp, only);
  if (name == "mxfp8-receiver")
    return make_mxfp8_transform(QuantizeSide::kReceiver, MxScaleRounding::kOcp, only);
  if (name == "fp8-block") return make_fp8_block_transform(QuantizeSide::kSender, only);
  if (name == "fp8-block-receiver") return make_fp8_block_transform(QuantizeSide::kReceiver, only);
  return nullptr;
}

// The model a bench names, with its --layers or a default: Qwen3-30B-A3B 48, Llama-3-8B
// `llama_layers`, and "toy", a Llama-shaped model of hidden size 512 small enough for CPUs, 4.
ModelSpec bench_model(const RefitBenchOptions& options, int llama_layers) {
  const auto layers = [&](int fallback) { return options.layers > 0 ? options.layers : fallback; };
  if (options.model == "qwen3-30b-a3b") return qwen3_30b_a3b_model(layers(48));
  if (options.model == "toy") return toy_model(layers(4), 512);
  return llama3_8b_model(layers(llama_layers));
}

// The executor's options a bench gives (staging budget, where colocated slices are quantized).
ReshardOptions bench_reshard_options(const RefitBenchOptions& options) {
  ReshardOptions reshard_options;
  reshard_options.quantize_colocated_on_sender = options.quantize_colocated_on_sender;
  if (options.staging_budget == "unlimited") {
    reshard_options.staging_budget = ReshardOptions::kUnlimited;
  } else if (!options.staging_budget.empty()) {
    reshard_options.staging_budget = parse_bytes(options.staging_budget);
  }
  return reshard_options;
}

// One PE's tensors of a model refit: its source shards filled with the pattern, its destinations
// zeroed (FP8 data and scales where the transform writes them), all owned here.
struct RefitTensors {
  std::vector<std::unique_ptr<Tensor>> memory;
  std::vector<Tensor*> destinations;  // every destination buffer (data and scales)
  TensorMap src, dst;

  RefitTensors(const ReshardPlan& plan, const ReshardTransform* transform, PeId me, bool gpu,
               Progress& progress) {
    for (std::uint32_t p = 0; p < plan.params().size(); ++p) {
      progress.note("filling the tensors: parameter " + std::to_string(p + 1) + " of " +
                    std::to_string(plan.params().size()));
      const ParamSpec& param = plan.params()[p];
      if (const Shard* shard = plan.src_layout().find_shard(me, p)) {
        auto t = allocate(Box::whole(shard->local_shape).elements() * 2, gpu);
        upload(*t, source_values(param, *shard));
        src[param.name] = {t->buffer, DType::kBFloat16, {}};
        memory.push_back(std::move(t));
      }
      if (const Shard* shard = plan.dst_layout().find_shard(me, p)) {
        const std::size_t elements = Box::whole(shard->local_shape).elements();
        LocalTensor tensor;
        if (transform && transform->should_transform(param)) {
          auto data = allocate(elements, gpu);
          auto scale =
              allocate(transform->destination_scale(shard->local_shape).value().bytes(), gpu);
          tensor = {data->buffer, DType::kFloat8E4M3, scale->buffer};
          destinations.push_back(data.get());
          destinations.push_back(scale.get());
          memory.push_back(std::move(data));
          memory.push_back(std::move(scale));
        } else {
          auto data = allocate(elements * 2, gpu);
          tensor = {data->buffer, DType::kBFloat16, {}};
          destinations.push_back(data.get());
          memory.push_back(std::move(data));
        }
        dst[param.name] = tensor;
      }
    }
  }

  void clear_destinations() {
    for (Tensor* t : destinations) clear(*t);
  }

  // Wrong bytes in a sample of this PE's bf16 destinations.
  std::uint64_t sampled_wrong_bytes(const ReshardPlan& plan, PeId me) {
    std::uint64_t wrong = 0;
    for (std::uint32_t p = 0; p < plan.params().size(); ++p) {
      const ParamSpec& param = plan.params()[p];
      const Shard* shard = plan.dst_layout().find_shard(me, p);
      if (shard == nullptr || dst[param.name].dtype != DType::kBFloat16) continue;
      const auto it = std::find_if(memory.begin(), memory.end(), [&](const auto& t) {
        return t->buffer.data == dst[param.name].data.data;
      });
      wrong += verify_sample(param, *shard, download(**it));
    }
    return wrong;
  }
};

// The host time of launching one graph, every PE at once (bench-refit's graph replay and the
// driver's floors beside it): the slowest PE's median, warm (right after another launch) and cold
// (after a whole refit waited for and a barrier), and each PE's own medians. 0: not measured.
struct LaunchTimes {
  double warm = 0, cold = 0;
  std::vector<double> warm_of_pe, cold_of_pe;
};

// Prints " PE 0 x us, PE 1 y us" and a newline: each PE's median host time of one launch.
void print_each_pe(const std::vector<double>& seconds_of_pe) {
  for (std::size_t pe = 0; pe < seconds_of_pe.size(); ++pe)
    std::printf(" PE %zu %.1f us%s", pe, seconds_of_pe[pe] * 1e6,
                pe + 1 < seconds_of_pe.size() ? "," : "");
  std::printf("\n");
}

}  // namespace

std::uint64_t run_refit_bench(std::shared_ptr<Bootstrap> bootstrap,
                              const RefitBenchOptions& options) {
  CopyService service(bootstrap, bench_service_options(options.transport));
  service.init(LogLevel::kWarn);
  const PeId me = service.my_pe();
  const int n = service.n_pes();
  const bool gpu = service.transport_name() != "host";
  const ModelSpec model = bench_model(options, 32);
  const auto [from, to] = layouts_for(options.model, n);
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, from), build_layout(model, to)));
  const std::string& only = options.transform_only;
  const std::shared_ptr<ReshardTransform> transform = bench_transform(options.transform, only);
  const std::string transform_name =
      !transform
          ? "none"
          : transform->name() + (only.empty() ? "" : " (parameters matching '" + only + "')");

  Progress progress("bench-refit", me == 0);
  RefitTensors tensors(*plan, transform.get(), me, gpu, progress);
  TensorMap& src = tensors.src;
  TensorMap& dst = tensors.dst;

  ReshardReport report;
  const ReshardOptions reshard_options = bench_reshard_options(options);
  // Median of the slowest PE's time per `refit()`, after the warm-up.
  auto time_each = [&](const auto& refit) {
    std::vector<double> times;
    for (int i = 0; i < options.warmup + options.iterations; ++i) {
      progress.note(i < options.warmup ? "warm-up refit " + std::to_string(i + 1) + " of " +
                                             std::to_string(options.warmup)
                                       : "refit " + std::to_string(i + 1 - options.warmup) +
                                             " of " + std::to_string(options.iterations));
      bootstrap->barrier();
      const auto start = std::chrono::steady_clock::now();
      refit();
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      const double slowest = max_over_pes(*bootstrap, seconds);
      if (i >= options.warmup) times.push_back(slowest);
    }
    std::sort(times.begin(), times.end());
    return times[times.size() / 2];
  };
  // Host time each timed execute spent checking its tensors and agreeing (ReshardReport), the
  // slowest PE's of each refit.
  std::vector<double> check_times, agree_times;
  auto time_refits = [&](CopyService& on) {
    check_times.clear();
    agree_times.clear();
    return time_each([&] {
      report = execute_reshard_plan(plan, src, dst, on, transform, nullptr, reshard_options);
      check_times.push_back(report.timing.check_seconds);
      agree_times.push_back(report.timing.agree_seconds);
    });
  };
  // Device memory the refits hold beyond the tensors: free memory of each PE's GPU before the
  // first refit and after the last, every PE between barriers (PEs sharing a GPU see the same
  // figure: all of them together).
  auto free_device_bytes = [&]() -> std::int64_t {
    bootstrap->barrier();
    std::int64_t free_bytes = 0;
#ifdef RESHARD_WITH_CUDA
    if (gpu) {
      std::size_t free = 0, total = 0;
      cudaSetDevice(service.device());
      cudaDeviceSynchronize();
      cudaMemGetInfo(&free, &total);
      free_bytes = static_cast<std::int64_t>(free);
    }
#endif
    bootstrap->barrier();
    return free_bytes;
  };
  const std::int64_t free_before = free_device_bytes();
  const double median = time_refits(service);
  // The slowest PE's check and agreement in each timed refit, their medians.
  const auto slowest_median = [&](std::vector<double> times) {
    times.erase(times.begin(),
                times.begin() + std::min<std::ptrdiff_t>(static_cast<std::ptrdiff_t>(times.size()),
                                                         options.warmup));
    for (double& t : times) t = max_over_pes(*bootstrap, t);
    std::sort(times.begin(), times.end());
    return times.empty() ? 0.0 : times[times.size() / 2];
  };
  const double check_median = slowest_median(check_times);
  const double agree_median = slowest_median(agree_times);
  const std::int64_t extra_device_bytes =
      max_over_pes(*bootstrap, free_before - free_device_bytes());
  const ReshardReport measured = report;
  // The same refit through rerun_reshard_plan: the tensors taken as the last refit had them,
  // without execute_reshard_plan's check of every tensor and its agreement among the PEs.
  const double rerun_median =
      time_each([&] { rerun_reshard_plan(plan, service, transform, nullptr); });
  // The same refit bound once (Refit): what a training loop keeping its tensors runs, with
  // nothing looked up or checked and no collective besides the transfer's own.
  double bound_median = 0;
  // The same bound refit captured in a CUDA graph (RefitGraph) and replayed on a stream (the cuda
  // transport): each replay's wall time, and the host time of one launch right after another
  // (the driver's launch path warm) and of one launched cold, the slowest PE's medians.
  double graph_median = 0;
  // The host time of a launch of the refit's graph, of the driver's one-node graph and of a graph
  // of the leader's shape (stream memory operations, then one more node) made of nodes with
  // nothing to do: the slowest PE's medians and each PE's, launched warm and cold.
  LaunchTimes replay_times, floor_times, shaped_floor_times;
  {
    Refit bound(plan, src, dst, service, transform, reshard_options);
    bound_median = time_each([&] { bound.run(); });
#ifdef RESHARD_WITH_CUDA
    if (service.transport_name() == "cuda") {  // its tensors are GPU memory
      cudaStream_t stream = nullptr;
      cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
      {
        RefitGraph graph(bound, stream);
        graph_median = time_each([&] {
          graph.replay(stream);
          cudaStreamSynchronize(stream);
        });
        // The host time of a launch, every PE at once: the slowest PE's median and each PE's own
        // (which PE's graph is the slowest to launch). `warm`: right after another launch, the
        // driver's launch path warm; else cold: after a whole refit (the stream waited for) and a
        // barrier, as a refit once a training step is launched. Every graph launched cold comes
        // after the same refit: how long the host waited before a launch sets its cost (the
        // driver's launch path runs from the caches the wait left), so a floor launched right
        // after its own microsecond-long previous run would not compare.
        const auto launch_host_time = [&](const auto& launch, bool warm, double& slowest,
                                          std::vector<double>& of_pe) {
          std::vector<double> launches, mine;
          // A launch's host time is a few microseconds and varies with the host's scheduling: at
          // least 50 samples (each waits for one replay, milliseconds) make its median steady.
          const int samples = std::max(options.iterations, 50);
          for (int i = 0; i < options.warmup + samples; ++i) {
            if (!warm) {
              graph.replay(stream);
              cudaStreamSynchronize(stream);
            }
            bootstrap->barrier();
            if (warm) launch();
            const auto start = std::chrono::steady_clock::now();
            launch();
            const double host =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            cudaStreamSynchronize(stream);
            if (i < options.warmup) continue;
            launches.push_back(max_over_pes(*bootstrap, host));
            mine.push_back(host);
          }
          std::sort(launches.begin(), launches.end());
          slowest = launches[launches.size() / 2];
          std::sort(mine.begin(), mine.end());
          of_pe = gather_from_pes(*bootstrap, mine[mine.size() / 2]);
        };
        const auto time_launches = [&](const auto& launch, LaunchTimes& times) {
          launch_host_time(launch, true, times.warm, times.warm_of_pe);
          launch_host_time(launch, false, times.cold, times.cold_of_pe);
        };
        time_launches([&] { graph.replay(stream); }, replay_times);
        // The driver's floors in the same processes, launched the same way beside the same
        // contexts sharing the GPU: a graph of one node (a 4-byte memset); and one of the shape a
        // delegating leader's run has, a batch of stream memory operations (a wait for a word
        // already set and a write of it) and then one node (the memset): what the driver charges
        // for the kinds of node a refit ordered among processes sharing a GPU needs.
        std::uint64_t* words = nullptr;  // the memset's and the memory operations' words
        const auto capture = [&](bool memory_ops) {
          cudaGraph_t captured = nullptr;
          cudaGraphExec_t exec = nullptr;
          if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess)
            return exec;
          bool shaped = true;
          try {
            if (memory_ops) {
              const cuda::StreamMemoryOp ops[] = {{words + 1, 0, true}, {words + 1, 0, false}};
              cuda::queue_stream_memory_ops(stream, ops,
                                            service.options().advanced.cuda_batch_memops);
            }
          } catch (const std::exception&) {  // the driver lacks them: no graph of that shape
            shaped = false;
          }
          cudaMemsetAsync(words, 0, 4, stream);
          if (cudaStreamEndCapture(stream, &captured) == cudaSuccess && shaped &&
              cudaGraphInstantiate(&exec, captured, 0) != cudaSuccess)
            exec = nullptr;
          if (captured != nullptr) cudaGraphDestroy(captured);
          return exec;
        };
        cudaGraphExec_t one_node = nullptr, shaped = nullptr;
        if (cudaMalloc(&words, 2 * sizeof(std::uint64_t)) == cudaSuccess &&
            cudaMemset(words, 0, 2 * sizeof(std::uint64_t)) == cudaSuccess) {
          one_node = capture(false);
          shaped = capture(true);
        }
        cudaGetLastError();
        // Each measured only where every PE has it (the measurement's barriers are collective).
        if (max_over_pes(*bootstrap, one_node == nullptr ? 1.0 : 0.0) == 0.0)
          time_launches([&] { cudaGraphLaunch(one_node, stream); }, floor_times);
        if (max_over_pes(*bootstrap, shaped == nullptr ? 1.0 : 0.0) == 0.0)
          time_launches([&] { cudaGraphLaunch(shaped, stream); }, shaped_floor_times);
        if (one_node != nullptr) cudaGraphExecDestroy(one_node);
        if (shaped != nullptr) cudaGraphExecDestroy(shaped);
        if (words != nullptr) cudaFree(words);
      }
      cudaStreamDestroy(stream);
    }
#endif
  }
  std::uint64_t my_source_bytes = 0;
  for (const auto& [name, tensor] : src) my_source_bytes += tensor.data.bytes;
  const auto source_shard = static_cast<std::int64_t>(max_over_pes(*bootstrap, my_source_bytes));

  // Wrong bytes in a sample of the BF16 destinations, the most on any PE.
  auto sampled_wrong_bytes = [&] {
    return max_over_pes(*bootstrap, tensors.sampled_wrong_bytes(*plan, me));
  };
  const std::uint64_t wrong = sampled_wrong_bytes();

  // PEs sharing a GPU (colocated, as RL jobs run trainer and engine): NCCL refuses them, so the
  // baseline is the copy loop frameworks write by hand.
  const std::vector<int> devices = gather_from_pes(*bootstrap, gpu ? service.device() : -1);
  const bool one_gpu =
      gpu && std::all_of(devices.begin(), devices.end(), [&](int d) { return d == devices[0]; });
  const bool shares_gpu =
      gpu && std::set<int>(devices.begin(), devices.end()).size() < devices.size();
  const int pes_per_gpu =
      gpu ? static_cast<int>(devices.size() / std::set<int>(devices.begin(), devices.end()).size())
          : 0;

  // The baseline on the same tensors and process group, its bytes checked the same way.
  std::string baseline_name = options.baseline;
  if (baseline_name == "auto") {
    const auto built = available_transports();
    const bool has_nccl = std::find(built.begin(), built.end(), "nccl") != built.end();
    baseline_name = shares_gpu && !transform ? "ipc-loop"
                    : gpu && !shares_gpu && has_nccl && service.transport_name() != "nccl" ? "nccl"
                                                                                           : "none";
  }
  double baseline_median = 0;
  std::uint64_t baseline_wrong = 0;
  if (baseline_name == "ipc-loop") {
#ifdef RESHARD_WITH_CUDA
    if (!gpu || transform) {
      throw_error(ErrorCode::kInvalidArgument,
                  "--baseline ipc-loop copies bf16 GPU tensors: use a GPU transport and no "
                  "--transform");
    }
    IpcCopyLoop loop(*bootstrap, *plan, src, dst);
    tensors.clear_destinations();
    baseline_median = time_each([&] { loop.run(); });
    baseline_wrong = sampled_wrong_bytes();
#else
    throw_error(ErrorCode::kInvalidArgument, "--baseline ipc-loop needs a CUDA build");
#endif
  } else if (baseline_name != "none") {
    const CopyServiceOptions baseline_options =
        bench_service_options(parse_transport_kind(baseline_name));
    if (baseline_name == "nccl" && me == 0 && !baseline_options.nccl.nonblocking)
      std::printf("(NCCL baseline with blocking calls: RESHARD_NCCL_NONBLOCKING=0 unless set)\n");
    CopyService baseline(bootstrap, baseline_options);
    baseline.init(LogLevel::kWarn);
    baseline_name = baseline.transport_name();
    tensors.clear_destinations();
    baseline_median = time_refits(baseline);
    baseline.finalize();
    baseline_wrong = sampled_wrong_bytes();
  }
  report = measured;

  double ceiling = 0;
#ifdef RESHARD_WITH_CUDA
  if (gpu) ceiling = copy_engine_ceiling_gbps(*bootstrap);
#endif
  const double busiest = plan->stats().lower_bound_bytes / median / 1e9;
  // Every PE on one GPU: no transfer can beat one process copying all the plan's bytes (local ones
  // too) at the device-to-device rate measured above.
  const double copy_ceiling_s =
      one_gpu && ceiling > 0 ? plan->stats().total_bytes / (ceiling * 1e9) : 0;
  bool mps = false;
#ifdef RESHARD_WITH_CUDA
  mps = shares_gpu && cuda::mps_server_found();
#endif

  const PlanStats& stats = plan->stats();
  if (me == 0) {
    const double remote = static_cast<double>(stats.total_bytes - stats.local_bytes);
    std::printf("refit: %s (%d layers, %s), %s -> %s on %d PEs, transport %s, transform %s\n",
                model.name.c_str(), model.layers, format_bytes(model.total_bytes()).c_str(),
                from.str().c_str(), to.str().c_str(), n, service.transport_name().c_str(),
                transform_name.c_str());
    std::printf(
        "  (a layout: tp, dp, pp, ep, etp = tensor, data, pipeline, expert and in-expert tensor "
        "parallel sizes; xN = N replicas side by side; @R = its first rank)\n");
    std::printf("  plan: %s\n", plan->summary().c_str());
    if (report.locally_converted_bytes > 0) {
      std::printf("  local ops converted in place while the transfer runs (PE 0): %s\n",
                  format_bytes(report.locally_converted_bytes).c_str());
    }
    // The busiest PE's bytes over the time: the rate at which the plan's lower bound was met.
    std::printf(
        "  median of %d refits: %.2f ms | %.1f GB/s over the links (all PEs) | busiest PE "
        "%.1f GB/s%s\n",
        options.iterations, median * 1e3, remote / median / 1e9, busiest,
        wrong ? "  WRONG BYTES" : "");
    if (baseline_median > 0) {
      std::printf(
          "  baseline %s in this run, same tensors: %.2f ms; speed-up of %s over it: %.2fx%s\n",
          baseline_name.c_str(), baseline_median * 1e3, service.transport_name().c_str(),
          baseline_median / median, baseline_wrong ? "  BASELINE WRONG BYTES" : "");
    }
    std::printf(
        "  median of %d reruns (rerun_reshard_plan: the same tensors, not checked again): %.2f "
        "ms",
        options.iterations, rerun_median * 1e3);
    if (baseline_median > 0) std::printf(", %.2fx the baseline", baseline_median / rerun_median);
    std::printf("\n  median of %d runs of the refit bound once (Refit::run): %.2f ms",
                options.iterations, bound_median * 1e3);
    if (baseline_median > 0) std::printf(", %.2fx the baseline", baseline_median / bound_median);
    std::printf("\n");
    if (graph_median > 0) {
      std::printf(
          "  median of %d replays of it captured in a CUDA graph (RefitGraph::replay, then the "
          "stream waited for): %.2f ms\n  host time of a launch (slowest PE's median; each PE's), "
          "right after another launch and cold (after a whole refit waited for, then a barrier):\n",
          options.iterations, graph_median * 1e3);
      const auto print_times = [](const char* what, const LaunchTimes& times) {
        if (times.warm <= 0) return;
        std::printf("    %s: %.1f us;", what, times.warm * 1e6);
        print_each_pe(times.warm_of_pe);
        std::printf("      cold %.1f us;", times.cold * 1e6);
        print_each_pe(times.cold_of_pe);
      };
      print_times("the replay (RefitGraph::replay)", replay_times);
      print_times("the driver's floor, a one-node graph (a 4-byte memset)", floor_times);
      print_times(
          "a graph of a delegating leader's shape (stream memory operations, then the memset)",
          shaped_floor_times);
    }
    std::printf(
        "  host time of each execute_reshard_plan before any work (slowest PE, median): checking "
        "the tensors %.3f ms, the PEs agreeing %.3f ms\n",
        check_median * 1e3, agree_median * 1e3);
    if (copy_ceiling_s > 0) {
      std::printf(
          "  %d PEs share one GPU (MPS %s): one process copying the same bytes at the "
          "device-to-device rate needs %.2f ms; %s at %.2f of that ceiling (reruns %.2f, bound "
          "runs %.2f)\n",
          n, mps ? "on" : "off", copy_ceiling_s * 1e3, service.transport_name().c_str(),
          copy_ceiling_s / median, copy_ceiling_s / rerun_median, copy_ceiling_s / bound_median);
    } else if (ceiling > 0) {
      std::printf(
          "  copy-engine ceiling in this run: %.1f GB/s (one GPU to one peer); busiest PE "
          "at %.2f of it\n",
          ceiling, busiest / ceiling);
    }
    if (gpu) {
      std::printf(
          "  device memory held by the refits beyond the tensors: %s per GPU (%.2fx an average "
          "PE's source shard per PE); strided slices in place %s, packed %s (PE 0)\n",
          format_bytes(static_cast<std::uint64_t>(std::max<std::int64_t>(0, extra_device_bytes)))
              .c_str(),
          source_shard > 0 ? static_cast<double>(extra_device_bytes) /
                                 (static_cast<double>(pes_per_gpu) * source_shard)
                           : 0.0,
          format_bytes(report.strided_bytes).c_str(), format_bytes(report.packed_bytes).c_str());
      std::printf("  staging held by PE 0: %s in %u phase(s)%s (budget %s)\n",
                  format_bytes(measured.staging_bytes).c_str(), measured.phases,
                  measured.pipelined ? ", pipelined (arrivals read beside the next transfer)" : "",
                  options.staging_budget.empty() ? "default" : options.staging_budget.c_str());
    }
    if (report.timing.prepare_seconds + report.timing.transfer_seconds +
            report.timing.finalize_seconds >
        0) {
      std::printf(
          "  last refit on PE 0, phases waited for: prepare %.2f ms, transfer %.2f ms, "
          "finalize %.2f ms (host queuing %.2f ms of it)\n",
          report.timing.prepare_seconds * 1e3, report.timing.transfer_seconds * 1e3,
          report.timing.finalize_seconds * 1e3, report.timing.issue_seconds * 1e3);
    }
    if (!options.json_path.empty()) {
      std::ofstream json(options.json_path, std::ios::app);
      json << "{\"bench\":\"refit\",\"date\":\"" << utc_date() << "\",\"versions\":\""
           << component_versions() << "\",\"device\":\"" << device_name() << "\",\"commit\":\""
           << options.commit << "\",\"engine\":\""
           << (service.transport_name() == "cuda" ? service.options().cuda.engine : "")
           << "\",\"model\":\"" << model.name << "\",\"layers\":" << model.layers << ",\"src\":\""
           << from.str() << "\",\"dst\":\"" << to.str() << "\",\"pes\":" << n << ",\"transport\":\""
           << service.transport_name() << "\",\"transform\":\""
           << (transform ? transform->name() : "none") << "\","
           << (transform && !only.empty() ? "\"transform_only\":\"" + only + "\"," : "")
           << "\"median_s\":" << median << ",\"rerun_median_s\":" << rerun_median
           << ",\"bound_median_s\":" << bound_median << ",\"check_median_s\":" << check_median
           << ",\"agree_median_s\":" << agree_median << ",\"total_bytes\":" << stats.total_bytes
           << ",\"local_bytes\":" << stats.local_bytes
           << ",\"locally_converted_bytes_pe0\":" << report.locally_converted_bytes
           << ",\"lower_bound_bytes\":" << stats.lower_bound_bytes
           << ",\"busiest_pe_gbps\":" << busiest << ",\"ce_ceiling_gbps\":" << ceiling;
      if (graph_median > 0) {
        json << ",\"graph_replay_median_s\":" << graph_median;
        const auto json_times = [&](const char* name, const LaunchTimes& times) {
          if (times.warm <= 0) return;
          json << ",\"graph_" << name << "_host_median_s\":" << times.warm << ",\"graph_" << name
               << "_cold_host_median_s\":" << times.cold;
        };
        json_times("replay", replay_times);
        json_times("floor", floor_times);
        json_times("shaped_floor", shaped_floor_times);
      }
      if (shares_gpu) {
        json << ",\"colocated\":true,\"mps\":" << (mps ? "true" : "false")
             << ",\"same_device_order\":\"" << service.options().cuda.same_device << "\"";
        json << ",\"batch_memops\":"
             << (service.options().advanced.cuda_batch_memops ? "true" : "false")
             << ",\"nvshmem_waits\":\"" << service.options().nvshmem.waits << "\""
             << ",\"front_end_waits\":"
             << (reshard::execution::ServiceSlot::waits_in_stream_front_end(service) ? "true"
                                                                                     : "false");
      }
      if (const auto nodes = service.options().node_size) json << ",\"node_size\":" << *nodes;
      if (copy_ceiling_s > 0) json << ",\"copy_ceiling_s\":" << copy_ceiling_s;
      if (gpu) {
        json << ",\"extra_device_bytes_per_gpu\":" << extra_device_bytes
             << ",\"pes_per_gpu\":" << pes_per_gpu
             << ",\"strided_bytes_pe0\":" << report.strided_bytes
             << ",\"packed_bytes_pe0\":" << report.packed_bytes
             << ",\"staging_bytes_pe0\":" << measured.staging_bytes
             << ",\"phases\":" << measured.phases
             << ",\"pipelined\":" << (measured.pipelined ? "true" : "false")
             << ",\"staging_budget\":\""
             << (options.staging_budget.empty() ? "default" : options.staging_budget) << "\""
             << ",\"quantize_colocated_on_sender\":"
             << (options.quantize_colocated_on_sender ? "true" : "false");
      }
      if (baseline_median > 0) {
        json << ",\"baseline\":\"" << baseline_name
             << "\",\"baseline_median_s\":" << baseline_median
             << ",\"baseline_wrong\":" << baseline_wrong;
      }
      json << ",\"wrong\":" << wrong << "}\n";
    }
  }
  return wrong + baseline_wrong;
}

namespace {

// Memory in use by this process and its GPU, for the soak's windows.
struct MemoryInUse {
  std::int64_t rss = 0;     // this process's resident set
  std::int64_t device = 0;  // this PE's GPU, all processes on it
  std::int64_t shm = 0;     // /dev/shm segments this process maps

  static MemoryInUse now([[maybe_unused]] int device) {
    MemoryInUse used;
    std::ifstream statm("/proc/self/statm");
    std::int64_t pages = 0, resident = 0;
    if (statm >> pages >> resident) used.rss = resident * sysconf(_SC_PAGESIZE);
    // Shared memory this process maps (/dev/shm segments, unlinked ones too): what it would
    // leak; /dev/shm as a whole holds other jobs' segments.
    std::ifstream maps("/proc/self/maps");
    for (std::string line; std::getline(maps, line);) {
      unsigned long begin = 0, end = 0;
      if (line.find(" /dev/shm/") != std::string::npos &&
          std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) == 2)
        used.shm += static_cast<std::int64_t>(end - begin);
    }
#ifdef RESHARD_WITH_CUDA
    if (device >= 0) {
      std::size_t free = 0, total = 0;
      cudaSetDevice(device);
      if (cudaMemGetInfo(&free, &total) == cudaSuccess)
        used.device = static_cast<std::int64_t>(total - free);
    }
#endif
    return used;
  }
};

}  // namespace

int run_soak_bench(std::shared_ptr<Bootstrap> bootstrap, const SoakBenchOptions& options) {
  const RefitBenchOptions& refit = options.refit;
  if (options.refits < options.window || options.window < 1) {
    throw_error(ErrorCode::kInvalidArgument,
                "bench-soak: --refits " + std::to_string(options.refits) +
                    " must hold at least one --window of " + std::to_string(options.window));
  }
  CopyService service(bootstrap, bench_service_options(refit.transport));
  service.init(LogLevel::kWarn);
  const PeId me = service.my_pe();
  const int n = service.n_pes();
  const bool gpu = service.transport_name() != "host";
  const int device = gpu ? service.device() : -1;
  const ModelSpec model = bench_model(refit, 16);
  const auto [from, to] = layouts_for(refit.model, n);
  auto plan = std::make_shared<const ReshardPlan>(
      make_reshard_plan(build_layout(model, from), build_layout(model, to)));
  const std::shared_ptr<ReshardTransform> transform =
      bench_transform(refit.transform, refit.transform_only);
  Progress progress("bench-soak", me == 0, std::chrono::seconds(10));
  RefitTensors tensors(*plan, transform.get(), me, gpu, progress);
  Refit bound(plan, tensors.src, tensors.dst, service, transform, bench_reshard_options(refit));

  struct Window {
    double median_s = 0;
    MemoryInUse used;
  };
  std::vector<Window> windows;
  std::uint64_t wrong = 0;
  std::vector<double> times;
  const std::string engine =
      service.transport_name() == "cuda" ? service.options().cuda.engine : "";
  std::ofstream json;
  if (me == 0 && !refit.json_path.empty()) json.open(refit.json_path, std::ios::app);
  auto record_head = [&] {
    std::ostringstream out;
    out << "\"date\":\"" << utc_date() << "\",\"commit\":\"" << refit.commit << "\",\"device\":\""
        << device_name() << "\",\"versions\":\"" << component_versions() << "\",\"model\":\""
        << model.name << "\",\"layers\":" << model.layers << ",\"pes\":" << n << ",\"transport\":\""
        << service.transport_name() << "\",\"engine\":\"" << engine << "\",\"transform\":\""
        << (transform ? transform->name() : "none") << "\"";
    return out.str();
  };
  if (me == 0) {
    std::printf(
        "soak: %s (%d layers), %s -> %s on %d PEs, transport %s%s%s, transform %s: %d "
        "refits in windows of %d after %d warm-up, checked every %d\n",
        model.name.c_str(), model.layers, from.str().c_str(), to.str().c_str(), n,
        service.transport_name().c_str(), engine.empty() ? "" : " engine ", engine.c_str(),
        transform ? transform->name().c_str() : "none", options.refits, options.window,
        options.warmup, options.verify_every);
    std::printf("%8s | %10s | %10s | %12s | %10s | %6s\n", "refits", "median ms", "RSS MiB",
                "device MiB", "shm MiB", "wrong");
  }
  for (int i = 0; i < options.warmup; ++i) bound.run();
  // One checked refit in the warm-up too: what checking allocates once (host copies of the
  // destinations) is then in the first window, not growth between windows.
  auto checked_refit = [&] {
    bootstrap->barrier();
    tensors.clear_destinations();
    bootstrap->barrier();
    bound.run();
    return max_over_pes(*bootstrap, tensors.sampled_wrong_bytes(*plan, me));
  };
  if (options.verify_every > 0) wrong += checked_refit();
  for (int i = 1; i <= options.refits; ++i) {
    const auto start = std::chrono::steady_clock::now();
    bound.run();
    times.push_back(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    // One more refit into cleared destinations, untimed, then a sample of them checked.
    if (options.verify_every > 0 && i % options.verify_every == 0) wrong += checked_refit();
    if (i % options.window != 0) continue;
    std::sort(times.begin(), times.end());
    Window window;
    window.median_s = max_over_pes(*bootstrap, times[times.size() / 2]);
    times.clear();
    const MemoryInUse used = MemoryInUse::now(device);
    window.used = {max_over_pes(*bootstrap, used.rss), max_over_pes(*bootstrap, used.device),
                   max_over_pes(*bootstrap, used.shm)};
    windows.push_back(window);
    progress.note("refit " + std::to_string(i) + " of " + std::to_string(options.refits));
    if (me == 0) {
      std::printf("%8d | %10.3f | %10.1f | %12.1f | %10.1f | %6llu\n", i, window.median_s * 1e3,
                  window.used.rss / 1048576.0, window.used.device / 1048576.0,
                  window.used.shm / 1048576.0, static_cast<unsigned long long>(wrong));
      if (json.is_open()) {
        json << "{\"bench\":\"soak_window\"," << record_head() << ",\"refits_done\":" << i
             << ",\"window\":" << options.window << ",\"median_s\":" << window.median_s
             << ",\"rss_bytes\":" << window.used.rss
             << ",\"device_used_bytes\":" << window.used.device
             << ",\"shm_used_bytes\":" << window.used.shm << ",\"wrong\":" << wrong << "}\n";
      }
    }
  }
  const Window& first = windows.front();
  const Window& last = windows.back();
  const double slowdown = last.median_s / first.median_s;
  const std::int64_t rss_growth = last.used.rss - first.used.rss;
  const std::int64_t device_growth = last.used.device - first.used.device;
  const std::int64_t shm_growth = last.used.shm - first.used.shm;
  int failed = 0;
  failed += slowdown > options.max_slowdown;
  failed += rss_growth > options.max_rss_growth;
  failed += device_growth > options.max_device_growth;
  failed += shm_growth > options.max_shm_growth;
  failed += wrong > 0;
  if (me == 0) {
    auto mib = [](std::int64_t bytes) { return bytes / 1048576.0; };
    std::printf(
        "last window / first: time %.3fx (at most %.2fx), RSS %+.1f MiB (at most %.1f), "
        "device %+.1f MiB (at most %.1f), /dev/shm %+.1f MiB (at most %.1f), wrong bytes "
        "%llu: %s\n",
        slowdown, options.max_slowdown, mib(rss_growth), mib(options.max_rss_growth),
        mib(device_growth), mib(options.max_device_growth), mib(shm_growth),
        mib(options.max_shm_growth), static_cast<unsigned long long>(wrong),
        failed == 0 ? "held" : "FAILED");
    if (json.is_open()) {
      json << "{\"bench\":\"soak\"," << record_head() << ",\"refits\":" << options.refits
           << ",\"window\":" << options.window << ",\"first_median_s\":" << first.median_s
           << ",\"last_median_s\":" << last.median_s << ",\"slowdown\":" << slowdown
           << ",\"rss_growth_bytes\":" << rss_growth << ",\"device_growth_bytes\":" << device_growth
           << ",\"shm_growth_bytes\":" << shm_growth << ",\"wrong\":" << wrong
           << ",\"passed\":" << (failed == 0 ? "true" : "false") << "}\n";
    }
  }
  return failed;
}

}  // namespace reshard::bench

// The reshard command line: `reshard bench` (the copy benchmark; launches its own processes when
// started outside a launcher; `reshard bench plot` draws results), `bench-gpu`, `bench-refit`,
// `bench-soak`, `bench-plan` and `bench-scheduler`.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/bench.hpp"
#include "bench/workloads.hpp"
#include "core/transport.hpp"
#include "launch/local_launcher.hpp"
#include "reshard/reshard.hpp"

namespace {

std::string self_executable(const char* argv0) {
  char path[4096];
  const ssize_t n = ::readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return argv0;
  path[n] = '\0';
  return path;
}

// The plotting script: installed beside the program (PREFIX/share/reshard), else in the sources
// this program was built from.
std::string plot_script(const char* argv0) {
  const std::filesystem::path installed =
      std::filesystem::path(self_executable(argv0)).parent_path().parent_path() / "share" /
      "reshard" / "plot_results.py";
  if (std::filesystem::exists(installed)) return installed.string();
  return RESHARD_SOURCE_DIR "/tools/bench/plot_results.py";
}

#ifdef RESHARD_WITH_CUDA
// The GPU benchmarks on a machine without a visible GPU: one sentence and status 1.
int no_gpu(const char* command) {
  std::fprintf(stderr,
               "reshard %s: no CUDA device is visible here (check CUDA_VISIBLE_DEVICES and the "
               "driver); the GPU benchmarks need one, `reshard bench` runs on the host\n",
               command);
  return 1;
}
#endif

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"reshard: move tensor shards between processes and GPUs", "reshard"};
  app.require_subcommand(1);
  app.option_defaults()->always_capture_default();  // --help shows every default
  app.set_version_flag("--version", reshard::component_versions());

  reshard::bench::CopyBenchOptions bench;
  bench.workloads = reshard::bench::workload_kinds();
  std::string size_text = "1MiB";
  std::string transport = "auto";
  int nprocs = 4;
  auto* bench_cmd = app.add_subcommand(
      "bench", "Run resharding workloads across processes, verify every byte, print a table");
  bench_cmd->add_option("-w,--workload", bench.workloads, "uniform, random, small, refit")
      ->delimiter(',')
      ->check(CLI::IsMember(reshard::bench::workload_kinds()));
  bench_cmd->add_option("-s,--size", size_text, "per-peer size (uniform), scale of the others");
  bench_cmd->add_option("-i,--iters", bench.iterations, "timed runs per workload")
      ->check(CLI::Range(1, 1000000));
  bench_cmd->add_option("--warmup", bench.warmup, "untimed runs first")->check(CLI::Range(0, 1000));
  bench_cmd
      ->add_option("-n,--np", nprocs,
                   "processes to start when not under reshard-run/torchrun/mpirun")
      ->check(CLI::Range(1, 1024));
  bench_cmd->add_option("-t,--transport", transport,
                        "auto or host: the workloads are in host memory, which only the host "
                        "transport moves (the GPU transports cuda, nvshmem and nccl: bench-gpu, "
                        "bench-refit)");
  bench_cmd->add_option("--seed", bench.seed, "workload seed");
  bench_cmd->add_option("--json", bench.json_path, "append results as JSON lines to this file");
  bench_cmd->add_flag("--verify", bench.verify,
                      "also time every workload in verify mode (checksums) and report its cost");

  std::vector<std::string> plot_inputs;
  std::string plot_out;  // default: beside the first results file
  auto* plot_cmd = bench_cmd->add_subcommand(
      "plot", "Draw PNG charts of benchmark results (JSON lines) with matplotlib");
  plot_cmd->add_option("results", plot_inputs, "JSON-lines result files")->required();
  plot_cmd->add_option("--out", plot_out,
                       "directory for the charts (default: the folder of the first results file)");

  reshard::bench::SchedulerBenchOptions sched;
  std::string chunk_text = "1MiB";
  auto* sched_cmd =
      app.add_subcommand("bench-scheduler", "Time the scheduler on a random workload on one core");
  sched_cmd->add_option("--requests", sched.requests, "number of requests");
  sched_cmd->add_option("--pes", sched.pes, "number of PEs")->check(CLI::Range(1, 1 << 20));
  sched_cmd->add_option("--chunk", chunk_text, "chunk size");
  sched_cmd->add_option("-k,--peers-per-round", sched.max_peers_per_round, "peers per PE per round")
      ->check(CLI::Range(1, 255));
  sched_cmd->add_option("--repeats", sched.repeats, "timed repetitions")->check(CLI::Range(1, 100));

  reshard::bench::RefitBenchOptions refit;
  std::string refit_transport = "auto";
  auto* refit_cmd = app.add_subcommand(
      "bench-refit", "Refit a model shape through the planner and executor; time vs lower bound");
  refit_cmd->add_option("-m,--model", refit.model, "llama3-8b or qwen3-30b-a3b")
      ->check(CLI::IsMember({"llama3-8b", "qwen3-30b-a3b"}));
  refit_cmd->add_option("--layers", refit.layers, "layers (default: the model's)")
      ->check(CLI::Range(0, 1000));
  refit_cmd
      ->add_option("--transform", refit.transform,
                   "none, mxfp8 (quantized by the sender: FP8 on the wire), mxfp8-receiver "
                   "(bf16 on the wire, quantized on arrival), fp8-block or fp8-block-receiver "
                   "(FP8 with a float scale per 128 x 128 tile)")
      ->check(
          CLI::IsMember({"none", "mxfp8", "mxfp8-receiver", "fp8-block", "fp8-block-receiver"}));
  refit_cmd->add_option(
      "--transform-only", refit.transform_only,
      "apply the transform only to parameters whose name contains this (e.g. "
      "'layers.': embeddings stay bf16, as DeepSeek-V3's FP8 checkpoints keep them)");
  refit_cmd->add_option("-t,--transport", refit_transport, "auto, host, cuda, nvshmem or nccl");
  refit_cmd
      ->add_option("--baseline", refit.baseline,
                   "timed after it on the same tensors: auto (ipc-loop where PEs share a GPU, "
                   "else nccl beside another GPU transport), none, ipc-loop (the per-block "
                   "cudaMemcpy2DAsync loop over CUDA IPC that frameworks write by hand), host, "
                   "cuda, nvshmem or nccl")
      ->check(CLI::IsMember({"auto", "none", "ipc-loop", "host", "cuda", "nvshmem", "nccl"}));
  refit_cmd->add_option("--staging-budget", refit.staging_budget,
                        "most staging memory per PE (e.g. 512MiB, 0, unlimited; default "
                        "RESHARD_STAGING_BUDGET, else 2GiB): larger refits run in phases");
  refit_cmd->add_flag("!--receiver-quantizes-colocated", refit.quantize_colocated_on_sender,
                      "transforms on arrival quantize on the receiver even between PEs on one GPU "
                      "(by default the sender does there: same bits, half the bytes)");
  refit_cmd->add_option("-i,--iters", refit.iterations, "timed refits")->check(CLI::Range(1, 1000));
  refit_cmd->add_option("--warmup", refit.warmup, "untimed refits first")
      ->check(CLI::Range(0, 100));
  refit_cmd->add_option("-n,--np", nprocs, "processes when not under a launcher");
  refit_cmd->add_option("--json", refit.json_path, "append the result as a JSON line");
  refit_cmd->add_option("--commit", refit.commit, "source revision recorded in the JSON line");

  reshard::bench::SoakBenchOptions soak;
  std::string soak_transport = "auto";
  auto* soak_cmd = app.add_subcommand(
      "bench-soak",
      "Run one bound model refit many times: time, host and device memory per window, checked");
  soak_cmd
      ->add_option("-m,--model", soak.refit.model,
                   "llama3-8b, qwen3-30b-a3b or toy (Llama-shaped, hidden size 512)")
      ->check(CLI::IsMember({"llama3-8b", "qwen3-30b-a3b", "toy"}));
  soak_cmd
      ->add_option("--layers", soak.refit.layers,
                   "layers (default: Llama-3-8B 16, Qwen3-30B-A3B 48, toy 4)")
      ->check(CLI::Range(0, 1000));
  soak_cmd
      ->add_option("--transform", soak.refit.transform,
                   "none, mxfp8, mxfp8-receiver, fp8-block or fp8-block-receiver")
      ->check(
          CLI::IsMember({"none", "mxfp8", "mxfp8-receiver", "fp8-block", "fp8-block-receiver"}));
  soak_cmd->add_option("-t,--transport", soak_transport, "auto, host, cuda, nvshmem or nccl");
  soak_cmd->add_option("--staging-budget", soak.refit.staging_budget,
                       "most staging memory per PE (default RESHARD_STAGING_BUDGET, else 2GiB)");
  soak_cmd->add_option("-r,--refits", soak.refits, "timed refits")->check(CLI::Range(1, 10000000));
  soak_cmd->add_option("-w,--window", soak.window, "refits per window (median, memory)")
      ->check(CLI::Range(1, 1000000));
  soak_cmd->add_option("--warmup", soak.warmup, "untimed refits first")
      ->check(CLI::Range(0, 100000));
  soak_cmd
      ->add_option("--verify-every", soak.verify_every,
                   "one more refit into cleared destinations, checked, every so many (0: never)")
      ->check(CLI::Range(0, 10000000));
  soak_cmd
      ->add_option("--max-slowdown", soak.max_slowdown,
                   "the last window's median over the first's that still passes")
      ->check(CLI::Range(1.0, 100.0));
  soak_cmd->add_option("-n,--np", nprocs, "processes when not under a launcher");
  soak_cmd->add_option("--json", soak.refit.json_path,
                       "append each window and the verdict as JSON lines");
  soak_cmd->add_option("--commit", soak.refit.commit, "source revision recorded in the JSON lines");

  reshard::bench::PlanBenchOptions plan;
  auto* plan_cmd = app.add_subcommand(
      "bench-plan", "Time the planner on a 1-trillion-parameter MoE layout change on one core");
  plan_cmd->add_option("--layers", plan.layers, "transformer layers")->check(CLI::Range(1, 1000));
  plan_cmd->add_option("--experts", plan.experts, "experts per layer")->check(CLI::Range(1, 4096));
  plan_cmd->add_option("--repeats", plan.repeats, "timed repetitions")->check(CLI::Range(1, 100));

  reshard::bench::ScaleBenchOptions scale;
  auto* scale_cmd = app.add_subcommand(
      "bench-scale",
      "Plan a 1T-parameter MoE refit for thousands of GPUs and estimate its time on HGX and NVL72 "
      "clusters");
  scale_cmd->add_option("--gpus", scale.total_gpus, "total GPUs per case (half train, half serve)")
      ->delimiter(',')
      ->check(CLI::Range(256, 1 << 20));
  scale_cmd
      ->add_option("--domains", scale.domains, "NVLink domain sizes: 8 (HGX) and/or 72 (NVL72)")
      ->delimiter(',')
      ->check(CLI::IsMember({8, 72}));
  scale_cmd->add_option("--wire", scale.wire, "bf16 or mxfp8")
      ->check(CLI::IsMember({"bf16", "mxfp8"}));
  scale_cmd->add_option("--layers", scale.layers, "transformer layers")->check(CLI::Range(1, 1000));
  scale_cmd->add_option("--experts", scale.experts, "experts per layer")
      ->check(CLI::Range(1, 4096));
  scale_cmd->add_flag("!--no-kimi", scale.kimi, "leave out the Kimi-K2 256 -> 128 reference case");

  reshard::bench::GpuBenchOptions gpu;
  std::vector<std::string> gpu_sizes = {"4KiB", "16KiB", "64KiB", "256KiB", "1MiB",
                                        "4MiB", "16MiB", "64MiB", "256MiB"};
  auto* gpu_cmd = app.add_subcommand(
      "bench-gpu",
      "All-to-all size sweep on the GPU transports, NCCL and the copy-engine ceiling side by side");
  gpu_cmd->add_option("-s,--sizes", gpu_sizes, "per-peer sizes")->delimiter(',');
  gpu_cmd
      ->add_option("-e,--engines", gpu.engines,
                   "sm, ce, auto, autotune (CUDA transport), nvshmem and nccl")
      ->delimiter(',')
      ->check(CLI::IsMember({"sm", "ce", "auto", "autotune", "nvshmem", "nccl"}));
  std::vector<std::string> gpu_workloads = reshard::bench::workload_kinds();
  gpu_workloads.push_back("all-to-all");
  gpu_cmd
      ->add_option("-w,--workloads", gpu.workloads,
                   "all-to-all (size sweep) and/or random, small, uniform, refit (at each size)")
      ->delimiter(',')
      ->check(CLI::IsMember(gpu_workloads));
  gpu_cmd->add_option("-n,--np", nprocs, "processes (one per GPU) when not under a launcher");
  gpu_cmd->add_option("--repeats", gpu.repeats, "timed repeats (median reported)")
      ->check(CLI::Range(1, 1000));
  gpu_cmd->add_option("--warmup", gpu.warmup, "untimed runs first")->check(CLI::Range(0, 1000));
  gpu_cmd->add_option("--max-iters", gpu.max_iterations, "most runs per timed repeat")
      ->check(CLI::Range(1, 100000));
  gpu_cmd->add_flag("--graph", gpu.graph,
                    "time CUDA-transport runs as replays of one captured run (CUDA graph)");
  gpu_cmd->add_option("--json", gpu.json_path, "append results as JSON lines to this file");
  gpu_cmd->add_option("--commit", gpu.commit, "source revision recorded in the JSON lines");

  reshard::bench::ConvertBenchOptions convert;
  std::vector<std::string> convert_layouts = {"contiguous", "column-block"};
  auto* convert_cmd = app.add_subcommand(
      "bench-convert",
      "Time the conversion kernels (MXFP8, block FP8, casts, pack/unpack) on one GPU against a "
      "device-to-device copy of the same bytes; check every result against the host reference");
  convert_cmd
      ->add_option("-s,--shapes", convert.shapes,
                   "ROWSxCOLS (one matrix) or ROWSxCOLSxCOUNT (that many in one launch)")
      ->delimiter(',');
  convert_cmd
      ->add_option("-m,--model", convert.model,
                   "also every weight matrix of this model in one launch: llama3-8b, "
                   "qwen3-30b-a3b or none")
      ->check(CLI::IsMember({"llama3-8b", "qwen3-30b-a3b", "none"}));
  convert_cmd->add_option("--layers", convert.layers, "the model's layers")
      ->check(CLI::Range(1, 1000));
  convert_cmd
      ->add_option("-c,--conversions", convert.conversions,
                   "mxfp8, mxfp8-round-up, mxfp8-megatron (Megatron-LM's scale rounding, scales "
                   "swizzled as its buffers keep them), fp8-block, cast-bf16-fp32, cast-fp32-bf16, "
                   "pack, unpack")
      ->delimiter(',')
      ->check(CLI::IsMember({"mxfp8", "mxfp8-round-up", "mxfp8-megatron", "fp8-block",
                             "cast-bf16-fp32", "cast-fp32-bf16", "pack", "unpack"}));
  convert_cmd
      ->add_option("--layouts", convert_layouts,
                   "contiguous (whole matrices) and/or column-block (their left half of the "
                   "columns: strided rows)")
      ->delimiter(',')
      ->check(CLI::IsMember({"contiguous", "column-block"}));
  convert_cmd->add_option("-i,--iters", convert.iterations, "conversions per timed repeat")
      ->check(CLI::Range(1, 100000));
  convert_cmd->add_option("--repeats", convert.repeats, "timed repeats (median reported)")
      ->check(CLI::Range(1, 1000));
  convert_cmd->add_option("--json", convert.json_path, "append results as JSON lines to this file");
  convert_cmd->add_option("--commit", convert.commit, "source revision recorded in the JSON lines");

  CLI11_PARSE(app, argc, argv);

  try {
    if (*plot_cmd) {
      // The drawing is Python (matplotlib): run the script that ships with the sources.
      std::vector<std::string> args = {"python3", plot_script(argv[0])};
      args.insert(args.end(), plot_inputs.begin(), plot_inputs.end());
      if (plot_out.empty()) {
        // Beside the records, never into the caller's working directory unasked.
        const std::string& first = plot_inputs.front();
        const auto slash = first.find_last_of('/');
        plot_out = slash == std::string::npos ? "." : first.substr(0, slash == 0 ? 1 : slash);
      }
      args.insert(args.end(), {"--out", plot_out});
      std::vector<char*> argv_plot;
      for (std::string& arg : args) argv_plot.push_back(arg.data());
      argv_plot.push_back(nullptr);
      ::execvp("python3", argv_plot.data());
      std::perror("reshard bench plot: cannot run python3");
      return 1;
    }
    if (*plan_cmd) {
      reshard::bench::run_plan_bench(plan);
      return 0;
    }
    if (*scale_cmd) {
      reshard::bench::run_scale_bench(scale);
      return 0;
    }
    if (*convert_cmd) {
#ifdef RESHARD_WITH_CUDA
      if (reshard::visible_cuda_devices() == 0) return no_gpu("bench-convert");
      convert.column_block.clear();
      for (const std::string& layout : convert_layouts)
        convert.column_block.push_back(layout == "column-block");
      const std::uint64_t wrong = reshard::bench::run_convert_bench(convert);
      if (wrong != 0) {
        std::fprintf(stderr, "reshard bench-convert: %llu bytes differ from the host reference\n",
                     static_cast<unsigned long long>(wrong));
        return 1;
      }
      return 0;
#else
      std::fprintf(stderr, "reshard bench-convert: this build has no CUDA\n");
      return 1;
#endif
    }
    if (*sched_cmd) {
      sched.chunk_bytes = reshard::parse_bytes(chunk_text);
      reshard::bench::run_scheduler_bench(sched);
      return 0;
    }
    bench.size = reshard::parse_bytes(size_text);
    if (*bench_cmd && bench.size == 0) {
      std::fprintf(stderr, "reshard bench: --size must be at least 1 byte\n");
      return 2;
    }
    // One process has no peer: every workload would move 0 bytes between PEs.
    const char* world = std::getenv("WORLD_SIZE");
    const int bench_pes = world != nullptr ? std::atoi(world) : nprocs;
    if (*bench_cmd && !*plot_cmd && bench_pes < 2) {
      std::fprintf(stderr,
                   "reshard bench: with one process nothing moves between processes; run it with "
                   "-n 2 or more\n");
      return 2;
    }
    bench.transport = reshard::parse_transport_kind(transport);
    for (const std::string& text : gpu_sizes) gpu.sizes.push_back(reshard::parse_bytes(text));
#ifdef RESHARD_WITH_CUDA
    // Before any process starts: one sentence, not a CUDA error from every rank.
    if (*gpu_cmd && reshard::visible_cuda_devices() == 0) return no_gpu("bench-gpu");
#endif
    const bool under_launcher = std::getenv("RANK") != nullptr ||
                                std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr ||
                                std::getenv("PMI_SIZE") != nullptr;
    if (!under_launcher && nprocs > 1) {
      reshard::LaunchOptions launch;
      launch.n_procs = nprocs;
      launch.name = "reshard";
      // One program to its user: rank 0 prints the tables, so its lines go out as they are;
      // other ranks' lines (warnings) keep their prefix.
      launch.output = [](const std::string& line, bool to_stderr) {
        static const std::string kRankZero = "[rank 0] ";
        const bool own = line.compare(0, kRankZero.size(), kRankZero) == 0;
        std::FILE* out = to_stderr ? stderr : stdout;
        std::fprintf(out, "%s\n", own ? line.c_str() + kRankZero.size() : line.c_str());
        std::fflush(out);
      };
      launch.command.push_back(self_executable(argv[0]));
      for (int i = 1; i < argc; ++i) launch.command.push_back(argv[i]);
      const reshard::LaunchResult result = reshard::launch_local(launch);
      if (result.exit_code != 0)
        std::fprintf(stderr, "reshard bench: %s\n", result.summary.c_str());
      return result.exit_code;
    }
    std::shared_ptr<reshard::Bootstrap> bootstrap = reshard::make_default_bootstrap();
    std::uint64_t wrong = 0;
    if (*refit_cmd) {
      refit.transport = reshard::parse_transport_kind(refit_transport);
      wrong = reshard::bench::run_refit_bench(bootstrap, refit);
    } else if (*soak_cmd) {
      soak.refit.transport = reshard::parse_transport_kind(soak_transport);
      const int failed = reshard::bench::run_soak_bench(bootstrap, soak);
      if (failed != 0) std::fprintf(stderr, "reshard bench-soak: %d check(s) failed\n", failed);
      return failed != 0 ? 1 : 0;
    } else if (*gpu_cmd) {
#ifdef RESHARD_WITH_CUDA
      wrong = reshard::bench::run_gpu_bench(bootstrap, gpu);
#else
      std::fprintf(stderr, "reshard bench-gpu: this build has no CUDA transport\n");
      return 1;
#endif
    } else {
      wrong = reshard::bench::run_copy_bench(bootstrap, bench);
    }
    if (wrong != 0) {
      std::fprintf(stderr, "reshard bench: %llu bytes were wrong\n",
                   static_cast<unsigned long long>(wrong));
      return 1;
    }
    return 0;
  } catch (const reshard::Error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return 1;
  }
}

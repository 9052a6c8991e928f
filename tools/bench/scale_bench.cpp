// `reshard bench-scale`: a 1-trillion-parameter MoE refit planned for thousands of GPUs and timed
// on paper (reshard/refit_model.hpp) for two cluster shapes, next to the published figure of the
// fastest system we know of (Kimi-K2, 256 -> 128 GPUs over RDMA in about 1.3 s).
#include <chrono>
#include <cstdio>
#include <memory>

#include "bench/bench.hpp"
#include "reshard/plan.hpp"
#include "reshard/refit_model.hpp"

namespace reshard::bench {
namespace {

constexpr double kPublishedKimiSeconds = 1.3;

ClusterShape cluster_for_domain(int domain) {
  ClusterShape shape;
  if (domain == 72) {
    // GB200 NVL72: 72 GPUs on NVLink (about 900 GB/s each way per GPU), 4 GPUs per tray, one
    // 400 Gb/s NIC per GPU.
    shape.nvlink_domain = 72;
    shape.nvlink_gbps = 900;
    shape.gpus_per_node = 4;
    shape.nics_per_node = 4;
  } else {
    // HGX H200: 8 GPUs on NVSwitch (390 GB/s measured each way), 8 x 400 Gb/s NICs per node.
    shape.nvlink_domain = domain;
    shape.gpus_per_node = 8;
    shape.nics_per_node = 8;
  }
  return shape;
}

struct Case {
  std::string name;
  Parallelism src, dst;
};

void report(const Case& c, const ModelSpec& model, const ScaleBenchOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  RefitModelOptions model_options;
  if (options.wire == "mxfp8") model_options.matrix_wire_ratio = 33.0 / 64.0;
  // Planned op by op: only the transfers the model needs are kept (16,384 GPUs fit).
  RefitTransfers planned =
      refit_transfers(build_layout(model, c.src), build_layout(model, c.dst), model_options);
  const double plan_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  for (std::size_t i = 0; i < options.domains.size(); ++i) {
    const int domain = options.domains[i];
    const ClusterShape shape = cluster_for_domain(domain);
    // The last shape takes the transfers; the others work on a copy.
    const RefitEstimate e =
        i + 1 == options.domains.size()
            ? estimate_refit(std::move(planned.transfers), planned.ranks, shape, model_options)
            : estimate_refit(planned.transfers, planned.ranks, shape, model_options);
    std::printf(
        "%-26s %5d -> %-5d %7d %8.1f s %10llu %10s %10s %10s %8.3f s %8.3f s %7u", c.name.c_str(),
        c.src.world(), c.dst.world(), domain, plan_s,
        static_cast<unsigned long long>(planned.stats.ops), format_bytes(e.network_bytes).c_str(),
        format_bytes(e.busiest_network_bytes).c_str(), format_bytes(e.busiest_nvlink_bytes).c_str(),
        e.lower_bound_s, e.scheduled_s, e.rounds);
    // The published figure is for the whole model: a model cut down by --layers or --experts is
    // not compared with it.
    const ScaleBenchOptions full{};
    const bool whole_model = options.layers == full.layers && options.experts == full.experts;
    if (c.name.rfind("kimi", 0) == 0 && whole_model) {
      std::printf("  (published: %.1f s; estimate / published = %.2f)", kPublishedKimiSeconds,
                  e.scheduled_s / kPublishedKimiSeconds);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}

}  // namespace

void run_scale_bench(const ScaleBenchOptions& options) {
  const ModelSpec model = moe_1t_model(options.layers, options.experts);
  std::printf("bench-scale: %s (%s in bf16), %s on the wire; trainer and engine on disjoint GPUs\n",
              model.name.c_str(), format_bytes(model.total_bytes()).c_str(), options.wire.c_str());
  std::printf("%-26s %13s %7s %10s %10s %10s %10s %10s %10s %10s %7s\n", "case", "GPUs", "domain",
              "plan", "ops", "net bytes", "net/GPU", "nvl/GPU", "bound", "scheduled", "rounds");
  std::vector<Case> cases;
  if (options.kimi) {
    // 256 trainer GPUs (PP 16, TP 8, DP 2, EP 16) -> 128 engine GPUs (8 x TP 16 / EP 16).
    cases.push_back({"kimi-k2 256 -> 128",
                     {.tp = 8, .dp = 2, .pp = 16, .ep = 16},
                     {.tp = 16, .replicas = 8, .ep = 16, .first_pe = 256}});
  }
  for (int total : options.total_gpus) {
    // Half trains (PP 16, TP 8, DP as needed, EP up to 64); half serves (replicas of TP 32 / EP
    // 32).
    const int trainer = total / 2, dp = std::max(1, trainer / 128);
    Parallelism src{.tp = 8, .dp = dp, .pp = 16, .ep = std::min(64, 8 * dp)};
    Parallelism dst{
        .tp = 32, .replicas = std::max(1, trainer / 32), .ep = 32, .first_pe = src.world()};
    cases.push_back({"1T MoE, " + std::to_string(src.world() + dst.world()) + " GPUs", src, dst});
  }
  for (const Case& c : cases) report(c, model, options);
  std::printf(
      "net/nvl per GPU: the busiest GPU's bytes over the network / NVLink (one direction); bound: "
      "the busiest link direction at full rate; scheduled: the scheduler's rounds (%d peers per "
      "GPU per round, 64 MiB batches) under the model, %.0f us per round. Model and assumptions: "
      "docs/performance.md.\n",
      RefitModelOptions{}.peers_per_round, ClusterShape{}.round_latency_s * 1e6);
}

}  // namespace reshard::bench

// `reshard bench-plan`: time make_reshard_plan on a trillion-parameter MoE re-layout on one core.
#include <chrono>
#include <cstdio>

#include "bench/bench.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/plan.hpp"

namespace reshard::bench {

double run_plan_bench(const PlanBenchOptions& options) {
  const ModelSpec model = moe_1t_model(options.layers, options.experts);
  auto seconds_since = [](auto start) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  auto start = std::chrono::steady_clock::now();
  auto src = std::make_shared<const Layout>(build_layout(model, options.src));
  auto dst = std::make_shared<const Layout>(build_layout(model, options.dst));
  const double build_s = seconds_since(start);
  double best = 1e30;
  ReshardPlan plan;
  for (int r = 0; r < options.repeats; ++r) {
    start = std::chrono::steady_clock::now();
    plan = make_reshard_plan(src, dst);
    best = std::min(best, seconds_since(start));
  }
  std::printf("plan: %s, %zu parameters, %s (bf16)\n", model.name.c_str(), model.params.size(),
              format_bytes(model.total_bytes()).c_str());
  std::printf("  source      %s: %d ranks, %zu shards\n", options.src.str().c_str(),
              options.src.world(), src->shards().size());
  std::printf("  destination %s: %d ranks, %zu shards\n", options.dst.str().c_str(),
              options.dst.world(), dst->shards().size());
  std::printf("  layouts built in %.3f s; make_reshard_plan best of %d: %.3f s on one core\n",
              build_s, options.repeats, best);
  std::printf("  %s\n", plan.summary().c_str());
  return best;
}

}  // namespace reshard::bench

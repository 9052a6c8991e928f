// The refit model (reshard/refit_model.hpp) on layouts whose answer is known by hand.
#include "reshard/refit_model.hpp"

#include <gtest/gtest.h>

#include <algorithm>

#include "reshard/error.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/plan.hpp"

namespace reshard {
namespace {

// TP 2 on ranks 0-1 to TP 2 on ranks 2-3: rank i + 2 receives exactly rank i's shard.
ReshardPlan mirrored_plan() {
  const ModelSpec model = toy_model(2, 256);
  auto src = std::make_shared<const Layout>(build_layout(model, {.tp = 2}));
  auto dst = std::make_shared<const Layout>(build_layout(model, {.tp = 2, .first_pe = 2}));
  return make_reshard_plan(src, dst);
}

std::uint64_t busiest(const ReshardPlan& plan) {
  std::uint64_t most = 0;
  for (std::size_t r = 0; r < plan.egress().size(); ++r)
    most = std::max({most, plan.egress()[r], plan.ingress()[r]});
  return most;
}

TEST(RefitModel, PairsAcrossDomainsTakeTheNetworkAtItsRate) {
  const ReshardPlan plan = mirrored_plan();
  ClusterShape cluster;
  cluster.nvlink_domain = 2;  // {0, 1} and {2, 3}: every byte crosses the network
  cluster.gpus_per_node = 2;
  const RefitEstimate e = estimate_refit(plan, cluster);
  EXPECT_EQ(e.ranks, 4);
  EXPECT_EQ(e.nvlink_bytes, 0u);
  EXPECT_EQ(e.network_bytes, plan.stats().total_bytes - plan.stats().local_bytes);
  EXPECT_EQ(e.busiest_network_bytes, busiest(plan));
  const double rate = cluster.network_gbps_per_gpu() * 1e9;
  EXPECT_NEAR(e.lower_bound_s, busiest(plan) / rate, 1e-12);
  // Disjoint pairs: every round moves one batch per pair, so the rounds add up to the bound.
  EXPECT_NEAR(e.scheduled_s - e.rounds * cluster.round_latency_s, e.lower_bound_s, 1e-9);
}

TEST(RefitModel, OneDomainMovesEverythingOverNvlink) {
  const ReshardPlan plan = mirrored_plan();
  ClusterShape cluster;
  cluster.nvlink_domain = 4;
  const RefitEstimate e = estimate_refit(plan, cluster);
  EXPECT_EQ(e.network_bytes, 0u);
  EXPECT_EQ(e.nvlink_bytes, plan.stats().total_bytes - plan.stats().local_bytes);
  EXPECT_NEAR(e.lower_bound_s, busiest(plan) / (cluster.nvlink_gbps * 1e9), 1e-12);
  EXPECT_GE(e.scheduled_s, e.lower_bound_s);
}

TEST(RefitModel, Fp8OnTheWireShrinksOnlyMatrices) {
  const ReshardPlan plan = mirrored_plan();
  ClusterShape cluster;
  cluster.nvlink_domain = 2;
  cluster.gpus_per_node = 2;
  const RefitEstimate bf16 = estimate_refit(plan, cluster);
  const RefitEstimate fp8 = estimate_refit(plan, cluster, {.matrix_wire_ratio = 33.0 / 64.0});
  std::uint64_t vectors = 0;  // 1-D parameters (norms) keep their bytes
  for (const TransferOp& op : plan.ops())
    if (!op.local() && plan.params()[op.param].shape.size() < 2) vectors += op.bytes;
  const double expected = (bf16.network_bytes - vectors) * 33.0 / 64.0 + vectors;
  EXPECT_NEAR(static_cast<double>(fp8.network_bytes), expected, plan.ops().size());
  EXPECT_LT(fp8.lower_bound_s, bf16.lower_bound_s);
}

// Planning op by op must give the plan make_reshard_plan keeps (same ops in the same order,
// same stats), and the model the same answer from either — with replicas to balance, MoE experts
// and a cluster where some bytes stay on NVLink.
TEST(RefitModel, OpByOpPlanningMatchesTheWholePlan) {
  const ModelSpec model = toy_model(3, 256, 8);
  const Layout src = build_layout(model, {.tp = 2, .dp = 2, .ep = 4});
  const Layout dst = build_layout(model, {.tp = 4, .replicas = 2, .ep = 2, .first_pe = 2});
  const ReshardPlan plan = make_reshard_plan(src, dst);
  std::vector<TransferOp> streamed;
  const PlanStats stats =
      for_each_reshard_op(src, dst, [&](const TransferOp& op) { streamed.push_back(op); });
  ASSERT_EQ(streamed.size(), plan.ops().size());
  for (std::size_t i = 0; i < streamed.size(); ++i) {
    EXPECT_EQ(streamed[i].task_id, plan.ops()[i].task_id) << "op " << i;
    EXPECT_EQ(streamed[i].src_pe, plan.ops()[i].src_pe) << "op " << i;
    EXPECT_EQ(streamed[i].dst_pe, plan.ops()[i].dst_pe) << "op " << i;
    EXPECT_EQ(streamed[i].bytes, plan.ops()[i].bytes) << "op " << i;
  }
  EXPECT_EQ(stats.total_bytes, plan.stats().total_bytes);
  EXPECT_EQ(stats.local_bytes, plan.stats().local_bytes);
  EXPECT_EQ(stats.lower_bound_bytes, plan.stats().lower_bound_bytes);
  ClusterShape cluster;
  cluster.nvlink_domain = 4;
  cluster.gpus_per_node = 4;
  const RefitModelOptions options{.matrix_wire_ratio = 33.0 / 64.0};
  const RefitEstimate whole = estimate_refit(plan, cluster, options);
  RefitTransfers planned = refit_transfers(src, dst, options);
  const RefitEstimate streamed_estimate =
      estimate_refit(std::move(planned.transfers), planned.ranks, cluster, options);
  EXPECT_GT(whole.nvlink_bytes, 0u);
  EXPECT_GT(whole.network_bytes, 0u);
  EXPECT_EQ(streamed_estimate.nvlink_bytes, whole.nvlink_bytes);
  EXPECT_EQ(streamed_estimate.network_bytes, whole.network_bytes);
  EXPECT_EQ(streamed_estimate.rounds, whole.rounds);
  EXPECT_DOUBLE_EQ(streamed_estimate.scheduled_s, whole.scheduled_s);
  EXPECT_DOUBLE_EQ(streamed_estimate.lower_bound_s, whole.lower_bound_s);
}

TEST(RefitModel, RefusesAClusterWithoutLinks) {
  const ReshardPlan plan = mirrored_plan();
  ClusterShape cluster;
  cluster.nvlink_gbps = 0;
  try {
    estimate_refit(plan, cluster);
    FAIL() << "a cluster without NVLink bandwidth was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(std::string(e.what()).find("link rates"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace reshard

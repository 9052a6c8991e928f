#include "reshard/refit_model.hpp"

#include <algorithm>
#include <array>
#include <vector>

#include "reshard/error.hpp"
#include "reshard/scheduler.hpp"

namespace reshard {
namespace {

bool is_16bit_float(DType dtype) { return dtype == DType::kBFloat16 || dtype == DType::kFloat16; }

// Per GPU, the bytes it moves over each link direction: NVLink out/in, network out/in.
using LinkBytes = std::array<double, 4>;

// The wire bytes of a non-local op: matrices of 16-bit floats at the transform's ratio.
std::uint64_t wire_bytes(const TransferOp& op, const ParamSpec& param,
                         const RefitModelOptions& options) {
  const double ratio =
      param.shape.size() >= 2 && is_16bit_float(param.dtype) ? options.matrix_wire_ratio : 1.0;
  const auto bytes = static_cast<std::uint64_t>(static_cast<double>(op.bytes) * ratio + 0.5);
  return std::max<std::uint64_t>(bytes, 1);
}

void check_cluster(const ClusterShape& cluster) {
  if (cluster.nvlink_domain < 1 || cluster.gpus_per_node < 1 || cluster.nvlink_gbps <= 0 ||
      cluster.network_gbps_per_gpu() <= 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "cluster shape: NVLink domain, GPUs per node and both link rates must be positive");
  }
}

}  // namespace

RefitTransfers refit_transfers(const Layout& src, const Layout& dst,
                               const RefitModelOptions& options) {
  RefitTransfers out;
  PeId top = std::max(src.max_pe(), dst.max_pe());
  out.stats = for_each_reshard_op(src, dst, [&](const TransferOp& op) {
    if (op.local()) return;
    out.transfers.push_back(
        {op.task_id, op.src_pe, op.dst_pe, wire_bytes(op, src.params()[op.param], options)});
  });
  out.ranks = top + 1;
  return out;
}

RefitEstimate estimate_refit(const ReshardPlan& plan, const ClusterShape& cluster,
                             const RefitModelOptions& options) {
  check_cluster(cluster);
  PeId top = 0;
  for (const TransferOp& op : plan.ops()) top = std::max({top, op.src_pe, op.dst_pe});
  std::vector<Transfer> transfers;
  transfers.reserve(plan.ops().size());
  for (const TransferOp& op : plan.ops()) {
    if (op.local()) continue;
    transfers.push_back(
        {op.task_id, op.src_pe, op.dst_pe, wire_bytes(op, plan.params()[op.param], options)});
  }
  return estimate_refit(std::move(transfers), top + 1, cluster, options);
}

RefitEstimate estimate_refit(std::vector<Transfer> transfers, int ranks,
                             const ClusterShape& cluster, const RefitModelOptions& options) {
  check_cluster(cluster);
  RefitEstimate estimate;
  estimate.ranks = ranks;
  std::sort(transfers.begin(), transfers.end(),
            [](const Transfer& a, const Transfer& b) { return a.task < b.task; });

  const double nvlink_rate = cluster.nvlink_gbps * 1e9;
  const double network_rate = cluster.network_gbps_per_gpu() * 1e9;
  std::vector<LinkBytes> total(estimate.ranks, LinkBytes{});
  // Adds a transfer to both ends' link bytes; true when it stays on NVLink.
  auto add = [&](std::vector<LinkBytes>& links, PeId src, PeId dst, double bytes) {
    const bool nvlink = cluster.domain_of(src) == cluster.domain_of(dst);
    links[src][nvlink ? 0 : 2] += bytes;
    links[dst][nvlink ? 1 : 3] += bytes;
    return nvlink;
  };
  for (const Transfer& t : transfers) {
    const bool nvlink = add(total, t.src, t.dst, static_cast<double>(t.bytes));
    (nvlink ? estimate.nvlink_bytes : estimate.network_bytes) += t.bytes;
  }
  auto link_time = [&](const LinkBytes& b) {
    return std::max(
        {b[0] / nvlink_rate, b[1] / nvlink_rate, b[2] / network_rate, b[3] / network_rate});
  };
  for (const LinkBytes& b : total) {
    estimate.lower_bound_s = std::max(estimate.lower_bound_s, link_time(b));
    estimate.busiest_nvlink_bytes =
        std::max(estimate.busiest_nvlink_bytes, static_cast<std::uint64_t>(std::max(b[0], b[1])));
    estimate.busiest_network_bytes =
        std::max(estimate.busiest_network_bytes, static_cast<std::uint64_t>(std::max(b[2], b[3])));
  }

  SchedulerOptions scheduler;
  scheduler.chunk_bytes = options.chunk_bytes;
  scheduler.min_chunk_bytes = std::min<std::uint64_t>(1 << 20, options.chunk_bytes);
  scheduler.max_peers_per_round = options.peers_per_round;
  const Schedule schedule = build_schedule(transfers, estimate.ranks, scheduler);
  estimate.rounds = schedule.rounds;
  // Batches come sorted by round: each round's link bytes, then its busiest direction.
  std::vector<LinkBytes> round_links(estimate.ranks, LinkBytes{});
  std::vector<PeId> touched;
  std::size_t next = 0;
  for (std::uint32_t round = 0; round < schedule.rounds; ++round) {
    for (; next < schedule.batches.size() && schedule.batches[next].round == round; ++next) {
      const Batch& batch = schedule.batches[next];
      add(round_links, batch.src, batch.dst, static_cast<double>(batch.bytes));
      touched.push_back(batch.src);
      touched.push_back(batch.dst);
    }
    double longest = 0;
    for (PeId rank : touched) {
      longest = std::max(longest, link_time(round_links[rank]));
      round_links[rank] = LinkBytes{};
    }
    touched.clear();
    estimate.scheduled_s += longest + cluster.round_latency_s;
  }
  return estimate;
}

}  // namespace reshard

// A refit on paper: how long a plan would take on a cluster of a given shape, from the plan's
// bytes, the scheduler's rounds and the links each byte crosses. It runs on one CPU, so plans for
// thousands of GPUs can be judged before any are booked (`reshard bench-scale`).
//
// The model: every GPU sends and receives over NVLink to the GPUs of its NVLink domain and over
// its share of the node's NICs to everyone else, both at once, each direction separately. A round
// of the schedule lasts as long as its busiest link direction on any GPU, plus a fixed latency;
// the refit lasts the sum of its rounds. Assumptions (no congestion inside the network, links
// reaching the given fraction of their line rate, senders not limited by the GPU's memory) are
// listed in docs/performance.md.
#pragma once

#include <cstdint>
#include <vector>

#include "reshard/plan.hpp"
#include "reshard/scheduler.hpp"

namespace reshard {

struct ClusterShape {
  int gpus_per_node = 8;
  int nvlink_domain = 8;     // GPUs sharing NVLink (8: an HGX node, 72: a GB200 NVL72 rack)
  double nvlink_gbps = 390;  // per GPU and direction, GB/s (H200 measured: 390-395)
  int nics_per_node = 8;
  double nic_gbit = 400;             // per NIC, Gbit/s
  double network_efficiency = 0.85;  // fraction of the NIC line rate transfers reach
  double round_latency_s = 25e-6;    // fixed cost of a round (signals, launches, network latency)

  double network_gbps_per_gpu() const {
    return nics_per_node * nic_gbit / 8 * network_efficiency / gpus_per_node;
  }
  int domain_of(PeId rank) const { return rank / nvlink_domain; }
};

struct RefitModelOptions {
  // Bytes on the wire per byte of the parameter for matrices (2-D or more) of 16-bit floats:
  // 1 for BF16, 33/64 for MXFP8 (one FP8 byte per element and a scale per 32).
  double matrix_wire_ratio = 1.0;
  std::uint64_t chunk_bytes = 64 << 20;  // the scheduler's largest batch
  int peers_per_round = 8;               // peers a GPU sends to (and receives from) per round
};

struct RefitEstimate {
  int ranks = 0;
  std::uint64_t nvlink_bytes = 0;           // crossing NVLink, whole job
  std::uint64_t network_bytes = 0;          // crossing the network, whole job
  std::uint64_t busiest_network_bytes = 0;  // max over GPUs and directions
  std::uint64_t busiest_nvlink_bytes = 0;
  double lower_bound_s = 0;  // busiest link direction at full rate, perfect overlap
  double scheduled_s = 0;    // the scheduler's rounds under the model
  std::uint32_t rounds = 0;
};

RefitEstimate estimate_refit(const ReshardPlan& plan, const ClusterShape& cluster,
                             const RefitModelOptions& options = {});

// The plan of `src` -> `dst` reduced to what the model needs: the non-local ops as transfers
// with their wire bytes (24 bytes each instead of a full op), planned op by op so plans of tens
// of millions of ops (16,384 GPUs) fit in memory. Reuse it for several cluster shapes.
struct RefitTransfers {
  std::vector<Transfer> transfers;
  int ranks = 0;
  PlanStats stats;
};
RefitTransfers refit_transfers(const Layout& src, const Layout& dst,
                               const RefitModelOptions& options = {});
// `transfers` with wire bytes among `ranks` GPUs (the overload above converts a plan's ops).
RefitEstimate estimate_refit(std::vector<Transfer> transfers, int ranks,
                             const ClusterShape& cluster, const RefitModelOptions& options = {});

}  // namespace reshard

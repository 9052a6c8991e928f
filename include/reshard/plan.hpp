// The reshard planner: two layouts in, the transfer operations that turn one into the other out.
// A pure, deterministic function of its inputs: every PE derives the same operations and task
// ids without talking to the others.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "reshard/layout.hpp"

namespace reshard {

// One block of one parameter moving from a source PE's tensor to a destination PE's tensor.
struct TransferOp {
  std::uint32_t param = 0;  // index into ReshardPlan::params()
  PeId src_pe = 0;
  PeId dst_pe = 0;
  Box region;        // the block in the full parameter
  Extents src_at{};  // its position in the source PE's local tensor
  Extents dst_at{};  // its position in the destination PE's local tensor
  std::uint64_t bytes = 0;
  // Shared by sender and receiver; depends only on the parameter, the destination PE and the
  // region, so adding a PE does not renumber the others. The low kSubTaskBits are zero: the
  // executor numbers an op's wire buffers there.
  TaskId task_id = 0;
  // Former names of src_pe and dst_pe, kept for one release; the planner fills them alike.
  PeId src_rank = 0;
  PeId dst_rank = 0;

  Box src_box() const;  // the block in the source PE's local tensor
  Box dst_box() const;
  bool local() const { return src_pe == dst_pe; }
};

constexpr int kSubTaskBits = 8;

struct PlanStats {
  std::uint64_t total_bytes = 0;  // every op
  std::uint64_t local_bytes = 0;  // ops whose source and destination PE are the same
  std::uint64_t max_egress_bytes = 0;
  std::uint64_t max_ingress_bytes = 0;
  // max over PEs of max(bytes sent, bytes received), local copies excluded: no transport can
  // finish the plan faster than this many bytes at one PE's link bandwidth.
  std::uint64_t lower_bound_bytes = 0;
  std::uint64_t ops = 0;
  std::uint64_t local_ops = 0;
};

struct PlanOptions {
  // Regions with several replica sources are split into this many bytes or more per part so the
  // replicas share the sending (0 = never split).
  std::uint64_t split_min_bytes = 1 << 20;
  // Split boundaries fall on multiples of this many rows of the first dimension (keeps 128x128
  // FP8 blocks and MX blocks whole).
  std::int64_t split_row_align = 128;
};

class ReshardPlan {
 public:
  const std::vector<ParamSpec>& params() const { return src_->params(); }
  const std::vector<TransferOp>& ops() const { return ops_; }
  const PlanStats& stats() const { return stats_; }
  const Layout& src_layout() const { return *src_; }
  const Layout& dst_layout() const { return *dst_; }
  // Distinct for distinct op lists; executors use it to know a schedule still fits the plan.
  std::uint64_t fingerprint() const { return fingerprint_; }
  // Per-PE bytes sent and received (local copies excluded), indexed by PE.
  const std::vector<std::uint64_t>& egress() const { return egress_; }
  const std::vector<std::uint64_t>& ingress() const { return ingress_; }
  std::string summary() const;  // one line: ops, bytes, lower bound

 private:
  friend ReshardPlan make_reshard_plan(std::shared_ptr<const Layout>, std::shared_ptr<const Layout>,
                                       const PlanOptions&);
  std::shared_ptr<const Layout> src_;
  std::shared_ptr<const Layout> dst_;
  std::vector<TransferOp> ops_;
  PlanStats stats_;
  std::vector<std::uint64_t> egress_;
  std::vector<std::uint64_t> ingress_;
  std::uint64_t fingerprint_ = 0;
};

// Every destination element gets exactly one source; an element with none, a parameter whose
// shape or dtype differ between the layouts, or destination pieces that overlap are refused with
// an error naming the parameter, PE and region. Among replicas, a source on the destination PE
// wins (a local copy); otherwise regions go to the replica with the least egress so far, largest
// first, splitting large ones across replicas.
ReshardPlan make_reshard_plan(std::shared_ptr<const Layout> src, std::shared_ptr<const Layout> dst,
                              const PlanOptions& options = {});
ReshardPlan make_reshard_plan(const Layout& src, const Layout& dst,
                              const PlanOptions& options = {});

// The same plan, op by op: each op goes to `sink` as it is made and none is kept (a plan for
// tens of thousands of GPUs holds tens of millions of ops). Returns the plan's stats.
PlanStats for_each_reshard_op(const Layout& src, const Layout& dst,
                              const std::function<void(const TransferOp&)>& sink,
                              const PlanOptions& options = {});

}  // namespace reshard

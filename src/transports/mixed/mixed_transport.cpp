// Mixed transport: one schedule, two transports. Batches between PEs of one node (an NVLink
// domain) go through the intra-node transport (CUDA IPC, or host shared memory), over a bootstrap
// of the node's PEs; batches between nodes go through the inter-node transport (NVSHMEM or NCCL)
// over every PE. On a CUDA stream the two run side by side: the intra-node part on a side stream
// forked from the caller's and joined back, so work queued after run() waits for both.
#include <algorithm>
#include <string>

#include "bootstrap/group_bootstrap.hpp"
#include "core/nodes.hpp"
#include "core/transport.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"

#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#endif

namespace reshard {
namespace {

class MixedTransport final : public Transport {
 public:
  MixedTransport(Bootstrap& bootstrap, const NodeMap& nodes, const TransportFactory& intra,
                 const TransportFactory& inter)
      : nodes_(nodes), me_(bootstrap.rank()), n_pes_(bootstrap.size()) {
    members_ = nodes_.members(nodes_.node_of[me_]);
    group_ = std::make_unique<GroupBootstrap>(bootstrap, members_);
    intra_ = intra(*group_);
    inter_ = inter(bootstrap);
    name_ = std::string(intra_->name()) + "+" + inter_->name();
#ifdef RESHARD_WITH_CUDA
    if (intra_->device() >= 0 && inter_->device() >= 0) {
      // Both parts may wait on the GPU for other PEs' kernels at once (the CUDA transport's flags,
      // NVSHMEM's or NCCL's): each gets its half of this PE's share of the GPU, counted over every
      // PE of the job (the node's bootstrap alone misses colocated PEs of other nodes). Without it,
      // four PEs sharing one GPU under MPS asked for three GPUs' worth of resident CTAs and spun
      // until the timeout (one H200, 2026-11-27).
      const int sharing = cuda::pes_on_this_gpu(bootstrap, intra_->device());
      intra_->limit_gpu_share(2 * sharing);
      inter_->limit_gpu_share(2 * sharing);
      // A part that waits in its stream's front end must not run beside the other part's stream
      // (see TransportCaps::front_end_waits): the parts take turns on the caller's stream.
      one_stream_ = intra_->caps().front_end_waits || inter_->caps().front_end_waits;
    }
    if (intra_->device() >= 0) {
      cuda::DeviceScope scope(intra_->device());
      RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&side_, cudaStreamNonBlocking));
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      RESHARD_CUDA_CHECK(cudaEventCreateWithFlags(&join_, cudaEventDisableTiming));
    }
#endif
    RESHARD_LOG(kInfo, "mixed transport: PE " << me_ << " in node " << nodes_.node_of[me_] << " of "
                                              << nodes_.nodes << " (" << members_.size()
                                              << " PEs), " << name_);
  }
  ~MixedTransport() override { finalize(); }

  const char* name() const override { return name_.c_str(); }

  TransportCaps caps() const override {
    const TransportCaps a = intra_->caps(), b = inter_->caps();
    // The intra-node transport's "every peer of my group" means no limit in the whole job.
    const int intra_peers =
        a.max_peers_per_round >= static_cast<int>(members_.size()) ? n_pes_ : a.max_peers_per_round;
    return {std::min(a.chunk_bytes, b.chunk_bytes), std::min(intra_peers, b.max_peers_per_round),
            std::min(a.min_chunk_bytes, b.min_chunk_bytes), a.strided_rows && b.strided_rows,
            a.front_end_waits || b.front_end_waits};
  }

  int device() const override { return intra_->device(); }

  void check_buffer(const Buffer& buffer) const override {
    intra_->check_buffer(buffer);
    inter_->check_buffer(buffer);
  }

  void schedule(std::span<const ExecutionPlan> phases) override {
    intra_plans_.clear();
    inter_plans_.clear();
    for (const ExecutionPlan& plan : phases) split(plan);
    in_node([&] { intra_->schedule(intra_plans_); });
    inter_->schedule(inter_plans_);
  }

  void run(const ExecutionPlan& /*plan*/, std::size_t phase, void* stream) override {
    const ExecutionPlan& intra_plan = intra_plans_.at(phase);
    const ExecutionPlan& inter_plan = inter_plans_.at(phase);
#ifdef RESHARD_WITH_CUDA
    if (stream != nullptr && side_ != nullptr && !one_stream_) {
      cuda::DeviceScope scope(intra_->device());
      auto caller = static_cast<cudaStream_t>(stream);
      RESHARD_CUDA_CHECK(cudaEventRecord(fork_, caller));
      // The inter-node part first: a transport that refuses this stream (NVSHMEM under graph
      // capture) then leaves no side stream joined to the caller's.
      part(*inter_, [&] { inter_->run(inter_plan, phase, caller); });
      RESHARD_CUDA_CHECK(cudaStreamWaitEvent(side_, fork_, 0));
      in_node([&] { intra_->run(intra_plan, phase, side_); });
      RESHARD_CUDA_CHECK(cudaEventRecord(join_, side_));
      RESHARD_CUDA_CHECK(cudaStreamWaitEvent(caller, join_, 0));
      return;
    }
#endif
    // In turn, node first: every PE finishes (or queues) its node's part before it starts the
    // inter-node part, so neither waits on a PE that is busy with the other.
    in_node([&] { intra_->run(intra_plan, phase, stream); });
    part(*inter_, [&] { inter_->run(inter_plan, phase, stream); });
  }

  void synchronize() override {
    in_node([&] { intra_->synchronize(); });
    part(*inter_, [&] { inter_->synchronize(); });
  }

  void forget_schedule() override {
    in_node([&] { intra_->forget_schedule(); });
    inter_->forget_schedule();
  }

  void abort(const std::string& reason) noexcept override {
    intra_->abort(reason);
    inter_->abort(reason);
  }

  // A run given up on a part is run again on both: each part's peers (this node's PEs, every
  // PE) learn of it from that part's own mark, and the meeting recovers both, node first, as
  // runs go. Retryable where the part that failed says so (a timeout on a live peer, a peer's
  // retry); the other part stopped where it was, which its recover() takes from.
  void offer_retry(const std::string& reason) noexcept override {
    intra_->offer_retry(reason);
    inter_->offer_retry(reason);
  }
  bool can_retry() const override { return failed_ != nullptr && failed_->can_retry(); }
  bool retry_requested() const override {
    return intra_->retry_requested() || inter_->retry_requested();
  }
  void recover() override {
    failed_ = nullptr;
    in_node([&] { intra_->recover(); });
    inter_->recover();
  }

  void finalize() noexcept override {
    if (finalized_) return;
    finalized_ = true;
    if (intra_) intra_->finalize();
    if (inter_) inter_->finalize();
#ifdef RESHARD_WITH_CUDA
    if (side_) cudaStreamDestroy(side_);
    if (fork_) cudaEventDestroy(fork_);
    if (join_) cudaEventDestroy(join_);
    side_ = nullptr;
    fork_ = join_ = nullptr;
#endif
  }

 private:
  // Runs `call` on part `which`, remembering the part that failed (can_retry() asks it).
  template <typename Call>
  void part(Transport& which, Call&& call) {
    try {
      call();
    } catch (...) {
      failed_ = &which;
      throw;
    }
  }

  // The intra-node transport numbers PEs within the node: its errors say which PEs those are.
  template <typename Call>
  void in_node(Call&& call) {
    try {
      part(*intra_, call);
    } catch (const Error& error) {
      std::string numbering;
      for (std::size_t i = 0; i < members_.size(); ++i) {
        numbering +=
            (i == 0 ? "" : ", ") + std::to_string(i) + " is PE " + std::to_string(members_[i]);
      }
      throw error.with_message(std::string(error.what()) + " [PE numbers of node " +
                               std::to_string(nodes_.node_of[me_]) + ": " + numbering + "]");
    }
  }

  // The plan's batches with PEs of this node, renumbered for the node's bootstrap, and the
  // local copies go to the intra-node transport's plan of the phase; the rest to the inter-node
  // one's.
  void split(const ExecutionPlan& plan) {
    ExecutionPlan& intra_plan = intra_plans_.emplace_back();
    ExecutionPlan& inter_plan = inter_plans_.emplace_back();
    intra_plan.rounds = inter_plan.rounds = plan.rounds;
    intra_plan.local_copies = plan.local_copies;
    auto route = [&](const PlannedBatch& batch, auto member) {
      const bool inside = nodes_.same_node(me_, batch.peer);
      ExecutionPlan& target = inside ? intra_plan : inter_plan;
      PlannedBatch copy = batch;
      if (inside) {
        copy.peer = static_cast<PeId>(
            std::lower_bound(members_.begin(), members_.end(), batch.peer) - members_.begin());
      }
      copy.first_span = static_cast<std::uint32_t>(target.spans.size());
      target.spans.insert(target.spans.end(), plan.spans.begin() + batch.first_span,
                          plan.spans.begin() + batch.first_span + batch.span_count);
      (target.*member).push_back(copy);
    };
    for (const PlannedBatch& batch : plan.sends) route(batch, &ExecutionPlan::sends);
    for (const PlannedBatch& batch : plan.receives) route(batch, &ExecutionPlan::receives);
  }

  NodeMap nodes_;
  int me_ = 0;
  int n_pes_ = 0;
  std::vector<int> members_;
  std::unique_ptr<GroupBootstrap> group_;
  std::unique_ptr<Transport> intra_, inter_;
  std::string name_;
  std::vector<ExecutionPlan> intra_plans_, inter_plans_;  // per phase
  Transport* failed_ = nullptr;                           // the part whose call threw last
  bool finalized_ = false;
#ifdef RESHARD_WITH_CUDA
  cudaStream_t side_ = nullptr;
  bool one_stream_ = false;  // the parts in turn on the caller's stream (front-end waits)
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
#endif
};

}  // namespace

std::unique_ptr<Transport> make_mixed_transport(Bootstrap& bootstrap, const NodeMap& nodes,
                                                const TransportFactory& intra,
                                                const TransportFactory& inter) {
  return std::make_unique<MixedTransport>(bootstrap, nodes, intra, inter);
}

}  // namespace reshard

// Executing a reshard plan on a copy service: register once, schedule once, run every refit.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "reshard/copy_service.hpp"
#include "reshard/plan.hpp"
#include "reshard/transform.hpp"

namespace reshard {

struct ReshardReport;
struct ReshardOptions;
namespace execution {
// execute_reshard_plan's executor on `service` for (plan, transform, options), run by
// Resharder::execute_as_prepared; nullopt (and nothing collective done) where the service keeps
// none or its schedule went. For the Python binding, which vouches for the tensors itself.
std::optional<ReshardReport> execute_as_prepared(const std::shared_ptr<const ReshardPlan>& plan,
                                                 CopyService& service,
                                                 const std::shared_ptr<ReshardTransform>& transform,
                                                 void* cuda_stream, const ReshardOptions& options);
}  // namespace execution

// This PE's local tensors by parameter name.
using TensorMap = std::unordered_map<std::string, LocalTensor>;

struct ReshardOptions {
  static constexpr std::uint64_t kUnlimited = UINT64_MAX;
  // 2 GiB, about 1.5% of an H200: at 512 MiB a refit quantizing on arrival ran in so many phases
  // that their handshakes cost 1.19x (Llama-3-8B) and 1.80x (Qwen3-30B-A3B) the bf16 refit on 2
  // H200s, at 2 GiB 1.04x and 1.06x (docs/performance.md).
  static constexpr std::uint64_t kDefaultStagingBudget = 2ull << 30;
  // Most bytes of staging one PE holds at once: the wire buffers of the built-in transforms
  // (FP8 data and scales, casts, bf16 landing before a conversion on arrival) and slices packed
  // for transports that do not move rows in place. A refit that needs more runs in phases, each
  // within the budget and reusing the same memory, one after the other. The memory stays with the
  // executor between refits (at most the budget). 0: no staging at all; kUnlimited: one phase, as
  // much as the refit needs. Unset: RESHARD_STAGING_BUDGET ("512MiB", "unlimited", ...). A budget
  // given either way is strict: a refit with a slice that alone needs more is refused before
  // anything moves, naming the slice. With neither, the budget is kDefaultStagingBudget, or the
  // largest slice's need where that is more. Every PE must use the same budget. A custom
  // transform's own wire buffers are its own and outside the budget.
  std::optional<std::uint64_t> staging_budget;
  // The built-in transforms that quantize on arrival (QuantizeSide::kReceiver) quantize on the
  // sender instead for ops between two PEs whose tensors are on the same GPU (colocated
  // processes): the same kernel on the same GPU writes the same bits, half the bytes move and no
  // bf16 landing buffer is needed. false: every op where the transform says. Every PE must agree.
  bool quantize_colocated_on_sender = true;
  // Tensors under names the plan does not have are refused before any byte moves (as PyTorch's
  // load_state_dict(strict=True) refuses them): an engine parameter the model spec lacks would
  // otherwise stay stale without a word. Checked when a refit is prepared and whenever a map
  // holds another number of tensors than the last one checked. true: such tensors are ignored.
  bool allow_unknown_names = false;
  // Parts of a refit that can run on their own (Refit::run with groups): the group of each of the
  // plan's parameters, by its index in ReshardPlan::params(); groups are numbered from 0, and
  // empty means one group. Each group's ops run in phases of their own, group after group (the
  // staging budget splits a group further where it must), so a run of some groups moves exactly
  // their parameters' bytes and touches no other destination. Every PE must give the same
  // groups. layer_groups() makes one group per layer.
  std::vector<std::uint32_t> param_groups;
};

// One group per transformer layer, for ReshardOptions::param_groups: parameters whose names hold
// a number as a dotted part ("decoder.layers.7.mlp.fc1.weight") are grouped by the name up to and
// including that number ("decoder.layers.7"); the others form "embeddings" (names containing
// "embed") and "head" (the rest: final norm, output layer). Groups are numbered in the order the
// plan first names them; `names`, where given, receives each group's name.
std::vector<std::uint32_t> layer_groups(const ReshardPlan& plan,
                                        std::vector<std::string>* names = nullptr);
// The same rule over parameter names (one group number per name).
std::vector<std::uint32_t> layer_groups(std::span<const std::string> params,
                                        std::vector<std::string>* names = nullptr);

// How long a refit's steps took on this PE: profiling, apart from what the refit did.
struct ReshardTimings {
  // Host time execute() spent before any work: checking each tensor (and a custom transform's
  // hooks) against the prepared refit, and the PEs agreeing whether it still holds; a run of a
  // prepared refit (Refit::run, rerun()) does neither (both 0 there). A MoE refit of thousands of
  // tensors spends most of its host time here.
  double check_seconds = 0, agree_seconds = 0;
  // With AdvancedOptions::step_timing (RESHARD_STEP_TIMING=1) only (each step is then waited for):
  // packing and send-side transforms, the copy service's run (with the local conversions beside
  // it), unpacking and receive-side transforms.
  double prepare_seconds = 0, transfer_seconds = 0, finalize_seconds = 0;
  double issue_seconds = 0;  // of those, the host's own time queuing the work
};

// What a refit did on this PE; `timing` says how long its steps took.
struct ReshardReport {
  // This call registered and scheduled: the first call, or new buffers on any PE (the PEs
  // agree on it, so all of them report it in the same refit).
  bool rescheduled = false;
  // On the wire from and to this PE, local copies excluded: what travels, e.g. FP8 data and
  // scales where a transform quantizes on the sender.
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t packed_bytes = 0;  // copied through staging because a slice was not contiguous
  // Slices that are not contiguous but travelled in place, row by row (no staging): all of them
  // on transports that move rows in place.
  std::uint64_t strided_bytes = 0;
  // Local ops (source and destination on this PE) that the transform converted straight into
  // the destination, beside the transfer: their bytes in the parameter's dtype.
  std::uint64_t locally_converted_bytes = 0;
  // Staging memory this PE holds for the refit (at most the budget: the largest phase), and the
  // phases the refit ran in (see ReshardOptions::staging_budget).
  std::uint64_t staging_bytes = 0;
  std::uint32_t phases = 1;
  // The phases alternated between two halves of the budget, each phase's unpacks and conversions
  // on arrival running on the GPU beside the next phase's transfer (a refit in phases on a GPU
  // where some PE reads staging after its bytes land, and every slice fits in half the budget).
  bool pipelined = false;
  // A built-in transform's conversions were queued as the last refit queued them, without calling
  // its hooks again (every refit after the first with the same tensors).
  bool conversions_replayed = false;
  ReshardTimings timing;
  // Deprecated, and gone in the next release: the timings under their former names, copies of
  // `timing`'s. (Not marked [[deprecated]]: GCC then warns wherever a report is made or copied.)
  double prepare_seconds = 0, transfer_seconds = 0, finalize_seconds = 0, issue_seconds = 0;
  double check_seconds = 0, agree_seconds = 0;
};

class Resharder {
 public:
  // The plan's PEs are the service's. The transform, if any, applies to the parameters it
  // selects with should_transform().
  Resharder(std::shared_ptr<const ReshardPlan> plan, CopyService& service,
            std::shared_ptr<ReshardTransform> transform = nullptr, ReshardOptions options = {});
  ~Resharder();
  Resharder(const Resharder&) = delete;
  Resharder& operator=(const Resharder&) = delete;

  // Collective: every PE calls it once per refit. Moves this PE's source slices into the
  // destination tensors of every PE. The first call (and any call whose tensors changed:
  // other pointers, sizes or dtypes) registers and schedules; later calls only run. Scheduling is
  // collective, so a refit with new tensors must pass them on every PE at once. With a CUDA
  // stream, packing, the transfers and the conversions are queued on it; otherwise the call returns
  // when the bytes have landed. Refused before any byte moves when a tensor is missing or too small
  // (naming it).
  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream = nullptr);
  // Collective: runs the refit the last execute() prepared again, with that call's tensors, as
  // CopyService::run() runs registered buffers: nothing is looked up or compared, and the PEs
  // do not agree on anything first, so every PE must call rerun() in the same refit, and the
  // tensors must still be where they were (the same allocations; their contents may change). A
  // refit of thousands of tensors saves the per-tensor checks of execute() (Qwen3-30B-A3B, 12
  // layers: about 1 ms a refit). Refused before any execute(), and after clear_requests() or
  // another plan's schedule on the service.
  ReshardReport rerun(void* cuda_stream = nullptr);
  // Collective: execute() with the tensors the last execute() prepared with, which the caller
  // vouches it was given again (the same buffers, dtypes and shapes): nothing is looked up or
  // compared, but the PEs agree as execute() does, so PEs with new tensors may call execute()
  // in the same refit (every PE then prepares again). Refused where nothing is prepared.
  ReshardReport execute_as_prepared(void* cuda_stream = nullptr);

  // Whether `options` ask for what this executor was made with (execute_reshard_plan makes a new
  // one otherwise).
  bool same_options(const ReshardOptions& options) const;

 private:
  // Whether the service still holds this executor's schedule.
  bool still_scheduled() const;
  friend class Refit;
  friend std::optional<ReshardReport> execution::execute_as_prepared(
      const std::shared_ptr<const ReshardPlan>&, CopyService&,
      const std::shared_ptr<ReshardTransform>&, void*, const ReshardOptions&);
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A refit bound once to its tensors, then run as often as needed: the fast path of a training
// loop. Construction is collective (every PE at once): it checks that every PE holds the
// same plan, checks each tensor against the plan's layouts, places the staging and schedules; a
// refusal on any PE is the same error on every PE, naming the PE and the cause, before
// anything is scheduled. The refit holds its tensor maps (their buffers stay the caller's: they
// must stay allocated while the refit may run them; Python's reshard.bind holds the tensors
// themselves), its executor, staging and streams, and frees them with itself. The service must
// outlive it, and holds one schedule: a second refit bound on the same service replaces this
// one's (run() then refuses); give each its own CopyService.
class Refit {
 public:
  Refit(std::shared_ptr<const ReshardPlan> plan, TensorMap src, TensorMap dst, CopyService& service,
        std::shared_ptr<ReshardTransform> transform = nullptr, const ReshardOptions& options = {},
        void* cuda_stream = nullptr);
  ~Refit();
  Refit(Refit&&) noexcept;
  Refit& operator=(Refit&&) noexcept;
  Refit(const Refit&) = delete;
  Refit& operator=(const Refit&) = delete;

  // Collective: moves every bound source slice into every PE's bound destination tensors. No
  // tensor is looked up or checked and no host collective runs: every PE must call run() in
  // the same refit (as CopyService::run()). With a CUDA stream the work is queued there and run()
  // returns at once (capturable in a CUDA graph); otherwise it returns when the bytes have landed,
  // after the work queued on the legacy default stream. Refused where the service no longer holds
  // this refit's schedule (clear_requests(), another refit or plan scheduled on it).
  ReshardReport run(void* cuda_stream = nullptr);
  // Collective: run() of only the given groups of ReshardOptions::param_groups (any order, each
  // once; they run in group order), bitwise what run() writes into their parameters' destinations
  // and nothing else. Every PE must run the same groups in the same calls.
  ReshardReport run(std::span<const std::uint32_t> groups, void* cuda_stream = nullptr);
  // How many groups the refit was bound with (1 without ReshardOptions::param_groups).
  std::uint32_t groups() const;
  // Collective: replaces the named tensors (names bound at construction; other tensors stay).
  // Where no PE's tensors differ from those bound (the same buffers, dtype and shape) this is
  // one small all-gather; otherwise every PE prepares and schedules again. A refusal on any
  // PE (an unknown name, a bad tensor) is the same error on every PE and leaves the refit as
  // it was; a failure while scheduling leaves it unusable until an update() succeeds.
  ReshardReport update(const TensorMap& src, const TensorMap& dst, void* cuda_stream = nullptr);

  // What binding (or the last update() that prepared again) prepared: bytes on the wire, staging
  // held, phases.
  const ReshardReport& report() const { return report_; }
  const TensorMap& sources() const;
  const TensorMap& destinations() const;
  CopyService& service() const;

 private:
  friend class RefitGraph;
  struct Impl;
  std::unique_ptr<Impl> impl_;
  ReshardReport report_;
};

// A bound refit's run(stream) captured once in a CUDA graph and replayed with one launch: the
// refit for the host time of a graph launch (the cuda transport; built-in conversions included).
// Capturing moves no bytes and waits for no peer, but the transport counts it as a run begun: every
// PE captures where the others do (the same point among its runs), and replays as it would run()
// (the same refits, in the same order, each ordered after its writes to the sources). A replay runs
// the tensors, staging and schedule the refit held at capture: once an update() scheduled it
// again or its service holds another schedule, replay() refuses (capture again). The refit must
// outlive its graphs (moving it is fine). Like a graph captured by hand, a replay is not followed
// by the copy service's watchdog: the kernels' own timeouts bound its waits.
class RefitGraph {
 public:
  // Captures on `cuda_stream` (a non-blocking stream of its own where null).
  explicit RefitGraph(Refit& refit, void* cuda_stream = nullptr);
  ~RefitGraph();
  RefitGraph(RefitGraph&&) noexcept;
  RefitGraph& operator=(RefitGraph&&) noexcept;
  RefitGraph(const RefitGraph&) = delete;
  RefitGraph& operator=(const RefitGraph&) = delete;

  // Queues the refit on `cuda_stream` (the legacy default stream where null) and returns at once.
  void replay(void* cuda_stream = nullptr);

 private:
  void release() noexcept;
  const Refit::Impl* refit_ = nullptr;  // stays where it is when the Refit is moved
  std::uint64_t schedule_ = 0;          // the refit's schedule it captured (Refit::Impl::schedules)
  int device_ = -1;
  void* graph_ = nullptr;  // cudaGraphExec_t
};

// One call per refit: keeps one Resharder on the service, for the last (plan, transform, options)
// executed there, so the next call with the same plan, buffers and options reuses the schedule
// (built-in transforms count as the same when they do the same: a fresh make_cast_transform at
// every call reuses it). Where any PE passes new tensors, every PE schedules again in that
// refit (one small all-gather per call decides). clear_requests() on the service drops it; a
// Refit is the same without the per-call check.
ReshardReport execute_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                   const TensorMap& src, const TensorMap& dst, CopyService& service,
                                   std::shared_ptr<ReshardTransform> transform = nullptr,
                                   void* cuda_stream = nullptr, const ReshardOptions& options = {});
// Resharder::rerun() of the executor execute_reshard_plan keeps on the service for (plan,
// transform): the last refit again, with the tensors it was given. Refused where there is none.
ReshardReport rerun_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                 CopyService& service,
                                 const std::shared_ptr<ReshardTransform>& transform = nullptr,
                                 void* cuda_stream = nullptr);

}  // namespace reshard

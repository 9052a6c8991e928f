// The executor's state (not installed): Resharder::Impl, whose member functions live in
// resharder.cpp (construction, the checks of plan, names and tensors, a refit's entry),
// preparation.cpp (once per set of tensors: this PE's sides of the plan's ops, their wire
// buffers, the staging phases, the copy service's schedule) and phase_runs.cpp (every refit: each
// phase's conversions, packs, transfer and unpacks, on a stream). Refit (refit.cpp) holds one.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/env.hpp"
#include "execution/staging.hpp"
#include "execution/tensor_identity.hpp"
#include "execution/verdicts.hpp"
#include "reshard/error.hpp"
#include "reshard/resharder.hpp"
#include "service/service_slot.hpp"
#include "transforms/conversions.hpp"
#include "transforms/wire_ranges.hpp"

namespace reshard {
namespace execution {

// One op as this PE takes part in it (as sender or receiver).
struct Side {
  const TransferOp* op = nullptr;
  const Shard* shard = nullptr;  // this PE's shard of the parameter
  bool transformed = false;
  std::uint32_t phase = 0;  // of the refit (Phase)
  std::vector<WireRange> wire;
  BoxView view;  // the slice in the local tensor (rows merged)
};

// A local op whose transform converts it in place (converts_locally): no wire, no request.
struct LocalSide {
  OpSlice from, to;  // the op's source and destination slices on this PE
};

// One phase of a refit (ReshardOptions::staging_budget): this PE's sides of its ops, and the
// packs and unpacks of their non-contiguous slices.
struct Phase {
  std::vector<std::size_t> sends, receives;  // indices into Prepared::sends / receives
  std::vector<std::size_t> locals;           // indices into Prepared::locals
  BlockCopyBatch packs, unpacks;
  // A built-in transform's conversions of the phase, as the first refit of the phase queued them
  // (send hooks and their flush; local conversions; receive hooks and theirs), and whether it ran.
  ConversionRecording sends_converted, locals_converted, receives_finalized;
  bool recorded = false;
};

}  // namespace execution

struct Resharder::Impl {
  using Side = execution::Side;
  using LocalSide = execution::LocalSide;
  using Phase = execution::Phase;
  using GpuAllocations = execution::GpuAllocations;
  using MapWalk = execution::MapWalk;
  using TensorIdentity = execution::TensorIdentity;

  std::shared_ptr<const ReshardPlan> plan;
  CopyService& service;
  std::shared_ptr<ReshardTransform> transform;
  execution::RangedTransform* ranged;      // the transform, where it is a built-in one
  std::optional<std::uint64_t> requested;  // the budget given (option, else environment)
  bool colocated_on_sender;                // ReshardOptions::quantize_colocated_on_sender
  bool allow_unknown_names;                // ReshardOptions::allow_unknown_names
  // ReshardOptions::param_groups (empty: one group), and how many groups that makes.
  std::vector<std::uint32_t> param_groups;
  std::uint32_t group_count = 1;
  // The plan's parameter names (for refusing tensors under others), and the sizes of the maps
  // whose names were last checked.
  std::unordered_set<std::string_view> plan_names;
  std::size_t names_checked_src = SIZE_MAX, names_checked_dst = SIZE_MAX;
  // Each PE's GPU (gpu_identity), where colocated_on_sender; else empty. Handed to the transform
  // at every refit: executors with other options may share it.
  std::vector<std::uint64_t> placement;
  std::uint64_t budget;  // requested, else the default
  PeId me;
  bool rows_in_place;  // strided slices travel in place (ServiceSlot::moves_rows_in_place)
  std::vector<const TransferOp*> send_ops, recv_ops;
  // The parameters this PE's ops touch, each once in op order: the sources (the first
  // `source_params`), then the destinations. Copies, side by side in memory: the per-refit check
  // reads them in turn (same_tensors_as_prepared).
  std::vector<std::string> param_names;
  std::size_t source_params = 0;
  // How many of this PE's ops send each source slice (parameter, then the box's offsets and
  // extents): more than one where replicas receive it.
  std::map<std::vector<std::int64_t>, int> sends_of_slice;
  std::unordered_map<TaskId, std::uint32_t> op_index;  // by task id
  execution::StagingPool staging;
  // This PE's sides of the ops, as registered and scheduled for `tensors`.
  struct Prepared {
    bool valid = false;
    std::vector<Side> sends, receives;
    std::vector<LocalSide> locals;
    int device = -1;                      // the GPU of the tensors (device_of)
    std::vector<bool> converted_locally;  // by op index in the plan
    std::vector<std::unique_ptr<Phase>> phases;
    // Each group's phases: [group_phases[g], group_phases[g + 1]).
    std::vector<std::uint32_t> group_phases;
    // The phases alternate between two staging regions (assign_phases): on a GPU, a phase's
    // unpacks and conversions on arrival run beside the next phase's transfer.
    bool pipelined = false;
    std::vector<LocalTensor> tensors;
    // The same, flat (TensorIdentity, shapes one after the other), for the per-refit check.
    std::vector<TensorIdentity> identities;
    std::vector<std::int64_t> shapes;
    GpuAllocations allocations;  // where the GPU tensors among them live
    // The maps as given, where each holds only tensors this PE's ops touch (a map of more is
    // checked by name: walking it would read tensors the refit does not use).
    MapWalk src_walk, dst_walk;
    ReshardReport report;  // the byte counts, the same at every refit
    // Every phase ran since the preparation, recording the built-in transform's conversions:
    // the next refits replay them instead of calling its hooks.
    bool conversions_recorded() const {
      return std::all_of(phases.begin(), phases.end(),
                         [](const std::unique_ptr<Phase>& phase) { return phase->recorded; });
    }
  } prepared;
  std::uint64_t registered_generation = UINT64_MAX;  // the service's, after our schedule
  void* own_stream = nullptr;
  int own_stream_device = -1;
  int loaded_kernels_on = -1;  // the GPU execution::cuda::load_kernels loaded them on
  // With local conversions on a GPU, the transfer runs on a stream of the highest priority,
  // ordered after the caller's (fork) and before the caller's later work (join), while the
  // conversions run on the caller's: the GPU's CTA scheduler then gives the transfer's kernels
  // the SMs they ask for first and the conversions the rest.
  void* transfer_stream = nullptr;
  void* transfer_fork = nullptr;
  void* transfer_join = nullptr;
  // A pipelined refit's (run_pipelined): recorded on the caller's stream once the last phase that
  // used each staging region has been read.
  void* region_read[2] = {nullptr, nullptr};
  int transfer_stream_device = -1;

  // ---- resharder.cpp: construction, the checks of plan, names and tensors, a refit's entry

  Impl(std::shared_ptr<const ReshardPlan> p, CopyService& s, std::shared_ptr<ReshardTransform> t,
       ReshardOptions o);
  ~Impl();

  // Refuses a tensor under a name the plan does not have (ReshardOptions::allow_unknown_names),
  // naming it; where `changed_only`, only maps of another size than those last checked.
  void check_names(const TensorMap& src, const TensorMap& dst, bool changed_only);

  // A built-in transform converts through per-refit state (queues, recordings, placement): the
  // executor converts with a copy of its own, so the caller's object stays a description that
  // any number of refits (and threads) may share. A custom transform is used as given.
  static std::shared_ptr<ReshardTransform> own_instance(std::shared_ptr<ReshardTransform> given) {
    const auto* ranged = dynamic_cast<const execution::RangedTransform*>(given.get());
    return ranged != nullptr ? ranged->fresh_copy() : given;
  }

  std::vector<std::vector<std::byte>> gather_verdicts(std::span<const std::byte> mine,
                                                      const std::exception_ptr& failure,
                                                      const char* meeting = nullptr) {
    return execution::gather_verdicts(service, mine, failure, meeting);
  }

  // Collective: PEs that built different plans (from different layouts) would register task
  // ids that match nothing; say so plainly instead, naming the PEs and the first parameter
  // whose transfers differ.
  // The same all-gather says where every PE's GPU is (`placement`).
  void check_same_plan_everywhere();

  // This PE's GPU as every process on the machine names it (cuda::physical_gpu, hashed);
  // 0 on the host transport.
  std::uint64_t gpu_identity() const;

  static std::vector<std::int64_t> slice_key(const TransferOp& op);

  bool transforms(const TransferOp& op) const {
    return transform && transform->should_transform(plan->params()[op.param]);
  }

  const LocalTensor& tensor_for(const TensorMap& tensors, const Layout& layout,
                                const TransferOp& op, bool sending, const Shard*& shard) const;

  // Names the parameter, region and wire buffer behind each task id a validation error lists.
  std::string explain(const Error& error) const;

  static std::optional<std::uint64_t> requested_budget(const ReshardOptions& options) {
    return options.staging_budget ? options.staging_budget : env::staging_budget();
  }

  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream);

  // execute() of `src` and `dst`, or, where they are null, of the tensors the last call prepared
  // with, which the caller vouches it was given again (execute_as_prepared): then nothing is
  // looked up or compared here, and the maps are made of the prepared tensors only where
  // something reads them (a custom transform's hooks, or a preparation that another PE's new
  // tensors make every PE run).
  ReshardReport execute(const TensorMap* given_src, const TensorMap* given_dst, void* cuda_stream);

  // The tensors the last preparation took, as maps (what a custom transform's hooks and a
  // preparation read) into `src` and `dst`.
  void maps_of_prepared(TensorMap& src, TensorMap& dst) const {
    for (std::size_t i = 0; i < param_names.size(); ++i)
      map_of(i, src, dst).emplace(param_names[i], prepared.tensors[i]);
  }

  // Whether the refit prepared last is still the service's schedule.
  bool still_scheduled() const {
    return prepared.valid && execution::ServiceSlot::generation(service) == registered_generation;
  }

  // The prepared refit again, with `src` and `dst` (the prepared tensors, as a bound Refit holds
  // them), or, where null, the tensors the last execute() prepared with (Resharder::rerun).
  // Where `groups` is given, only those groups' phases (Refit::run with groups).
  static ReshardReport& with_former_timing_names(ReshardReport& report);
  ReshardReport rerun(void* cuda_stream, const TensorMap* bound_src = nullptr,
                      const TensorMap* bound_dst = nullptr,
                      std::span<const std::uint32_t>* groups = nullptr);

  // `op` as errors name it: its parameter, region and PEs.
  static std::string where(const ReshardPlan& plan, const TransferOp& op);

  // ---- preparation.cpp: once per set of tensors

  std::uint32_t group_of(const TransferOp& op) const {
    return param_groups.empty() ? 0 : param_groups[op.param];
  }

  // The wire buffers the transform returns for a transformed side (its hooks run at every refit:
  // the sender's converts the data now).
  std::vector<execution::WireRange> transform_wire(const Side& side, const LocalTensor& tensor,
                                                   bool sending, void* stream);

  // How this PE takes part in `op`: its wire buffers, and the pack (sending) or unpack
  // (receiving) a non-contiguous slice needs, added to `copies`. While the pool is sizing, a
  // custom transform's hooks are not called (its wire buffers are its own, outside the budget).
  Side prepare_side(const TransferOp& op, const TensorMap& tensors, bool sending, void* stream,
                    execution::BlockCopyBatch& copies, ReshardReport& report);

  // The bytes a side puts on the wire or takes from it: what the transform made of the op (FP8
  // data and scales by the sender, say), the op's own bytes without one.
  static std::uint64_t wire_bytes(const Side& side) {
    std::uint64_t bytes = 0;
    for (const execution::WireRange& w : side.wire) bytes += w.range.bytes();
    return bytes;
  }

  // A local op of a transformed parameter that the transform converts in place: recorded in
  // prepared.locals (checked by the transform now, before the schedule).
  bool converts_locally(const TransferOp& op, const TensorMap& src, const TensorMap& dst);

  void register_and_schedule(const std::vector<Side>& sends, const std::vector<Side>& receives);

  // Where param_names[i] is looked up: `src` for the sources, `dst` for the destinations.
  template <typename Map>
  Map& map_of(std::size_t i, Map& src, Map& dst) const {
    return i < source_params ? src : dst;
  }

  // What a prepared refit depends on: every tensor this PE's ops touch (param_names' order).
  std::vector<LocalTensor> tensors_used(const TensorMap& src, const TensorMap& dst) const;

  // Whether `src` and `dst` hold, for every tensor this PE's ops touch, what the prepared
  // refit was prepared for: a walk of maps kept (or built again alike) beside a record of them,
  // else one lookup each; nothing copied. A MoE refit checks thousands at every refit
  // (Qwen3-30B-A3B, 12 layers: 4,782 a PE; rerun() skips them): on one H200's host 0.1-0.2 ms
  // walked, 0.5-0.7 ms looked up, against a transfer of 8-9 ms. (Shares of the lookups on helper
  // threads made no difference on one H100 with 4 PEs, 2026-11-27.)
  bool same_tensors_as_prepared(const TensorMap& src, const TensorMap& dst) const;

  // Whether a transform's hooks returned the wire buffers a side was scheduled with.
  static bool same_wire(const std::vector<execution::WireRange>& a,
                        const std::vector<execution::WireRange>& b);

  // Re-runs a custom transform's hooks of a prepared refit; false when it returned other wire
  // buffers than those scheduled (the refit is then prepared again). A built-in transform's
  // send hooks run phase by phase instead (convert_sends), and its buffers are the pool's.
  // Where `phases` is given, only the sides of the phases it marks.
  bool rerun_transforms(const TensorMap& src, const TensorMap& dst, void* stream,
                        const std::vector<bool>* phases = nullptr);

  // Collective: whether `mine` holds on every PE (gather_verdicts: a PE's `failure` throws on
  // every PE).
  bool all_ranks_agree(bool mine, const std::exception_ptr& failure = nullptr,
                       const char* meeting = nullptr);

  // Collective: which phase each op of the plan runs in, the same on every PE. Every PE
  // says what staging each of its ops needs (`sized`: bytes per (sending, op task id)) and which
  // ops share another's conversion (`leaders`); every PE then computes the same
  // execution::assign_phases of it (a unit that alone needs more than a budget the caller gave is
  // refused on every PE alike). Records each group's first phase in prepared.group_phases.
  // Carries each PE's verdict on its own preparation so far (gather_verdicts), and refuses
  // budgets or groups that differ between PEs.
  std::vector<std::uint32_t> assign_phases(
      const std::map<execution::StagingPool::OpKey, std::size_t>& sized,
      const std::map<std::uint32_t, std::uint32_t>& leaders, const std::exception_ptr& failure);

  // A digest of param_groups, which every PE must give alike (FNV-1a).
  std::uint64_t groups_digest() const {
    std::uint64_t digest = 1469598103934665603ull;
    for (std::uint32_t g : param_groups) digest = (digest ^ g) * 1099511628211ull;
    return digest;
  }

  // Collective: prepares this PE's sides for `src` and `dst`: checks that every PE holds the
  // same plan, sizes the staging every op needs (the hooks run dry), agrees on the phases with
  // the other PEs, places the staging, takes each side's wire buffers from there, phase by
  // phase as the refits run them, and schedules. A refusal found on one PE (a missing or bad
  // tensor, a transform's hook) stops every PE alike before anything is scheduled
  // (gather_verdicts).
  void prepare(const TensorMap& src, const TensorMap& dst, void* stream, ReshardReport& report);

  // ---- phase_runs.cpp: every refit

  // The GPU of the first GPU tensor (a PE's tensors are on one), or -1 where there is none.
  static int device_of(const TensorMap& src, const TensorMap& dst);

  // The stream a refit runs on: the caller's, else this executor's own on `device` (none for
  // host tensors, device < 0).
  void* stream_on(int device, void* cuda_stream);

#ifdef RESHARD_WITH_CUDA
  // Waits for this executor's own stream, where a refit without the caller's stream ran. The
  // transfers on it wait for peers, so they are waited for first through the copy service, whose
  // wait notices a peer that exited or stopped and gives up at the service's timeout; what is
  // queued after them (unpacks, conversions on arrival) is local and always ends.
  void wait_for_own_stream(void* stream);
#endif

  // Runs `hooks`, which queue a transform's conversions and flush them on `stream`; for a
  // built-in transform, recording its queue calls into `recording`, or, with `replay`, making the
  // recorded calls again instead. The hooks' outcome depends only on the plan, the tensors'
  // buffers, the staging and the placement, which stay the same from the recording refit on.
  template <typename Hooks>
  void convert_or_replay(execution::ConversionRecording& recording, bool replay, void* stream,
                         Hooks&& hooks) {
    if (replay) return recording.replay(stream);
    if (ranged == nullptr) return hooks();
    struct Recording {
      execution::RangedTransform* transform;
      ~Recording() { transform->record_conversions(nullptr); }
    } scope{ranged};
    recording.clear();
    ranged->record_conversions(&recording);
    hooks();
  }

  // Queues the phase's local ops' conversions on `stream`.
  void convert_locals(Phase& phase, const TensorMap& src, const TensorMap& dst, void* stream,
                      bool replay);

  // Runs the copy service's phase `p` and the phase's local ops' conversions side by side: the
  // transfer on the high-priority stream where there are conversions on a GPU, on `stream`
  // otherwise.
  void transfer_and_convert_locals(std::uint32_t p, const TensorMap& src, const TensorMap& dst,
                                   void* stream, bool replay);

#ifdef RESHARD_WITH_CUDA
  // The high-priority stream and its events, on the tensors' GPU.
  void use_transfer_stream();
#endif

#ifdef RESHARD_WITH_CUDA
  void destroy_transfer_stream();
#endif

#ifdef RESHARD_WITH_CUDA
  // A pipelined refit (Prepared::pipelined) of the phases `chosen` marks (all where null): each
  // phase's send-side conversions, packs and transfer on the high-priority stream, its local
  // conversions, unpacks and conversions on arrival on `stream`, after its bytes landed; so a
  // phase's arrivals are read while the next phase's bytes land in the other staging region. A
  // phase writes a region (its own conversions, and peers, whose copies into this PE's memory
  // wait until its transfer starts here) only once the last phase that used the region has been
  // read. `stream` ends after all of it.
  void run_pipelined(const TensorMap& src, const TensorMap& dst, void* stream,
                     const std::vector<bool>* chosen, bool& replayed);
#endif

  // With AdvancedOptions::step_timing, waits for the work queued so far and adds the time since the
  // last mark to `phase`.
  struct PhaseClock {
    bool enabled = false;
    void* stream = nullptr;
    double* issued = nullptr;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void mark(double& phase) {
      if (!enabled) return;
      *issued += std::chrono::duration<double>(std::chrono::steady_clock::now() - last).count();
#ifdef RESHARD_WITH_CUDA
      if (stream != nullptr) execution::cuda::synchronize_stream(stream);
#endif
      const auto now = std::chrono::steady_clock::now();
      phase += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  // A built-in transform's send hooks for the phase's ops: they queue the conversions into the
  // phase's wire buffers, which are those prepared (the pool hands each op the same ones).
  void convert_sends(const Phase& phase, const TensorMap& src, void* stream);

  void finalize_receives(const Phase& phase, const TensorMap& dst, void* stream);

  // The prepared refit's phases (those `chosen` marks, where given) on `stream` (the caller's
  // `cuda_stream`, or this executor's own, then waited for).
  void run_phases(const TensorMap& src, const TensorMap& dst, void* stream, void* cuda_stream,
                  PhaseClock& clock, ReshardReport& report, const std::vector<bool>* chosen);
};

}  // namespace reshard

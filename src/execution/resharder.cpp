// The executor: turns this rank's share of a reshard plan into copy-service requests once, then
// only packs, runs and unpacks at every refit.
#include "reshard/resharder.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_set>

#include "core/env.hpp"
#include "core/message.hpp"
#include "execution/phase_assignment.hpp"
#include "execution/staging.hpp"
#include "execution/task_ids.hpp"
#include "execution/tensor_identity.hpp"
#include "execution/verdicts.hpp"
#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_device.hpp"
#endif
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "service/service_slot.hpp"
#include "transforms/conversions.hpp"
#include "transforms/wire_ranges.hpp"

namespace reshard {
namespace {

using execution::GpuAllocations;
using execution::MapWalk;
using execution::TensorIdentity;
using execution::wire_task;

// One op as this rank takes part in it (as sender or receiver).
struct Side {
  const TransferOp* op = nullptr;
  const Shard* shard = nullptr;  // this rank's shard of the parameter
  bool transformed = false;
  std::uint32_t phase = 0;  // of the refit (Phase)
  std::vector<execution::WireRange> wire;
  execution::BoxView view;  // the slice in the local tensor (rows merged)
};

// A local op whose transform converts it in place (converts_locally): no wire, no request.
struct LocalSide {
  OpSlice from, to;  // the op's source and destination slices on this rank
};

std::string where(const ReshardPlan& plan, const TransferOp& op) {
  std::ostringstream text;
  text << "'" << plan.params()[op.param].name << "' " << op.region.str() << " (rank " << op.src_rank
       << " -> rank " << op.dst_rank << ")";
  return text.str();
}

}  // namespace

// One phase of a refit (ReshardOptions::staging_budget): this rank's sides of its ops, and the
// packs and unpacks of their non-contiguous slices.
struct Phase {
  std::vector<std::size_t> sends, receives;  // indices into Prepared::sends / receives
  std::vector<std::size_t> locals;           // indices into Prepared::locals
  execution::BlockCopyBatch packs, unpacks;
  // A built-in transform's conversions of the phase, as the first refit of the phase queued them
  // (send hooks and their flush; local conversions; receive hooks and theirs), and whether it ran.
  execution::ConversionRecording sends_converted, locals_converted, receives_finalized;
  bool recorded = false;
};

struct Resharder::Impl {
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
  // Each rank's GPU (gpu_identity), where colocated_on_sender; else empty. Handed to the transform
  // at every refit: executors with other options may share it.
  std::vector<std::uint64_t> placement;
  std::uint64_t budget;  // requested, else the default
  PeId me;
  bool rows_in_place;  // strided slices travel in place (CopyService::moves_rows_in_place)
  std::vector<const TransferOp*> send_ops, recv_ops;
  // The parameters this rank's ops touch, each once in op order: the sources (the first
  // `source_params`), then the destinations. Copies, side by side in memory: the per-refit check
  // reads them in turn (same_tensors_as_prepared).
  std::vector<std::string> param_names;
  std::size_t source_params = 0;
  // How many of this rank's ops send each source slice (parameter, then the box's offsets and
  // extents): more than one where replicas receive it.
  std::map<std::vector<std::int64_t>, int> sends_of_slice;
  std::unordered_map<TaskId, std::uint32_t> op_index;  // by task id
  execution::StagingPool staging;
  // This rank's sides of the ops, as registered and scheduled for `tensors`.
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
    // The maps as given, where each holds only tensors this rank's ops touch (a map of more is
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

  Impl(std::shared_ptr<const ReshardPlan> p, CopyService& s, std::shared_ptr<ReshardTransform> t,
       ReshardOptions o)
      : plan(std::move(p)),
        service(s),
        transform(own_instance(std::move(t))),
        ranged(dynamic_cast<execution::RangedTransform*>(transform.get())),
        requested(requested_budget(o)),
        colocated_on_sender(o.quantize_colocated_on_sender),
        allow_unknown_names(o.allow_unknown_names),
        param_groups(o.param_groups),
        budget(requested.value_or(ReshardOptions::kDefaultStagingBudget)),
        me(s.my_pe()),
        rows_in_place(s.moves_rows_in_place()) {
    if (!plan) throw_error(ErrorCode::kInvalidArgument, "Resharder: null plan");
    for (const TransferOp& op : plan->ops()) {
      op_index.emplace(op.task_id, static_cast<std::uint32_t>(&op - plan->ops().data()));
      if (op.src_rank >= service.n_pes() || op.dst_rank >= service.n_pes()) {
        throw_error(ErrorCode::kInvalidArgument, "the plan moves " + where(*plan, op) +
                                                     " but the service has only " +
                                                     std::to_string(service.n_pes()) + " PEs");
      }
      if (op.src_rank == me) {
        send_ops.push_back(&op);
        ++sends_of_slice[slice_key(op)];
      }
      if (op.dst_rank == me) recv_ops.push_back(&op);
    }
    for (const auto* ops : {&send_ops, &recv_ops}) {
      std::vector<bool> seen(plan->params().size());
      for (const TransferOp* op : *ops) {
        if (seen[op->param]) continue;
        seen[op->param] = true;
        param_names.push_back(plan->params()[op->param].name);
      }
      if (ops == &send_ops) source_params = param_names.size();
    }
    for (const ParamSpec& param : plan->params()) plan_names.insert(param.name);
    if (!param_groups.empty()) {
      if (param_groups.size() != plan->params().size()) {
        throw_error(ErrorCode::kInvalidArgument,
                    "ReshardOptions::param_groups has " + std::to_string(param_groups.size()) +
                        " entries; the plan has " + std::to_string(plan->params().size()) +
                        " parameters (one group number each)");
      }
      group_count = *std::max_element(param_groups.begin(), param_groups.end()) + 1;
    }
  }

  std::uint32_t group_of(const TransferOp& op) const {
    return param_groups.empty() ? 0 : param_groups[op.param];
  }

  // Refuses a tensor under a name the plan does not have (ReshardOptions::allow_unknown_names),
  // naming it; where `changed_only`, only maps of another size than those last checked.
  void check_names(const TensorMap& src, const TensorMap& dst, bool changed_only) {
    if (allow_unknown_names) return;
    if (changed_only && src.size() == names_checked_src && dst.size() == names_checked_dst) return;
    for (auto [map, role] : {std::pair{&src, "source"}, std::pair{&dst, "destination"}}) {
      std::vector<std::string_view> unknown;
      for (const auto& entry : *map) {
        if (!plan_names.count(entry.first)) unknown.push_back(entry.first);
      }
      if (unknown.empty()) continue;
      std::sort(unknown.begin(), unknown.end());
      throw_error(
          ErrorCode::kInvalidArgument,
          std::string(role) + " tensor '" + std::string(unknown[0]) + "' on rank " +
              std::to_string(me) + " is not a parameter of the plan" +
              (unknown.size() > 1 ? " (nor are " + std::to_string(unknown.size() - 1) + " more)"
                                  : std::string()) +
              ": it would never be written. Add it to the model spec, or allow tensors "
              "the plan does not move (ReshardOptions::allow_unknown_names; Python "
              "strict=False)");
    }
    names_checked_src = src.size();
    names_checked_dst = dst.size();
  }

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

  // Collective: ranks that built different plans (from different layouts) would register task
  // ids that match nothing; say so plainly instead, naming the ranks and the first parameter
  // whose transfers differ.
  // The same all-gather says where every rank's GPU is (`placement`).
  void check_same_plan_everywhere() {
    const std::uint64_t mine[] = {plan->fingerprint(), plan->ops().size(), plan->params().size(),
                                  gpu_identity(), colocated_on_sender};
    const auto all = service.all_gather(std::as_bytes(std::span(mine)));
    std::vector<std::array<std::uint64_t, 3>> theirs(all.size());
    std::vector<std::uint64_t> gpu_of_rank(all.size());
    for (std::size_t r = 0; r < all.size(); ++r) {
      if (all[r].size() != sizeof mine) {
        throw_error(ErrorCode::kInvalidState, "rank " + std::to_string(r) +
                                                  " runs another reshard build (its executor "
                                                  "sent " +
                                                  std::to_string(all[r].size()) +
                                                  " bytes where this one sends " +
                                                  std::to_string(sizeof mine) + ")");
      }
      std::memcpy(theirs[r].data(), all[r].data(), 24);
      std::uint64_t on_sender = 0;
      std::memcpy(&gpu_of_rank[r], all[r].data() + 24, 8);
      std::memcpy(&on_sender, all[r].data() + 32, 8);
      if ((on_sender != 0) != colocated_on_sender) {
        throw_error(ErrorCode::kInvalidArgument,
                    "ReshardOptions::quantize_colocated_on_sender differs between ranks: rank " +
                        std::to_string(me) + " has " + (colocated_on_sender ? "true" : "false") +
                        ", rank " + std::to_string(r) + " " + (on_sender ? "true" : "false"));
      }
    }
    if (colocated_on_sender) placement = std::move(gpu_of_rank);
    std::size_t other = 1;
    while (other < theirs.size() && theirs[other] == theirs[0]) ++other;
    if (other == theirs.size()) return;
    // Per parameter: its name and every transfer of it; the first that differs is named.
    std::vector<std::uint64_t> per_param(plan->params().size());
    for (std::size_t p = 0; p < per_param.size(); ++p)
      per_param[p] = std::hash<std::string>{}(plan->params()[p].name);
    for (const TransferOp& op : plan->ops()) {
      std::uint64_t& h = per_param[op.param];
      for (std::uint64_t v :
           {op.task_id, std::uint64_t(op.src_rank), std::uint64_t(op.dst_rank), op.bytes})
        h = (h ^ v) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
    }
    const auto params = service.all_gather(std::as_bytes(std::span(per_param)));
    std::ostringstream text;
    text << "the reshard plan differs between ranks: rank 0 has " << theirs[0][1] << " ops over "
         << theirs[0][2] << " parameters, rank " << other << " " << theirs[other][1] << " ops over "
         << theirs[other][2] << " parameters";
    const std::size_t n0 = params[0].size() / 8, n1 = params[other].size() / 8;
    for (std::size_t p = 0; p < std::min({n0, n1, plan->params().size()}); ++p) {
      if (std::memcmp(params[0].data() + 8 * p, params[other].data() + 8 * p, 8) != 0) {
        text << "; the first parameter whose transfers differ is '" << plan->params()[p].name
             << "' (as rank " << me << " numbers them)";
        break;
      }
    }
    text << ". Every rank must build the plan from the same two layouts.";
    throw_error(ErrorCode::kValidation, text.str());
  }

  // This rank's GPU as every process on the machine names it (cuda::physical_gpu, hashed);
  // 0 on the host transport.
  std::uint64_t gpu_identity() const {
    const int device = service.device();
    if (device < 0) return 0;
#ifdef RESHARD_WITH_CUDA
    const std::uint64_t id = std::hash<std::string>{}(cuda::physical_gpu(device));
    return id == 0 ? 1 : id;
#else
    return 0;
#endif
  }

  ~Impl() {
#ifdef RESHARD_WITH_CUDA
    if (own_stream != nullptr) execution::cuda::destroy_stream(own_stream_device, own_stream);
    if (transfer_stream != nullptr) destroy_transfer_stream();
#endif
  }

  static std::vector<std::int64_t> slice_key(const TransferOp& op) {
    const Box box = op.src_box();
    std::vector<std::int64_t> key{op.param};
    key.insert(key.end(), box.offset.begin(), box.offset.begin() + box.ndim);
    key.insert(key.end(), box.extent.begin(), box.extent.begin() + box.ndim);
    return key;
  }

  bool transforms(const TransferOp& op) const {
    return transform && transform->should_transform(plan->params()[op.param]);
  }

  const LocalTensor& tensor_for(const TensorMap& tensors, const Layout& layout,
                                const TransferOp& op, bool sending, const Shard*& shard) const {
    const ParamSpec& param = plan->params()[op.param];
    const char* role = sending ? "source" : "destination";
    auto it = tensors.find(param.name);
    if (it == tensors.end()) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string("rank ") + std::to_string(me) + " has no " + role + " tensor for '" +
                      param.name + "', which the plan moves (" + where(*plan, op) + ")");
    }
    shard = layout.find_shard(me, layout.param_index(param.name));
    const LocalTensor& tensor = it->second;
    const auto elements = static_cast<std::size_t>(Box::whole(shard->local_shape).elements());
    const bool converted = transforms(op);
    if (!converted && tensor.dtype != param.dtype) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string(role) + " tensor '" + param.name + "' on rank " + std::to_string(me) +
                      " is " + dtype_name(tensor.dtype) + " but the parameter is " +
                      dtype_name(param.dtype) + " (no transform applies to it)");
    }
    if (!tensor.shape.empty() && tensor.shape != shard->local_shape) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string(role) + " tensor '" + param.name + "' on rank " + std::to_string(me) +
                      " has shape " + shape_str(tensor.shape) +
                      " but the layout's local shape is " + shape_str(shard->local_shape) +
                      " (a transposed or reshaped tensor would scramble the parameter)");
    }
    const std::size_t need = elements * dtype_size(tensor.dtype);
    if (tensor.data.data == nullptr || tensor.data.bytes < need) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string(role) + " tensor '" + param.name + "' on rank " + std::to_string(me) +
                      " holds " + std::to_string(tensor.data.bytes) + " bytes; its local shape " +
                      Box::whole(shard->local_shape).str() + " needs " + std::to_string(need));
    }
    return tensor;
  }

  // The GPU of the tensors, or -1 where they are all in host memory.
  // The GPU of the first GPU tensor (a rank's tensors are on one), or -1 where there is none.
  static int device_of(const TensorMap& src, const TensorMap& dst) {
    for (const TensorMap* map : {&src, &dst}) {
      for (const auto& [name, tensor] : *map) {
        if (tensor.data.kind == MemoryKind::kCuda) return tensor.data.device;
      }
    }
    return -1;
  }

  // The stream a refit runs on: the caller's, else this executor's own on `device` (none for
  // host tensors, device < 0).
  void* stream_on(int device, void* cuda_stream) {
    if (cuda_stream != nullptr) return cuda_stream;
    if (device < 0) return nullptr;
#ifdef RESHARD_WITH_CUDA
    if (own_stream == nullptr) {
      own_stream = execution::cuda::create_stream(device);
      own_stream_device = device;
    }
    // The refit goes after what the caller queued on the default stream (its tensors' writes).
    execution::cuda::wait_for_default_stream(own_stream_device, own_stream);
    return own_stream;
#else
    throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
  }

#ifdef RESHARD_WITH_CUDA
  // Waits for this executor's own stream, where a refit without the caller's stream ran. The
  // transfers on it wait for peers, so they are waited for first through the copy service, whose
  // wait notices a peer that exited or stopped and gives up at the service's timeout; what is
  // queued after them (unpacks, conversions on arrival) is local and always ends.
  void wait_for_own_stream(void* stream) {
    service.synchronize();
    execution::cuda::synchronize_stream(stream);
  }
#endif

  // The wire buffers the transform returns for a transformed side (its hooks run at every refit:
  // the sender's converts the data now).
  std::vector<execution::WireRange> transform_wire(const Side& side, const LocalTensor& tensor,
                                                   bool sending, void* stream) {
    const TransferOp& op = *side.op;
    const Box local = sending ? op.src_box() : op.dst_box();
    const OpSlice slice{plan->params()[op.param], op, local, side.shard->local_shape};
    std::vector<execution::WireRange> wire;
    if (ranged != nullptr) {
      // The built-in transforms: wire buffers from the executor's pool (bounded by the budget);
      // strided slices go from and land in the tensors in place where rows move in place.
      wire = sending ? ranged->send_ranges(slice, tensor, stream, staging, rows_in_place)
                     : ranged->recv_ranges(slice, tensor, staging, rows_in_place);
    } else {
      for (const Buffer& buffer : sending ? transform->prepare_send(slice, tensor, stream)
                                          : transform->prepare_recv(slice, tensor))
        wire.push_back(execution::WireRange::whole(buffer));
    }
    if (wire.empty() || wire.size() > static_cast<std::size_t>(kMaxWireBuffers)) {
      throw_error(ErrorCode::kInvalidArgument,
                  "transform '" + transform->name() + "' returned " + std::to_string(wire.size()) +
                      " wire buffers for " + where(*plan, op) + " (1.." +
                      std::to_string(kMaxWireBuffers) + " allowed)");
    }
    return wire;
  }

  // How this rank takes part in `op`: its wire buffers, and the pack (sending) or unpack
  // (receiving) a non-contiguous slice needs, added to `copies`. While the pool is sizing, a
  // custom transform's hooks are not called (its wire buffers are its own, outside the budget).
  Side prepare_side(const TransferOp& op, const TensorMap& tensors, bool sending, void* stream,
                    execution::BlockCopyBatch& copies, ReshardReport& report) {
    const Layout& layout = sending ? plan->src_layout() : plan->dst_layout();
    Side side;
    side.op = &op;
    const LocalTensor& tensor = tensor_for(tensors, layout, op, sending, side.shard);
    side.transformed = transforms(op);
    if (side.transformed && ranged == nullptr && staging.sizing()) return side;
    if (side.transformed) {
      side.wire = transform_wire(side, tensor, sending, stream);
      return side;
    }
    side.view =
        execution::view_of(sending ? op.src_box() : op.dst_box(), side.shard->local_shape, true);
    const std::size_t element = dtype_size(tensor.dtype);
    // A strided slice travels in place where the transport copies rows at full speed: no
    // staging, no pack, no unpack.
    if (side.view.contiguous() || rows_in_place) {
      side.wire.push_back({tensor.data, execution::strided_range_of(side.view, element)});
      if (!side.view.contiguous()) report.strided_bytes += op.bytes;
      return side;
    }
    const Buffer& packed = staging.slot({sending, op.task_id, 0}, tensor.data, op.bytes);
    side.wire.push_back({packed, StridedRange::contiguous(0, op.bytes)});
    report.packed_bytes += op.bytes;
    if (sending) {
      copies.add_pack(tensor.data, side.view, element, packed);
    } else {
      copies.add_unpack(packed, tensor.data, side.view, element);
    }
    return side;
  }

  // The bytes a side puts on the wire or takes from it: what the transform made of the op (FP8
  // data and scales by the sender, say), the op's own bytes without one.
  static std::uint64_t wire_bytes(const Side& side) {
    std::uint64_t bytes = 0;
    for (const execution::WireRange& w : side.wire) bytes += w.range.bytes();
    return bytes;
  }

  // A local op of a transformed parameter that the transform converts in place: recorded in
  // prepared.locals (checked by the transform now, before the schedule).
  bool converts_locally(const TransferOp& op, const TensorMap& src, const TensorMap& dst) {
    if (!transforms(op)) return false;
    const Shard* src_shard = nullptr;
    const Shard* dst_shard = nullptr;
    const LocalTensor& from = tensor_for(src, plan->src_layout(), op, true, src_shard);
    const LocalTensor& to = tensor_for(dst, plan->dst_layout(), op, false, dst_shard);
    const ParamSpec& param = plan->params()[op.param];
    LocalSide local{{param, op, op.src_box(), src_shard->local_shape},
                    {param, op, op.dst_box(), dst_shard->local_shape}};
    const bool converts = ranged != nullptr
                              ? ranged->converts_local_op(local.from, from, local.to, to,
                                                          sends_of_slice.at(slice_key(op)) > 1)
                              : transform->converts_locally(local.from, from, local.to, to);
    if (!converts) return false;
    prepared.locals.push_back(local);
    prepared.converted_locally[&op - plan->ops().data()] = true;
    prepared.report.locally_converted_bytes += op.bytes;
    return true;
  }

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
                      bool replay) {
    if (phase.locals.empty()) return;
    convert_or_replay(phase.locals_converted, replay, stream, [&] {
      for (std::size_t index : phase.locals) {
        const LocalSide& local = prepared.locals[index];
        const std::string& name = local.from.param.name;
        transform->convert_local(local.from, src.at(name), local.to, dst.at(name), stream);
      }
      transform->flush(stream);
    });
  }

  // Runs the copy service's phase `p` and the phase's local ops' conversions side by side: the
  // transfer on the high-priority stream where there are conversions on a GPU, on `stream`
  // otherwise.
  void transfer_and_convert_locals(std::uint32_t p, const TensorMap& src, const TensorMap& dst,
                                   void* stream, bool replay) {
    Phase& phase = *prepared.phases[p];
    // The service has phases up to the last any rank registered a request in: one of only local
    // conversions (a group of them) may lie past them.
    if (p >= service.phases()) return convert_locals(phase, src, dst, stream, replay);
#ifdef RESHARD_WITH_CUDA
    if (!phase.locals.empty() && stream != nullptr && prepared.device >= 0) {
      use_transfer_stream();
      execution::cuda::order_after(transfer_stream, stream, transfer_fork);
      execution::ServiceSlot::run_phase(service, p, transfer_stream);
      convert_locals(phase, src, dst, stream, replay);
      execution::cuda::order_after(stream, transfer_stream, transfer_join);
      return;
    }
#endif
    execution::ServiceSlot::run_phase(service, p, stream);
    convert_locals(phase, src, dst, stream, replay);
  }

#ifdef RESHARD_WITH_CUDA
  // The high-priority stream and its events, on the tensors' GPU.
  void use_transfer_stream() {
    if (transfer_stream != nullptr && transfer_stream_device != prepared.device) {
      destroy_transfer_stream();
    }
    if (transfer_stream != nullptr) return;
    transfer_stream = execution::cuda::create_stream(prepared.device, /*high_priority=*/true);
    transfer_fork = execution::cuda::create_event(prepared.device);
    transfer_join = execution::cuda::create_event(prepared.device);
    for (void*& event : region_read) event = execution::cuda::create_event(prepared.device);
    transfer_stream_device = prepared.device;
  }

  void destroy_transfer_stream() {
    execution::cuda::destroy_stream(transfer_stream_device, transfer_stream);
    for (void* event : {transfer_fork, transfer_join, region_read[0], region_read[1]})
      execution::cuda::destroy_event(transfer_stream_device, event);
    transfer_stream = nullptr;
  }

  // A pipelined refit (Prepared::pipelined) of the phases `chosen` marks (all where null): each
  // phase's send-side conversions, packs and transfer on the high-priority stream, its local
  // conversions, unpacks and conversions on arrival on `stream`, after its bytes landed; so a
  // phase's arrivals are read while the next phase's bytes land in the other staging region. A
  // phase writes a region (its own conversions, and peers, whose copies into this rank's memory
  // wait until its transfer starts here) only once the last phase that used the region has been
  // read. `stream` ends after all of it.
  void run_pipelined(const TensorMap& src, const TensorMap& dst, void* stream,
                     const std::vector<bool>* chosen, bool& replayed) {
    use_transfer_stream();
    execution::cuda::order_after(transfer_stream, stream, transfer_fork);
    bool region_in_use[2] = {false, false};
    for (std::uint32_t p = 0; p < prepared.phases.size(); ++p) {
      if (chosen != nullptr && !(*chosen)[p]) continue;
      Phase& phase = *prepared.phases[p];
      const bool replay = ranged != nullptr && phase.recorded;
      replayed = replayed && replay;
      if (region_in_use[p % 2]) execution::cuda::wait_event(transfer_stream, region_read[p % 2]);
      convert_or_replay(phase.sends_converted, replay, transfer_stream, [&] {
        if (ranged != nullptr) convert_sends(phase, src, transfer_stream);
        if (transform) transform->flush(transfer_stream);
      });
      phase.packs.run(transfer_stream);
      if (p < service.phases()) execution::ServiceSlot::run_phase(service, p, transfer_stream);
      convert_locals(phase, src, dst, stream, replay);
      execution::cuda::order_after(stream, transfer_stream, transfer_join);
      phase.unpacks.run(stream);
      convert_or_replay(phase.receives_finalized, replay, stream, [&] {
        finalize_receives(phase, dst, stream);
        if (transform) transform->flush(stream);
      });
      execution::cuda::record_event(region_read[p % 2], stream);
      region_in_use[p % 2] = true;
      phase.recorded = ranged != nullptr;
    }
  }
#endif

  void register_and_schedule(const std::vector<Side>& sends, const std::vector<Side>& receives) {
    execution::ServiceSlot::clear_requests(service);
    for (const Side& side : sends) {
      service.set_phase(side.phase);
      for (std::size_t i = 0; i < side.wire.size(); ++i) {
        const execution::WireRange& w = side.wire[i];
        service.register_send(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.range,
                              side.op->dst_rank);
      }
    }
    for (const Side& side : receives) {
      service.set_phase(side.phase);
      for (std::size_t i = 0; i < side.wire.size(); ++i) {
        const execution::WireRange& w = side.wire[i];
        service.register_receive(wire_task(side.op->task_id, side.wire.size(), i), w.buffer,
                                 w.range, side.op->src_rank);
      }
    }
    service.set_phase(0);
    try {
      service.schedule();
    } catch (const Error& error) {
      if (error.code() != ErrorCode::kValidation || error.tasks().empty()) throw;
      throw Error(ErrorCode::kValidation, explain(error), error.tasks());
    }
  }

  // Names the parameter, region and wire buffer behind each task id a validation error lists.
  std::string explain(const Error& error) const {
    std::ostringstream text;
    text << error.what() << "\nin terms of the reshard plan:";
    std::size_t shown = 0;
    for (TaskId task : error.tasks()) {
      const TaskId op_task = execution::op_task_of(task);
      auto it = std::find_if(plan->ops().begin(), plan->ops().end(),
                             [&](const TransferOp& op) { return op.task_id == op_task; });
      if (it == plan->ops().end() || ++shown > 8) continue;
      text << "\n  - task " << task << " is wire buffer " << execution::wire_index_of(task) + 1
           << " of " << execution::wire_count_of(task) << " of " << where(*plan, *it);
    }
    text << "\n(wire buffers without a partner mean the sender's and the receiver's transform "
            "returned different numbers or sizes of buffers for the same op)";
    return text.str();
  }

  // Where param_names[i] is looked up: `src` for the sources, `dst` for the destinations.
  template <typename Map>
  Map& map_of(std::size_t i, Map& src, Map& dst) const {
    return i < source_params ? src : dst;
  }

  // What a prepared refit depends on: every tensor this rank's ops touch (param_names' order).
  std::vector<LocalTensor> tensors_used(const TensorMap& src, const TensorMap& dst) const {
    std::vector<LocalTensor> used;
    used.reserve(param_names.size());
    for (std::size_t i = 0; i < param_names.size(); ++i) {
      const TensorMap& map = map_of(i, src, dst);
      auto it = map.find(param_names[i]);
      used.push_back(it == map.end() ? LocalTensor{} : it->second);
    }
    return used;
  }

  // Whether `src` and `dst` hold, for every tensor this rank's ops touch, what the prepared
  // refit was prepared for: a walk of maps kept (or built again alike) beside a record of them,
  // else one lookup each; nothing copied. A MoE refit checks thousands at every refit
  // (Qwen3-30B-A3B, 12 layers: 4,782 a rank; rerun() skips them): on one H200's host 0.1-0.2 ms
  // walked, 0.5-0.7 ms looked up, against a transfer of 8-9 ms. (Shares of the lookups on helper
  // threads made no difference on one H100 with 4 PEs, 2026-11-27.)
  bool same_tensors_as_prepared(const TensorMap& src, const TensorMap& dst) const {
    static const LocalTensor kAbsent{};
    if (prepared.identities.size() != param_names.size()) return false;
    if (prepared.src_walk.matches(src) && prepared.dst_walk.matches(dst))
      return prepared.allocations.unchanged();
    for (std::size_t i = 0; i < param_names.size(); ++i) {
      const TensorMap& map = map_of(i, src, dst);
      const auto it = map.find(param_names[i]);
      if (!prepared.identities[i].matches(it == map.end() ? kAbsent : it->second, prepared.shapes))
        return false;
    }
    return prepared.allocations.unchanged();
  }

  // Whether a transform's hooks returned the wire buffers a side was scheduled with.
  static bool same_wire(const std::vector<execution::WireRange>& a,
                        const std::vector<execution::WireRange>& b) {
    return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                      [](const execution::WireRange& x, const execution::WireRange& y) {
                        return x.buffer.data == y.buffer.data && x.range.bytes() == y.range.bytes();
                      });
  }

  // Re-runs a custom transform's hooks of a prepared refit; false when it returned other wire
  // buffers than those scheduled (the refit is then prepared again). A built-in transform's
  // send hooks run phase by phase instead (convert_sends), and its buffers are the pool's.
  // Where `phases` is given, only the sides of the phases it marks.
  bool rerun_transforms(const TensorMap& src, const TensorMap& dst, void* stream,
                        const std::vector<bool>* phases = nullptr) {
    if (ranged != nullptr || transform == nullptr) return true;
    for (auto [sides, map, sending] :
         {std::tuple{&prepared.sends, &src, true}, std::tuple{&prepared.receives, &dst, false}}) {
      for (Side& side : *sides) {
        if (!side.transformed || (phases != nullptr && !(*phases)[side.phase])) continue;
        const LocalTensor& tensor = map->at(plan->params()[side.op->param].name);
        if (!same_wire(transform_wire(side, tensor, sending, stream), side.wire)) return false;
      }
    }
    return true;
  }

  // Collective: whether `mine` holds on every rank (gather_verdicts: a rank's `failure` throws on
  // every rank).
  bool all_ranks_agree(bool mine, const std::exception_ptr& failure = nullptr,
                       const char* meeting = nullptr) {
    const std::byte flag{static_cast<unsigned char>(mine ? 1 : 0)};
    const auto all = gather_verdicts(std::span<const std::byte>(&flag, 1), failure, meeting);
    return std::all_of(all.begin(), all.end(), [](const std::vector<std::byte>& part) {
      return part.size() == 1 && part[0] == std::byte{1};
    });
  }

  static std::optional<std::uint64_t> requested_budget(const ReshardOptions& options) {
    return options.staging_budget ? options.staging_budget : env::staging_budget();
  }

  // Collective: which phase each op of the plan runs in, the same on every rank. Every rank
  // says what staging each of its ops needs (`sized`: bytes per (sending, op task id)) and which
  // ops share another's conversion (`leaders`); every rank then computes the same
  // execution::assign_phases of it (a unit that alone needs more than a budget the caller gave is
  // refused on every rank alike). Records each group's first phase in prepared.group_phases.
  // Carries each rank's verdict on its own preparation so far (gather_verdicts), and refuses
  // budgets or groups that differ between ranks.
  std::vector<std::uint32_t> assign_phases(
      const std::map<execution::StagingPool::OpKey, std::size_t>& sized,
      const std::map<std::uint32_t, std::uint32_t>& leaders, const std::exception_ptr& failure) {
    std::map<std::uint32_t, std::uint64_t> mine;  // op index -> bytes on this rank
    bool reads_arrivals = false;  // on a GPU, staging that bytes land in before being read again
    for (const auto& [key, bytes] : sized) {
      mine[op_index.at(key.second)] += bytes;
      reads_arrivals = reads_arrivals || (!key.first && prepared.device >= 0);
    }
    message::Writer out;
    out.put<std::uint64_t>(budget);
    out.put<std::uint64_t>(groups_digest());
    out.put<std::uint8_t>(reads_arrivals ? 1 : 0);
    out.put<std::uint8_t>(service.options().debug.pipelined_phases ? 1 : 0);
    out.put<std::uint64_t>(prepared.device >= 0 ? gpu_identity() : 0);
    std::vector<std::uint64_t> flat;
    for (const auto& [op, bytes] : mine) flat.insert(flat.end(), {op, bytes});
    out.put_array(std::span<const std::uint64_t>(flat));
    flat.clear();
    for (const auto& [op, leader] : leaders) flat.insert(flat.end(), {op, leader});
    out.put_array(std::span<const std::uint64_t>(flat));
    const auto all = gather_verdicts(out.bytes(), failure);
    bool any_reads_arrivals = false, every_rank_pipelines = true, gpu_shared = false;
    std::set<std::uint64_t> gpus;  // the ranks' GPUs (gpu_identity)
    const std::size_t ops = plan->ops().size();
    std::vector<std::uint32_t> leader(ops);  // each op's, itself where it shares no conversion
    for (std::uint32_t i = 0; i < ops; ++i) leader[i] = i;
    std::vector<std::vector<std::pair<PeId, std::uint64_t>>> needs(ops);
    for (std::size_t rank = 0; rank < all.size(); ++rank) {
      message::Reader in(all[rank]);
      const auto theirs = in.get<std::uint64_t>();
      if (theirs != budget) {
        throw_error(ErrorCode::kInvalidArgument,
                    "the staging budget differs between ranks: rank " + std::to_string(me) +
                        " has " + execution::budget_text(budget) + ", rank " +
                        std::to_string(rank) + " " + execution::budget_text(theirs) +
                        " (ReshardOptions::staging_budget / RESHARD_STAGING_BUDGET must agree)");
      }
      if (in.get<std::uint64_t>() != groups_digest()) {
        throw_error(ErrorCode::kInvalidArgument,
                    "the refit's groups (ReshardOptions::param_groups) differ between rank " +
                        std::to_string(me) + " and rank " + std::to_string(rank) +
                        ": every rank must group the plan's parameters alike");
      }
      any_reads_arrivals = in.get<std::uint8_t>() != 0 || any_reads_arrivals;
      every_rank_pipelines = in.get<std::uint8_t>() != 0 && every_rank_pipelines;
      const auto gpu = in.get<std::uint64_t>();
      if (gpu != 0) gpu_shared = !gpus.insert(gpu).second || gpu_shared;
      const auto pairs = in.get_array<std::uint64_t>();
      for (std::size_t i = 0; i + 1 < pairs.size(); i += 2)
        needs.at(pairs[i]).emplace_back(static_cast<PeId>(rank), pairs[i + 1]);
      const auto shared = in.get_array<std::uint64_t>();
      for (std::size_t i = 0; i + 1 < shared.size(); i += 2)
        leader.at(shared[i]) = static_cast<std::uint32_t>(shared[i + 1]);
    }
    execution::PhaseRequest request;
    request.group.resize(ops);
    for (std::uint32_t i = 0; i < ops; ++i) request.group[i] = group_of(plan->ops()[i]);
    request.leader = std::move(leader);
    request.needs = std::move(needs);
    request.group_count = group_count;
    request.ranks = static_cast<int>(all.size());
    request.budget = budget;
    request.budget_given = requested.has_value();
    // Where some rank reads staging after its bytes land (unpacks, conversions on arrival, on a
    // GPU) and the refit runs in phases anyway, the phases alternate between two halves of the
    // budget: a phase's arrivals are read beside the next phase's transfer instead of after it
    // (run_pipelined). Not with a custom transform (its hooks run on the host at their own pace);
    // not where PEs share a GPU: there the conversions take the SMs that the transfer kernels of
    // the GPU's other PEs wait for (4x H200, 2 PEs per GPU, Llama-3-8B MXFP8 on arrival: 31.5 ms
    // in phases one after the other, 85.5 ms pipelined); and not where any rank turns it off
    // (DebugOptions::pipelined_phases).
    const bool custom_transform = transform != nullptr && ranged == nullptr;
    request.may_pipeline =
        any_reads_arrivals && every_rank_pipelines && !gpu_shared && !custom_transform;
    execution::PhaseAssignment assignment = execution::assign_phases(
        request, [&](std::uint32_t op) { return where(*plan, plan->ops()[op]); });
    prepared.pipelined = assignment.pipelined;
    prepared.group_phases = std::move(assignment.group_phases);
    return std::move(assignment.phase_of);
  }

  // A digest of param_groups, which every rank must give alike (FNV-1a).
  std::uint64_t groups_digest() const {
    std::uint64_t digest = 1469598103934665603ull;
    for (std::uint32_t g : param_groups) digest = (digest ^ g) * 1099511628211ull;
    return digest;
  }

  // Collective: prepares this rank's sides for `src` and `dst`: checks that every rank holds the
  // same plan, sizes the staging every op needs (the hooks run dry), agrees on the phases with
  // the other ranks, places the staging, takes each side's wire buffers from there, phase by
  // phase as the refits run them, and schedules. A refusal found on one rank (a missing or bad
  // tensor, a transform's hook) stops every rank alike before anything is scheduled
  // (gather_verdicts).
  void prepare(const TensorMap& src, const TensorMap& dst, void* stream, ReshardReport& report) {
    prepared.valid = false;
    check_same_plan_everywhere();
    if (ranged != nullptr) ranged->set_placement(placement);
#ifdef RESHARD_WITH_CUDA
    // The last refit's work may still read the staging that is placed anew here.
    if (stream != nullptr && staging.reserved_bytes() > 0)
      execution::cuda::synchronize_stream(stream);
#endif
    // The built-in transforms convert nothing here: the refits convert phase by phase.
    struct DryRun {
      execution::RangedTransform* ranged;
      explicit DryRun(execution::RangedTransform* r) : ranged(r) {
        if (ranged != nullptr) ranged->set_dry_run(true);
      }
      ~DryRun() {
        if (ranged != nullptr) ranged->set_dry_run(false);
      }
    } dry_run(ranged);
    std::exception_ptr failure;
    std::vector<LocalTensor> tensors;
    std::vector<const TransferOp*> sending, receiving;  // through the copy service
    // Sizing. A transform that converts a slice once for several ops (replicas) gives the later
    // ones the first one's wire buffers: those ops share a phase (`leaders`: op index -> the op
    // whose conversion it shares).
    std::map<execution::StagingPool::OpKey, std::size_t> sized;
    std::map<std::uint32_t, std::uint32_t> leaders;
    try {
      prepared.sends.clear();
      prepared.receives.clear();
      prepared.locals.clear();
      prepared.phases.clear();
      prepared.converted_locally.assign(plan->ops().size(), false);
      prepared.report = ReshardReport{};
      check_names(src, dst, false);
      tensors = tensors_used(src, dst);
      prepared.device = device_of(src, dst);
#ifdef RESHARD_WITH_CUDA
      if (prepared.device >= 0 && loaded_kernels_on != prepared.device) {
        execution::cuda::load_kernels(prepared.device);
        loaded_kernels_on = prepared.device;
      }
#endif
      for (const TransferOp* op : send_ops) {
        if (op->local() && converts_locally(*op, src, dst)) continue;
        sending.push_back(op);
      }
      for (const TransferOp* op : recv_ops) {
        if (!prepared.converted_locally[op - plan->ops().data()]) receiving.push_back(op);
      }
      staging.start_sizing();
      execution::BlockCopyBatch scratch;
      ReshardReport ignored;
      for (const auto& [ops, map, is_send] :
           {std::tuple{&sending, &src, true}, std::tuple{&receiving, &dst, false}}) {
        for (const TransferOp* op : *ops) {
          const Side side = prepare_side(*op, *map, is_send, stream, scratch, ignored);
          if (!is_send || side.wire.empty()) continue;
          const auto owner = staging.sized_owner(side.wire[0].buffer.data);
          if (owner && std::get<1>(*owner) != op->task_id)
            leaders[op_index.at(op->task_id)] = op_index.at(std::get<1>(*owner));
        }
        if (ranged != nullptr) transform->flush(stream);
      }
      sized = staging.sized_bytes();
    } catch (...) {
      failure = std::current_exception();
    }
    const std::vector<std::uint32_t> phase_of = assign_phases(sized, leaders, failure);
    ReshardReport& counts = prepared.report;
    try {
      auto phase_of_op = [&](const TransferOp& op) { return phase_of[&op - plan->ops().data()]; };
      staging.arrange(
          [&](const execution::StagingPool::OpKey& key) {
            return phase_of[op_index.at(key.second)];
          },
          prepared.pipelined ? 2 : 1);
      const std::uint32_t phases =
          phase_of.empty() ? 1 : *std::max_element(phase_of.begin(), phase_of.end()) + 1;
      for (std::uint32_t p = 0; p < phases; ++p)
        prepared.phases.push_back(std::make_unique<Phase>());
      for (std::size_t i = 0; i < prepared.locals.size(); ++i)
        prepared.phases[phase_of_op(prepared.locals[i].from.op)]->locals.push_back(i);
      for (std::uint32_t p = 0; p < phases; ++p) {
        Phase& phase = *prepared.phases[p];
        for (const auto& [ops, map, is_send] :
             {std::tuple{&sending, &src, true}, std::tuple{&receiving, &dst, false}}) {
          std::vector<Side>& sides = is_send ? prepared.sends : prepared.receives;
          for (const TransferOp* op : *ops) {
            if (phase_of_op(*op) != p) continue;
            (is_send ? phase.sends : phase.receives).push_back(sides.size());
            sides.push_back(prepare_side(*op, *map, is_send, stream,
                                         is_send ? phase.packs : phase.unpacks, counts));
            sides.back().phase = p;
            if (!op->local())
              (is_send ? counts.bytes_sent : counts.bytes_received) += wire_bytes(sides.back());
          }
          // As the refits do: a transform converts a slice once per phase.
          if (is_send && ranged != nullptr) transform->flush(stream);
        }
      }
      counts.staging_bytes = staging.reserved_bytes();
      counts.phases = phases;
    } catch (...) {
      failure = std::current_exception();
    }
    // A custom transform's hooks run only now (its wire buffers are its own): every rank says
    // whether they took their buffers before any rank schedules.
    gather_verdicts({}, failure);
    // Every rank prepares in the same refit (execute agrees on it), so every rank schedules.
    if (registered_generation == UINT64_MAX) {
      RESHARD_LOG(kDebug, "scheduling the reshard plan: "
                              << prepared.sends.size() + prepared.receives.size() << " sides here");
    } else {
      RESHARD_LOG(kInfo,
                  "a rank's reshard buffers changed since the last schedule: scheduling "
                  "again on every rank");
    }
    register_and_schedule(prepared.sends, prepared.receives);
    registered_generation = execution::ServiceSlot::generation(service);
    report.rescheduled = true;
    prepared.identities.clear();
    prepared.shapes.clear();
    for (const LocalTensor& tensor : tensors)
      prepared.identities.push_back(TensorIdentity::of(tensor, prepared.shapes));
    prepared.allocations.record(tensors,
                                service.transport_name().find("cuda") != std::string::npos);
    // A map may hold tensors this rank does not move (a replica another rank sends from, the
    // whole model handed to every rank): walking it reads those too, and their identities are
    // recorded with the rest, so a walk that matches says the used ones are unchanged. Where
    // most of a map is unused, looking up the used names costs less than walking past the rest.
    for (auto [walk, map, used] :
         {std::tuple{&prepared.src_walk, &src, source_params},
          std::tuple{&prepared.dst_walk, &dst, param_names.size() - source_params}}) {
      if (map->size() <= 2 * used) {
        walk->record(*map);
      } else {
        walk->forget();
      }
    }
    prepared.tensors = std::move(tensors);
    prepared.valid = true;
  }

  // With DebugOptions::phase_timing, waits for the work queued so far and adds the time since the
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
  void convert_sends(const Phase& phase, const TensorMap& src, void* stream) {
    for (std::size_t index : phase.sends) {
      const Side& side = prepared.sends[index];
      if (!side.transformed) continue;
      const LocalTensor& tensor = src.at(plan->params()[side.op->param].name);
      if (!same_wire(transform_wire(side, tensor, true, stream), side.wire)) {
        throw_error(ErrorCode::kInvalidState,
                    "transform '" + transform->name() + "' returned other wire buffers for " +
                        where(*plan, *side.op) + " than it was scheduled with");
      }
    }
  }

  void finalize_receives(const Phase& phase, const TensorMap& dst, void* stream) {
    for (std::size_t index : phase.receives) {
      const Side& side = prepared.receives[index];
      if (!side.transformed) continue;
      const TransferOp& op = *side.op;
      const LocalTensor& tensor = dst.at(plan->params()[op.param].name);
      std::vector<Buffer> buffers;
      for (const execution::WireRange& w : side.wire) buffers.push_back(w.buffer);
      const OpSlice slice{plan->params()[op.param], op, op.dst_box(), side.shard->local_shape};
      transform->finalize_recv(slice, tensor, buffers, stream);
    }
  }

  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
    return execute(&src, &dst, cuda_stream);
  }

  // execute() of `src` and `dst`, or, where they are null, of the tensors the last call prepared
  // with, which the caller vouches it was given again (execute_as_prepared): then nothing is
  // looked up or compared here, and the maps are made of the prepared tensors only where
  // something reads them (a custom transform's hooks, or a preparation that another rank's new
  // tensors make every rank run).
  ReshardReport execute(const TensorMap* given_src, const TensorMap* given_dst, void* cuda_stream) {
    using Clock = std::chrono::steady_clock;
    ReshardReport report;
    // A refit with the same tensors as the last one reuses its sides, packs and schedule; only
    // the transforms' hooks run again.
    const auto started = Clock::now();
    const bool vouched = given_src == nullptr;
    TensorMap rebuilt_src, rebuilt_dst;
    auto rebuild = [&] {
      if (rebuilt_src.empty() && rebuilt_dst.empty()) maps_of_prepared(rebuilt_src, rebuilt_dst);
    };
    const TensorMap& src = vouched ? rebuilt_src : *given_src;
    const TensorMap& dst = vouched ? rebuilt_dst : *given_dst;
    std::exception_ptr failure;
    void* stream = nullptr;
    bool reusable = false;
    try {
      if (vouched && !still_scheduled()) {
        throw_error(ErrorCode::kInvalidState,
                    "execute_as_prepared: no refit of this plan is prepared on this copy service");
      }
      if (!vouched) check_names(src, dst, true);
      const bool same = vouched || (still_scheduled() && same_tensors_as_prepared(src, dst));
      // The same tensors are on the prepared refit's GPU (device_of walks every tensor of host
      // maps).
      stream = stream_on(same ? prepared.device : device_of(src, dst), cuda_stream);
      if (vouched && transform != nullptr && ranged == nullptr) rebuild();
      reusable = same && rerun_transforms(src, dst, stream);
    } catch (...) {
      failure = std::current_exception();
    }
    const auto checked = Clock::now();
    report.check_seconds = std::chrono::duration<double>(checked - started).count();
    // Scheduling is collective: a rank given new tensors alone must not schedule alone (its peers
    // would run the old schedule and both sides time out), so the ranks agree, in one small
    // all-gather per refit, and all prepare again where any one must. A rank that refused its
    // tensors says so in the same all-gather.
    const bool agreed = all_ranks_agree(reusable, failure, "execute_reshard_plan()");
    report.agree_seconds = std::chrono::duration<double>(Clock::now() - checked).count();
    PhaseClock clock{.enabled = service.options().debug.phase_timing,
                     .stream = stream,
                     .issued = &report.issue_seconds};
    if (!agreed) {
      if (vouched) rebuild();
      prepare(src, dst, stream, report);
    }
    if (vouched && transform != nullptr && !(ranged != nullptr && prepared.conversions_recorded()))
      rebuild();
    run_phases(src, dst, stream, cuda_stream, clock, report, nullptr);
    return report;
  }

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
  ReshardReport rerun(void* cuda_stream, const TensorMap* bound_src = nullptr,
                      const TensorMap* bound_dst = nullptr,
                      std::span<const std::uint32_t>* groups = nullptr) {
    if (!still_scheduled()) {
      throw_error(ErrorCode::kInvalidState,
                  "rerun: no refit of this plan is prepared on this copy service (call "
                  "execute_reshard_plan, or the Resharder's execute(), first; clear_requests() "
                  "and another plan's schedule on the service drop it)");
    }
    std::vector<bool> chosen;  // the phases of `groups`
    if (groups != nullptr) {
      chosen.assign(prepared.phases.size(), false);
      for (std::uint32_t g : *groups) {
        if (g >= group_count) {
          throw_error(ErrorCode::kInvalidArgument,
                      "Refit::run: group " + std::to_string(g) + " of a refit of " +
                          std::to_string(group_count) + " group(s) (ReshardOptions::param_groups)");
        }
        for (std::uint32_t p = prepared.group_phases[g]; p < prepared.group_phases[g + 1]; ++p)
          chosen[p] = true;
      }
    }
    const std::vector<bool>* phases = groups != nullptr ? &chosen : nullptr;
    ReshardReport report;
    void* stream = stream_on(prepared.device, cuda_stream);
    PhaseClock clock{.enabled = service.options().debug.phase_timing,
                     .stream = stream,
                     .issued = &report.issue_seconds};
    // A built-in transform's conversions replay (recorded by the last refit), and without a
    // transform nothing reads the maps; a custom transform's hooks run again on the prepared
    // tensors, and must return the wire buffers they were scheduled with.
    TensorMap rebuilt_src, rebuilt_dst;  // left empty where nothing reads them
    const TensorMap* src = bound_src != nullptr ? bound_src : &rebuilt_src;
    const TensorMap* dst = bound_dst != nullptr ? bound_dst : &rebuilt_dst;
    if (transform != nullptr && (ranged == nullptr || !prepared.conversions_recorded())) {
      if (bound_src == nullptr) maps_of_prepared(rebuilt_src, rebuilt_dst);
      if (!rerun_transforms(*src, *dst, stream, phases)) {
        throw_error(ErrorCode::kInvalidState,
                    "rerun: transform '" + transform->name() +
                        "' returned other wire buffers than the refit was scheduled with: "
                        "execute the plan instead, on every rank, to schedule it again");
      }
    }
    try {
      run_phases(*src, *dst, stream, cuda_stream, clock, report, phases);
    } catch (const Error& error) {
      // Ranks agree on nothing before a rerun: one that executes the plan (or stops) while its
      // peers rerun leaves them waiting for it. Say which calls must match.
      if (error.code() != ErrorCode::kTimeout && error.code() != ErrorCode::kPeerFailure) throw;
      throw Error(error.code(),
                  std::string(error.what()) +
                      " [during a run of a prepared refit (Refit::run, rerun_reshard_plan): every "
                      "rank must rerun the same refit together; where any rank executes or "
                      "updates it instead, every rank must]",
                  error.tasks());
    }
    return report;
  }

  // The prepared refit's phases (those `chosen` marks, where given) on `stream` (the caller's
  // `cuda_stream`, or this executor's own, then waited for).
  void run_phases(const TensorMap& src, const TensorMap& dst, void* stream,
                  [[maybe_unused]] void* cuda_stream, PhaseClock& clock, ReshardReport& report,
                  const std::vector<bool>* chosen) {
    execution::ServiceSlot::begin_run(service);
    bool replayed = ranged != nullptr;
#ifdef RESHARD_WITH_CUDA
    // Phase timing waits for each phase, which a pipeline would not show.
    const bool pipelined =
        prepared.pipelined && stream != nullptr && prepared.device >= 0 && !clock.enabled;
    if (pipelined) run_pipelined(src, dst, stream, chosen, replayed);
#else
    const bool pipelined = false;
#endif
    report.pipelined = pipelined;
    // Phase by phase, in stream order: the next phase's conversions reuse the staging of this
    // one, and the copy service lets a phase write a peer's memory only once the peer finished
    // the phases before it.
    for (std::uint32_t p = 0; !pipelined && p < prepared.phases.size(); ++p) {
      if (chosen != nullptr && !(*chosen)[p]) continue;
      Phase& phase = *prepared.phases[p];
      // A built-in transform's conversions: recorded by the first run of the phase since the
      // preparation, replayed by the next ones.
      const bool replay = ranged != nullptr && phase.recorded;
      replayed = replayed && replay;
      convert_or_replay(phase.sends_converted, replay, stream, [&] {
        if (ranged != nullptr) convert_sends(phase, src, stream);
        if (transform) transform->flush(stream);  // the send hooks' conversions
      });
      phase.packs.run(stream);
      clock.mark(report.prepare_seconds);
      transfer_and_convert_locals(p, src, dst, stream, replay);
      clock.mark(report.transfer_seconds);
      phase.unpacks.run(stream);
      convert_or_replay(phase.receives_finalized, replay, stream, [&] {
        finalize_receives(phase, dst, stream);
        if (transform) transform->flush(stream);
      });
      clock.mark(report.finalize_seconds);
      phase.recorded = ranged != nullptr;
    }
    report.conversions_replayed = replayed;
#ifdef RESHARD_WITH_CUDA
    if (cuda_stream == nullptr && stream != nullptr) wait_for_own_stream(stream);
#endif
    report.bytes_sent = prepared.report.bytes_sent;
    report.bytes_received = prepared.report.bytes_received;
    report.packed_bytes = prepared.report.packed_bytes;
    report.strided_bytes = prepared.report.strided_bytes;
    report.locally_converted_bytes = prepared.report.locally_converted_bytes;
    report.staging_bytes = prepared.report.staging_bytes;
    report.phases = prepared.report.phases;
  }
};

Resharder::Resharder(std::shared_ptr<const ReshardPlan> plan, CopyService& service,
                     std::shared_ptr<ReshardTransform> transform, ReshardOptions options)
    : impl_(std::make_unique<Impl>(std::move(plan), service, std::move(transform), options)) {}

bool Resharder::same_options(const ReshardOptions& options) const {
  return Impl::requested_budget(options) == impl_->requested &&
         options.quantize_colocated_on_sender == impl_->colocated_on_sender &&
         options.allow_unknown_names == impl_->allow_unknown_names &&
         options.param_groups == impl_->param_groups;
}

Resharder::~Resharder() = default;

ReshardReport Resharder::execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
  return impl_->execute(src, dst, cuda_stream);
}

ReshardReport Resharder::rerun(void* cuda_stream) { return impl_->rerun(cuda_stream); }

ReshardReport Resharder::execute_as_prepared(void* cuda_stream) {
  return impl_->execute(nullptr, nullptr, cuda_stream);
}

bool Resharder::still_scheduled() const { return impl_->still_scheduled(); }

// ---- Refit: bound once, run many ----

struct Refit::Impl {
  Resharder::Impl executor;
  TensorMap src, dst;  // the bound tensors (the executor's records point into these)
  bool bound = false;  // prepared and scheduled for src and dst (false after a failed update)

  Impl(std::shared_ptr<const ReshardPlan> plan, TensorMap s, TensorMap d, CopyService& service,
       std::shared_ptr<ReshardTransform> transform, const ReshardOptions& options)
      : executor(std::move(plan), service, std::move(transform), options),
        src(std::move(s)),
        dst(std::move(d)) {}

  // `meeting`: the call's name where binding opens it (the ranks may come at different times).
  void bind(void* cuda_stream, ReshardReport& report, const char* meeting = nullptr) {
    bound = false;
    std::exception_ptr failure;
    void* stream = nullptr;
    try {
      stream = executor.stream_on(Resharder::Impl::device_of(src, dst), cuda_stream);
    } catch (...) {
      failure = std::current_exception();
    }
    executor.gather_verdicts({}, failure, meeting);
    executor.prepare(src, dst, stream, report);
#ifdef RESHARD_WITH_CUDA
    if (cuda_stream == nullptr && stream != nullptr) executor.wait_for_own_stream(stream);
#endif
    bound = true;
  }

  // Why run() cannot run, or empty.
  std::string unusable() const {
    if (!bound) {
      return "Refit::run: the last update() of this refit failed, so it holds no schedule; "
             "update() again on every rank with the tensors corrected";
    }
    if (!executor.still_scheduled()) {
      return "Refit::run: the copy service no longer holds this refit's schedule "
             "(clear_requests(), or another refit or plan scheduled on it since); a service "
             "holds one schedule: give each bound refit its own CopyService, or bind again";
    }
    return {};
  }
};

Refit::Refit(std::shared_ptr<const ReshardPlan> plan, TensorMap src, TensorMap dst,
             CopyService& service, std::shared_ptr<ReshardTransform> transform,
             const ReshardOptions& options, void* cuda_stream)
    : impl_(std::make_unique<Impl>(std::move(plan), std::move(src), std::move(dst), service,
                                   std::move(transform), options)) {
  ReshardReport ignored;
  impl_->bind(cuda_stream, ignored, "bind()");
  report_ = impl_->executor.prepared.report;
  report_.rescheduled = true;
}

Refit::~Refit() = default;
Refit::Refit(Refit&&) noexcept = default;
Refit& Refit::operator=(Refit&&) noexcept = default;

ReshardReport Refit::run(void* cuda_stream) {
  if (const std::string why = impl_->unusable(); !why.empty())
    throw_error(ErrorCode::kInvalidState, why);
  return impl_->executor.rerun(cuda_stream, &impl_->src, &impl_->dst);
}

ReshardReport Refit::run(std::span<const std::uint32_t> groups, void* cuda_stream) {
  if (const std::string why = impl_->unusable(); !why.empty())
    throw_error(ErrorCode::kInvalidState, why);
  return impl_->executor.rerun(cuda_stream, &impl_->src, &impl_->dst, &groups);
}

std::uint32_t Refit::groups() const { return impl_->executor.group_count; }

ReshardReport Refit::update(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
  Impl& self = *impl_;
  std::exception_ptr failure;
  // GPU memory freed and allocated again at the same addresses is new memory too.
  bool changed = !self.bound || !self.executor.still_scheduled() ||
                 !self.executor.prepared.allocations.unchanged();
  std::vector<std::pair<TensorMap::iterator, LocalTensor>> previous;  // to restore on failure
  try {
    for (auto [given, bound, role] :
         {std::tuple{&src, &self.src, "source"}, std::tuple{&dst, &self.dst, "destination"}}) {
      for (const auto& [name, tensor] : *given) {
        auto it = bound->find(name);
        if (it == bound->end()) {
          throw_error(ErrorCode::kInvalidArgument,
                      std::string("Refit::update: '") + name + "' is not a " + role +
                          " tensor of this refit on rank " + std::to_string(self.executor.me) +
                          " (only tensors bound at construction can be replaced)");
        }
        std::vector<std::int64_t> shapes;
        if (!TensorIdentity::of(it->second, shapes).matches(tensor, shapes)) changed = true;
        previous.emplace_back(it, it->second);
        it->second = tensor;
      }
    }
  } catch (...) {
    failure = std::current_exception();
  }
  auto restore = [&] {
    for (auto& [it, tensor] : previous) it->second = std::move(tensor);
  };
  // Collective: where no rank's tensors changed, nothing is prepared again. A refusal (a name
  // not bound, on any rank) leaves every rank's refit as it was.
  bool unchanged = false;
  try {
    unchanged = self.executor.all_ranks_agree(!changed, failure, "update()");
  } catch (...) {
    restore();
    throw;
  }
  if (unchanged) {
    ReshardReport report = report_;
    report.rescheduled = false;
    return report;
  }
  try {
    ReshardReport ignored;
    self.bind(cuda_stream, ignored);
  } catch (...) {
    // The preparation was dropped part way: the refit runs again only after an update() that
    // succeeds (Impl::unusable says so).
    restore();
    self.bound = false;
    throw;
  }
  report_ = self.executor.prepared.report;
  report_.rescheduled = true;
  return report_;
}

std::vector<std::uint32_t> layer_groups(const ReshardPlan& plan, std::vector<std::string>* names) {
  std::vector<std::string> params;
  for (const ParamSpec& param : plan.params()) params.push_back(param.name);
  return layer_groups(std::span<const std::string>(params), names);
}

std::vector<std::uint32_t> layer_groups(std::span<const std::string> params,
                                        std::vector<std::string>* names) {
  // The name up to and including its first dotted part that is all digits, or empty.
  auto layer_of = [](std::string_view name) -> std::string_view {
    std::size_t start = 0;
    while (start <= name.size()) {
      const std::size_t end = std::min(name.find('.', start), name.size());
      const std::string_view part = name.substr(start, end - start);
      if (!part.empty() &&
          std::all_of(part.begin(), part.end(), [](char c) { return c >= '0' && c <= '9'; }))
        return name.substr(0, end);
      start = end + 1;
    }
    return {};
  };
  std::vector<std::uint32_t> groups(params.size());
  std::vector<std::string> found;
  std::unordered_map<std::string_view, std::uint32_t> number;
  auto group_named = [&](std::string_view name) {
    auto [it, added] = number.emplace(name, static_cast<std::uint32_t>(found.size()));
    if (added) found.emplace_back(name);
    return it->second;
  };
  for (std::size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params[i];
    const std::string_view layer = layer_of(name);
    groups[i] = group_named(!layer.empty()                            ? layer
                            : name.find("embed") != std::string::npos ? "embeddings"
                                                                      : "head");
  }
  if (names != nullptr) *names = std::move(found);
  return groups;
}

const TensorMap& Refit::sources() const { return impl_->src; }
const TensorMap& Refit::destinations() const { return impl_->dst; }
CopyService& Refit::service() const { return impl_->executor.service; }

}  // namespace reshard

// The executor: turns this rank's share of a reshard plan into copy-service requests once, then
// only packs, runs and unpacks at every refit.
#include "reshard/resharder.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <span>
#include <sstream>
#include <tuple>

#include "core/env.hpp"
#include "execution/staging.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "transforms/wire_ranges.hpp"

namespace reshard {
namespace {

// An op's wire buffer i of n travels under op.task_id | n << 4 | i: both sides derive it, and
// sides that disagree on n cannot match by accident.
TaskId wire_task(TaskId op_task, std::size_t count, std::size_t index) {
  return op_task | (static_cast<TaskId>(count) << 4) | static_cast<TaskId>(index);
}

// One op as this rank takes part in it (as sender or receiver).
struct Side {
  const TransferOp* op = nullptr;
  const Shard* shard = nullptr;  // this rank's shard of the parameter
  bool transformed = false;
  std::vector<exec::WireRange> wire;
  exec::BoxView view;  // the slice in the local tensor (rows merged)
};

// A local op whose transform converts it in place (converts_locally): no wire, no request.
struct LocalSide {
  OpSlice from, to;  // the op's source and destination slices on this rank
};

using RegistrationKey =
    std::tuple<bool, TaskId, const void*, std::size_t, std::size_t, std::uint64_t, PeId>;

std::string where(const ReshardPlan& plan, const TransferOp& op) {
  std::ostringstream text;
  text << "'" << plan.params()[op.param].name << "' " << op.region.str() << " (rank " << op.src_rank
       << " -> rank " << op.dst_rank << ")";
  return text.str();
}

}  // namespace

struct Resharder::Impl {
  std::shared_ptr<const ReshardPlan> plan;
  CopyService& service;
  std::shared_ptr<ReshardTransform> transform;
  exec::RangedTransform* ranged;  // the transform, where it offers strided wire ranges
  PeId me;
  bool rows_in_place;  // strided slices travel in place (CopyService::moves_rows_in_place)
  std::vector<const TransferOp*> send_ops, recv_ops;
  std::vector<const std::string*> send_params, recv_params;  // each once, in op order
  exec::StagingPool staging;
  // This rank's sides of the ops, as registered and scheduled for `tensors`.
  struct Prepared {
    bool valid = false;
    std::vector<Side> sends, receives;
    std::vector<LocalSide> locals;
    int device = -1;                      // the GPU of the tensors (device_of)
    std::vector<bool> converted_locally;  // by op index in the plan
    exec::BlockCopyBatch packs, unpacks;
    std::vector<LocalTensor> tensors;
    ReshardReport report;  // the byte counts, the same at every refit
  } prepared;
  std::vector<RegistrationKey> registered;
  std::uint64_t registered_generation = UINT64_MAX;
  void* own_stream = nullptr;
  int own_stream_device = -1;
  // With local conversions on a GPU, the transfer runs on a stream of the highest priority,
  // ordered after the caller's (fork) and before the caller's later work (join), while the
  // conversions run on the caller's: the GPU's CTA scheduler then gives the transfer's kernels
  // the SMs they ask for first and the conversions the rest.
  void* transfer_stream = nullptr;
  void* transfer_fork = nullptr;
  void* transfer_join = nullptr;
  int transfer_stream_device = -1;

  Impl(std::shared_ptr<const ReshardPlan> p, CopyService& s, std::shared_ptr<ReshardTransform> t)
      : plan(std::move(p)),
        service(s),
        transform(std::move(t)),
        ranged(dynamic_cast<exec::RangedTransform*>(transform.get())),
        me(s.my_pe()),
        rows_in_place(s.moves_rows_in_place()) {
    if (!plan) throw_error(ErrorCode::kInvalidArgument, "Resharder: null plan");
    for (const TransferOp& op : plan->ops()) {
      if (op.src_rank >= service.n_pes() || op.dst_rank >= service.n_pes()) {
        throw_error(ErrorCode::kInvalidArgument, "the plan moves " + where(*plan, op) +
                                                     " but the service has only " +
                                                     std::to_string(service.n_pes()) + " PEs");
      }
      if (op.src_rank == me) send_ops.push_back(&op);
      if (op.dst_rank == me) recv_ops.push_back(&op);
    }
    for (auto [ops, names] :
         {std::pair{&send_ops, &send_params}, std::pair{&recv_ops, &recv_params}}) {
      std::vector<bool> seen(plan->params().size());
      for (const TransferOp* op : *ops) {
        if (seen[op->param]) continue;
        seen[op->param] = true;
        names->push_back(&plan->params()[op->param].name);
      }
    }
    check_same_plan_everywhere();
  }

  // Collective: ranks that built different plans (from different layouts) would register task
  // ids that match nothing; say so plainly instead, naming the ranks and the first parameter
  // whose transfers differ.
  void check_same_plan_everywhere() {
    const std::uint64_t mine[] = {plan->fingerprint(), plan->ops().size(), plan->params().size()};
    const auto all = service.all_gather(std::as_bytes(std::span(mine)));
    std::vector<std::array<std::uint64_t, 3>> theirs(all.size());
    for (std::size_t r = 0; r < all.size(); ++r) std::memcpy(theirs[r].data(), all[r].data(), 24);
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

  ~Impl() {
#ifdef RESHARD_WITH_CUDA
    if (own_stream != nullptr) exec::cuda::destroy_stream(own_stream_device, own_stream);
    if (transfer_stream != nullptr) destroy_transfer_stream();
#endif
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
  static int device_of(const TensorMap& src, const TensorMap& dst) {
    int device = -1;
    for (const TensorMap* map : {&src, &dst}) {
      for (const auto& [name, tensor] : *map) {
        if (tensor.data.kind == MemoryKind::kCuda) device = tensor.data.device;
      }
    }
    return device;
  }

  void* stream_for(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
    if (cuda_stream != nullptr) return cuda_stream;
    const int device = device_of(src, dst);
    if (device < 0) return nullptr;
#ifdef RESHARD_WITH_CUDA
    if (own_stream == nullptr) {
      own_stream = exec::cuda::create_stream(device);
      own_stream_device = device;
    }
    return own_stream;
#else
    throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
  }

  // The wire buffers the transform returns for a transformed side (its hooks run at every refit:
  // the sender's converts the data now).
  std::vector<exec::WireRange> transform_wire(const Side& side, const LocalTensor& tensor,
                                              bool sending, void* stream) const {
    const TransferOp& op = *side.op;
    const Box local = sending ? op.src_box() : op.dst_box();
    const OpSlice slice{plan->params()[op.param], op, local, side.shard->local_shape};
    std::vector<exec::WireRange> wire;
    if (ranged != nullptr && rows_in_place) {
      // The built-in transforms: strided slices go from and land in the tensors in place.
      wire =
          sending ? ranged->send_ranges(slice, tensor, stream) : ranged->recv_ranges(slice, tensor);
    } else {
      for (const Buffer& buffer : sending ? transform->prepare_send(slice, tensor, stream)
                                          : transform->prepare_recv(slice, tensor))
        wire.push_back(exec::WireRange::whole(buffer));
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
  // (receiving) a non-contiguous slice needs, added to `copies`.
  Side prepare_side(const TransferOp& op, const TensorMap& tensors, bool sending, void* stream,
                    exec::BlockCopyBatch& copies, ReshardReport& report) {
    const Layout& layout = sending ? plan->src_layout() : plan->dst_layout();
    Side side;
    side.op = &op;
    const LocalTensor& tensor = tensor_for(tensors, layout, op, sending, side.shard);
    side.transformed = transforms(op);
    if (side.transformed) {
      side.wire = transform_wire(side, tensor, sending, stream);
      return side;
    }
    side.view = exec::view_of(sending ? op.src_box() : op.dst_box(), side.shard->local_shape, true);
    const std::size_t element = dtype_size(tensor.dtype);
    // A strided slice travels in place where the transport copies rows at full speed: no
    // staging, no pack, no unpack.
    if (side.view.contiguous() || rows_in_place) {
      side.wire.push_back({tensor.data, exec::strided_range_of(side.view, element)});
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
    if (!transform->converts_locally(local.from, from, local.to, to)) return false;
    prepared.locals.push_back(local);
    prepared.converted_locally[&op - plan->ops().data()] = true;
    prepared.report.locally_converted_bytes += op.bytes;
    return true;
  }

  // Queues the local ops' conversions on `stream`.
  void convert_locals(const TensorMap& src, const TensorMap& dst, void* stream) {
    if (prepared.locals.empty()) return;
    for (const LocalSide& local : prepared.locals) {
      const std::string& name = local.from.param.name;
      transform->convert_local(local.from, src.at(name), local.to, dst.at(name), stream);
    }
    transform->flush(stream);
  }

  // Runs the copy service and the local ops' conversions side by side: the transfer on the
  // high-priority stream where there are conversions on a GPU, on `stream` otherwise.
  void transfer_and_convert_locals(const TensorMap& src, const TensorMap& dst, void* stream) {
#ifdef RESHARD_WITH_CUDA
    if (!prepared.locals.empty() && stream != nullptr && prepared.device >= 0) {
      if (transfer_stream != nullptr && transfer_stream_device != prepared.device) {
        destroy_transfer_stream();
      }
      if (transfer_stream == nullptr) {
        transfer_stream = exec::cuda::create_stream(prepared.device, /*high_priority=*/true);
        transfer_fork = exec::cuda::create_event(prepared.device);
        transfer_join = exec::cuda::create_event(prepared.device);
        transfer_stream_device = prepared.device;
      }
      exec::cuda::order_after(transfer_stream, stream, transfer_fork);
      service.run(transfer_stream);
      convert_locals(src, dst, stream);
      exec::cuda::order_after(stream, transfer_stream, transfer_join);
      return;
    }
#endif
    service.run(stream);
    convert_locals(src, dst, stream);
  }

#ifdef RESHARD_WITH_CUDA
  void destroy_transfer_stream() {
    exec::cuda::destroy_stream(transfer_stream_device, transfer_stream);
    exec::cuda::destroy_event(transfer_stream_device, transfer_fork);
    exec::cuda::destroy_event(transfer_stream_device, transfer_join);
    transfer_stream = nullptr;
  }
#endif

  std::vector<RegistrationKey> registration_keys(const std::vector<Side>& sends,
                                                 const std::vector<Side>& receives) const {
    std::vector<RegistrationKey> keys;
    for (const auto* list : {&sends, &receives}) {
      const bool sending = list == &sends;
      for (const Side& side : *list) {
        for (std::size_t i = 0; i < side.wire.size(); ++i) {
          const exec::WireRange& w = side.wire[i];
          keys.emplace_back(sending, wire_task(side.op->task_id, side.wire.size(), i),
                            w.buffer.data, w.range.pos, w.range.bytes(), w.range.row_bytes,
                            sending ? side.op->dst_rank : side.op->src_rank);
        }
      }
    }
    return keys;
  }

  void register_and_schedule(const std::vector<Side>& sends, const std::vector<Side>& receives) {
    service.clear_requests();
    for (const Side& side : sends) {
      for (std::size_t i = 0; i < side.wire.size(); ++i) {
        const exec::WireRange& w = side.wire[i];
        service.register_send(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.range,
                              side.op->dst_rank);
      }
    }
    for (const Side& side : receives) {
      for (std::size_t i = 0; i < side.wire.size(); ++i) {
        const exec::WireRange& w = side.wire[i];
        service.register_receive(wire_task(side.op->task_id, side.wire.size(), i), w.buffer,
                                 w.range, side.op->src_rank);
      }
    }
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
      const TaskId op_task = (task >> kSubTaskBits) << kSubTaskBits;
      auto it = std::find_if(plan->ops().begin(), plan->ops().end(),
                             [&](const TransferOp& op) { return op.task_id == op_task; });
      if (it == plan->ops().end() || ++shown > 8) continue;
      const std::size_t count = (task >> 4) & 0xf;
      text << "\n  - task " << task << " is wire buffer " << (task & 0xf) + 1 << " of " << count
           << " of " << where(*plan, *it);
    }
    text << "\n(wire buffers without a partner mean the sender's and the receiver's transform "
            "returned different numbers or sizes of buffers for the same op)";
    return text.str();
  }

  // What a prepared refit depends on: every tensor this rank's ops touch, in op order.
  std::vector<LocalTensor> tensors_used(const TensorMap& src, const TensorMap& dst) const {
    std::vector<LocalTensor> used;
    used.reserve(send_params.size() + recv_params.size());
    for (const auto& [params, map] :
         {std::pair{&send_params, &src}, std::pair{&recv_params, &dst}}) {
      for (const std::string* name : *params) {
        auto it = map->find(*name);
        used.push_back(it == map->end() ? LocalTensor{} : it->second);
      }
    }
    return used;
  }

  static bool same_tensors(const std::vector<LocalTensor>& a, const std::vector<LocalTensor>& b) {
    auto same_buffer = [](const Buffer& x, const Buffer& y) {
      return x.data == y.data && x.bytes == y.bytes && x.kind == y.kind && x.device == y.device;
    };
    return std::equal(
        a.begin(), a.end(), b.begin(), b.end(), [&](const LocalTensor& x, const LocalTensor& y) {
          return x.dtype == y.dtype && same_buffer(x.data, y.data) && same_buffer(x.scale, y.scale);
        });
  }

  // Re-runs the transform hooks of a prepared refit; false when a transform returned other wire
  // buffers than those scheduled (the refit is then prepared again).
  bool rerun_transforms(const TensorMap& src, const TensorMap& dst, void* stream) {
    for (auto [sides, map, sending] :
         {std::tuple{&prepared.sends, &src, true}, std::tuple{&prepared.receives, &dst, false}}) {
      for (Side& side : *sides) {
        if (!side.transformed) continue;
        const LocalTensor& tensor = map->at(plan->params()[side.op->param].name);
        const std::vector<exec::WireRange> wire = transform_wire(side, tensor, sending, stream);
        const bool same = std::equal(wire.begin(), wire.end(), side.wire.begin(), side.wire.end(),
                                     [](const exec::WireRange& a, const exec::WireRange& b) {
                                       return a.buffer.data == b.buffer.data &&
                                              a.range.bytes() == b.range.bytes();
                                     });
        if (!same) return false;
      }
    }
    return true;
  }

  // Prepares this rank's sides for `tensors` (tensors_used of src and dst).
  void prepare(const TensorMap& src, const TensorMap& dst, std::vector<LocalTensor> tensors,
               void* stream, ReshardReport& report) {
    prepared.sends.clear();
    prepared.receives.clear();
    prepared.locals.clear();
    prepared.converted_locally.assign(plan->ops().size(), false);
    prepared.device = device_of(src, dst);
    prepared.packs.clear();
    prepared.unpacks.clear();
    prepared.report = ReshardReport{};
    ReshardReport& counts = prepared.report;
    for (const TransferOp* op : send_ops) {
      if (op->local() && converts_locally(*op, src, dst)) continue;
      prepared.sends.push_back(prepare_side(*op, src, true, stream, prepared.packs, counts));
      if (!op->local()) counts.bytes_sent += op->bytes;
    }
    for (const TransferOp* op : recv_ops) {
      if (prepared.converted_locally[op - plan->ops().data()]) continue;
      prepared.receives.push_back(prepare_side(*op, dst, false, stream, prepared.unpacks, counts));
      if (!op->local()) counts.bytes_received += op->bytes;
    }
    // New tensors always mean a new schedule, even where the registrations happen to match
    // (buffers a transform owns): whether a rank schedules must not depend on what its
    // transform returns, since every rank that changed its tensors schedules together.
    std::vector<RegistrationKey> keys = registration_keys(prepared.sends, prepared.receives);
    const bool new_tensors = !prepared.tensors.empty() && !same_tensors(tensors, prepared.tensors);
    if (new_tensors || keys != registered || service.generation() != registered_generation) {
      if (registered.empty()) {
        RESHARD_LOG(kDebug, "scheduling the reshard plan: " << keys.size() << " requests here");
      } else {
        RESHARD_LOG(kInfo, "reshard buffers changed since the last schedule: rescheduling "
                               << keys.size() << " requests");
      }
      const bool first = registered.empty() && registered_generation == UINT64_MAX;
      registered.clear();
      try {
        register_and_schedule(prepared.sends, prepared.receives);
      } catch (const Error& error) {
        if (first || error.code() != ErrorCode::kTimeout) throw;
        throw Error(ErrorCode::kTimeout,
                    std::string(error.what()) + "\n(rank " + std::to_string(me) +
                        " scheduled again because its tensors or wire buffers changed since the "
                        "last refit; scheduling is collective, so every rank must pass its new "
                        "tensors in the same refit)");
      }
      registered = std::move(keys);
      registered_generation = service.generation();
      report.rescheduled = true;
    }
    prepared.tensors = std::move(tensors);
    prepared.valid = true;
  }

  // With RESHARD_PHASE_TIMING, waits for the work queued so far and adds the time since the
  // last mark to `phase`.
  struct PhaseClock {
    bool enabled = env::phase_timing();
    void* stream = nullptr;
    double* issued = nullptr;
    std::chrono::steady_clock::time_point last = std::chrono::steady_clock::now();
    void mark(double& phase) {
      if (!enabled) return;
      *issued += std::chrono::duration<double>(std::chrono::steady_clock::now() - last).count();
#ifdef RESHARD_WITH_CUDA
      if (stream != nullptr) exec::cuda::synchronize_stream(stream);
#endif
      const auto now = std::chrono::steady_clock::now();
      phase += std::chrono::duration<double>(now - last).count();
      last = now;
    }
  };

  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
    ReshardReport report;
    void* stream = stream_for(src, dst, cuda_stream);
    PhaseClock clock{.stream = stream, .issued = &report.issue_seconds};
    // A refit with the same tensors as the last one reuses its sides, packs and schedule; only
    // the transforms' hooks run again.
    std::vector<LocalTensor> tensors = tensors_used(src, dst);
    const bool reuse = prepared.valid && service.generation() == registered_generation &&
                       same_tensors(tensors, prepared.tensors) &&
                       rerun_transforms(src, dst, stream);
    if (!reuse) {
      prepared.valid = false;
      prepare(src, dst, std::move(tensors), stream, report);
    }
    if (transform) transform->flush(stream);  // the send hooks' conversions
    prepared.packs.run(stream);
    clock.mark(report.prepare_seconds);
    transfer_and_convert_locals(src, dst, stream);
    clock.mark(report.transfer_seconds);
    prepared.unpacks.run(stream);
    for (const Side& side : prepared.receives) {
      if (!side.transformed) continue;
      const TransferOp& op = *side.op;
      const LocalTensor& tensor = dst.at(plan->params()[op.param].name);
      std::vector<Buffer> buffers;
      for (const exec::WireRange& w : side.wire) buffers.push_back(w.buffer);
      const OpSlice slice{plan->params()[op.param], op, op.dst_box(), side.shard->local_shape};
      transform->finalize_recv(slice, tensor, buffers, stream);
    }
    if (transform) transform->flush(stream);
    clock.mark(report.finalize_seconds);
#ifdef RESHARD_WITH_CUDA
    if (cuda_stream == nullptr && stream != nullptr) exec::cuda::synchronize_stream(stream);
#endif
    report.bytes_sent = prepared.report.bytes_sent;
    report.bytes_received = prepared.report.bytes_received;
    report.packed_bytes = prepared.report.packed_bytes;
    report.strided_bytes = prepared.report.strided_bytes;
    report.locally_converted_bytes = prepared.report.locally_converted_bytes;
    return report;
  }
};

Resharder::Resharder(std::shared_ptr<const ReshardPlan> plan, CopyService& service,
                     std::shared_ptr<ReshardTransform> transform)
    : impl_(std::make_unique<Impl>(std::move(plan), service, std::move(transform))) {}

Resharder::~Resharder() = default;

ReshardReport Resharder::execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
  return impl_->execute(src, dst, cuda_stream);
}

namespace {

// The executors execute_reshard_plan keeps on a service, by plan and transform.
struct ExecutorCache {
  std::map<std::pair<const ReshardPlan*, const ReshardTransform*>,
           std::pair<std::shared_ptr<const ReshardPlan>, std::unique_ptr<Resharder>>>
      executors;
};

}  // namespace

ReshardReport execute_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                   const TensorMap& src, const TensorMap& dst, CopyService& service,
                                   std::shared_ptr<ReshardTransform> transform, void* cuda_stream) {
  std::shared_ptr<void>& slot = service.attachment();
  if (!slot) slot = std::make_shared<ExecutorCache>();
  auto& cache = static_cast<ExecutorCache*>(slot.get())->executors;
  auto key = std::make_pair(plan.get(), transform.get());
  auto it = cache.find(key);
  if (it == cache.end()) {
    // The plan is held alongside so its address cannot be reused by another plan.
    it = cache
             .emplace(key,
                      std::make_pair(plan, std::make_unique<Resharder>(plan, service, transform)))
             .first;
  }
  return it->second.second->execute(src, dst, cuda_stream);
}

}  // namespace reshard

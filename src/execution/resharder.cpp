// The executor: turns this rank's share of a reshard plan into copy-service requests once, then
// only packs, runs and unpacks at every refit.
#include "reshard/resharder.hpp"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "execution/staging.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"

namespace reshard {
namespace {

// An op's wire buffer i of n travels under op.task_id | n << 4 | i: both sides derive it, and
// sides that disagree on n cannot match by accident.
TaskId wire_task(TaskId op_task, std::size_t count, std::size_t index) {
  return op_task | (static_cast<TaskId>(count) << 4) | static_cast<TaskId>(index);
}

struct WireRef {
  Buffer buffer;
  std::size_t pos = 0;
  std::size_t size = 0;
};

// One op as this rank takes part in it (as sender or receiver).
struct Side {
  const TransferOp* op = nullptr;
  const Shard* shard = nullptr;  // this rank's shard of the parameter
  bool transformed = false;
  std::vector<WireRef> wire;
  exec::Staging* staging = nullptr;  // set when the slice is packed through staging
  exec::BoxView view;                // the slice in the local tensor (rows merged)
};

using RegistrationKey = std::tuple<bool, TaskId, const void*, std::size_t, std::size_t, PeId>;

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
  PeId me;
  std::vector<const TransferOp*> send_ops, recv_ops;
  std::map<std::pair<bool, TaskId>, exec::Staging> staging;  // (is send, op task) -> memory
  std::vector<RegistrationKey> registered;
  std::uint64_t registered_generation = UINT64_MAX;
  void* own_stream = nullptr;
  int own_stream_device = -1;

  Impl(std::shared_ptr<const ReshardPlan> p, CopyService& s, std::shared_ptr<ReshardTransform> t)
      : plan(std::move(p)), service(s), transform(std::move(t)), me(s.my_pe()) {
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
  }

  ~Impl() {
#ifdef RESHARD_WITH_CUDA
    if (own_stream != nullptr) exec::cuda::destroy_stream(own_stream_device, own_stream);
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
    const std::size_t need = elements * dtype_size(tensor.dtype);
    if (tensor.data.data == nullptr || tensor.data.bytes < need) {
      throw_error(ErrorCode::kInvalidArgument,
                  std::string(role) + " tensor '" + param.name + "' on rank " + std::to_string(me) +
                      " holds " + std::to_string(tensor.data.bytes) + " bytes; its local shape " +
                      Box::whole(shard->local_shape).str() + " needs " + std::to_string(need));
    }
    return tensor;
  }

  void* stream_for(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
    if (cuda_stream != nullptr) return cuda_stream;
    int device = -1;
    for (const TensorMap* map : {&src, &dst}) {
      for (const auto& [name, tensor] : *map) {
        if (tensor.data.kind == MemoryKind::kCuda) device = tensor.data.device;
      }
    }
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

  Side prepare_side(const TransferOp& op, const TensorMap& tensors, bool sending, void* stream,
                    ReshardReport& report) {
    const Layout& layout = sending ? plan->src_layout() : plan->dst_layout();
    Side side;
    side.op = &op;
    const LocalTensor& tensor = tensor_for(tensors, layout, op, sending, side.shard);
    const Box local = sending ? op.src_box() : op.dst_box();
    side.transformed = transforms(op);
    if (side.transformed) {
      const OpSlice slice{plan->params()[op.param], op, local, side.shard->local_shape};
      std::vector<Buffer> buffers = sending ? transform->prepare_send(slice, tensor, stream)
                                            : transform->prepare_recv(slice, tensor);
      if (buffers.empty() || buffers.size() > static_cast<std::size_t>(kMaxWireBuffers)) {
        throw_error(ErrorCode::kInvalidArgument,
                    "transform '" + transform->name() + "' returned " +
                        std::to_string(buffers.size()) + " wire buffers for " + where(*plan, op) +
                        " (1.." + std::to_string(kMaxWireBuffers) + " allowed)");
      }
      for (const Buffer& buffer : buffers) side.wire.push_back({buffer, 0, buffer.bytes});
      return side;
    }
    side.view = exec::view_of(local, side.shard->local_shape, true);
    const std::size_t element = dtype_size(tensor.dtype);
    if (side.view.contiguous()) {
      side.wire.push_back(
          {tensor.data, static_cast<std::size_t>(side.view.base) * element, op.bytes});
      return side;
    }
    side.staging = &staging[{sending, op.task_id}];
    side.staging->fit(tensor.data, op.bytes);
    side.wire.push_back({side.staging->buffer(), 0, op.bytes});
    report.packed_bytes += op.bytes;
    if (sending) exec::pack_block(tensor.data, side.view, element, side.staging->buffer(), stream);
    return side;
  }

  std::vector<RegistrationKey> registration_keys(const std::vector<Side>& sends,
                                                 const std::vector<Side>& receives) const {
    std::vector<RegistrationKey> keys;
    for (const auto* list : {&sends, &receives}) {
      const bool sending = list == &sends;
      for (const Side& side : *list) {
        for (std::size_t i = 0; i < side.wire.size(); ++i) {
          const WireRef& w = side.wire[i];
          keys.emplace_back(sending, wire_task(side.op->task_id, side.wire.size(), i),
                            w.buffer.data, w.pos, w.size,
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
        const WireRef& w = side.wire[i];
        service.register_send(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.pos,
                              w.size, side.op->dst_rank);
      }
    }
    for (const Side& side : receives) {
      for (std::size_t i = 0; i < side.wire.size(); ++i) {
        const WireRef& w = side.wire[i];
        service.register_receive(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.pos,
                                 w.size, side.op->src_rank);
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

  ReshardReport execute(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
    ReshardReport report;
    void* stream = stream_for(src, dst, cuda_stream);
    std::vector<Side> sends, receives;
    sends.reserve(send_ops.size());
    receives.reserve(recv_ops.size());
    for (const TransferOp* op : send_ops) {
      sends.push_back(prepare_side(*op, src, true, stream, report));
      if (!op->local()) report.bytes_sent += op->bytes;
    }
    for (const TransferOp* op : recv_ops) {
      receives.push_back(prepare_side(*op, dst, false, stream, report));
      if (!op->local()) report.bytes_received += op->bytes;
    }
    std::vector<RegistrationKey> keys = registration_keys(sends, receives);
    if (keys != registered || service.generation() != registered_generation) {
      if (registered.empty()) {
        RESHARD_LOG(kDebug, "scheduling the reshard plan: " << keys.size() << " requests here");
      } else {
        RESHARD_LOG(kInfo, "reshard buffers changed since the last schedule: rescheduling "
                               << keys.size() << " requests");
      }
      registered.clear();
      register_and_schedule(sends, receives);
      registered = std::move(keys);
      registered_generation = service.generation();
      report.rescheduled = true;
    }
    service.run(stream);
    for (const Side& side : receives) {
      const TransferOp& op = *side.op;
      const LocalTensor& tensor = dst.at(plan->params()[op.param].name);
      if (side.transformed) {
        std::vector<Buffer> buffers;
        for (const WireRef& w : side.wire) buffers.push_back(w.buffer);
        const OpSlice slice{plan->params()[op.param], op, op.dst_box(), side.shard->local_shape};
        transform->finalize_recv(slice, tensor, buffers, stream);
      } else if (side.staging != nullptr) {
        exec::unpack_block(side.staging->buffer(), tensor.data, side.view, dtype_size(tensor.dtype),
                           stream);
      }
    }
#ifdef RESHARD_WITH_CUDA
    if (cuda_stream == nullptr && stream != nullptr) exec::cuda::synchronize_stream(stream);
#endif
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

// A refit's phases, at every refit: each phase's conversions (recorded by the first refit and
// replayed), packs, transfer and unpacks, in stream order, or pipelined across two staging regions
// on a GPU.
#include <chrono>

#include "execution/resharder_impl.hpp"
#include "reshard/error.hpp"
#include "service/service_slot.hpp"

namespace reshard {

int Resharder::Impl::device_of(const TensorMap& src, const TensorMap& dst) {
  for (const TensorMap* map : {&src, &dst}) {
    for (const auto& [name, tensor] : *map) {
      if (tensor.data.kind == MemoryKind::kCuda) return tensor.data.device;
    }
  }
  return -1;
}

void* Resharder::Impl::stream_on(int device, void* cuda_stream) {
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
void Resharder::Impl::wait_for_own_stream(void* stream) {
  service.synchronize();
  execution::cuda::synchronize_stream(stream);
}
#endif

void Resharder::Impl::convert_locals(Phase& phase, const TensorMap& src, const TensorMap& dst,
                                     void* stream, bool replay) {
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

void Resharder::Impl::transfer_and_convert_locals(std::uint32_t p, const TensorMap& src,
                                                  const TensorMap& dst, void* stream, bool replay) {
  Phase& phase = *prepared.phases[p];
  // The service has phases up to the last any PE registered a request in: one of only local
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
void Resharder::Impl::use_transfer_stream() {
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
#endif

#ifdef RESHARD_WITH_CUDA
void Resharder::Impl::destroy_transfer_stream() {
  execution::cuda::destroy_stream(transfer_stream_device, transfer_stream);
  for (void* event : {transfer_fork, transfer_join, region_read[0], region_read[1]})
    execution::cuda::destroy_event(transfer_stream_device, event);
  transfer_stream = nullptr;
}
#endif

#ifdef RESHARD_WITH_CUDA
void Resharder::Impl::run_pipelined(const TensorMap& src, const TensorMap& dst, void* stream,
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

void Resharder::Impl::convert_sends(const Phase& phase, const TensorMap& src, void* stream) {
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

void Resharder::Impl::finalize_receives(const Phase& phase, const TensorMap& dst, void* stream) {
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

void Resharder::Impl::run_phases(const TensorMap& src, const TensorMap& dst, void* stream,
                                 [[maybe_unused]] void* cuda_stream, PhaseClock& clock,
                                 ReshardReport& report, const std::vector<bool>* chosen) {
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
    clock.mark(report.timing.prepare_seconds);
    transfer_and_convert_locals(p, src, dst, stream, replay);
    clock.mark(report.timing.transfer_seconds);
    phase.unpacks.run(stream);
    convert_or_replay(phase.receives_finalized, replay, stream, [&] {
      finalize_receives(phase, dst, stream);
      if (transform) transform->flush(stream);
    });
    clock.mark(report.timing.finalize_seconds);
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

}  // namespace reshard

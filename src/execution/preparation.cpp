// A refit's preparation, once per set of tensors: this PE's sides of the plan's ops, the wire
// buffers a transform makes of them, packs and unpacks, the staging phases every PE agrees on,
// and the copy service's schedule.
#include <chrono>
#include <cstring>
#include <set>
#include <sstream>
#include <tuple>

#include "core/message.hpp"
#include "execution/phase_assignment.hpp"
#include "execution/resharder_impl.hpp"
#include "execution/task_ids.hpp"
#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_device.hpp"
#endif
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "service/service_slot.hpp"

namespace reshard {

using execution::wire_task;

std::vector<execution::WireRange> Resharder::Impl::transform_wire(const Side& side,
                                                                  const LocalTensor& tensor,
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
    throw_error(ErrorCode::kInvalidArgument, "transform '" + transform->name() + "' returned " +
                                                 std::to_string(wire.size()) +
                                                 " wire buffers for " + where(*plan, op) + " (1.." +
                                                 std::to_string(kMaxWireBuffers) + " allowed)");
  }
  return wire;
}

execution::Side Resharder::Impl::prepare_side(const TransferOp& op, const TensorMap& tensors,
                                              bool sending, void* stream,
                                              execution::BlockCopyBatch& copies,
                                              ReshardReport& report) {
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

bool Resharder::Impl::converts_locally(const TransferOp& op, const TensorMap& src,
                                       const TensorMap& dst) {
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

void Resharder::Impl::register_and_schedule(const std::vector<Side>& sends,
                                            const std::vector<Side>& receives) {
  execution::ServiceSlot::clear_requests(service);
  for (const Side& side : sends) {
    service.set_phase(side.phase);
    for (std::size_t i = 0; i < side.wire.size(); ++i) {
      const execution::WireRange& w = side.wire[i];
      service.register_send(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.range,
                            side.op->dst_pe);
    }
  }
  for (const Side& side : receives) {
    service.set_phase(side.phase);
    for (std::size_t i = 0; i < side.wire.size(); ++i) {
      const execution::WireRange& w = side.wire[i];
      service.register_receive(wire_task(side.op->task_id, side.wire.size(), i), w.buffer, w.range,
                               side.op->src_pe);
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

std::vector<LocalTensor> Resharder::Impl::tensors_used(const TensorMap& src,
                                                       const TensorMap& dst) const {
  std::vector<LocalTensor> used;
  used.reserve(param_names.size());
  for (std::size_t i = 0; i < param_names.size(); ++i) {
    const TensorMap& map = map_of(i, src, dst);
    auto it = map.find(param_names[i]);
    used.push_back(it == map.end() ? LocalTensor{} : it->second);
  }
  return used;
}

bool Resharder::Impl::same_tensors_as_prepared(const TensorMap& src, const TensorMap& dst) const {
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

bool Resharder::Impl::same_wire(const std::vector<execution::WireRange>& a,
                                const std::vector<execution::WireRange>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end(),
                    [](const execution::WireRange& x, const execution::WireRange& y) {
                      return x.buffer.data == y.buffer.data && x.range.bytes() == y.range.bytes();
                    });
}

bool Resharder::Impl::rerun_transforms(const TensorMap& src, const TensorMap& dst, void* stream,
                                       const std::vector<bool>* phases) {
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

bool Resharder::Impl::all_ranks_agree(bool mine, const std::exception_ptr& failure,
                                      const char* meeting) {
  const std::byte flag{static_cast<unsigned char>(mine ? 1 : 0)};
  const auto all = gather_verdicts(std::span<const std::byte>(&flag, 1), failure, meeting);
  return std::all_of(all.begin(), all.end(), [](const std::vector<std::byte>& part) {
    return part.size() == 1 && part[0] == std::byte{1};
  });
}

std::vector<std::uint32_t> Resharder::Impl::assign_phases(
    const std::map<execution::StagingPool::OpKey, std::size_t>& sized,
    const std::map<std::uint32_t, std::uint32_t>& leaders, const std::exception_ptr& failure) {
  std::map<std::uint32_t, std::uint64_t> mine;  // op index -> bytes on this PE
  bool reads_arrivals = false;  // on a GPU, staging that bytes land in before being read again
  for (const auto& [key, bytes] : sized) {
    mine[op_index.at(key.second)] += bytes;
    reads_arrivals = reads_arrivals || (!key.first && prepared.device >= 0);
  }
  message::Writer out;
  out.put<std::uint64_t>(budget);
  out.put<std::uint64_t>(groups_digest());
  out.put<std::uint8_t>(reads_arrivals ? 1 : 0);
  out.put<std::uint8_t>(service.options().advanced.pipelined_phases ? 1 : 0);
  out.put<std::uint64_t>(prepared.device >= 0 ? gpu_identity() : 0);
  std::vector<std::uint64_t> flat;
  for (const auto& [op, bytes] : mine) flat.insert(flat.end(), {op, bytes});
  out.put_array(std::span<const std::uint64_t>(flat));
  flat.clear();
  for (const auto& [op, leader] : leaders) flat.insert(flat.end(), {op, leader});
  out.put_array(std::span<const std::uint64_t>(flat));
  const auto all = gather_verdicts(out.bytes(), failure);
  bool any_reads_arrivals = false, every_rank_pipelines = true, gpu_shared = false;
  std::set<std::uint64_t> gpus;  // the PEs' GPUs (gpu_identity)
  const std::size_t ops = plan->ops().size();
  std::vector<std::uint32_t> leader(ops);  // each op's, itself where it shares no conversion
  for (std::uint32_t i = 0; i < ops; ++i) leader[i] = i;
  std::vector<std::vector<std::pair<PeId, std::uint64_t>>> needs(ops);
  for (std::size_t rank = 0; rank < all.size(); ++rank) {
    message::Reader in(all[rank]);
    const auto theirs = in.get<std::uint64_t>();
    if (theirs != budget) {
      throw_error(ErrorCode::kInvalidArgument,
                  "the staging budget differs between PEs: PE " + std::to_string(me) + " has " +
                      execution::budget_text(budget) + ", PE " + std::to_string(rank) + " " +
                      execution::budget_text(theirs) +
                      " (ReshardOptions::staging_budget / RESHARD_STAGING_BUDGET must agree)");
    }
    if (in.get<std::uint64_t>() != groups_digest()) {
      throw_error(ErrorCode::kInvalidArgument,
                  "the refit's groups (ReshardOptions::param_groups) differ between PE " +
                      std::to_string(me) + " and PE " + std::to_string(rank) +
                      ": every PE must group the plan's parameters alike");
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
  // Where some PE reads staging after its bytes land (unpacks, conversions on arrival, on a
  // GPU) and the refit runs in phases anyway, the phases alternate between two halves of the
  // budget: a phase's arrivals are read beside the next phase's transfer instead of after it
  // (run_pipelined). Not with a custom transform (its hooks run on the host at their own pace);
  // not where PEs share a GPU: there the conversions take the SMs that the transfer kernels of
  // the GPU's other PEs wait for (4x H200, 2 PEs per GPU, Llama-3-8B MXFP8 on arrival: 31.5 ms
  // in phases one after the other, 85.5 ms pipelined); and not where any PE turns it off
  // (AdvancedOptions::pipelined_phases).
  const bool custom_transform = transform != nullptr && ranged == nullptr;
  request.may_pipeline =
      any_reads_arrivals && every_rank_pipelines && !gpu_shared && !custom_transform;
  execution::PhaseAssignment assignment = execution::assign_phases(
      request, [&](std::uint32_t op) { return where(*plan, plan->ops()[op]); });
  prepared.pipelined = assignment.pipelined;
  prepared.group_phases = std::move(assignment.group_phases);
  return std::move(assignment.phase_of);
}

void Resharder::Impl::prepare(const TensorMap& src, const TensorMap& dst, void* stream,
                              ReshardReport& report) {
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
        [&](const execution::StagingPool::OpKey& key) { return phase_of[op_index.at(key.second)]; },
        prepared.pipelined ? 2 : 1);
    const std::uint32_t phases =
        phase_of.empty() ? 1 : *std::max_element(phase_of.begin(), phase_of.end()) + 1;
    for (std::uint32_t p = 0; p < phases; ++p) prepared.phases.push_back(std::make_unique<Phase>());
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
  // A custom transform's hooks run only now (its wire buffers are its own): every PE says
  // whether they took their buffers before any PE schedules.
  gather_verdicts({}, failure);
  // Every PE prepares in the same refit (execute agrees on it), so every PE schedules.
  if (registered_generation == UINT64_MAX) {
    RESHARD_LOG(kDebug, "scheduling the reshard plan: "
                            << prepared.sends.size() + prepared.receives.size() << " sides here");
  } else {
    RESHARD_LOG(kInfo,
                "a PE's reshard buffers changed since the last schedule: scheduling "
                "again on every PE");
  }
  register_and_schedule(prepared.sends, prepared.receives);
  registered_generation = execution::ServiceSlot::generation(service);
  report.rescheduled = true;
  prepared.identities.clear();
  prepared.shapes.clear();
  for (const LocalTensor& tensor : tensors)
    prepared.identities.push_back(TensorIdentity::of(tensor, prepared.shapes));
  prepared.allocations.record(tensors, service.transport_name().find("cuda") != std::string::npos);
  // A map may hold tensors this PE does not move (a replica another PE sends from, the
  // whole model handed to every PE): walking it reads those too, and their identities are
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

}  // namespace reshard

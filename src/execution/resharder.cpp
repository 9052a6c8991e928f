// The executor: turns this PE's share of a reshard plan into copy-service requests once, then
// only packs, runs and unpacks at every refit. Here: its construction, the checks of the plan,
// the names and the tensors, and a refit's entry (execute, rerun).
#include <array>
#include <chrono>
#include <cstring>
#include <functional>
#include <sstream>
#include <tuple>

#include "core/message.hpp"
#include "execution/resharder_impl.hpp"
#include "execution/task_ids.hpp"
#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_device.hpp"
#endif
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "service/service_slot.hpp"

namespace reshard {

std::string Resharder::Impl::where(const ReshardPlan& plan, const TransferOp& op) {
  std::ostringstream text;
  text << "'" << plan.params()[op.param].name << "' " << op.region.str() << " (PE " << op.src_pe
       << " -> PE " << op.dst_pe << ")";
  return text.str();
}

Resharder::Impl::Impl(std::shared_ptr<const ReshardPlan> p, CopyService& s,
                      std::shared_ptr<ReshardTransform> t, ReshardOptions o)
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
      rows_in_place(execution::ServiceSlot::moves_rows_in_place(s)) {
  if (!plan) throw_error(ErrorCode::kInvalidArgument, "Resharder: null plan");
  for (const TransferOp& op : plan->ops()) {
    op_index.emplace(op.task_id, static_cast<std::uint32_t>(&op - plan->ops().data()));
    if (op.src_pe >= service.n_pes() || op.dst_pe >= service.n_pes()) {
      throw_error(ErrorCode::kInvalidArgument, "the plan moves " + where(*plan, op) +
                                                   " but the service has only " +
                                                   std::to_string(service.n_pes()) + " PEs");
    }
    if (op.src_pe == me) {
      send_ops.push_back(&op);
      ++sends_of_slice[slice_key(op)];
    }
    if (op.dst_pe == me) recv_ops.push_back(&op);
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

void Resharder::Impl::check_names(const TensorMap& src, const TensorMap& dst, bool changed_only) {
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
        std::string(role) + " tensor '" + std::string(unknown[0]) + "' on PE " +
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

void Resharder::Impl::check_same_plan_everywhere() {
  const std::uint64_t mine[] = {plan->fingerprint(), plan->ops().size(), plan->params().size(),
                                gpu_identity(), colocated_on_sender};
  const auto all = service.all_gather(std::as_bytes(std::span(mine)));
  std::vector<std::array<std::uint64_t, 3>> theirs(all.size());
  std::vector<std::uint64_t> gpu_of_rank(all.size());
  for (std::size_t r = 0; r < all.size(); ++r) {
    if (all[r].size() != sizeof mine) {
      throw_error(ErrorCode::kInvalidState, "PE " + std::to_string(r) +
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
                  "ReshardOptions::quantize_colocated_on_sender differs between PEs: PE " +
                      std::to_string(me) + " has " + (colocated_on_sender ? "true" : "false") +
                      ", PE " + std::to_string(r) + " " + (on_sender ? "true" : "false"));
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
         {op.task_id, std::uint64_t(op.src_pe), std::uint64_t(op.dst_pe), op.bytes})
      h = (h ^ v) * 0x100000001b3ULL + 0x9e3779b97f4a7c15ULL;
  }
  const auto params = service.all_gather(std::as_bytes(std::span(per_param)));
  std::ostringstream text;
  text << "the reshard plan differs between PEs: PE 0 has " << theirs[0][1] << " ops over "
       << theirs[0][2] << " parameters, PE " << other << " " << theirs[other][1] << " ops over "
       << theirs[other][2] << " parameters";
  const std::size_t n0 = params[0].size() / 8, n1 = params[other].size() / 8;
  for (std::size_t p = 0; p < std::min({n0, n1, plan->params().size()}); ++p) {
    if (std::memcmp(params[0].data() + 8 * p, params[other].data() + 8 * p, 8) != 0) {
      text << "; the first parameter whose transfers differ is '" << plan->params()[p].name
           << "' (as PE " << me << " numbers them)";
      break;
    }
  }
  text << ". Every PE must build the plan from the same two layouts.";
  throw_error(ErrorCode::kValidation, text.str());
}

std::uint64_t Resharder::Impl::gpu_identity() const {
  const int device = service.device();
  if (device < 0) return 0;
#ifdef RESHARD_WITH_CUDA
  const std::uint64_t id = std::hash<std::string>{}(cuda::physical_gpu(device));
  return id == 0 ? 1 : id;
#else
  return 0;
#endif
}

Resharder::Impl::~Impl() {
#ifdef RESHARD_WITH_CUDA
  if (own_stream != nullptr) execution::cuda::destroy_stream(own_stream_device, own_stream);
  if (transfer_stream != nullptr) destroy_transfer_stream();
#endif
}

std::vector<std::int64_t> Resharder::Impl::slice_key(const TransferOp& op) {
  const Box box = op.src_box();
  std::vector<std::int64_t> key{op.param};
  key.insert(key.end(), box.offset.begin(), box.offset.begin() + box.ndim);
  key.insert(key.end(), box.extent.begin(), box.extent.begin() + box.ndim);
  return key;
}

const LocalTensor& Resharder::Impl::tensor_for(const TensorMap& tensors, const Layout& layout,
                                               const TransferOp& op, bool sending,
                                               const Shard*& shard) const {
  const ParamSpec& param = plan->params()[op.param];
  const char* role = sending ? "source" : "destination";
  auto it = tensors.find(param.name);
  if (it == tensors.end()) {
    throw_error(ErrorCode::kInvalidArgument,
                std::string("PE ") + std::to_string(me) + " has no " + role + " tensor for '" +
                    param.name + "', which the plan moves (" + where(*plan, op) + ")");
  }
  shard = layout.find_shard(me, layout.param_index(param.name));
  const LocalTensor& tensor = it->second;
  const auto elements = static_cast<std::size_t>(Box::whole(shard->local_shape).elements());
  const bool converted = transforms(op);
  if (!converted && tensor.dtype != param.dtype) {
    throw_error(ErrorCode::kInvalidArgument,
                std::string(role) + " tensor '" + param.name + "' on PE " + std::to_string(me) +
                    " is " + dtype_name(tensor.dtype) + " but the parameter is " +
                    dtype_name(param.dtype) + " (no transform applies to it)");
  }
  if (!tensor.shape.empty() && tensor.shape != shard->local_shape) {
    throw_error(ErrorCode::kInvalidArgument,
                std::string(role) + " tensor '" + param.name + "' on PE " + std::to_string(me) +
                    " has shape " + shape_str(tensor.shape) + " but the layout's local shape is " +
                    shape_str(shard->local_shape) +
                    " (a transposed or reshaped tensor would scramble the parameter)");
  }
  const std::size_t need = elements * dtype_size(tensor.dtype);
  if (tensor.data.data == nullptr || tensor.data.bytes < need) {
    throw_error(ErrorCode::kInvalidArgument,
                std::string(role) + " tensor '" + param.name + "' on PE " + std::to_string(me) +
                    " holds " + std::to_string(tensor.data.bytes) + " bytes; its local shape " +
                    Box::whole(shard->local_shape).str() + " needs " + std::to_string(need));
  }
  return tensor;
}

std::string Resharder::Impl::explain(const Error& error) const {
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

// The report's timings under their former names too, for one release (ReshardReport).
ReshardReport& Resharder::Impl::with_former_timing_names(ReshardReport& report) {
  report.prepare_seconds = report.timing.prepare_seconds;
  report.transfer_seconds = report.timing.transfer_seconds;
  report.finalize_seconds = report.timing.finalize_seconds;
  report.issue_seconds = report.timing.issue_seconds;
  report.check_seconds = report.timing.check_seconds;
  report.agree_seconds = report.timing.agree_seconds;
  return report;
}

ReshardReport Resharder::Impl::execute(const TensorMap& src, const TensorMap& dst,
                                       void* cuda_stream) {
  return execute(&src, &dst, cuda_stream);
}

ReshardReport Resharder::Impl::execute(const TensorMap* given_src, const TensorMap* given_dst,
                                       void* cuda_stream) {
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
  report.timing.check_seconds = std::chrono::duration<double>(checked - started).count();
  // Scheduling is collective: a PE given new tensors alone must not schedule alone (its peers
  // would run the old schedule and both sides time out), so the PEs agree, in one small
  // all-gather per refit, and all prepare again where any one must. A PE that refused its
  // tensors says so in the same all-gather.
  const bool agreed = all_ranks_agree(reusable, failure, "execute_reshard_plan()");
  report.timing.agree_seconds = std::chrono::duration<double>(Clock::now() - checked).count();
  PhaseClock clock{.enabled = service.options().advanced.step_timing,
                   .stream = stream,
                   .issued = &report.timing.issue_seconds};
  if (!agreed) {
    if (vouched) rebuild();
    prepare(src, dst, stream, report);
  }
  if (vouched && transform != nullptr && !(ranged != nullptr && prepared.conversions_recorded()))
    rebuild();
  run_phases(src, dst, stream, cuda_stream, clock, report, nullptr);
  return with_former_timing_names(report);
}

ReshardReport Resharder::Impl::rerun(void* cuda_stream, const TensorMap* bound_src,
                                     const TensorMap* bound_dst,
                                     std::span<const std::uint32_t>* groups) {
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
  PhaseClock clock{.enabled = service.options().advanced.step_timing,
                   .stream = stream,
                   .issued = &report.timing.issue_seconds};
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
                      "execute the plan instead, on every PE, to schedule it again");
    }
  }
  try {
    run_phases(*src, *dst, stream, cuda_stream, clock, report, phases);
  } catch (const Error& error) {
    // PEs agree on nothing before a rerun: one that executes the plan (or stops) while its
    // peers rerun leaves them waiting for it. Say which calls must match.
    if (error.code() != ErrorCode::kTimeout && error.code() != ErrorCode::kPeerFailure) throw;
    throw error.with_message(
        std::string(error.what()) +
        " [during a run of a prepared refit (Refit::run, rerun_reshard_plan): every PE must "
        "rerun the same refit together; where any PE executes or updates it instead, every "
        "PE must]");
  }
  return with_former_timing_names(report);
}

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

}  // namespace reshard

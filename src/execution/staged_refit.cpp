// StagedRefit: a Refit bound to twins of the destination tensors, and the local copy that
// commits them.
#include "reshard/staged_refit.hpp"

#include <algorithm>
#include <deque>
#include <exception>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "execution/box_view.hpp"
#include "execution/staging.hpp"
#include "execution/verdicts.hpp"
#include "reshard/error.hpp"

namespace reshard {
namespace {

// Twins of destination tensors: memory of the same kind, device and size for the data and scales
// of each, carved from one allocation per memory place (one CUDA IPC export for all of them, and
// small twins never share driver pages with other allocations).
struct Twins {
  std::vector<execution::Staging> arenas;
  TensorMap tensors;  // each destination's description, on its twin's memory
};

constexpr std::size_t kTwinAlignment = 256;  // every twin on the copy kernels' vector path

std::size_t aligned(std::size_t bytes) {
  return (bytes + kTwinAlignment - 1) / kTwinAlignment * kTwinAlignment;
}

// A buffer's bytes as one row: how scales (whose blocks no plan piece describes) are copied whole.
execution::BoxView whole_bytes(const Buffer& buffer) {
  execution::BoxView view;
  view.cols = static_cast<std::int64_t>(buffer.bytes);
  return view;
}

std::uint64_t bytes_of(const TensorMap& tensors) {
  std::uint64_t total = 0;
  for (const auto& [name, tensor] : tensors) total += tensor.data.bytes + tensor.scale.bytes;
  return total;
}

}  // namespace

struct StagedRefit::Impl {
  std::shared_ptr<const ReshardPlan> plan;
  TensorMap dst;               // the destination tensors the caller bound
  Twins twins;                 // what the refit writes instead
  std::optional<Refit> refit;  // bound to the sources and the twins
  // The group of each of the plan's parameters (ReshardOptions::param_groups; empty: one group).
  std::vector<std::uint32_t> param_groups;
  // Per group: twins -> destinations, the blocks the plan writes of its parameters (a deque:
  // the batches own uploads and do not move).
  std::deque<execution::BlockCopyBatch> commit_copies;
  std::vector<bool> staged;  // per group: staged since its last commit
  std::uint64_t version = 0;
  int device = -1;             // the GPU of this PE's destinations, -1 on the host
  void* own_stream = nullptr;  // commit() without a stream runs here

  Impl(std::shared_ptr<const ReshardPlan> p, TensorMap d, std::vector<std::uint32_t> groups)
      : plan(std::move(p)), dst(std::move(d)), param_groups(std::move(groups)) {}

  std::uint32_t group_count() const { return static_cast<std::uint32_t>(commit_copies.size()); }

  // What the destinations hold, for the errors that say nothing was written.
  std::string holding() const {
    return "; the destination tensors hold version " + std::to_string(version);
  }

  ~Impl() {
#ifdef RESHARD_WITH_CUDA
    if (own_stream != nullptr) execution::cuda::destroy_stream(device, own_stream);
#endif
  }

  // Twins of `tensors`, their scales seeded with the destination's (a scale block no op writes
  // keeps its value through a commit).
  static Twins make_twins(const TensorMap& tensors) {
    using Place = std::pair<MemoryKind, int>;
    std::map<Place, std::size_t> sizes;
    for (const auto& [name, tensor] : tensors) {
      for (const Buffer* part : {&tensor.data, &tensor.scale}) {
        if (part->bytes > 0) sizes[{part->kind, part->device}] += aligned(part->bytes);
      }
    }
    Twins twins;
    std::map<Place, std::pair<std::byte*, std::size_t>> next;  // where the next twin goes
    for (const auto& [place, bytes] : sizes) {
      twins.arenas.emplace_back(place.first, place.second, bytes);
      next[place] = {twins.arenas.back().data(), 0};
    }
    auto carve = [&](const Buffer& like) {
      if (like.bytes == 0) return Buffer{nullptr, 0, like.kind, like.device};
      auto& [base, used] = next.at({like.kind, like.device});
      Buffer out{base + used, like.bytes, like.kind, like.device};
      used += aligned(like.bytes);
      return out;
    };
    execution::BlockCopyBatch seed;
    bool on_gpu = false;
    for (const auto& [name, tensor] : tensors) {
      LocalTensor twin = tensor;
      twin.data = carve(tensor.data);
      twin.scale = carve(tensor.scale);
      if (tensor.scale.bytes > 0) {
        on_gpu = on_gpu || tensor.scale.kind == MemoryKind::kCuda;
        seed.add_copy(tensor.scale, twin.scale, whole_bytes(tensor.scale), 1);
      }
      twins.tensors.emplace(name, twin);
    }
    seed.run(nullptr);
#ifdef RESHARD_WITH_CUDA
    if (on_gpu) execution::cuda::synchronize_stream(nullptr);
#endif
    return twins;
  }

  // Collective: stages `groups` (all of them where `whole`), which lose their staged values
  // first: a failure leaves them unstaged and every destination as it was.
  ReshardReport stage(std::span<const std::uint32_t> groups, bool whole, void* cuda_stream) {
    for (std::uint32_t g : groups) {
      if (g < staged.size()) staged[g] = false;
    }
    try {
      ReshardReport report = whole ? refit->run(cuda_stream) : refit->run(groups, cuda_stream);
      for (std::uint32_t g : groups) staged[g] = true;
      return report;
    } catch (const Error& error) {
      throw error.with_message(std::string(error.what()) +
                               " [a staged refit: no destination tensor was written" + holding() +
                               "]");
    }
  }

  // Writes the staged twins of `groups` (checked) into the destinations; advances the version.
  void commit(std::span<const std::uint32_t> groups, void* cuda_stream) {
    if (device < 0) {
      for (std::uint32_t g : groups) commit_copies[g].run(nullptr);
    } else {
#ifdef RESHARD_WITH_CUDA
      void* stream = cuda_stream;
      if (stream == nullptr) {
        if (own_stream == nullptr) own_stream = execution::cuda::create_stream(device);
        // After what the caller queued on the legacy default stream (its tensors' writes).
        execution::cuda::wait_for_default_stream(device, own_stream);
        stream = own_stream;
      }
      for (std::uint32_t g : groups) {
        if (!commit_copies[g].empty()) commit_copies[g].run(stream);
      }
      if (cuda_stream == nullptr) execution::cuda::synchronize_stream(stream);
#else
      (void)cuda_stream;
      throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
    }
    for (std::uint32_t g : groups) staged[g] = false;
    ++version;
  }

  // The blocks of this PE's destination tensors the plan writes, twin to tensor, by group;
  // scales whole.
  void list_commit_copies(PeId me, std::uint32_t groups) {
    commit_copies.clear();
    commit_copies.resize(groups);
    staged.assign(groups, false);
    device = -1;
    std::unordered_map<std::string_view, std::uint32_t> group_of;
    if (!param_groups.empty()) {
      for (std::size_t i = 0; i < plan->params().size(); ++i)
        group_of.emplace(plan->params()[i].name, param_groups[i]);
    }
    const Layout& layout = plan->dst_layout();
    for (const auto& [name, tensor] : dst) {
      const LocalTensor& twin = twins.tensors.at(name);
      if (tensor.data.kind == MemoryKind::kCuda) device = tensor.data.device;
      const ParamSpec* param = layout.find_param(name);
      const Shard* shard =
          param == nullptr ? nullptr : layout.find_shard(me, layout.param_index(name));
      if (shard == nullptr) continue;  // a name the plan lacks (allowed): nothing lands there
      const auto group = group_of.find(name);
      execution::BlockCopyBatch& copies =
          commit_copies[group == group_of.end() ? 0 : group->second];
      const std::size_t element_bytes = dtype_size(tensor.dtype);
      for (const Piece& piece : shard->pieces) {
        copies.add_copy(twin.data, tensor.data,
                        execution::view_of(shard->local_box(piece), shard->local_shape,
                                           /*merge_full_dims=*/true),
                        element_bytes);
      }
      if (tensor.scale.bytes > 0)
        copies.add_copy(twin.scale, tensor.scale, whole_bytes(tensor.scale), 1);
    }
  }
};

StagedRefit::StagedRefit(std::shared_ptr<const ReshardPlan> plan, TensorMap src, TensorMap dst,
                         CopyService& service, std::shared_ptr<ReshardTransform> transform,
                         const ReshardOptions& options, void* cuda_stream,
                         std::optional<std::uint64_t> max_staged_bytes)
    : impl_(std::make_unique<Impl>(plan, std::move(dst), options.param_groups)) {
  Impl& self = *impl_;
  // Collective: a PE whose twins would pass the limit (or cannot have them) stops every PE
  // before anything is allocated or scheduled.
  std::exception_ptr failure;
  const std::uint64_t needed = bytes_of(self.dst);
  try {
    if (max_staged_bytes && needed > *max_staged_bytes) {
      throw_error(ErrorCode::kInvalidArgument,
                  "a staged refit needs " + format_bytes(needed) + " of staging on PE " +
                      std::to_string(service.my_pe()) +
                      " (a twin of each destination tensor), more than max_staged_bytes " +
                      format_bytes(*max_staged_bytes) +
                      ": raise the limit, or refit without staging");
    }
    self.twins = Impl::make_twins(self.dst);
  } catch (...) {
    failure = std::current_exception();
  }
  execution::gather_verdicts(service, {}, failure, "bind()");
  self.refit.emplace(std::move(plan), std::move(src), self.twins.tensors, service,
                     std::move(transform), options, cuda_stream);
  self.list_commit_copies(service.my_pe(), self.refit->groups());
}

StagedRefit::~StagedRefit() = default;
StagedRefit::StagedRefit(StagedRefit&&) noexcept = default;
StagedRefit& StagedRefit::operator=(StagedRefit&&) noexcept = default;

ReshardReport StagedRefit::stage(void* cuda_stream) {
  std::vector<std::uint32_t> every(impl_->group_count());
  for (std::uint32_t g = 0; g < every.size(); ++g) every[g] = g;
  return impl_->stage(every, /*whole=*/true, cuda_stream);
}

ReshardReport StagedRefit::stage(std::span<const std::uint32_t> groups, void* cuda_stream) {
  return impl_->stage(groups, /*whole=*/false, cuda_stream);
}

void StagedRefit::commit(void* cuda_stream) {
  Impl& self = *impl_;
  if (!staged()) {
    std::string missing;
    for (std::uint32_t g = 0; g < self.group_count(); ++g) {
      if (!self.staged[g]) missing += (missing.empty() ? "" : ", ") + std::to_string(g);
    }
    throw_error(ErrorCode::kInvalidState,
                std::string("StagedRefit::commit: nothing is staged (no stage() since the last "
                            "commit(), or the last stage() failed)") +
                    (self.group_count() > 1 ? " for group(s) " + missing : "") + self.holding());
  }
  std::vector<std::uint32_t> every(self.group_count());
  for (std::uint32_t g = 0; g < every.size(); ++g) every[g] = g;
  self.commit(every, cuda_stream);
}

void StagedRefit::commit(std::span<const std::uint32_t> groups, void* cuda_stream) {
  Impl& self = *impl_;
  for (std::uint32_t g : groups) {
    if (g >= self.group_count()) {
      throw_error(ErrorCode::kInvalidArgument,
                  "StagedRefit::commit: group " + std::to_string(g) + " of a refit of " +
                      std::to_string(self.group_count()) + " group(s)" + self.holding());
    }
    if (!self.staged[g]) {
      throw_error(ErrorCode::kInvalidState,
                  "StagedRefit::commit: group " + std::to_string(g) +
                      " is not staged (no stage of it since its last commit, or that stage "
                      "failed); nothing was committed" +
                      self.holding());
    }
  }
  self.commit(groups, cuda_stream);
}

ReshardReport StagedRefit::update(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
  Impl& self = *impl_;
  std::fill(self.staged.begin(), self.staged.end(), false);
  // New twins for every destination (the replaced ones and the rest: one arena, no space left
  // behind); the refit's own update() checks the names and schedules again. A refused update
  // leaves the bound tensors and twins as they were.
  TensorMap destinations = self.dst;
  for (const auto& [name, tensor] : dst) {
    if (destinations.count(name) != 0) destinations[name] = tensor;
  }
  Twins fresh = Impl::make_twins(destinations);
  TensorMap retargeted;  // the refit's destinations are twins: every one of them moves
  for (const auto& [name, twin] : fresh.tensors) retargeted.emplace(name, twin);
  for (const auto& [name, tensor] : dst) {
    if (retargeted.count(name) == 0) retargeted.emplace(name, tensor);  // refused by the refit
  }
  ReshardReport report = self.refit->update(src, retargeted, cuda_stream);
  self.dst = std::move(destinations);
  self.twins = std::move(fresh);
  self.list_commit_copies(self.refit->service().my_pe(), self.refit->groups());
  return report;
}

std::uint64_t StagedRefit::version() const { return impl_->version; }
bool StagedRefit::staged() const {
  return std::all_of(impl_->staged.begin(), impl_->staged.end(), [](bool s) { return s; });
}
std::vector<std::uint32_t> StagedRefit::staged_groups() const {
  std::vector<std::uint32_t> groups;
  for (std::uint32_t g = 0; g < impl_->group_count(); ++g) {
    if (impl_->staged[g]) groups.push_back(g);
  }
  return groups;
}
std::uint64_t StagedRefit::staged_bytes() const { return bytes_of(impl_->dst); }
const ReshardReport& StagedRefit::report() const { return impl_->refit->report(); }
const TensorMap& StagedRefit::sources() const { return impl_->refit->sources(); }
const TensorMap& StagedRefit::destinations() const { return impl_->dst; }
CopyService& StagedRefit::service() const { return impl_->refit->service(); }

}  // namespace reshard

// StagedRefit: a Refit bound to twins of the destination tensors, and the local copy that
// commits them.
#include "reshard/staged_refit.hpp"

#include <exception>
#include <map>
#include <string>
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
  TensorMap dst;                            // the destination tensors the caller bound
  Twins twins;                              // what the refit writes instead
  std::optional<Refit> refit;               // bound to the sources and the twins
  execution::BlockCopyBatch commit_copies;  // twins -> destinations, the blocks the plan writes
  std::uint64_t version = 0;
  bool staged = false;
  int device = -1;             // the GPU of this rank's destinations, -1 on the host
  void* own_stream = nullptr;  // commit() without a stream runs here

  Impl(std::shared_ptr<const ReshardPlan> p, TensorMap d) : plan(std::move(p)), dst(std::move(d)) {}

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

  // The blocks of this rank's destination tensors the plan writes, twin to tensor; scales whole.
  void list_commit_copies(PeId me) {
    commit_copies.clear();
    device = -1;
    const Layout& layout = plan->dst_layout();
    for (const auto& [name, tensor] : dst) {
      const LocalTensor& twin = twins.tensors.at(name);
      if (tensor.data.kind == MemoryKind::kCuda) device = tensor.data.device;
      const ParamSpec* param = layout.find_param(name);
      const Shard* shard =
          param == nullptr ? nullptr : layout.find_shard(me, layout.param_index(name));
      if (shard == nullptr) continue;  // a name the plan lacks (allowed): nothing lands there
      const std::size_t element_bytes = dtype_size(tensor.dtype);
      for (const Piece& piece : shard->pieces) {
        commit_copies.add_copy(twin.data, tensor.data,
                               execution::view_of(shard->local_box(piece), shard->local_shape,
                                                  /*merge_full_dims=*/true),
                               element_bytes);
      }
      if (tensor.scale.bytes > 0)
        commit_copies.add_copy(twin.scale, tensor.scale, whole_bytes(tensor.scale), 1);
    }
  }
};

StagedRefit::StagedRefit(std::shared_ptr<const ReshardPlan> plan, TensorMap src, TensorMap dst,
                         CopyService& service, std::shared_ptr<ReshardTransform> transform,
                         const ReshardOptions& options, void* cuda_stream,
                         std::optional<std::uint64_t> max_staged_bytes)
    : impl_(std::make_unique<Impl>(plan, std::move(dst))) {
  Impl& self = *impl_;
  // Collective: a rank whose twins would pass the limit (or cannot have them) stops every rank
  // before anything is allocated or scheduled.
  std::exception_ptr failure;
  const std::uint64_t needed = bytes_of(self.dst);
  try {
    if (max_staged_bytes && needed > *max_staged_bytes) {
      throw_error(ErrorCode::kInvalidArgument,
                  "a staged refit needs " + format_bytes(needed) + " of staging on rank " +
                      std::to_string(service.my_pe()) +
                      " (a twin of each destination tensor), more than max_staged_bytes " +
                      format_bytes(*max_staged_bytes) +
                      ": raise the limit, or refit without staging");
    }
    self.twins = Impl::make_twins(self.dst);
  } catch (...) {
    failure = std::current_exception();
  }
  execution::gather_verdicts(service, {}, failure);
  self.refit.emplace(std::move(plan), std::move(src), self.twins.tensors, service,
                     std::move(transform), options, cuda_stream);
  self.list_commit_copies(service.my_pe());
}

StagedRefit::~StagedRefit() = default;
StagedRefit::StagedRefit(StagedRefit&&) noexcept = default;
StagedRefit& StagedRefit::operator=(StagedRefit&&) noexcept = default;

ReshardReport StagedRefit::stage(void* cuda_stream) {
  Impl& self = *impl_;
  self.staged = false;
  try {
    ReshardReport report = self.refit->run(cuda_stream);
    self.staged = true;
    return report;
  } catch (const Error& error) {
    throw Error(error.code(),
                std::string(error.what()) +
                    " [a staged refit: no destination tensor was written; they hold version " +
                    std::to_string(self.version) + "]",
                error.tasks());
  }
}

void StagedRefit::commit(void* cuda_stream) {
  Impl& self = *impl_;
  if (!self.staged) {
    throw_error(ErrorCode::kInvalidState,
                "StagedRefit::commit: nothing is staged (no stage() since the last commit(), or "
                "the last stage() failed); the destination tensors hold version " +
                    std::to_string(self.version));
  }
  if (self.device < 0 || self.commit_copies.empty()) {
    self.commit_copies.run(nullptr);
  } else {
#ifdef RESHARD_WITH_CUDA
    void* stream = cuda_stream;
    if (stream == nullptr) {
      if (self.own_stream == nullptr) self.own_stream = execution::cuda::create_stream(self.device);
      // After what the caller queued on the legacy default stream (its tensors' writes).
      execution::cuda::wait_for_default_stream(self.device, self.own_stream);
      stream = self.own_stream;
    }
    self.commit_copies.run(stream);
    if (cuda_stream == nullptr) execution::cuda::synchronize_stream(stream);
#else
    (void)cuda_stream;
    throw_error(ErrorCode::kUnsupported, "GPU tensors need a build with CUDA");
#endif
  }
  self.staged = false;
  ++self.version;
}

ReshardReport StagedRefit::update(const TensorMap& src, const TensorMap& dst, void* cuda_stream) {
  Impl& self = *impl_;
  self.staged = false;
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
  self.list_commit_copies(self.refit->service().my_pe());
  return report;
}

std::uint64_t StagedRefit::version() const { return impl_->version; }
bool StagedRefit::staged() const { return impl_->staged; }
std::uint64_t StagedRefit::staged_bytes() const { return bytes_of(impl_->dst); }
const ReshardReport& StagedRefit::report() const { return impl_->refit->report(); }
const TensorMap& StagedRefit::sources() const { return impl_->refit->sources(); }
const TensorMap& StagedRefit::destinations() const { return impl_->dst; }
CopyService& StagedRefit::service() const { return impl_->refit->service(); }

}  // namespace reshard

// Refit: bound once, run many. It holds an executor (Resharder::Impl) prepared for the tensors it
// owns; also the layer groups a refit offers.
#include <algorithm>
#include <string>
#include <string_view>
#include <utility>

#include "execution/resharder_impl.hpp"
#include "reshard/error.hpp"
#ifdef RESHARD_WITH_CUDA
#include "gpu/cuda_check.hpp"
#include "gpu/cuda_device.hpp"
#endif

namespace reshard {

using execution::TensorIdentity;

struct Refit::Impl {
  Resharder::Impl executor;
  TensorMap src, dst;  // the bound tensors (the executor's records point into these)
  bool bound = false;  // prepared and scheduled for src and dst (false after a failed update)
  std::uint64_t schedules = 0;  // how often it was prepared and scheduled (a RefitGraph's check)

  Impl(std::shared_ptr<const ReshardPlan> plan, TensorMap s, TensorMap d, CopyService& service,
       std::shared_ptr<ReshardTransform> transform, const ReshardOptions& options)
      : executor(std::move(plan), service, std::move(transform), options),
        src(std::move(s)),
        dst(std::move(d)) {}

  // `meeting`: the call's name where binding opens it (the PEs may come at different times).
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
    ++schedules;
  }

  // Why run() cannot run, or empty.
  std::string unusable() const {
    if (!bound) {
      return "Refit::run: the last update() of this refit failed, so it holds no schedule; "
             "update() again on every PE with the tensors corrected";
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
                          " tensor of this refit on PE " + std::to_string(self.executor.me) +
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
  // Collective: where no PE's tensors changed, nothing is prepared again. A refusal (a name
  // not bound, on any PE) leaves every PE's refit as it was.
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

RefitGraph::RefitGraph(Refit& refit, void* cuda_stream) : refit_(refit.impl_.get()) {
  const Refit::Impl& bound = *refit_;
  if (const std::string why = bound.unusable(); !why.empty())
    throw_error(ErrorCode::kInvalidState, "RefitGraph: " + why);
  const std::string transport = refit.service().transport_name();
  if (transport != "cuda") {
    throw_error(ErrorCode::kUnsupported,
                "RefitGraph: this refit runs on the " + transport +
                    " transport; only the cuda transport's runs can be captured in a CUDA graph "
                    "(NVSHMEM's signal values advance every run; NCCL's and the host's runs are "
                    "driven from the host)");
  }
  device_ = bound.executor.prepared.device;
  if (device_ < 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "RefitGraph: this refit's tensors on PE " + std::to_string(bound.executor.me) +
                    " are host memory; a CUDA graph captures a refit of GPU tensors");
  }
  schedule_ = bound.schedules;
#ifdef RESHARD_WITH_CUDA
  cuda::DeviceScope scope(device_);
  cudaStream_t stream = static_cast<cudaStream_t>(cuda_stream);
  cudaStream_t own = nullptr;  // a capture needs a stream other than the legacy default one
  if (stream == nullptr) {
    RESHARD_CUDA_CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    stream = own;
  }
  cudaGraph_t graph = nullptr;
  // Relaxed: a run's first use of a job list allocates its device and pinned memory (kept for
  // every later run), which a stricter capture mode would refuse.
  cudaError_t status = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
  if (status == cudaSuccess) {
    try {
      refit.run(stream);
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph != nullptr) cudaGraphDestroy(graph);
      if (own != nullptr) cudaStreamDestroy(own);
      throw;
    }
    status = cudaStreamEndCapture(stream, &graph);
  }
  cudaGraphExec_t exec = nullptr;
  if (status == cudaSuccess) status = cudaGraphInstantiate(&exec, graph, 0);
  // Uploaded now, so that the first replay does not pay for it.
  if (status == cudaSuccess) status = cudaGraphUpload(exec, stream);
  if (status == cudaSuccess && own != nullptr) status = cudaStreamSynchronize(own);
  if (graph != nullptr) cudaGraphDestroy(graph);
  if (own != nullptr) cudaStreamDestroy(own);
  if (status != cudaSuccess) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
    cuda::throw_cuda_error(status, "RefitGraph: capturing the refit's run in a CUDA graph");
  }
  graph_ = exec;
#else
  (void)cuda_stream;
  throw_error(ErrorCode::kUnsupported, "RefitGraph: reshard was built without CUDA");
#endif
}

void RefitGraph::replay(void* cuda_stream) {
  if (graph_ == nullptr)
    throw_error(ErrorCode::kInvalidState, "RefitGraph::replay: this graph was moved from");
  const Refit::Impl& bound = *refit_;
  // Two integers and the service's generation: a replay of a refit scheduled again since would
  // move bytes from and into memory that is no longer the refit's.
  if (!bound.bound || bound.schedules != schedule_ || !bound.executor.still_scheduled()) {
    const std::string why = bound.unusable();
    throw_error(ErrorCode::kInvalidState,
                "RefitGraph::replay: " +
                    (why.empty() ? std::string("the refit was scheduled again since this graph "
                                               "was captured (an update() with new tensors)")
                                 : why) +
                    "; capture the refit again");
  }
#ifdef RESHARD_WITH_CUDA
  if (cuda_stream == nullptr) {  // the legacy default stream of the refit's device's context
    cuda::DeviceScope scope(device_);
    RESHARD_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_), nullptr));
    return;
  }
  RESHARD_CUDA_CHECK(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph_),
                                     static_cast<cudaStream_t>(cuda_stream)));
#else
  (void)cuda_stream;  // a build without CUDA has no graph to replay (none could be captured)
#endif
}

void RefitGraph::release() noexcept {
#ifdef RESHARD_WITH_CUDA
  if (graph_ != nullptr) {
    auto scope = cuda::DeviceScope::try_enter(device_);
    cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph_));
  }
#endif
  graph_ = nullptr;
}

RefitGraph::~RefitGraph() { release(); }

RefitGraph::RefitGraph(RefitGraph&& other) noexcept
    : refit_(other.refit_),
      schedule_(other.schedule_),
      device_(other.device_),
      graph_(std::exchange(other.graph_, nullptr)) {}

RefitGraph& RefitGraph::operator=(RefitGraph&& other) noexcept {
  if (this != &other) {
    release();
    refit_ = other.refit_;
    schedule_ = other.schedule_;
    device_ = other.device_;
    graph_ = std::exchange(other.graph_, nullptr);
  }
  return *this;
}

const TensorMap& Refit::sources() const { return impl_->src; }
const TensorMap& Refit::destinations() const { return impl_->dst; }
CopyService& Refit::service() const { return impl_->executor.service; }

}  // namespace reshard

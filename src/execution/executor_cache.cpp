// execute_reshard_plan and rerun_reshard_plan: the executor a copy service keeps for them.
#include <string>

#include "reshard/error.hpp"
#include "reshard/resharder.hpp"
#include "service/service_slot.hpp"
#include "transforms/wire_ranges.hpp"

namespace reshard {

namespace {

// What execute_reshard_plan keeps on a service: the executor of the last (plan, transform,
// options) it ran, and nothing more. A service holds one schedule, so an executor of another
// plan would schedule again at its next call anyway; keeping only the last one bounds the
// memory (staging, on GPUs device memory) of callers who make a new transform or plan object
// every refit. Built-in transforms are told apart by what they do (a fresh
// make_cast_transform(kFloat32) at every call reuses the executor), custom ones by identity.
struct ExecutorCache {
  std::shared_ptr<const ReshardPlan> plan;      // held so its address cannot be reused by another
  std::shared_ptr<ReshardTransform> transform;  // likewise
  std::string transform_key;
  std::unique_ptr<Resharder> executor;
};

std::string transform_key(const std::shared_ptr<ReshardTransform>& transform) {
  if (!transform) return {};
  if (const auto* ranged = dynamic_cast<const execution::RangedTransform*>(transform.get()))
    return "built-in:" + ranged->description();
  return "custom:" + std::to_string(reinterpret_cast<std::uintptr_t>(transform.get()));
}

ExecutorCache* cache_of(CopyService& service) {
  std::shared_ptr<void>& slot = execution::ServiceSlot::executors(service);
  return static_cast<ExecutorCache*>(slot.get());
}

}  // namespace

ReshardReport execute_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                   const TensorMap& src, const TensorMap& dst, CopyService& service,
                                   std::shared_ptr<ReshardTransform> transform, void* cuda_stream,
                                   const ReshardOptions& options) {
  std::shared_ptr<void>& slot = execution::ServiceSlot::executors(service);
  if (!slot) slot = std::make_shared<ExecutorCache>();
  ExecutorCache& cache = *static_cast<ExecutorCache*>(slot.get());
  std::string key = transform_key(transform);
  // Another plan, transform or budget: a new executor (and schedule) on every PE alike. Which
  // one a PE keeps is its own business: a new executor's first call agrees with the PEs that
  // kept theirs exactly as a kept one whose tensors changed does.
  if (!cache.executor || cache.plan != plan || cache.transform_key != key ||
      !cache.executor->same_options(options)) {
    cache.executor.reset();  // its staging goes before the new one's is placed
    cache.executor = std::make_unique<Resharder>(plan, service, transform, options);
    cache.plan = plan;
    cache.transform = std::move(transform);
    cache.transform_key = std::move(key);
  }
  return cache.executor->execute(src, dst, cuda_stream);
}

std::optional<ReshardReport> execution::execute_as_prepared(
    const std::shared_ptr<const ReshardPlan>& plan, CopyService& service,
    const std::shared_ptr<ReshardTransform>& transform, void* cuda_stream,
    const ReshardOptions& options) {
  ExecutorCache* cache = cache_of(service);
  if (cache == nullptr || !cache->executor || cache->plan != plan ||
      cache->transform_key != transform_key(transform) || !cache->executor->same_options(options) ||
      !cache->executor->still_scheduled()) {
    return std::nullopt;
  }
  return cache->executor->execute_as_prepared(cuda_stream);
}

ReshardReport rerun_reshard_plan(const std::shared_ptr<const ReshardPlan>& plan,
                                 CopyService& service,
                                 const std::shared_ptr<ReshardTransform>& transform,
                                 void* cuda_stream) {
  ExecutorCache* cache = cache_of(service);
  if (cache != nullptr && cache->executor && cache->plan == plan &&
      cache->transform_key == transform_key(transform)) {
    return cache->executor->rerun(cuda_stream);
  }
  throw_error(ErrorCode::kInvalidState,
              "rerun_reshard_plan: this plan" +
                  std::string(transform ? " with transform '" + transform->name() + "'" : "") +
                  " was not the last one executed on this copy service (call "
                  "execute_reshard_plan first; clear_requests() drops what it kept)");
}

}  // namespace reshard

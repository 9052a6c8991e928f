#include "reshard/options.hpp"

#include "core/env.hpp"
#include "reshard/error.hpp"

namespace reshard {

CopyServiceOptions CopyServiceOptions::from_environment() {
  CopyServiceOptions o;
  if (auto name = env::transport()) o.transport = parse_transport_kind(*name);
  if (auto name = env::inter_node_transport()) o.inter_node_transport = parse_transport_kind(*name);
  o.node_size = env::node_size();
  o.device = env::device();
  o.timeout = env::timeout();
  o.verify = env::verify();
  o.chunk_bytes = env::chunk_bytes();
  o.log_level = env::log_level().value_or(LogLevel::kInfo);
  o.host.staging_bytes = env::host_staging_bytes();
  o.cuda.engine = env::cuda_engine();
  o.cuda.ce_min_bytes = env::cuda_ce_min_bytes();
  o.cuda.ctas_per_peer = env::cuda_ctas_per_peer();
  o.cuda.bytes_per_cta = env::cuda_bytes_per_cta();
  o.cuda.same_device = env::cuda_same_device();
  o.nccl.nonblocking = env::nccl_nonblocking();
  o.nccl.group_spans = env::nccl_group_spans();
  o.nvshmem.staging_bytes = env::nvshmem_staging_bytes();
  o.debug.cuda_trace = env::cuda_trace();
  o.debug.nvshmem_trace = env::nvshmem_trace();
  o.debug.phase_timing = env::phase_timing();
  o.debug.cuda_ce_streams = env::cuda_ce_streams();
  o.debug.cuda_unroll = env::cuda_unroll();
  o.debug.cuda_early_launch = env::cuda_early_launch();
  o.debug.nvshmem_direct = env::nvshmem_direct();
  o.debug.nvshmem_send_stream = env::nvshmem_send_stream();
  o.debug.nvshmem_peers_per_round = env::nvshmem_peers_per_round();
  return o;
}

namespace {

[[noreturn]] void refuse(const std::string& field, const std::string& value,
                         const std::string& why) {
  throw_error(ErrorCode::kInvalidArgument,
              "CopyServiceOptions::" + field + " = " + value + " " + why);
}

void require_one_of(const std::string& field, const std::string& value,
                    std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (value == a) return;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  refuse(field, "'" + value + "'", "is not one of " + list);
}

}  // namespace

void CopyServiceOptions::validate() const {
  if (inter_node_transport && (*inter_node_transport == TransportKind::kAuto ||
                               *inter_node_transport == TransportKind::kCuda)) {
    refuse("inter_node_transport", transport_kind_name(*inter_node_transport),
           "cannot join nodes: use nvshmem, nccl or host");
  }
  if (node_size && *node_size < 1)
    refuse("node_size", std::to_string(*node_size), "must be at least 1");
  if (device && *device < 0) refuse("device", std::to_string(*device), "is negative");
  if (timeout.count() <= 0)
    refuse("timeout", std::to_string(timeout.count()) + " ms", "must be positive");
  if (chunk_bytes && *chunk_bytes == 0) refuse("chunk_bytes", "0", "must be positive");
  require_one_of("cuda.engine", cuda.engine, {"auto", "sm", "ce", "autotune"});
  require_one_of("cuda.same_device", cuda.same_device, {"auto", "delegate", "stream", "kernel"});
  if (cuda.ctas_per_peer < 1 || cuda.ctas_per_peer > 1024)
    refuse("cuda.ctas_per_peer", std::to_string(cuda.ctas_per_peer), "is outside 1..1024");
  if (cuda.bytes_per_cta < 4096)
    refuse("cuda.bytes_per_cta", std::to_string(cuda.bytes_per_cta), "is below 4 KiB");
  if (nccl.group_spans < 1) refuse("nccl.group_spans", "0", "must be at least 1");
  if (nvshmem.staging_bytes == 0) refuse("nvshmem.staging_bytes", "0", "must be positive");
  if (host.staging_bytes == 0) refuse("host.staging_bytes", "0", "must be positive");
  if (debug.cuda_ce_streams < 1 || debug.cuda_ce_streams > DebugOptions::kMaxCudaCeStreams) {
    refuse("debug.cuda_ce_streams", std::to_string(debug.cuda_ce_streams),
           "is outside 1.." + std::to_string(DebugOptions::kMaxCudaCeStreams));
  }
  if (debug.cuda_unroll != 4 && debug.cuda_unroll != 8)
    refuse("debug.cuda_unroll", std::to_string(debug.cuda_unroll), "is not 4 or 8");
  if (debug.nvshmem_peers_per_round < 0) {
    refuse("debug.nvshmem_peers_per_round", std::to_string(debug.nvshmem_peers_per_round),
           "is negative (0: every peer)");
  }
}

}  // namespace reshard

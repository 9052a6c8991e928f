#include "core/env.hpp"

#include <cstdlib>

#include "reshard/error.hpp"
#include "reshard/types.hpp"

namespace reshard::env {

std::optional<std::string> get(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int get_int(const char* name, int fallback) {
  auto value = get(name);
  if (!value) return fallback;
  try {
    std::size_t used = 0;
    int parsed = std::stoi(*value, &used);
    if (used == value->size()) return parsed;
  } catch (const std::exception&) {
  }
  throw_error(ErrorCode::kInvalidArgument,
              std::string(name) + "='" + *value + "' is not an integer");
}

std::chrono::milliseconds timeout() {
  auto value = get("RESHARD_TIMEOUT_S");
  if (!value) return std::chrono::milliseconds(30000);
  try {
    double seconds = std::stod(*value);
    if (seconds > 0) return std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
  } catch (const std::exception&) {
  }
  throw_error(ErrorCode::kInvalidArgument,
              "RESHARD_TIMEOUT_S='" + *value + "' is not a positive number of seconds");
}

std::optional<LogLevel> log_level() {
  auto value = get("RESHARD_LOG_LEVEL");
  if (!value) return std::nullopt;
  return parse_log_level(*value);
}

std::uint64_t host_staging_bytes() {
  auto value = get("RESHARD_HOST_STAGING_BYTES");
  return value ? parse_bytes(*value) : (8ull << 20);
}

std::optional<std::uint64_t> staging_budget() {
  auto value = get("RESHARD_STAGING_BUDGET");
  if (!value) return std::nullopt;
  if (*value == "unlimited") return UINT64_MAX;
  try {
    return parse_bytes(*value);
  } catch (const Error& error) {
    throw_error(ErrorCode::kInvalidArgument, "RESHARD_STAGING_BUDGET=" + *value +
                                                 ": not a byte count such as 512MiB, or "
                                                 "'unlimited' (" +
                                                 error.what() + ")");
  }
}

std::uint64_t nvshmem_staging_bytes() {
  auto value = get("RESHARD_NVSHMEM_STAGING_BYTES");
  return value ? parse_bytes(*value) : (512ull << 20);
}

std::optional<int> node_size() {
  if (!get("RESHARD_NODE_SIZE")) return std::nullopt;
  const int pes = get_int("RESHARD_NODE_SIZE", 0);
  if (pes < 1) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_NODE_SIZE=" + std::to_string(pes) + " must be at least 1");
  }
  return pes;
}

std::optional<std::string> inter_node_transport() {
  auto value = get("RESHARD_INTER_NODE_TRANSPORT");
  if (value && *value != "nccl" && *value != "nvshmem" && *value != "host") {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_INTER_NODE_TRANSPORT='" + *value + "' is not nccl, nvshmem or host");
  }
  return value;
}

bool verify() { return get_int("RESHARD_VERIFY", 0) != 0; }

std::optional<std::uint64_t> test_corrupt_task() {
  auto value = get("RESHARD_TEST_CORRUPT_TASK");
  if (!value) return std::nullopt;
  return std::stoull(*value);
}

bool nvshmem_direct() { return get_int("RESHARD_NVSHMEM_DIRECT", 1) != 0; }

bool nvshmem_send_stream() { return get_int("RESHARD_NVSHMEM_SEND_STREAM", 1) != 0; }
int nvshmem_peers_per_round() {
  const int peers = get_int("RESHARD_NVSHMEM_PEERS_PER_ROUND", 0);
  if (peers < 0) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_NVSHMEM_PEERS_PER_ROUND=" + std::to_string(peers) +
                    " is negative (0: every peer)");
  }
  return peers;
}
bool nvshmem_trace() { return get_int("RESHARD_NVSHMEM_TRACE", 0) != 0; }

bool cuda_trace() { return get_int("RESHARD_CUDA_TRACE", 0) != 0; }

std::optional<std::uint64_t> chunk_bytes() {
  auto value = get("RESHARD_CHUNK_BYTES");
  if (!value) return std::nullopt;
  return parse_bytes(*value);
}

std::optional<std::string> job_id() { return get("RESHARD_JOB_ID"); }

std::optional<std::string> transport() { return get("RESHARD_TRANSPORT"); }

std::optional<int> device() {
  if (!get("RESHARD_DEVICE")) return std::nullopt;
  return get_int("RESHARD_DEVICE", 0);
}

std::string cuda_engine() {
  const std::string engine = get("RESHARD_CUDA_ENGINE").value_or("auto");
  if (engine != "auto" && engine != "sm" && engine != "ce" && engine != "autotune") {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_CUDA_ENGINE='" + engine + "' is not one of auto, sm, ce, autotune");
  }
  return engine;
}

std::string cuda_same_device() {
  const std::string mode = get("RESHARD_CUDA_SAME_DEVICE").value_or("auto");
  if (mode != "auto" && mode != "delegate" && mode != "stream" && mode != "kernel") {
    throw_error(ErrorCode::kInvalidArgument, "RESHARD_CUDA_SAME_DEVICE='" + mode +
                                                 "' is not one of auto, delegate, stream, kernel");
  }
  return mode;
}

std::uint64_t cuda_ce_min_bytes() {
  auto value = get("RESHARD_CUDA_CE_MIN_BYTES");
  // With one copy-engine stream walking the peers in rotated order, the copy engine overtook the
  // SM engine from 64 MiB per peer in the 4-GPU all-to-all (368 vs 345 GB/s; 16 MiB: 312 vs 317;
  // 4x H200, 2026-11-22).
  return value ? parse_bytes(*value) : (32ull << 20);
}

int cuda_ctas_per_peer() {
  const int ctas = get_int("RESHARD_CUDA_CTAS_PER_PEER", 64);
  if (ctas < 1 || ctas > 1024) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_CUDA_CTAS_PER_PEER=" + std::to_string(ctas) + " is outside 1..1024");
  }
  return ctas;
}

std::uint64_t cuda_bytes_per_cta() {
  auto value = get("RESHARD_CUDA_BYTES_PER_CTA");
  const std::uint64_t bytes = value ? parse_bytes(*value) : (64ull << 10);
  if (bytes < 4096) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_CUDA_BYTES_PER_CTA=" + *value + " is below 4 KiB");
  }
  return bytes;
}

}  // namespace reshard::env

namespace reshard::env {

std::uint32_t nccl_group_spans() {
  const int spans = get_int("RESHARD_NCCL_GROUP_SPANS", 64);
  if (spans < 1) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_NCCL_GROUP_SPANS=" + std::to_string(spans) + " must be at least 1");
  }
  return static_cast<std::uint32_t>(spans);
}

bool nccl_nonblocking() { return get_int("RESHARD_NCCL_NONBLOCKING", 1) != 0; }

bool cuda_early_launch() { return get_int("RESHARD_CUDA_EARLY_LAUNCH", 1) != 0; }

bool phase_timing() { return get_int("RESHARD_PHASE_TIMING", 0) != 0; }

int cuda_ce_streams() {
  const int streams = get_int("RESHARD_CUDA_CE_STREAMS", 1);
  if (streams < 1 || streams > DebugOptions::kMaxCudaCeStreams) {
    throw_error(ErrorCode::kInvalidArgument, "RESHARD_CUDA_CE_STREAMS=" + std::to_string(streams) +
                                                 " is outside 1.." +
                                                 std::to_string(DebugOptions::kMaxCudaCeStreams));
  }
  return streams;
}

int cuda_unroll() {
  const int unroll = get_int("RESHARD_CUDA_UNROLL", 8);
  if (unroll != 4 && unroll != 8) {
    throw_error(ErrorCode::kInvalidArgument,
                "RESHARD_CUDA_UNROLL=" + std::to_string(unroll) + " is not 4 or 8");
  }
  return unroll;
}

}  // namespace reshard::env

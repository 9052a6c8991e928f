#include "reshard/options.hpp"

#include <algorithm>
#include <functional>

#include "core/env.hpp"
#include "reshard/error.hpp"
#include "reshard/types.hpp"

namespace reshard {

namespace {

// The variable that gives each option its default, by the option's name as errors spell it.
struct Variable {
  const char* field;
  const char* name;
};
constexpr Variable kVariables[] = {
    {"transport", "RESHARD_TRANSPORT"},
    {"inter_node_transport", "RESHARD_INTER_NODE_TRANSPORT"},
    {"node_size", "RESHARD_NODE_SIZE"},
    {"device", "RESHARD_DEVICE"},
    {"timeout", "RESHARD_TIMEOUT_S"},
    {"arrival_timeout", "RESHARD_ARRIVAL_TIMEOUT_S"},
    {"verify", "RESHARD_VERIFY"},
    {"chunk_bytes", "RESHARD_CHUNK_BYTES"},
    {"log_level", "RESHARD_LOG_LEVEL"},
    {"host.staging_bytes", "RESHARD_HOST_STAGING_BYTES"},
    {"cuda.engine", "RESHARD_CUDA_ENGINE"},
    {"cuda.ce_min_bytes", "RESHARD_CUDA_CE_MIN_BYTES"},
    {"cuda.ctas_per_peer", "RESHARD_CUDA_CTAS_PER_PEER"},
    {"cuda.bytes_per_cta", "RESHARD_CUDA_BYTES_PER_CTA"},
    {"cuda.same_device", "RESHARD_CUDA_SAME_DEVICE"},
    {"nccl.nonblocking", "RESHARD_NCCL_NONBLOCKING"},
    {"nccl.group_spans", "RESHARD_NCCL_GROUP_SPANS"},
    {"nvshmem.staging_bytes", "RESHARD_NVSHMEM_STAGING_BYTES"},
    {"nvshmem.waits", "RESHARD_NVSHMEM_WAITS"},
    {"debug.cuda_trace", "RESHARD_CUDA_TRACE"},
    {"debug.nvshmem_trace", "RESHARD_NVSHMEM_TRACE"},
    {"debug.phase_timing", "RESHARD_PHASE_TIMING"},
    {"debug.pipelined_phases", "RESHARD_PIPELINED_PHASES"},
    {"debug.cuda_ce_streams", "RESHARD_CUDA_CE_STREAMS"},
    {"debug.cuda_unroll", "RESHARD_CUDA_UNROLL"},
    {"debug.cuda_early_launch", "RESHARD_CUDA_EARLY_LAUNCH"},
    {"debug.cuda_batch_memops", "RESHARD_CUDA_BATCH_MEMOPS"},
    {"debug.nvshmem_direct", "RESHARD_NVSHMEM_DIRECT"},
    {"debug.nvshmem_send_stream", "RESHARD_NVSHMEM_SEND_STREAM"},
    {"debug.nvshmem_peers_per_round", "RESHARD_NVSHMEM_PEERS_PER_ROUND"},
};

const char* variable_of(const std::string& field) {
  for (const Variable& variable : kVariables) {
    if (field == variable.field) return variable.name;
  }
  return nullptr;
}

// The readers take an option by its field name and parse its variable's text only (text that does
// not parse is refused naming the variable); whether a value is in range is for the Checker
// below to say, once for code and environment alike.
std::optional<std::string> text_of(const char* field) { return env::get(variable_of(field)); }

void read(const char* field, std::string& option) {
  if (auto text = text_of(field)) option = *text;
}
void read(const char* field, int& option) {
  if (text_of(field)) option = env::get_int(variable_of(field), option);
}
void read(const char* field, bool& option) {
  if (text_of(field)) option = env::get_int(variable_of(field), 0) != 0;
}
void read(const char* field, std::uint32_t& option) {
  // A negative count reads as 0, which the Checker refuses quoting the variable's own text.
  if (text_of(field))
    option = static_cast<std::uint32_t>(std::max(0, env::get_int(variable_of(field), 0)));
}
template <typename Parsed, typename Parse>
Parsed parse_named(const char* field, const std::string& text, const char* expected, Parse parse) {
  try {
    return parse(text);
  } catch (const Error& error) {
    std::string why = error.what();
    if (why.rfind("reshard: ", 0) == 0) why.erase(0, 9);
    throw_error(ErrorCode::kInvalidArgument, std::string(variable_of(field)) + "='" + text +
                                                 "' is not " + expected + " (" + why + ")");
  }
}
void read(const char* field, std::uint64_t& option) {
  if (auto text = text_of(field))
    option = parse_named<std::uint64_t>(field, *text, "a byte count such as 64KiB", parse_bytes);
}
void read(const char* field, TransportKind& option) {
  if (auto text = text_of(field))
    option = parse_named<TransportKind>(field, *text, "a transport", parse_transport_kind);
}

// An optional option is set where its variable is, parsed as the plain one is.
template <typename T>
void read(const char* field, std::optional<T>& option) {
  if (!text_of(field)) return;
  T value{};
  read(field, value);
  option = value;
}

// How a refused option is named: by its field (set in code) or by its variable and the text it
// holds (taken from the environment).
using Subject = std::function<std::string(const std::string& field, const std::string& value)>;

std::string field_subject(const std::string& field, const std::string& value) {
  return "CopyServiceOptions::" + field + " = " + value;
}

std::string environment_subject(const std::string& field, const std::string& value) {
  const char* name = variable_of(field);
  const std::optional<std::string> text = name ? env::get(name) : std::nullopt;
  if (!text) return field_subject(field, value);
  return std::string(name) + "='" + *text + "' (CopyServiceOptions::" + field + ")";
}

class Checker {
 public:
  explicit Checker(Subject subject) : subject_(std::move(subject)) {}

  [[noreturn]] void refuse(const std::string& field, const std::string& value,
                           const std::string& why) const {
    throw_error(ErrorCode::kInvalidArgument, subject_(field, value) + " " + why);
  }

  void one_of(const std::string& field, const std::string& value,
              std::initializer_list<const char*> allowed) const {
    std::string list;
    for (const char* a : allowed) {
      if (value == a) return;
      list += (list.empty() ? "" : ", ") + std::string(a);
    }
    refuse(field, "'" + value + "'", "is not one of " + list);
  }

  void within(const std::string& field, long long value, long long low, long long high) const {
    if (value < low || value > high) {
      refuse(field, std::to_string(value),
             "is outside " + std::to_string(low) + ".." + std::to_string(high));
    }
  }

  void check(const CopyServiceOptions& o) const;

 private:
  Subject subject_;
};

void Checker::check(const CopyServiceOptions& o) const {
  if (o.inter_node_transport && (*o.inter_node_transport == TransportKind::kAuto ||
                                 *o.inter_node_transport == TransportKind::kCuda)) {
    refuse("inter_node_transport", transport_kind_name(*o.inter_node_transport),
           "cannot join nodes: use nvshmem, nccl or host");
  }
  if (o.node_size && *o.node_size < 1)
    refuse("node_size", std::to_string(*o.node_size), "must be at least 1");
  if (o.device && *o.device < 0) refuse("device", std::to_string(*o.device), "is negative");
  if (o.timeout.count() <= 0)
    refuse("timeout", std::to_string(o.timeout.count()) + " ms", "must be positive");
  if (o.arrival_timeout.count() <= 0) {
    refuse("arrival_timeout", std::to_string(o.arrival_timeout.count()) + " ms",
           "must be positive");
  }
  if (o.chunk_bytes && *o.chunk_bytes == 0) refuse("chunk_bytes", "0", "must be positive");
  one_of("cuda.engine", o.cuda.engine, {"auto", "sm", "ce", "autotune"});
  one_of("cuda.same_device", o.cuda.same_device, {"auto", "delegate", "stream", "kernel"});
  within("cuda.ctas_per_peer", o.cuda.ctas_per_peer, 1, 1024);
  if (o.cuda.bytes_per_cta < 4096)
    refuse("cuda.bytes_per_cta", std::to_string(o.cuda.bytes_per_cta), "is below 4 KiB");
  if (o.nccl.group_spans < 1) refuse("nccl.group_spans", "0", "must be at least 1");
  if (o.nvshmem.staging_bytes == 0) refuse("nvshmem.staging_bytes", "0", "must be positive");
  one_of("nvshmem.waits", o.nvshmem.waits, {"auto", "stream", "kernel"});
  if (o.host.staging_bytes == 0) refuse("host.staging_bytes", "0", "must be positive");
  within("debug.cuda_ce_streams", o.debug.cuda_ce_streams, 1, DebugOptions::kMaxCudaCeStreams);
  if (o.debug.cuda_unroll != 4 && o.debug.cuda_unroll != 8)
    refuse("debug.cuda_unroll", std::to_string(o.debug.cuda_unroll), "is not 4 or 8");
  if (o.debug.nvshmem_peers_per_round < 0) {
    refuse("debug.nvshmem_peers_per_round", std::to_string(o.debug.nvshmem_peers_per_round),
           "is negative (0: every peer)");
  }
}

}  // namespace

CopyServiceOptions CopyServiceOptions::from_environment() {
  CopyServiceOptions o;
  read("transport", o.transport);
  read("inter_node_transport", o.inter_node_transport);
  read("node_size", o.node_size);
  read("device", o.device);
  o.timeout = env::timeout();
  o.arrival_timeout = env::arrival_timeout();
  read("verify", o.verify);
  read("chunk_bytes", o.chunk_bytes);
  o.log_level = env::log_level().value_or(o.log_level);
  read("host.staging_bytes", o.host.staging_bytes);
  read("cuda.engine", o.cuda.engine);
  read("cuda.ce_min_bytes", o.cuda.ce_min_bytes);
  read("cuda.ctas_per_peer", o.cuda.ctas_per_peer);
  read("cuda.bytes_per_cta", o.cuda.bytes_per_cta);
  read("cuda.same_device", o.cuda.same_device);
  read("nccl.nonblocking", o.nccl.nonblocking);
  read("nccl.group_spans", o.nccl.group_spans);
  read("nvshmem.staging_bytes", o.nvshmem.staging_bytes);
  read("nvshmem.waits", o.nvshmem.waits);
  read("debug.cuda_trace", o.debug.cuda_trace);
  read("debug.nvshmem_trace", o.debug.nvshmem_trace);
  read("debug.phase_timing", o.debug.phase_timing);
  read("debug.pipelined_phases", o.debug.pipelined_phases);
  read("debug.cuda_ce_streams", o.debug.cuda_ce_streams);
  read("debug.cuda_unroll", o.debug.cuda_unroll);
  read("debug.cuda_early_launch", o.debug.cuda_early_launch);
  read("debug.cuda_batch_memops", o.debug.cuda_batch_memops);
  read("debug.nvshmem_direct", o.debug.nvshmem_direct);
  read("debug.nvshmem_send_stream", o.debug.nvshmem_send_stream);
  read("debug.nvshmem_peers_per_round", o.debug.nvshmem_peers_per_round);
  Checker(environment_subject).check(o);
  return o;
}

void CopyServiceOptions::validate() const { Checker(field_subject).check(*this); }

}  // namespace reshard

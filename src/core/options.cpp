#include "reshard/options.hpp"

#include <algorithm>
#include <functional>
#include <map>
#include <type_traits>

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
    {"cuda.same_device", "RESHARD_CUDA_SAME_DEVICE"},
    {"nccl.nonblocking", "RESHARD_NCCL_NONBLOCKING"},
    {"nvshmem.staging_bytes", "RESHARD_NVSHMEM_STAGING_BYTES"},
    {"nvshmem.waits", "RESHARD_NVSHMEM_WAITS"},
    {"advanced.cuda_ce_min_bytes", "RESHARD_CUDA_CE_MIN_BYTES"},
    {"advanced.cuda_ctas_per_peer", "RESHARD_CUDA_CTAS_PER_PEER"},
    {"advanced.cuda_bytes_per_cta", "RESHARD_CUDA_BYTES_PER_CTA"},
    {"advanced.cuda_ce_streams", "RESHARD_CUDA_CE_STREAMS"},
    {"advanced.cuda_unroll", "RESHARD_CUDA_UNROLL"},
    {"advanced.cuda_early_launch", "RESHARD_CUDA_EARLY_LAUNCH"},
    {"advanced.cuda_batch_memops", "RESHARD_CUDA_BATCH_MEMOPS"},
    {"advanced.nccl_group_spans", "RESHARD_NCCL_GROUP_SPANS"},
    {"advanced.nvshmem_direct", "RESHARD_NVSHMEM_DIRECT"},
    {"advanced.nvshmem_send_stream", "RESHARD_NVSHMEM_SEND_STREAM"},
    {"advanced.nvshmem_peers_per_round", "RESHARD_NVSHMEM_PEERS_PER_ROUND"},
    {"advanced.pipelined_phases", "RESHARD_PIPELINED_PHASES"},
    {"advanced.cuda_trace", "RESHARD_CUDA_TRACE"},
    {"advanced.nvshmem_trace", "RESHARD_NVSHMEM_TRACE"},
    {"advanced.step_timing", "RESHARD_STEP_TIMING"},
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

// Every field kept for one release under a former name, beside its new one: visit(former name,
// former field, its default, new name, new field, its default).
template <typename Visit>
void for_each_former_name(CopyServiceOptions& o, Visit visit) {
  const CopyServiceOptions d;
#define RESHARD_FORMER_NAME(group, former, name)                                                \
  visit(#group "." #former, o.group.former, d.group.former, "advanced." #name, o.advanced.name, \
        d.advanced.name)
  RESHARD_FORMER_NAME(cuda, ce_min_bytes, cuda_ce_min_bytes);
  RESHARD_FORMER_NAME(cuda, ctas_per_peer, cuda_ctas_per_peer);
  RESHARD_FORMER_NAME(cuda, bytes_per_cta, cuda_bytes_per_cta);
  RESHARD_FORMER_NAME(nccl, group_spans, nccl_group_spans);
  RESHARD_FORMER_NAME(debug, cuda_trace, cuda_trace);
  RESHARD_FORMER_NAME(debug, nvshmem_trace, nvshmem_trace);
  RESHARD_FORMER_NAME(debug, phase_timing, step_timing);
  RESHARD_FORMER_NAME(debug, pipelined_phases, pipelined_phases);
  RESHARD_FORMER_NAME(debug, cuda_ce_streams, cuda_ce_streams);
  RESHARD_FORMER_NAME(debug, cuda_unroll, cuda_unroll);
  RESHARD_FORMER_NAME(debug, cuda_early_launch, cuda_early_launch);
  RESHARD_FORMER_NAME(debug, cuda_batch_memops, cuda_batch_memops);
  RESHARD_FORMER_NAME(debug, nvshmem_direct, nvshmem_direct);
  RESHARD_FORMER_NAME(debug, nvshmem_send_stream, nvshmem_send_stream);
  RESHARD_FORMER_NAME(debug, nvshmem_peers_per_round, nvshmem_peers_per_round);
#undef RESHARD_FORMER_NAME
}

template <typename T>
std::string to_text(const T& value) {
  if constexpr (std::is_same_v<T, bool>) {
    return value ? "true" : "false";
  } else {
    return std::to_string(value);
  }
}

// The new names that took their value from a former name, by new name.
using FormerNames = std::map<std::string, std::string>;

// Moves each field set under a former name only to its new name; returns which did.
FormerNames move_former_names(CopyServiceOptions& o) {
  FormerNames moved;
  for_each_former_name(o, [&](const char* former_name, auto& former, const auto& former_default,
                              const char* name, auto& current, const auto& current_default) {
    if (former != former_default && current == current_default) {
      current = former;
      moved[name] = former_name;
    }
  });
  return moved;
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
    // A value set under a former name is refused under that name, as the caller wrote it.
    const auto former = former_names_.find(field);
    throw_error(
        ErrorCode::kInvalidArgument,
        subject_(former == former_names_.end() ? field : former->second, value) + " " + why);
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

  void check(const CopyServiceOptions& given);

 private:
  Subject subject_;
  FormerNames former_names_;
};

void Checker::check(const CopyServiceOptions& given) {
  // A former name set beside its new name to something else: which one was meant is unknown.
  CopyServiceOptions o = given;
  for_each_former_name(o, [&](const char* former_name, auto& former, const auto& former_default,
                              const char* name, auto& current, const auto& current_default) {
    if (former != former_default && current != current_default && former != current) {
      refuse(former_name, to_text(former),
             std::string("is the former name of ") + name + ", which is set to " +
                 to_text(current) + ": set " + name + " only");
    }
  });
  former_names_ = move_former_names(o);

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
  if (o.nvshmem.staging_bytes == 0) refuse("nvshmem.staging_bytes", "0", "must be positive");
  one_of("nvshmem.waits", o.nvshmem.waits, {"auto", "stream", "kernel"});
  if (o.host.staging_bytes == 0) refuse("host.staging_bytes", "0", "must be positive");
  const AdvancedOptions& a = o.advanced;
  within("advanced.cuda_ctas_per_peer", a.cuda_ctas_per_peer, 1, 1024);
  if (a.cuda_bytes_per_cta < 4096)
    refuse("advanced.cuda_bytes_per_cta", std::to_string(a.cuda_bytes_per_cta), "is below 4 KiB");
  within("advanced.cuda_ce_streams", a.cuda_ce_streams, 1, AdvancedOptions::kMaxCudaCeStreams);
  if (a.cuda_unroll != 4 && a.cuda_unroll != 8)
    refuse("advanced.cuda_unroll", std::to_string(a.cuda_unroll), "is not 4 or 8");
  if (a.nccl_group_spans < 1) refuse("advanced.nccl_group_spans", "0", "must be at least 1");
  if (a.nvshmem_peers_per_round < 0) {
    refuse("advanced.nvshmem_peers_per_round", std::to_string(a.nvshmem_peers_per_round),
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
  read("cuda.same_device", o.cuda.same_device);
  read("nccl.nonblocking", o.nccl.nonblocking);
  read("nvshmem.staging_bytes", o.nvshmem.staging_bytes);
  read("nvshmem.waits", o.nvshmem.waits);
  AdvancedOptions& a = o.advanced;
  read("advanced.cuda_ce_min_bytes", a.cuda_ce_min_bytes);
  read("advanced.cuda_ctas_per_peer", a.cuda_ctas_per_peer);
  read("advanced.cuda_bytes_per_cta", a.cuda_bytes_per_cta);
  read("advanced.cuda_ce_streams", a.cuda_ce_streams);
  read("advanced.cuda_unroll", a.cuda_unroll);
  read("advanced.cuda_early_launch", a.cuda_early_launch);
  read("advanced.cuda_batch_memops", a.cuda_batch_memops);
  read("advanced.nccl_group_spans", a.nccl_group_spans);
  read("advanced.nvshmem_direct", a.nvshmem_direct);
  read("advanced.nvshmem_send_stream", a.nvshmem_send_stream);
  read("advanced.nvshmem_peers_per_round", a.nvshmem_peers_per_round);
  read("advanced.pipelined_phases", a.pipelined_phases);
  read("advanced.cuda_trace", a.cuda_trace);
  read("advanced.nvshmem_trace", a.nvshmem_trace);
  // RESHARD_PHASE_TIMING, the former name, where the new one is not set.
  if (env::get("RESHARD_STEP_TIMING")) {
    read("advanced.step_timing", a.step_timing);
  } else if (env::get("RESHARD_PHASE_TIMING")) {
    a.step_timing = env::get_int("RESHARD_PHASE_TIMING", 0) != 0;
  }
  Checker(environment_subject).check(o);
  return o;
}

void CopyServiceOptions::validate() const { Checker(field_subject).check(*this); }

CopyServiceOptions CopyServiceOptions::with_former_names_applied() const {
  CopyServiceOptions o = *this;
  for (const auto& [name, former_name] : move_former_names(o)) {
    RESHARD_LOG(kWarn, "CopyServiceOptions::" << former_name
                                              << " is deprecated and goes in the next "
                                                 "release: set CopyServiceOptions::"
                                              << name);
  }
  // The former names back at their defaults: options read from one service and changed under the
  // new names for another must not meet an old value that now disagrees.
  for_each_former_name(o, [](const char*, auto& former, const auto& former_default, const char*,
                             auto&, const auto&) { former = former_default; });
  return o;
}

std::vector<std::pair<std::string, std::string>> CopyServiceOptions::former_names() {
  std::vector<std::pair<std::string, std::string>> names;
  CopyServiceOptions o;
  for_each_former_name(o, [&](const char* former_name, auto&, const auto&, const char* name, auto&,
                              const auto&) { names.emplace_back(former_name, name); });
  return names;
}

}  // namespace reshard

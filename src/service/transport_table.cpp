#include "service/transport_table.hpp"

#include <algorithm>
#include <string>
#include <vector>

#include "core/message.hpp"
#include "core/nodes.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"

namespace reshard {
namespace {

struct TransportEntry {
  TransportKind kind;
  std::unique_ptr<Transport> (*make)(Bootstrap&, const CopyServiceOptions&);
  std::string (*version)();  // what component_versions() says of it; nullptr: nothing
};

// The transports of this build, in the order available_transports() lists them.
const std::vector<TransportEntry>& transport_table() {
  static const std::vector<TransportEntry> table = {
      {TransportKind::kHost, make_host_transport, nullptr},
#ifdef RESHARD_WITH_CUDA
      {TransportKind::kCuda, make_cuda_transport, cuda_versions},
#endif
#ifdef RESHARD_WITH_NCCL
      {TransportKind::kNccl, make_nccl_transport, nccl_version},
#endif
#ifdef RESHARD_WITH_NVSHMEM
      {TransportKind::kNvshmem, make_nvshmem_transport, nvshmem_version},
#endif
  };
  return table;
}

const TransportEntry* find_entry(TransportKind kind) {
  for (const TransportEntry& entry : transport_table()) {
    if (entry.kind == kind) return &entry;
  }
  return nullptr;
}

// "host, cuda, nccl": the transports of this build, for error messages.
std::string built_transports() {
  std::string names;
  for (const std::string& n : available_transports()) names += (names.empty() ? "" : ", ") + n;
  return names;
}

// What a build needs for the transport.
std::string how_to_build(TransportKind kind) {
  switch (kind) {
    case TransportKind::kCuda:
      return "a build includes it where CUDA (nvcc) is found";
    case TransportKind::kNccl:
      return "a build with CUDA includes it where NCCL is found (the system's, or the "
             "nvidia-nccl-cu13 wheel in the environment the package is installed into: pip "
             "install nvidia-nccl-cu13, then pip install . again)";
    case TransportKind::kNvshmem:
      return "a build with CUDA includes it where NVSHMEM is found (the nvidia-nvshmem-cu13 "
             "wheel in the environment the package is installed into: pip install "
             "nvidia-nvshmem-cu13==3.4.5, then pip install . again)";
    default:
      return "see the README's \"What you need\"";
  }
}

bool is_available(TransportKind kind) { return find_entry(kind) != nullptr; }

std::unique_ptr<Transport> make_named(TransportKind kind, Bootstrap& bootstrap,
                                      const CopyServiceOptions& options) {
  const TransportEntry* entry = find_entry(kind);
  if (entry == nullptr) {
    throw_error(ErrorCode::kUnsupported, std::string("the ") + transport_kind_name(kind) +
                                             " transport is not part of this build (it has: " +
                                             built_transports() + "); " + how_to_build(kind));
  }
  return entry->make(bootstrap, options);
}

// Collective: what kAuto stands for, the same on every PE. Inside a node: the CUDA transport
// where every PE has a GPU, else host shared memory; between nodes: NVSHMEM (or NCCL where
// NVSHMEM is not built, or options.inter_node_transport), in one mixed schedule.
std::unique_ptr<Transport> make_auto_transport(Bootstrap& bootstrap,
                                               const CopyServiceOptions& options) {
  message::Writer mine;
  mine.put<std::int32_t>(visible_cuda_devices());
  bool all_gpus = true;
  for (const auto& part : bootstrap.all_gather(mine.bytes()))
    all_gpus = all_gpus && message::Reader(part).get<std::int32_t>() > 0;
  const NodeMap nodes = map_nodes(bootstrap, options.node_size);
  const TransportKind intra =
      all_gpus && is_available(TransportKind::kCuda) ? TransportKind::kCuda : TransportKind::kHost;
  if (nodes.nodes == 1) {
    if (intra == TransportKind::kHost && all_gpus && is_available(TransportKind::kNccl))
      return make_named(TransportKind::kNccl, bootstrap, options);
    return make_named(intra, bootstrap, options);
  }
  TransportKind inter = TransportKind::kHost;
  if (options.inter_node_transport) {
    inter = *options.inter_node_transport;
  } else if (all_gpus) {
    inter = is_available(TransportKind::kNvshmem) ? TransportKind::kNvshmem : TransportKind::kNccl;
  }
  const auto host_across_machines = [&](TransportKind kind) {
    return kind == TransportKind::kHost && !nodes.one_machine;
  };
  if (host_across_machines(intra) || host_across_machines(inter)) {
    throw_error(ErrorCode::kUnsupported,
                "the PEs run on " + std::to_string(nodes.nodes) +
                    " machines and not every PE has a GPU: reshard moves CPU memory between "
                    "processes of one machine only (host transport)");
  }
  return make_mixed_transport(
      bootstrap, nodes, [intra, &options](Bootstrap& b) { return make_named(intra, b, options); },
      [inter, &options](Bootstrap& b) { return make_named(inter, b, options); });
}

}  // namespace

std::vector<std::string> available_transports() {
  std::vector<std::string> names;
  for (const TransportEntry& entry : transport_table())
    names.emplace_back(transport_kind_name(entry.kind));
  return names;
}

std::string component_versions() {
  std::string text = "reshard " RESHARD_VERSION;
  for (const TransportEntry& entry : transport_table()) {
    // The CUDA transport's versions cover the runtime and driver every GPU transport uses.
    if (entry.version != nullptr) text += entry.version();
  }
  return text;
}

TransportKind parse_transport_kind(const std::string& name) {
  for (TransportKind kind : {TransportKind::kAuto, TransportKind::kHost, TransportKind::kCuda,
                             TransportKind::kNccl, TransportKind::kNvshmem}) {
    if (name == transport_kind_name(kind)) return kind;
  }
  throw_error(
      ErrorCode::kInvalidArgument,
      "unknown transport '" + name + "' (this build offers: auto, " + built_transports() + ")");
}

const char* transport_kind_name(TransportKind kind) {
  switch (kind) {
    case TransportKind::kAuto:
      return "auto";
    case TransportKind::kHost:
      return "host";
    case TransportKind::kCuda:
      return "cuda";
    case TransportKind::kNccl:
      return "nccl";
    case TransportKind::kNvshmem:
      return "nvshmem";
  }
  return "?";
}

std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const CopyServiceOptions& options) {
  return options.transport == TransportKind::kAuto
             ? make_auto_transport(bootstrap, options)
             : make_named(options.transport, bootstrap, options);
}

}  // namespace reshard

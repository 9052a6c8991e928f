// NVSHMEM's process-wide state and its start: initialised once per process, with the settings
// NVSHMEM reads from the environment set only for its initialisation.
#include "transports/nvshmem/nvshmem_transport_impl.hpp"

namespace reshard::nvshmem {

Runtime& runtime() {
  static Runtime instance;
  return instance;
}

namespace {

// NVSHMEM takes some settings from the environment only, when it initialises: they are set for
// that where the caller has not set them, and taken out again afterwards, so the process's
// environment is left as it was found.
class InitialisationEnv {
 public:
  InitialisationEnv() = default;
  InitialisationEnv(const InitialisationEnv&) = delete;
  InitialisationEnv& operator=(const InitialisationEnv&) = delete;
  ~InitialisationEnv() {
    for (const char* name : set_) ::unsetenv(name);
  }
  void set_default(const char* name, const std::string& value) {
    if (std::getenv(name) != nullptr) return;
    ::setenv(name, value.c_str(), 0);
    set_.push_back(name);
  }

 private:
  std::vector<const char*> set_;
};

}  // namespace

// Collective over `bootstrap`: NVSHMEM's unique-id bootstrap, the id from PE 0.
void initialize(Runtime& rt, Bootstrap& bootstrap, int device, std::uint64_t budget) {
  const int me = bootstrap.rank(), n = bootstrap.size();
  if (rt.initialized) {
    if (rt.rank != me || rt.size != n) {
      throw_error(ErrorCode::kUnsupported,
                  "NVSHMEM was initialised in this process as PE " + std::to_string(rt.rank) +
                      " of " + std::to_string(rt.size) + "; it cannot join a job of " +
                      std::to_string(n) + " PEs as PE " + std::to_string(me) +
                      " (NVSHMEM is initialised once per process)");
    }
    return;
  }
  // Staging: NvshmemTransportOptions::staging_bytes per PE (default 512 MiB) split into the
  // slots; the first service of the process sizes them.
  const std::uint64_t slots = (static_cast<std::uint64_t>(n) + 1) * kDepth;
  rt.chunk = std::clamp<std::uint64_t>(budget / slots / kAlign * kAlign, kMinChunk, kMaxChunk);
  rt.rank = me;
  rt.size = n;
  rt.device = device;
  // NVLink multicast stays off (shared machines), and the symmetric heap holds the staging.
  InitialisationEnv env;
  env.set_default("NVSHMEM_DISABLE_NVLS", "1");
  env.set_default("NVSHMEM_SYMMETRIC_SIZE", std::to_string(rt.heap_bytes() + (64 << 20)));

  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (me == 0 && nvshmemx_get_uniqueid(&id) != 0) {
    throw_error(ErrorCode::kSystem, "nvshmemx_get_uniqueid failed on PE 0");
  }
  message::Writer mine;
  mine.put(id);
  id = message::Reader(bootstrap.all_gather(mine.bytes())[0]).get<nvshmemx_uniqueid_t>();
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (nvshmemx_set_attr_uniqueid_args(me, n, &id, &attr) != 0 ||
      nvshmemx_hostlib_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID, &attr) != 0) {
    rt.broken = "NVSHMEM initialisation failed";
    throw_error(ErrorCode::kSystem, "NVSHMEM initialisation failed on PE " + std::to_string(me) +
                                        " (NVSHMEM_DEBUG=WARN says why; NVSHMEM_SYMMETRIC_SIZE=" +
                                        std::getenv("NVSHMEM_SYMMETRIC_SIZE") + ")");
  }
  rt.initialized = true;
  rt.heap = static_cast<std::byte*>(nvshmem_calloc(1, rt.heap_bytes()));
  if (rt.heap == nullptr) {
    rt.broken = "the NVSHMEM staging heap could not be allocated";
    throw_error(ErrorCode::kSystem,
                "nvshmem_calloc of " + std::to_string(rt.heap_bytes()) +
                    " bytes of staging failed (RESHARD_NVSHMEM_STAGING_BYTES sets the budget, "
                    "NVSHMEM_SYMMETRIC_SIZE the heap)");
  }
  rt.sent.assign(n, 0);
  rt.received.assign(n, 0);
  rt.last_put.assign(n, {});
  RESHARD_LOG(kDebug, "nvshmem transport: PE " << me << " of " << n << " on device " << device
                                               << ", " << kDepth << " slots of " << rt.chunk
                                               << " bytes per peer");
}

}  // namespace reshard::nvshmem

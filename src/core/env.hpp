// The RESHARD_* variables read outside CopyServiceOptions: what the bootstraps and the executor
// need before or beside a service. The service's own variables are read, and checked, in one
// place: CopyServiceOptions::from_environment() (core/options.cpp); the README lists them all.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "reshard/log.hpp"

namespace reshard::env {

// RESHARD_TIMEOUT_S: how long any wait on a peer may last (default 30 s).
std::chrono::milliseconds timeout();
// RESHARD_ARRIVAL_TIMEOUT_S (default 600 s): how long to wait for a PE that has not arrived yet.
std::chrono::milliseconds arrival_timeout();
// RESHARD_LOG_LEVEL: overrides the level passed to init().
std::optional<LogLevel> log_level();
// RESHARD_STAGING_BUDGET: most staging memory the executor holds per PE at once ("unlimited" for
// no bound; 0 for none); unset: none given (see ReshardOptions::staging_budget).
std::optional<std::uint64_t> staging_budget();
// RESHARD_JOB_ID: set by reshard-run so leftovers of a failed job can be found and removed.
std::optional<std::string> job_id();
// RESHARD_TRANSPORT: overrides the transport chosen in code ("auto", "host", "cuda", "nccl").
std::optional<std::string> transport();

// Any variable (unset and empty read alike); get_int refuses text that is not an integer, naming
// the variable.
std::optional<std::string> get(const char* name);
int get_int(const char* name, int fallback);

}  // namespace reshard::env

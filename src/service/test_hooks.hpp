// Fault injection for reshard's own tests (not installed, not part of the API).
#pragma once

#include <optional>

#include "reshard/copy_service.hpp"

namespace reshard::test_hooks {

struct ServiceProbe {
  // Verify mode's tests: after every run of `service` (each phase), before verify mode's check,
  // one byte of each of this PE's receives of `task` flips, as a faulty link or a stray write
  // would make it; nullopt: no more.
  static void corrupt_receives_after_run(CopyService& service, std::optional<TaskId> task);
};

}  // namespace reshard::test_hooks

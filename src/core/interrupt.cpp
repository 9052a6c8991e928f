#include "core/interrupt.hpp"

#include <atomic>
#include <string>

#include "reshard/error.hpp"

namespace reshard {
namespace {

std::atomic<InterruptCheck> installed{nullptr};

}  // namespace

void set_interrupt_check(InterruptCheck check) { installed.store(check); }

void throw_if_interrupted(const char* what, std::chrono::steady_clock::time_point waiting_since) {
  const InterruptCheck check = installed.load(std::memory_order_relaxed);
  if (check == nullptr) return;
  // The check may be costly (the Python module takes the GIL): only in long waits, and at most
  // once a period per thread.
  using Clock = std::chrono::steady_clock;
  thread_local Clock::time_point next_check{};
  const auto now = Clock::now();
  if (now - waiting_since < kInterruptCheckPeriod || now < next_check) return;
  next_check = now + kInterruptCheckPeriod;
  if (check()) {
    throw_error(ErrorCode::kInterrupted, std::string("interrupted (Ctrl-C) while waiting in ") +
                                             what + "; the other PEs are told this PE stopped");
  }
}

}  // namespace reshard

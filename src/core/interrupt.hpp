// Interruption of reshard's waits: a program that embeds reshard (the Python module) installs a
// check that says whether the user asked to stop (Ctrl-C), and every wait on peers (the
// bootstraps' collectives, the transports' runs) calls throw_if_interrupted() while it waits, so
// a blocked call ends with an ErrorCode::kInterrupted error within a fifth of a second instead of
// at its timeout. The service then fails as for any error: its peers are told, not left waiting.
#pragma once

#include <chrono>

namespace reshard {

// `check` is called from the thread that waits (at most every kInterruptCheckPeriod) and returns
// whether to stop; nullptr removes it. Not thread-safe against concurrent waits: install it once,
// before any service is made.
using InterruptCheck = bool (*)();
void set_interrupt_check(InterruptCheck check);

// Throws Error(kInterrupted) naming `what` where the installed check says to stop; asks it only
// once the wait has lasted a check period (since `waiting_since`), so waits of a refit's hot path
// never pay for the check, and then at most once a period per thread.
void throw_if_interrupted(const char* what, std::chrono::steady_clock::time_point waiting_since);

// How long a wait sleeps or polls at most between two checks.
inline constexpr std::chrono::milliseconds kInterruptCheckPeriod{100};

}  // namespace reshard

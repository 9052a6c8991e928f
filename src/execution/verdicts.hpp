// Each PE's verdict on its own part of a collective step of the executor: a refusal that only
// one PE finds (a bad tensor, a transform's hook, a tensor the Python binding cannot read)
// becomes the same error on every PE instead of a collective the others wait in forever.
#pragma once

#include <cstddef>
#include <exception>
#include <span>
#include <vector>

#include "reshard/copy_service.hpp"

namespace reshard::execution {

// Collective: every PE's `mine`, in PE order, once every PE has said how its own part went.
// Where a PE failed (`failure`), every PE throws the same error instead, naming that PE and
// its cause (a failing PE tells its own); the service stays usable, and a corrected call on
// every PE works. The failing PE keeps an exception of another kind as it is (a Python
// transform's own error, say); the others learn its text. The first collective of
// execute_reshard_plan, of binding a Refit and of Refit::update() is one of these, so a PE that
// fails before it can join it with its failure (the Python binding does, for tensors it cannot
// read).
//
// `meeting`: the call's name where this collective opens a call that the PEs may come to at
// different times (a trainer finishing its step): it then waits the arrival timeout, not the
// transfer timeout, and a PE that does not come in time is named on every PE, with nothing
// done (ServiceSlot::meet).
std::vector<std::vector<std::byte>> gather_verdicts(CopyService& service,
                                                    std::span<const std::byte> mine,
                                                    const std::exception_ptr& failure,
                                                    const char* meeting = nullptr);

}  // namespace reshard::execution

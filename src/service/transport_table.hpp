// Which transports this build has and how the service makes one: a table of {kind, factory,
// version}. Adding a transport means a row in transport_table.cpp and its own folder under
// src/transports/.
#pragma once

#include <memory>

#include "core/transport.hpp"
#include "reshard/options.hpp"

namespace reshard {

// Collective: the transport `options.transport` names (kAuto: what it stands for on this job, the
// same on every PE), configured by `options`.
std::unique_ptr<Transport> make_transport(Bootstrap& bootstrap, const CopyServiceOptions& options);

}  // namespace reshard

// Everything a C++ user of reshard needs.
#pragma once

#include "reshard/bootstrap.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/log.hpp"
#include "reshard/scheduler.hpp"
#include "reshard/types.hpp"

// Everything a C++ user of reshard needs. The scheduler (reshard/scheduler.hpp) and the refit
// cost model (reshard/refit_model.hpp) are installed for tools that study them, not included here.
#pragma once

#include "reshard/bootstrap.hpp"
#include "reshard/config.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/layout.hpp"
#include "reshard/log.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/options.hpp"
#include "reshard/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard/staged_refit.hpp"
#include "reshard/transform.hpp"
#include "reshard/types.hpp"

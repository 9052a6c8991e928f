// Everything a C++ user of reshard needs.
#pragma once

#include "reshard/bootstrap.hpp"
#include "reshard/config.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/layout.hpp"
#include "reshard/log.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/plan.hpp"
#include "reshard/refit_model.hpp"
#include "reshard/resharder.hpp"
#include "reshard/scheduler.hpp"
#include "reshard/transform.hpp"
#include "reshard/types.hpp"

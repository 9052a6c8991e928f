// The parts of reshard._core, each bound by its own file: errors, bootstraps, the launcher and
// the copy service (service_bindings.cpp); layouts and plans (planning_bindings.cpp); refits and
// transforms (execution_bindings.cpp). python_module.cpp makes the module of them.
#pragma once

#include <nanobind/nanobind.h>

#include <thread>

namespace reshard::python {

// The thread Python handles signals on, and the interrupt check reshard's waits ask there.
extern std::thread::id python_main_thread;
bool python_interrupted();

void bind_errors(nanobind::module_& m);
void bind_bootstrap(nanobind::module_& m);
void bind_launcher(nanobind::module_& m);
void bind_copy_service(nanobind::module_& m);
void bind_layouts(nanobind::module_& m);
void bind_plan(nanobind::module_& m);
void bind_execution(nanobind::module_& m);

}  // namespace reshard::python

// The parts of reshard._core, each bound by its own file: errors, bootstraps, the launcher and
// the copy service (service_bindings.cpp); layouts and plans (planning_bindings.cpp); refits and
// transforms (execution_bindings.cpp). python_module.cpp makes the module of them.
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <thread>

namespace reshard::python {

// Warns that a former name (kept for one release) was used: a DeprecationWarning saying what to
// use instead, raised as an error where the caller's warning filters say so.
inline void warn_deprecated(const std::string& message) {
  if (PyErr_WarnEx(PyExc_DeprecationWarning, message.c_str(), 1) != 0) {
    throw nanobind::python_error();
  }
}

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

// A read-only property under a former name (kept for one release): each read warns, naming the
// property to read instead (`now`, e.g. "TransferOp.src_pe"), and reads `field`.
template <typename Bound, typename Class, typename Field>
void def_former_name(Bound& bound, const char* former, Field Class::* field,
                     const std::string& now) {
  const std::string type = now.substr(0, now.find('.'));
  const std::string message =
      type + "." + former + " is deprecated and goes in the next release: read " + now;
  bound.def_prop_ro(former, [message, field](const Class& self) {
    warn_deprecated(message);
    return self.*field;
  });
}

}  // namespace reshard::python

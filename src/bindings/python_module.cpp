// reshard._core: the C++ library as seen from Python. Tensors arrive through DLPack or the buffer
// protocol (PyTorch, CuPy, NumPy, JAX), are never copied, and must be contiguous; everything
// long-running releases the GIL. The Python package (python/reshard) wraps this module with
// keyword arguments, lifetime handling and docstrings.
// The module is bound in parts (bindings.hpp); this file puts them together.
#include <nanobind/nanobind.h>

#include <thread>

#include "bindings/bindings.hpp"
#include "bindings/tensor_snapshot.hpp"
#include "core/interrupt.hpp"

namespace nb = nanobind;

NB_MODULE(_core, m) {
  m.doc() = "reshard's C++ core; use the `reshard` package rather than this module directly.";
#ifdef NDEBUG
  // Objects a program keeps until the interpreter ends (globals, compiled closures) are freed by
  // the process's exit, not leaked; nanobind would list each one on stderr. Debug builds keep the
  // warnings, for finding real leaks.
  nb::set_leak_warnings(false);
#endif
  reshard::python::bind_errors(m);
  reshard::python::python_main_thread = std::this_thread::get_id();
  reshard::set_interrupt_check(&reshard::python::python_interrupted);
  reshard::python::bind_bootstrap(m);
  reshard::python::bind_launcher(m);
  reshard::python::bind_copy_service(m);
  reshard::python::bind_layouts(m);
  reshard::python::bind_plan(m);
  reshard::python::bind_execution(m);
  reshard::python::bind_tensor_snapshot(m);
}

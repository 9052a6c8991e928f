// What execute_reshard_plan was last given from Python, for telling in one pass that a call hands
// over the same tensors again (the same dict entries, the same objects, the same memory), so the
// refit runs without converting and checking every tensor again.
#pragma once

#include <nanobind/nanobind.h>

namespace reshard::python {

void bind_tensor_snapshot(nanobind::module_& m);

}  // namespace reshard::python

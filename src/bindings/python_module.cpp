// reshard._core: the C++ library as seen from Python. Tensors arrive through DLPack or the buffer
// protocol (PyTorch, CuPy, NumPy, JAX), are never copied, and must be contiguous; everything
// long-running releases the GIL. The Python package (python/reshard) wraps this module with
// keyword arguments, lifetime handling and docstrings.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <thread>
#include <type_traits>

#include "bindings/tensor_snapshot.hpp"
#include "core/env.hpp"
#include "core/interrupt.hpp"
#include "execution/verdicts.hpp"
#include "launch/local_launcher.hpp"
#include "reshard/bootstrap.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/layout.hpp"
#include "reshard/model_layouts.hpp"
#include "reshard/options.hpp"
#include "reshard/plan.hpp"
#include "reshard/resharder.hpp"
#include "reshard/staged_refit.hpp"
#include "reshard/transform.hpp"
#include "service/service_slot.hpp"
#include "service/test_hooks.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace reshard::python {
namespace {

using Array = nb::ndarray<>;                // memory reshard writes
using ReadOnlyArray = nb::ndarray<nb::ro>;  // memory reshard only reads

// What an error names: a string, or a function that makes one (only once something is wrong:
// execute_reshard_plan converts thousands of tensors a call).
template <typename Describe>
std::string named(const Describe& what) {
  if constexpr (std::is_invocable_v<const Describe&>)
    return what();
  else
    return what;
}

// The element type of an array, as reshard names it.
template <typename Describe>
DType dtype_of(const nb::dlpack::dtype& type, const Describe& what) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(type.code);
  if (type.lanes == 1) {
    if (code == Code::Float && type.bits == 32) return DType::kFloat32;
    if (code == Code::Float && type.bits == 64) return DType::kFloat64;
    if (code == Code::Float && type.bits == 16) return DType::kFloat16;
    if (code == Code::Bfloat && type.bits == 16) return DType::kBFloat16;
    if (code == Code::Float8_E4M3FN && type.bits == 8) return DType::kFloat8E4M3;
    if (code == Code::Float8_E8M0FNU && type.bits == 8) return DType::kFloat8E8M0;
    if (code == Code::Int && type.bits == 8) return DType::kInt8;
    if (code == Code::UInt && type.bits == 8) return DType::kUInt8;
    if (code == Code::Int && type.bits == 32) return DType::kInt32;
    if (code == Code::Int && type.bits == 64) return DType::kInt64;
  }
  if (type.lanes == 1 && code == Code::UInt && type.bits == 16) {
    // NumPy has no bfloat16: its users hold bf16 weights as uint16.
    throw_error(ErrorCode::kInvalidArgument,
                named(what) +
                    " is uint16, which could hold bfloat16 or float16 bits: name the type, "
                    "e.g. LocalTensor(array, dtype=\"bfloat16\")");
  }
  throw_error(ErrorCode::kInvalidArgument,
              named(what) + ": unsupported element type (DLPack code " + std::to_string(type.code) +
                  ", " + std::to_string(type.bits) +
                  " bits): name the type, e.g. LocalTensor(array, dtype=\"float8_e4m3\")");
}

// The memory of a contiguous array. Non-contiguous arrays are refused rather than copied: reshard
// reads and writes the caller's memory in place.
template <typename AnyArray, typename Describe>
Buffer buffer_of(const AnyArray& array, const Describe& what) {
  // An array without elements is contiguous whatever its strides say (PyTorch gives an empty
  // shard of an uneven split the strides of its parent).
  bool empty = false;
  for (std::size_t d = 0; d < array.ndim(); ++d) empty = empty || array.shape(d) == 0;
  std::int64_t expected = 1;
  for (std::size_t d = array.ndim(); !empty && d-- > 0;) {
    if (array.shape(d) != 1 && array.stride(d) != expected) {
      throw_error(ErrorCode::kInvalidArgument,
                  named(what) + " is not contiguous (dimension " + std::to_string(d) +
                      " has stride " + std::to_string(array.stride(d)) + " elements, expected " +
                      std::to_string(expected) +
                      "); reshard moves memory in place: pass a contiguous array (.contiguous() "
                      "in PyTorch, numpy.ascontiguousarray in NumPy)");
    }
    expected *= static_cast<std::int64_t>(array.shape(d));
  }
  void* data = const_cast<void*>(array.data());
  const std::size_t bytes = array.nbytes();
  switch (array.device_type()) {
    case nb::device::cpu::value:
    case nb::device::cuda_host::value:
      return Buffer::host(data, bytes);
    case nb::device::cuda::value:
      return Buffer::cuda(data, bytes, array.device_id());
    default:
      throw_error(ErrorCode::kInvalidArgument,
                  named(what) + " lives on a device reshard does not handle (DLPack device type " +
                      std::to_string(array.device_type()) + "); use host or CUDA memory");
  }
}

// register_send / register_receive: `size` bytes at `pos`, or with `rows` (outer extents) and
// `pitches` (their strides in bytes) rows of `size` bytes each.
StridedRange strided_range(TaskId task, std::size_t pos, std::size_t size,
                           const std::vector<std::uint64_t>& rows,
                           const std::vector<std::uint64_t>& pitches) {
  if (rows.size() != pitches.size() || rows.size() > StridedRange::kMaxOuterDims) {
    throw Error(ErrorCode::kInvalidArgument,
                "task " + std::to_string(task) + ": rows has " + std::to_string(rows.size()) +
                    " extents and pitches " + std::to_string(pitches.size()) +
                    " strides; give one stride (in bytes) per extent, at most " +
                    std::to_string(StridedRange::kMaxOuterDims),
                {task});
  }
  StridedRange range{pos, size, static_cast<int>(rows.size())};
  std::copy(rows.begin(), rows.end(), range.extent.begin());
  std::copy(pitches.begin(), pitches.end(), range.stride.begin());
  return range;
}

void* stream_of(std::optional<std::uintptr_t> stream) {
  return stream ? reinterpret_cast<void*>(*stream) : nullptr;
}

// What `object` exports through DLPack. PyTorch's Tensor.__dlpack__ is Python code (checks, then
// the export: about 2 us a tensor), where torch.utils.dlpack.to_dlpack is the export alone (0.4
// us); a refit of a MoE model passes thousands of tensors a call, so plain tensors and
// parameters (requires_grad too, which __dlpack__ refuses) are exported directly. Subclasses
// (DTensor, ...) keep their own __dlpack__.
nb::object dlpack_source(nb::handle object) {
  struct Torch {
    PyTypeObject* tensor;
    PyTypeObject* parameter;
    nb::object to_dlpack;
  };
  static Torch* torch = nullptr;  // once PyTorch is imported; kept until the process ends
  if (torch == nullptr) {
    static PyObject* const name = PyUnicode_InternFromString("torch");
    PyObject* module = PyImport_GetModule(name);
    if (module == nullptr) {
      PyErr_Clear();
      return nb::borrow(object);  // no PyTorch in this process: no torch tensors either
    }
    nb::object torch_module = nb::steal(module);
    torch =
        new Torch{reinterpret_cast<PyTypeObject*>(torch_module.attr("Tensor").ptr()),
                  reinterpret_cast<PyTypeObject*>(torch_module.attr("nn").attr("Parameter").ptr()),
                  nb::module_::import_("torch.utils.dlpack").attr("to_dlpack")};
  }
  const PyTypeObject* type = Py_TYPE(object.ptr());
  if (type != torch->tensor && type != torch->parameter) return nb::borrow(object);
  return torch->to_dlpack(object);
}

// `object` as an array of reshard's (DLPack or the buffer protocol), or an error naming it.
template <typename AnyArray, typename Describe>
AnyArray array_of(nb::handle object, const Describe& what) {
  AnyArray array;
  std::string why;
  try {
    if (nb::try_cast(dlpack_source(object), array, false)) return array;
  } catch (const nb::python_error& error) {
    why = std::string(" (") + error.what() + ")";
  }
  if constexpr (!std::is_same_v<AnyArray, ReadOnlyArray>) {
    ReadOnlyArray read_only;
    if (why.empty() && nb::try_cast(dlpack_source(object), read_only, false)) {
      throw_error(ErrorCode::kInvalidArgument,
                  named(what) +
                      " is read-only, and reshard writes into it in place: pass a "
                      "writable array");
    }
  }
  throw_error(ErrorCode::kInvalidArgument,
              named(what) + ": " + nb::type_name(object.type()).c_str() +
                  " is not an array reshard can read" + why +
                  "; it takes DLPack or buffer-protocol arrays (PyTorch, NumPy, CuPy, JAX)");
}

// The memory of a registered array (as execute_reshard_plan reads tensors: PyTorch's exported
// directly), or an error naming the task.
template <typename AnyArray>
Buffer registered_buffer(nb::handle object, TaskId task, const char* side) {
  const auto what = [&] { return std::string(side) + " buffer of task " + std::to_string(task); };
  try {
    return buffer_of(array_of<AnyArray>(object, what), what);
  } catch (const Error& error) {
    throw Error(error.code(), error.what(), {task});
  }
}

// A tensor map as four lists: names, arrays, and the scales and dtype names (each None, or a list
// with None where a tensor has none). The arrays are read by tensor_map, which names the tensor
// where one is not an array.
using TensorLists = std::tuple<nb::list, nb::list, nb::object, nb::object>;

template <typename AnyArray>
TensorMap tensor_map(const TensorLists& lists, const char* role) {
  const auto& [names, arrays, scales, dtypes] = lists;
  const std::size_t count = nb::len(names);
  auto refuse = [&](const std::string& what) {
    throw_error(ErrorCode::kInvalidArgument, std::string(role) + " tensors: " + what);
  };
  // Lists of one item per name (scales and dtype names may be None instead).
  auto sized = [&](nb::handle list, const char* what) -> PyObject* {
    if (list.is_none()) return nullptr;
    if (!nb::isinstance<nb::list>(list) || nb::len(list) != count)
      refuse(std::string("the ") + what + " are not a list of one per name");
    return list.ptr();
  };
  PyObject* array_list = sized(arrays, "arrays");
  PyObject* scale_list = sized(scales, "scales");
  PyObject* dtype_list = sized(dtypes, "dtype names");
  // Checked each time: an array's own export (Python code) could change the lists.
  auto item = [&](PyObject* list, std::size_t i) -> nb::handle {
    if (list == nullptr) return nb::none();
    PyObject* value = PyList_GetItem(list, static_cast<Py_ssize_t>(i));
    if (value == nullptr) {
      PyErr_Clear();
      refuse("a list changed while it was read");
    }
    return value;
  };
  auto text = [&](nb::handle value, const char* what) {
    if (!nb::isinstance<nb::str>(value))
      refuse(std::string(what) + " " + nb::repr(value).c_str() + " is not a string");
    return nb::cast<std::string>(value);
  };
  TensorMap map;
  map.reserve(count);
  for (std::size_t i = 0; i < count; ++i) {
    const std::string name = text(item(names.ptr(), i), "the name");
    auto what = [&] { return std::string(role) + " tensor '" + name + "'"; };
    const auto data = array_of<AnyArray>(item(array_list, i), what);
    const nb::handle dtype = item(dtype_list, i);
    const nb::handle scale = item(scale_list, i);
    LocalTensor tensor;
    tensor.data = buffer_of(data, what);
    tensor.dtype =
        dtype.is_none() ? dtype_of(data.dtype(), what) : parse_dtype(text(dtype, "the dtype name"));
    tensor.shape.reserve(data.ndim());
    for (std::size_t d = 0; d < data.ndim(); ++d)
      tensor.shape.push_back(static_cast<std::int64_t>(data.shape(d)));
    if (!scale.is_none()) {
      auto scale_what = [&] { return what() + " (scale)"; };
      const auto scale_array = array_of<AnyArray>(scale, scale_what);
      tensor.scale = buffer_of(scale_array, scale_what);
      tensor.scale_dtype = dtype_of(scale_array.dtype(), scale_what);
      for (std::size_t d = 0; d < scale_array.ndim(); ++d)
        tensor.scale_shape.push_back(static_cast<std::int64_t>(scale_array.shape(d)));
    }
    map.insert_or_assign(name, std::move(tensor));
  }
  return map;
}

// This rank's tensor maps for a collective call, or, where one cannot be read (not an array,
// an unsupported dtype), that refusal shared with the other ranks in the call's first collective
// (execution::gather_verdicts), so they stop with the same error instead of waiting for this one.
std::pair<TensorMap, TensorMap> tensor_maps_or_refuse(const TensorLists& src,
                                                      const TensorLists& dst,
                                                      CopyService& service) {
  std::exception_ptr failure;
  try {
    return {tensor_map<ReadOnlyArray>(src, "source"), tensor_map<Array>(dst, "destination")};
  } catch (...) {
    failure = std::current_exception();
  }
  nb::gil_scoped_release released;
  execution::gather_verdicts(service, {}, failure);
  std::rethrow_exception(failure);  // not reached: the gather throws on every rank
}

std::vector<std::int64_t> extents(const Box& box) {
  return {box.extent.begin(), box.extent.begin() + box.ndim};
}
std::vector<std::int64_t> offsets(const Box& box) {
  return {box.offset.begin(), box.offset.begin() + box.ndim};
}

Box box_of(const std::vector<std::int64_t>& offset, const std::vector<std::int64_t>& extent) {
  if (offset.size() != extent.size() || offset.size() > static_cast<std::size_t>(kMaxDims)) {
    throw_error(ErrorCode::kInvalidArgument, "a block needs as many offsets as extents (at most " +
                                                 std::to_string(kMaxDims) + " dimensions), got " +
                                                 std::to_string(offset.size()) + " and " +
                                                 std::to_string(extent.size()));
  }
  Box box;
  box.ndim = static_cast<int>(offset.size());
  for (int d = 0; d < box.ndim; ++d) {
    box.offset[d] = offset[d];
    box.extent[d] = extent[d];
  }
  return box;
}

// The thread Python handles signals on: reshard's waits there run Python's signal handlers (so
// Ctrl-C raises KeyboardInterrupt in a blocked init(), schedule() or run()); other threads have
// none to run.
std::thread::id python_main_thread;

bool python_interrupted() {
  if (std::this_thread::get_id() != python_main_thread || !Py_IsInitialized()) return false;
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  PyErr_Clear();  // raised again as KeyboardInterrupt once the wait has ended (bind_errors)
  return true;
}

void bind_errors(nb::module_& m) {
  static nb::object error_type = nb::steal(
      PyErr_NewExceptionWithDoc("reshard._core.ReshardError",
                                "An error raised by reshard; `code` names its kind and `tasks` "
                                "lists the task ids involved, if any.",
                                PyExc_RuntimeError, nullptr));
  m.attr("ReshardError") = error_type;
  nb::register_exception_translator([](const std::exception_ptr& thrown, void*) {
    try {
      std::rethrow_exception(thrown);
    } catch (const Error& error) {
      if (error.code() == ErrorCode::kInterrupted) {
        PyErr_SetString(PyExc_KeyboardInterrupt, error.what());
        return;
      }
      nb::object instance = error_type(nb::str(error.what()));
      instance.attr("code") = nb::str(error_code_name(error.code()));
      instance.attr("tasks") = nb::cast(error.tasks());
      PyErr_SetObject(error_type.ptr(), instance.ptr());
    }
  });
}

void bind_bootstrap(nb::module_& m) {
  nb::class_<Bootstrap>(m, "Bootstrap")
      .def_prop_ro("rank", &Bootstrap::rank)
      .def_prop_ro("size", &Bootstrap::size)
      .def_prop_ro("local_rank", &Bootstrap::local_rank)
      .def("barrier", &Bootstrap::barrier, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "all_gather",
          [](Bootstrap& self, nb::bytes mine) {
            std::vector<std::vector<std::byte>> parts;
            {
              nb::gil_scoped_release released;
              parts =
                  self.all_gather({reinterpret_cast<const std::byte*>(mine.c_str()), mine.size()});
            }
            nb::list out;
            for (const auto& part : parts) {
              out.append(nb::bytes(reinterpret_cast<const char*>(part.data()), part.size()));
            }
            return out;
          },
          "mine"_a);
  m.def(
      "tcp_bootstrap",
      [](const std::string& address, int port, int rank, int size, int local_rank) {
        TcpBootstrapOptions options;
        options.address = address;
        options.port = port;
        options.rank = rank;
        options.size = size;
        options.local_rank = local_rank;
        options.timeout = env::timeout();
        return std::shared_ptr<Bootstrap>(std::make_shared<TcpBootstrap>(options));
      },
      "address"_a, "port"_a, "rank"_a, "size"_a, "local_rank"_a,
      nb::call_guard<nb::gil_scoped_release>());
  m.def("make_unique_id", &TcpBootstrap::make_unique_id, "host"_a = "127.0.0.1");
  m.def(
      "default_bootstrap", [] { return std::shared_ptr<Bootstrap>(make_default_bootstrap()); },
      nb::call_guard<nb::gil_scoped_release>());
  m.def(
      "mpi_bootstrap", [] { return std::shared_ptr<Bootstrap>(make_mpi_bootstrap()); },
      nb::call_guard<nb::gil_scoped_release>());
  m.def("mpi_bootstrap_available", &mpi_bootstrap_available);
}

// The local launcher (src/launch) behind `python -m reshard.launch`: the same one reshard-run
// uses. The job's output goes to this process's stdout and stderr; the GIL is released while it
// runs.
void bind_launcher(nb::module_& m) {
  m.def(
      "launch_local",
      [](std::vector<std::string> command, int nprocs, double timeout_s, double grace_s,
         std::optional<std::vector<std::string>> environment) {
        LaunchOptions options;
        options.n_procs = nprocs;
        options.command = std::move(command);
        options.time_limit = std::chrono::milliseconds(static_cast<long long>(timeout_s * 1e3));
        options.kill_grace = std::chrono::milliseconds(static_cast<long long>(grace_s * 1e3));
        options.environment = std::move(environment);
        options.name = "reshard.launch";
        const LaunchResult result = launch_local(options);
        return std::make_tuple(result.exit_code, result.first_failed_rank, result.summary);
      },
      "command"_a, "nprocs"_a, "timeout_s"_a = 0.0, "grace_s"_a = 5.0, "environment"_a = nb::none(),
      nb::call_guard<nb::gil_scoped_release>(),
      "Runs command as nprocs local processes with torchrun's variables; returns (exit code, "
      "first failed rank or -1, summary).");
}

// CopyServiceOptions with Python's units: the timeout in seconds, transports and log levels by
// name; reshard/copy_service.py turns CopyService's keywords into it.
void bind_options(nb::module_& m) {
  m.def("parse_bytes", &parse_bytes, "text"_a, "A byte count such as '64KiB' or '1.5GB'.");
  nb::class_<HostTransportOptions>(m, "HostTransportOptions")
      .def_rw("staging_bytes", &HostTransportOptions::staging_bytes);
  nb::class_<CudaTransportOptions>(m, "CudaTransportOptions")
      .def_rw("engine", &CudaTransportOptions::engine)
      .def_rw("ce_min_bytes", &CudaTransportOptions::ce_min_bytes)
      .def_rw("ctas_per_peer", &CudaTransportOptions::ctas_per_peer)
      .def_rw("bytes_per_cta", &CudaTransportOptions::bytes_per_cta)
      .def_rw("same_device", &CudaTransportOptions::same_device);
  nb::class_<NcclTransportOptions>(m, "NcclTransportOptions")
      .def_rw("nonblocking", &NcclTransportOptions::nonblocking)
      .def_rw("group_spans", &NcclTransportOptions::group_spans);
  nb::class_<NvshmemTransportOptions>(m, "NvshmemTransportOptions")
      .def_rw("staging_bytes", &NvshmemTransportOptions::staging_bytes)
      .def_rw("waits", &NvshmemTransportOptions::waits);
  nb::class_<DebugOptions>(m, "DebugOptions")
      .def_rw("cuda_trace", &DebugOptions::cuda_trace)
      .def_rw("nvshmem_trace", &DebugOptions::nvshmem_trace)
      .def_rw("phase_timing", &DebugOptions::phase_timing)
      .def_rw("pipelined_phases", &DebugOptions::pipelined_phases)
      .def_rw("cuda_ce_streams", &DebugOptions::cuda_ce_streams)
      .def_rw("cuda_unroll", &DebugOptions::cuda_unroll)
      .def_rw("cuda_early_launch", &DebugOptions::cuda_early_launch)
      .def_rw("cuda_batch_memops", &DebugOptions::cuda_batch_memops)
      .def_rw("nvshmem_direct", &DebugOptions::nvshmem_direct)
      .def_rw("nvshmem_send_stream", &DebugOptions::nvshmem_send_stream)
      .def_rw("nvshmem_peers_per_round", &DebugOptions::nvshmem_peers_per_round);
  nb::class_<CopyServiceOptions>(m, "CopyServiceOptions")
      .def(nb::init<>())
      .def_static("from_environment", &CopyServiceOptions::from_environment)
      .def("validate", &CopyServiceOptions::validate)
      .def_prop_rw(
          "transport", [](const CopyServiceOptions& o) { return transport_kind_name(o.transport); },
          [](CopyServiceOptions& o, const std::string& name) {
            o.transport = parse_transport_kind(name);
          })
      .def_prop_rw(
          "inter_node_transport",
          [](const CopyServiceOptions& o) -> std::optional<std::string> {
            if (!o.inter_node_transport) return std::nullopt;
            return transport_kind_name(*o.inter_node_transport);
          },
          [](CopyServiceOptions& o, std::optional<std::string> name) {
            o.inter_node_transport.reset();
            if (name) o.inter_node_transport = parse_transport_kind(*name);
          })
      .def_rw("node_size", &CopyServiceOptions::node_size)
      .def_rw("device", &CopyServiceOptions::device)
      .def_prop_rw(
          "timeout", [](const CopyServiceOptions& o) { return o.timeout.count() / 1000.0; },
          [](CopyServiceOptions& o, double seconds) {
            o.timeout = std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
          },
          "seconds")
      .def_rw("verify", &CopyServiceOptions::verify)
      .def_rw("chunk_bytes", &CopyServiceOptions::chunk_bytes)
      .def_prop_rw(
          "log_level", [](const CopyServiceOptions& o) { return log_level_name(o.log_level); },
          [](CopyServiceOptions& o, const std::string& name) {
            o.log_level = parse_log_level(name);
          })
      .def_rw("host", &CopyServiceOptions::host)
      .def_rw("cuda", &CopyServiceOptions::cuda)
      .def_rw("nccl", &CopyServiceOptions::nccl)
      .def_rw("nvshmem", &CopyServiceOptions::nvshmem)
      .def_rw("debug", &CopyServiceOptions::debug);
}

void bind_copy_service(nb::module_& m) {
  bind_options(m);
  // reshard's own tests of verify mode (not part of the API).
  m.def("_corrupt_receives_after_run", &test_hooks::ServiceProbe::corrupt_receives_after_run,
        "service"_a, "task"_a.none());
  m.def("available_transports", &available_transports);
  m.def("component_versions", &component_versions,
        "What this build runs on, found at run time: reshard, CUDA runtime and driver, NCCL, "
        "NVSHMEM (those built in).");
  nb::class_<ScheduleReport>(m, "ScheduleReport")
      .def_ro("transfers", &ScheduleReport::transfers)
      .def_ro("batches", &ScheduleReport::batches)
      .def_ro("rounds", &ScheduleReport::rounds)
      .def_ro("lower_bound_bytes", &ScheduleReport::lower_bound_bytes)
      .def_ro("makespan_bytes", &ScheduleReport::makespan_bytes)
      .def_ro("bytes_sent", &ScheduleReport::bytes_sent)
      .def_ro("bytes_received", &ScheduleReport::bytes_received)
      .def_ro("bytes_local", &ScheduleReport::bytes_local)
      .def_ro("phases", &ScheduleReport::phases)
      .def_prop_ro("bound_ratio", &ScheduleReport::bound_ratio);

  using GilFree = nb::call_guard<nb::gil_scoped_release>;
  nb::class_<CopyService>(m, "CopyService")
      .def(
          "__init__",
          [](CopyService* self, const std::string& transport, std::shared_ptr<Bootstrap> bootstrap,
             std::optional<CopyServiceOptions> options) {
            const TransportKind kind = parse_transport_kind(transport);
            nb::gil_scoped_release released;
            if (!bootstrap) bootstrap = make_default_bootstrap();
            if (options) {
              // As the constructor without options: a transport named in code wins;
              // RESHARD_TRANSPORT (the options' default) chooses where the code says "auto".
              if (kind != TransportKind::kAuto) options->transport = kind;
              new (self) CopyService(std::move(bootstrap), *options);
            } else {
              new (self) CopyService(std::move(bootstrap), kind);
            }
          },
          "transport"_a = "auto", "bootstrap"_a = nb::none(), "options"_a = nb::none())
      .def_prop_ro("options", [](const CopyService& self) { return self.options(); })
      .def("init", nb::overload_cast<const std::string&>(&CopyService::init), "log_level"_a,
           GilFree())
      .def("init", nb::overload_cast<>(&CopyService::init), GilFree())
      .def_prop_ro("my_pe", &CopyService::my_pe)
      .def_prop_ro("n_pes", &CopyService::n_pes)
      .def_prop_ro("device", &CopyService::device)
      .def_prop_ro("initialized", &CopyService::initialized)
      .def_prop_ro("transport_name", &CopyService::transport_name)
      .def_prop_ro("generation",
                   [](const CopyService& self) { return execution::ServiceSlot::generation(self); })
      .def(
          "register_send",
          [](CopyService& self, TaskId task, nb::handle src, std::size_t pos, std::size_t size,
             PeId dest, const std::vector<std::uint64_t>& rows,
             const std::vector<std::uint64_t>& pitches) {
            self.register_send(task, registered_buffer<ReadOnlyArray>(src, task, "send"),
                               strided_range(task, pos, size, rows, pitches), dest);
          },
          "task_id"_a, "src"_a, "src_pos"_a, "size"_a, "dest_pe"_a,
          "rows"_a = std::vector<std::uint64_t>{}, "pitches"_a = std::vector<std::uint64_t>{})
      .def(
          "register_receive",
          [](CopyService& self, TaskId task, nb::handle dst, std::size_t pos, std::size_t size,
             PeId src, const std::vector<std::uint64_t>& rows,
             const std::vector<std::uint64_t>& pitches) {
            self.register_receive(task, registered_buffer<Array>(dst, task, "receive"),
                                  strided_range(task, pos, size, rows, pitches), src);
          },
          "task_id"_a, "dst"_a, "dst_pos"_a, "size"_a, "src_pe"_a,
          "rows"_a = std::vector<std::uint64_t>{}, "pitches"_a = std::vector<std::uint64_t>{})
      .def_prop_ro("moves_rows_in_place", &CopyService::moves_rows_in_place)
      .def_prop_ro("waits_in_stream_front_end", &CopyService::waits_in_stream_front_end)
      .def("schedule", &CopyService::schedule, GilFree())
      .def(
          "run",
          [](CopyService& self, std::optional<std::uintptr_t> stream) {
            if (stream) {
              self.run(stream_of(stream));
            } else {
              self.run();
            }
          },
          "stream"_a = nb::none(), GilFree())
      .def("set_phase", &CopyService::set_phase, "phase"_a)
      .def_prop_ro("phases", &CopyService::phases)
      .def(
          "run_phase",
          [](CopyService& self, std::uint32_t phase, std::optional<std::uintptr_t> stream) {
            self.run_phase(phase, stream ? stream_of(stream) : nullptr);
          },
          "phase"_a, "stream"_a = nb::none(), GilFree())
      .def("synchronize", &CopyService::synchronize, GilFree())
      .def_prop_rw("verify", &CopyService::verify, &CopyService::set_verify)
      .def("clear_requests", &CopyService::clear_requests, GilFree())
      .def("finalize", &CopyService::finalize, GilFree());
}

// ModelParam::stage as Python names it ("layer", "first", "last").
const char* stage_name(Stage stage) {
  switch (stage) {
    case Stage::kFirst:
      return "first";
    case Stage::kLast:
      return "last";
    case Stage::kLayer:
      break;
  }
  return "layer";
}

void bind_layouts(nb::module_& m) {
  nb::class_<ParamSpec>(m, "ParamSpec",
                        "A parameter of a model: its name, global shape and dtype (\"bfloat16\", "
                        "\"float32\", \"float16\", \"fp8\", ...). `real_shape`, where the layout "
                        "pads the parameter (a vocabulary padded to a multiple of 128 x TP): the "
                        "block [0, real_shape[d]) holding the model's values, the only part plans "
                        "move, so two layouts may pad it differently (None: all of `shape`).")
      .def(
          "__init__",
          [](ParamSpec* self, std::string name, std::vector<std::int64_t> shape,
             const std::string& dtype, std::optional<std::vector<std::int64_t>> real_shape) {
            new (self) ParamSpec{std::move(name), std::move(shape), parse_dtype(dtype),
                                 real_shape.value_or(std::vector<std::int64_t>{})};
          },
          "name"_a, "shape"_a, "dtype"_a = "bfloat16", "real_shape"_a = nb::none())
      .def_ro("name", &ParamSpec::name)
      .def_ro("shape", &ParamSpec::shape)
      .def_prop_ro("real_shape", [](const ParamSpec& p) { return p.real(); })
      .def_prop_ro("dtype", [](const ParamSpec& p) { return std::string(dtype_name(p.dtype)); })
      .def_prop_ro("bytes", &ParamSpec::bytes)
      .def("__repr__", [](const ParamSpec& p) {
        std::string text =
            "ParamSpec('" + p.name + "', " + shape_str(p.shape) + ", " + dtype_name(p.dtype);
        if (p.real() != p.shape) text += ", real_shape=" + shape_str(p.real());
        return text + ")";
      });

  nb::class_<Layout>(m, "Layout",
                     "Which block of each parameter each rank holds. Made by build_layout() from "
                     "a ModelSpec and a Parallelism, or by hand: add_param() each parameter, then "
                     "add_shard(rank, name, offset, extent) per block a rank holds (its local "
                     "tensor is that block), or add_packed_shard() for a local tensor made of "
                     "several blocks (fused QKV). local_shape() and pieces() read it back.")
      .def(nb::init<>())
      .def("add_param", &Layout::add_param, "param"_a)
      .def(
          "add_shard",
          [](Layout& self, PeId rank, const std::string& param, std::vector<std::int64_t> offset,
             std::vector<std::int64_t> extent) {
            self.add_shard(rank, param, box_of(offset, extent));
          },
          "rank"_a, "param"_a, "offset"_a, "extent"_a)
      .def(
          "add_packed_shard",
          [](Layout& self, PeId rank, const std::string& param,
             std::vector<std::int64_t> local_shape,
             const std::vector<std::tuple<std::vector<std::int64_t>, std::vector<std::int64_t>,
                                          std::vector<std::int64_t>>>& pieces) {
            std::vector<Piece> converted;
            for (const auto& [offset, extent, local_at] : pieces) {
              Piece piece{box_of(offset, extent), {}};
              if (local_at.size() != offset.size()) {
                throw_error(ErrorCode::kInvalidArgument,
                            "a piece's local position needs one coordinate per dimension");
              }
              for (std::size_t d = 0; d < local_at.size(); ++d) piece.local_at[d] = local_at[d];
              converted.push_back(piece);
            }
            self.add_shard(rank, param, std::move(local_shape), std::move(converted));
          },
          "rank"_a, "param"_a, "local_shape"_a, "pieces"_a)
      .def_prop_ro("params", &Layout::params)
      .def_prop_ro("max_rank", &Layout::max_rank)
      .def("__repr__",
           [](const Layout& self) {
             return "Layout(" + std::to_string(self.params().size()) + " params, ranks 0.." +
                    std::to_string(self.max_rank()) + ")";
           })
      .def(
          "local_shape",
          [](const Layout& self, PeId rank,
             const std::string& param) -> std::optional<std::vector<std::int64_t>> {
            const Shard* shard = self.find_shard(rank, self.param_index(param));
            if (shard == nullptr) return std::nullopt;
            return shard->local_shape;
          },
          "rank"_a, "param"_a)
      .def(
          "pieces",
          [](const Layout& self, PeId rank, const std::string& param) {
            std::vector<std::tuple<std::vector<std::int64_t>, std::vector<std::int64_t>,
                                   std::vector<std::int64_t>>>
                out;
            const Shard* shard = self.find_shard(rank, self.param_index(param));
            if (shard == nullptr) return out;
            for (const Piece& piece : shard->pieces) {
              const Box local = shard->local_box(piece);
              out.emplace_back(offsets(piece.global), extents(piece.global), offsets(local));
            }
            return out;
          },
          "rank"_a, "param"_a,
          "The blocks of `param` that `rank` holds: (offset, extent) in the parameter and the "
          "offset of each in the rank's local tensor; empty when it holds none.");

  nb::class_<ModelParam>(m, "ModelParam",
                         "A parameter as build_layout() lays it out: `spec` (ParamSpec); `tp_dim`, "
                         "the dimension tensor parallelism splits (-1: every TP rank holds it "
                         "whole); `packed`, the sizes of partitions along tp_dim that are split "
                         "separately and held one after the other (fused QKV: [q, k, v] rows; "
                         "empty: one); `stage`, the pipeline stage that holds it (\"layer\": the "
                         "stage of `layer`; \"first\": embeddings; \"last\": final norm and head); "
                         "`expert`, the expert it belongs to (-1: none); `vocab`, whether its "
                         "tp_dim (or dim 0) indexes the vocabulary, which a Parallelism's "
                         "vocab_multiple pads.")
      .def(
          "__init__",
          [](ModelParam* self, ParamSpec spec, int tp_dim, std::vector<std::int64_t> packed,
             const std::string& stage, int layer, int expert, bool vocab) {
            Stage where = Stage::kLayer;
            if (stage == "first") {
              where = Stage::kFirst;
            } else if (stage == "last") {
              where = Stage::kLast;
            } else if (stage != "layer") {
              throw_error(ErrorCode::kInvalidArgument,
                          "stage must be 'layer', 'first' or 'last', not '" + stage + "'");
            }
            new (self)
                ModelParam{std::move(spec), tp_dim, std::move(packed), where, layer, expert, vocab};
          },
          "spec"_a, "tp_dim"_a = -1, "packed"_a = std::vector<std::int64_t>{}, "stage"_a = "layer",
          "layer"_a = 0, "expert"_a = -1, "vocab"_a = false)
      .def_ro("spec", &ModelParam::spec)
      .def_ro("tp_dim", &ModelParam::tp_dim)
      .def_ro("packed", &ModelParam::packed)
      .def_prop_ro("stage", [](const ModelParam& p) { return stage_name(p.stage); })
      .def_ro("layer", &ModelParam::layer)
      .def_ro("expert", &ModelParam::expert)
      .def_ro("vocab", &ModelParam::vocab)
      .def("__repr__", [](const ModelParam& p) {
        std::string text = "ModelParam('" + p.spec.name + "', tp_dim=" + std::to_string(p.tp_dim);
        if (!p.packed.empty()) {
          text += ", packed=[";
          for (std::size_t i = 0; i < p.packed.size(); ++i)
            text += (i ? ", " : "") + std::to_string(p.packed[i]);
          text += "]";
        }
        text +=
            std::string(", stage='") + stage_name(p.stage) + "', layer=" + std::to_string(p.layer);
        if (p.expert >= 0) text += ", expert=" + std::to_string(p.expert);
        if (p.vocab) text += ", vocab=True";
        return text + ")";
      });

  nb::class_<ModelSpec>(m, "ModelSpec",
                        "A model's parameters (ModelParam) with its layer and routed-expert "
                        "counts: what build_layout() lays out under a Parallelism. "
                        "llama3_8b_model(), qwen3_30b_a3b_model(), moe_1t_model() and toy_model() "
                        "make ready ones.")
      .def(
          "__init__",
          [](ModelSpec* self, std::string name, int layers, int experts,
             std::vector<ModelParam> params) {
            new (self) ModelSpec{std::move(name), layers, experts, std::move(params)};
          },
          "name"_a, "layers"_a, "experts"_a, "params"_a)
      .def_ro("name", &ModelSpec::name)
      .def_ro("layers", &ModelSpec::layers)
      .def_ro("experts", &ModelSpec::experts)
      .def_ro("params", &ModelSpec::params)
      .def_prop_ro("total_bytes", &ModelSpec::total_bytes)
      .def("__repr__", [](const ModelSpec& s) {
        return "ModelSpec('" + s.name + "', layers=" + std::to_string(s.layers) +
               ", experts=" + std::to_string(s.experts) + ", " + std::to_string(s.params.size()) +
               " params, " + format_bytes(s.total_bytes()) + ")";
      });

  nb::class_<Parallelism>(m, "Parallelism",
                          "How a job shards a model: tensor (tp), data (dp), pipeline (pp) and "
                          "expert (ep, with etp-way tensor parallelism inside each expert) "
                          "parallelism, `replicas` whole copies side by side, on ranks "
                          "rank_offset .. rank_offset + world - 1 (Megatron's rank order: tp "
                          "fastest, then dp, then pp). `vocab_multiple`: vocabulary rows "
                          "(ModelParam.vocab) padded up to a multiple of it, as the framework "
                          "pads them (Megatron-LM: 128 x tp; vLLM: 64); plans move the real rows "
                          "only, so each side may pad its own way.")
      .def(
          "__init__",
          [](Parallelism* self, int tp, int dp, int pp, int replicas, int ep, int etp,
             PeId rank_offset, std::int64_t vocab_multiple) {
            new (self) Parallelism{tp, dp, pp, replicas, ep, etp, rank_offset, vocab_multiple};
          },
          "tp"_a = 1, "dp"_a = 1, "pp"_a = 1, "replicas"_a = 1, "ep"_a = 1, "etp"_a = 1,
          "rank_offset"_a = 0, "vocab_multiple"_a = 0)
      .def_rw("tp", &Parallelism::tp)
      .def_rw("dp", &Parallelism::dp)
      .def_rw("pp", &Parallelism::pp)
      .def_rw("replicas", &Parallelism::replicas)
      .def_rw("ep", &Parallelism::ep)
      .def_rw("etp", &Parallelism::etp)
      .def_rw("rank_offset", &Parallelism::rank_offset)
      .def_rw("vocab_multiple", &Parallelism::vocab_multiple)
      .def_prop_ro("world", &Parallelism::world)
      .def("__repr__", [](const Parallelism& p) { return "Parallelism(" + p.str() + ")"; });

  m.def("build_layout", &build_layout, "model"_a, "parallelism"_a,
        "The Layout of `model` under `parallelism`: which block of each parameter each rank "
        "holds, as Megatron-LM (and vLLM, for tp/replicas) shard it. Uneven tensor-parallel "
        "splits follow torch.chunk.");
  m.def("llama3_8b_model", &llama3_8b_model, "layers"_a = 32);
  m.def("qwen3_30b_a3b_model", &qwen3_30b_a3b_model, "layers"_a = 48);
  m.def("moe_1t_model", &moe_1t_model, "layers"_a = 61, "experts"_a = 384);
  m.def("toy_model", &toy_model, "layers"_a, "hidden"_a, "experts"_a = 0);
}

void bind_plan(nb::module_& m) {
  nb::class_<TransferOp>(m, "TransferOp",
                         "One move of a plan: the block (offset, extent) of parameter `param` "
                         "(an index into plan.params) from src_rank to dst_rank, `bytes` long, "
                         "under `task_id`; src_offset / dst_offset say where it lies in each "
                         "rank's local tensor.")
      .def_ro("param", &TransferOp::param)
      .def_ro("src_rank", &TransferOp::src_rank)
      .def_ro("dst_rank", &TransferOp::dst_rank)
      .def_ro("bytes", &TransferOp::bytes)
      .def_ro("task_id", &TransferOp::task_id)
      .def_prop_ro("offset", [](const TransferOp& op) { return offsets(op.region); })
      .def_prop_ro("extent", [](const TransferOp& op) { return extents(op.region); })
      .def_prop_ro("src_offset", [](const TransferOp& op) { return offsets(op.src_box()); })
      .def_prop_ro("dst_offset", [](const TransferOp& op) { return offsets(op.dst_box()); })
      .def("__repr__", [](const TransferOp& op) {
        return "TransferOp(param " + std::to_string(op.param) + " " + op.region.str() + ", rank " +
               std::to_string(op.src_rank) + " -> " + std::to_string(op.dst_rank) + ", " +
               format_bytes(op.bytes) + ", task " + std::to_string(op.task_id) + ")";
      });

  nb::class_<PlanStats>(m, "PlanStats",
                        "A plan's totals: bytes moved (local ones too), the most any rank sends "
                        "(egress) or receives (ingress), and the lower bound (the larger of the "
                        "two: no schedule moves the plan faster than that rank's bytes).")
      .def_ro("total_bytes", &PlanStats::total_bytes)
      .def_ro("local_bytes", &PlanStats::local_bytes)
      .def_ro("max_egress_bytes", &PlanStats::max_egress_bytes)
      .def_ro("max_ingress_bytes", &PlanStats::max_ingress_bytes)
      .def_ro("lower_bound_bytes", &PlanStats::lower_bound_bytes)
      .def_ro("ops", &PlanStats::ops)
      .def_ro("local_ops", &PlanStats::local_ops)
      .def("__repr__", [](const PlanStats& s) {
        return "PlanStats(" + std::to_string(s.ops) + " ops, " + std::to_string(s.local_ops) +
               " local, " + format_bytes(s.total_bytes) + " moved, lower bound " +
               format_bytes(s.lower_bound_bytes) + " on the busiest rank)";
      });

  nb::class_<ReshardPlan>(m, "ReshardPlan",
                          "The transfer operations that turn one layout into another "
                          "(make_reshard_plan): pure and deterministic, the same on every rank.")
      .def_prop_ro("params", &ReshardPlan::params)
      .def_prop_ro("ops", &ReshardPlan::ops)
      .def_prop_ro("stats", &ReshardPlan::stats)
      .def_prop_ro("src_layout", &ReshardPlan::src_layout)
      .def_prop_ro("dst_layout", &ReshardPlan::dst_layout)
      .def_prop_ro("fingerprint", &ReshardPlan::fingerprint)
      .def("summary", &ReshardPlan::summary)
      .def("__repr__", [](const ReshardPlan& p) { return "ReshardPlan(" + p.summary() + ")"; });

  m.def(
      "make_reshard_plan",
      [](const Layout& src, const Layout& dst, std::uint64_t split_min_bytes,
         std::int64_t split_row_align) {
        PlanOptions options;
        options.split_min_bytes = split_min_bytes;
        options.split_row_align = split_row_align;
        auto a = std::make_shared<const Layout>(src);
        auto b = std::make_shared<const Layout>(dst);
        nb::gil_scoped_release released;
        return std::make_shared<const ReshardPlan>(make_reshard_plan(a, b, options));
      },
      "src"_a, "dst"_a, "split_min_bytes"_a = PlanOptions{}.split_min_bytes,
      "split_row_align"_a = PlanOptions{}.split_row_align,
      "The plan that turns layout `src` into layout `dst` (same parameters, shapes and dtypes). "
      "Where several ranks hold a destination block's source (replicas), the block is split so "
      "they share the sending: into parts of at least `split_min_bytes` (0: never split), cut on "
      "multiples of `split_row_align` rows of the first dimension (keeps 128 x 128 FP8 tiles and "
      "MX blocks whole).");
}

// An op's slice as Python sees it: plain values, valid after the hook returns.
struct SliceInfo {
  std::string param;
  std::vector<std::int64_t> offset, extent;  // the block in the full parameter
  std::vector<std::int64_t> local_offset;    // where it sits in this rank's local tensor
  std::vector<std::int64_t> local_shape;     // of this rank's local tensor
  PeId src_rank = 0, dst_rank = 0;
  TaskId task_id = 0;
};

SliceInfo slice_info(const OpSlice& slice) {
  return {slice.param.name,     offsets(slice.op.region), extents(slice.op.region),
          offsets(slice.local), slice.local_shape,        slice.op.src_rank,
          slice.op.dst_rank,    slice.op.task_id};
}

// A transform written in Python (a subclass of reshard.ReshardTransform): the engine's hooks call
// its _hook_* methods with the GIL held. It refers to the Python object weakly (that object holds
// this one, and a cycle through C++ would never be collected); the caller keeps it alive by
// passing it to every refit.
class PythonTransform final : public ReshardTransform {
 public:
  explicit PythonTransform(const nb::object& transform)
      : transform_(nb::module_::import_("weakref").attr("ref")(transform)),
        name_(nb::cast<std::string>(nb::str(transform.attr("name")))) {}
  ~PythonTransform() override {
    if (!Py_IsInitialized()) {
      transform_.release();  // the interpreter is gone: nothing left to decrement
      return;
    }
    nb::gil_scoped_acquire gil;
    transform_.reset();
  }

  std::string name() const override { return name_; }
  bool should_transform(const ParamSpec& param) const override {
    nb::gil_scoped_acquire gil;
    return nb::cast<bool>(self().attr("should_transform")(param));
  }
  std::vector<Buffer> prepare_send(const OpSlice& slice, const LocalTensor&,
                                   void* stream) override {
    nb::gil_scoped_acquire gil;
    return buffers(self().attr("_hook_prepare_send")(slice_info(slice), handle(stream)), slice);
  }
  std::vector<Buffer> prepare_recv(const OpSlice& slice, const LocalTensor&) override {
    nb::gil_scoped_acquire gil;
    return buffers(self().attr("_hook_prepare_recv")(slice_info(slice)), slice);
  }
  void finalize_recv(const OpSlice& slice, const LocalTensor&, std::span<const Buffer>,
                     void* stream) override {
    nb::gil_scoped_acquire gil;
    self().attr("_hook_finalize_recv")(slice_info(slice), handle(stream));
  }

 private:
  nb::object self() const {
    nb::object transform = transform_();
    if (transform.is_none()) {
      throw_error(ErrorCode::kInvalidState,
                  "the Python transform '" + name_ +
                      "' was garbage-collected while reshard "
                      "still uses it; keep a reference and pass it to every refit");
    }
    return transform;
  }
  static nb::object handle(void* stream) {
    if (stream == nullptr) return nb::none();
    return nb::int_(reinterpret_cast<std::uintptr_t>(stream));
  }
  std::vector<Buffer> buffers(const nb::handle& result, const OpSlice& slice) const {
    std::vector<Buffer> out;
    std::size_t index = 0;
    for (nb::handle item : result) {
      const std::string what = "wire buffer " + std::to_string(index++) + " that transform '" +
                               name_ + "' returned for '" + slice.param.name + "'";
      Array array;
      if (!nb::try_cast(item, array)) {
        throw_error(ErrorCode::kInvalidArgument, what + " is not an array (DLPack or buffer)");
      }
      out.push_back(buffer_of(array, what));
    }
    return out;
  }

  nb::object transform_;
  std::string name_;
};

// The options execute_reshard_plan, bind and the staged refit take from Python's keywords.
ReshardOptions refit_options(std::optional<std::uint64_t> staging_budget,
                             bool quantize_colocated_on_sender, bool strict) {
  ReshardOptions options;
  options.staging_budget = staging_budget;
  options.quantize_colocated_on_sender = quantize_colocated_on_sender;
  options.allow_unknown_names = !strict;
  return options;
}

void bind_execution(nb::module_& m) {
  nb::class_<ScaleTensor>(m, "ScaleTensor")
      .def_prop_ro("dtype", [](const ScaleTensor& s) { return std::string(dtype_name(s.dtype)); })
      .def_prop_ro("shape",
                   [](const ScaleTensor& s) {
                     nb::list extents;
                     for (std::int64_t extent : s.shape) extents.append(extent);
                     return nb::steal<nb::tuple>(PySequence_Tuple(extents.ptr()));
                   })
      .def_prop_ro("nbytes", &ScaleTensor::bytes)
      .def("__repr__", [](const ScaleTensor& s) {
        std::string shape;
        for (std::int64_t extent : s.shape) {
          shape += (shape.empty() ? "" : ", ") + std::to_string(extent);
        }
        return "ScaleTensor(dtype='" + std::string(dtype_name(s.dtype)) + "', shape=(" + shape +
               (s.shape.size() == 1 ? ",))" : "))");
      });
  nb::class_<ReshardTransform>(m, "ReshardTransform")
      .def_prop_ro("name", &ReshardTransform::name)
      .def("should_transform", &ReshardTransform::should_transform, "param"_a)
      .def(
          "should_transform",
          [](const ReshardTransform& self, const std::string& name) -> bool {
            // Megatron's hooks take a name; the built-ins choose by shape and dtype too.
            throw_error(
                ErrorCode::kInvalidArgument,
                self.name() + ".should_transform('" + name +
                    "'): a transform chooses by a parameter's shape and dtype as well as "
                    "its name: pass a ParamSpec, e.g. should_transform(reshard.ParamSpec('" +
                    name + "', [4096, 4096], 'bfloat16'))");
          },
          "param_name"_a)
      .def("destination_scale", &ReshardTransform::destination_scale, "local_shape"_a);

  m.def(
      "make_cast_transform",
      [](const std::string& wire) { return make_cast_transform(parse_dtype(wire)); }, "wire"_a);
  auto side_of = [](const std::string& side) {
    if (side == "sender") return QuantizeSide::kSender;
    if (side == "receiver") return QuantizeSide::kReceiver;
    throw_error(ErrorCode::kInvalidArgument,
                "side must be 'sender' or 'receiver', not '" + side + "'");
  };
  m.def(
      "make_mxfp8_transform",
      [side_of](const std::string& side, const std::string& rounding, std::string filter,
                const std::string& scale_layout) {
        MxScaleRounding rule = MxScaleRounding::kOcp;
        if (rounding == "round_up") {
          rule = MxScaleRounding::kRoundUp;
        } else if (rounding == "megatron") {
          rule = MxScaleRounding::kMegatron;
        } else if (rounding != "ocp") {
          throw_error(ErrorCode::kInvalidArgument,
                      "rounding must be 'ocp', 'round_up' or 'megatron', not '" + rounding + "'");
        }
        MxScaleLayout layout = MxScaleLayout::kRowMajor;
        if (scale_layout == "swizzled") {
          layout = MxScaleLayout::kSwizzled;
        } else if (scale_layout != "row_major") {
          throw_error(ErrorCode::kInvalidArgument,
                      "scale_layout must be 'row_major' or 'swizzled', not '" + scale_layout + "'");
        }
        return make_mxfp8_transform(side_of(side), rule, std::move(filter), layout);
      },
      "side"_a = "sender", "rounding"_a = "ocp", "name_filter"_a = "",
      "scale_layout"_a = "row_major");
  m.def(
      "make_fp8_block_transform",
      [side_of](const std::string& side, std::string filter) {
        return make_fp8_block_transform(side_of(side), std::move(filter));
      },
      "side"_a = "sender", "name_filter"_a = "");

  nb::class_<SliceInfo>(m, "SliceInfo")
      .def_ro("param", &SliceInfo::param)
      .def_ro("offset", &SliceInfo::offset)
      .def_ro("extent", &SliceInfo::extent)
      .def_ro("local_offset", &SliceInfo::local_offset)
      .def_ro("local_shape", &SliceInfo::local_shape)
      .def_ro("src_rank", &SliceInfo::src_rank)
      .def_ro("dst_rank", &SliceInfo::dst_rank)
      .def_ro("task_id", &SliceInfo::task_id)
      .def("__repr__", [](const SliceInfo& s) {
        return "SliceInfo('" + s.param + "', task " + std::to_string(s.task_id) + ", rank " +
               std::to_string(s.src_rank) + " -> " + std::to_string(s.dst_rank) + ")";
      });
  m.def(
      "python_transform",
      [](nb::object transform) -> std::shared_ptr<ReshardTransform> {
        return std::make_shared<PythonTransform>(transform);
      },
      "transform"_a);

  nb::class_<ReshardReport>(m, "ReshardReport")
      .def_ro("rescheduled", &ReshardReport::rescheduled)
      .def_ro("bytes_sent", &ReshardReport::bytes_sent)
      .def_ro("bytes_received", &ReshardReport::bytes_received)
      .def_ro("packed_bytes", &ReshardReport::packed_bytes)
      .def_ro("strided_bytes", &ReshardReport::strided_bytes)
      .def_ro("locally_converted_bytes", &ReshardReport::locally_converted_bytes)
      .def_ro("staging_bytes", &ReshardReport::staging_bytes)
      .def_ro("phases", &ReshardReport::phases)
      .def_ro("conversions_replayed", &ReshardReport::conversions_replayed)
      .def_ro("check_seconds", &ReshardReport::check_seconds)
      .def_ro("agree_seconds", &ReshardReport::agree_seconds)
      .def_ro("prepare_seconds", &ReshardReport::prepare_seconds)
      .def_ro("transfer_seconds", &ReshardReport::transfer_seconds)
      .def_ro("finalize_seconds", &ReshardReport::finalize_seconds);

  m.def(
      "execute_reshard_plan",
      [](const std::shared_ptr<const ReshardPlan>& plan, const TensorLists& src,
         const TensorLists& dst, CopyService& service, std::shared_ptr<ReshardTransform> transform,
         std::optional<std::uintptr_t> stream, std::optional<std::uint64_t> staging_budget,
         bool quantize_colocated_on_sender, bool strict) {
        const auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, service);
        const ReshardOptions options =
            refit_options(staging_budget, quantize_colocated_on_sender, strict);
        nb::gil_scoped_release released;
        return execute_reshard_plan(plan, src_map, dst_map, service, std::move(transform),
                                    stream_of(stream), options);
      },
      "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none(),
      "staging_budget"_a = nb::none(), "quantize_colocated_on_sender"_a = true, "strict"_a = true);
  m.def(
      "layer_groups",
      [](const std::vector<std::string>& params) {
        std::vector<std::string> names;
        std::vector<std::uint32_t> groups =
            layer_groups(std::span<const std::string>(params), &names);
        return std::make_pair(std::move(groups), std::move(names));
      },
      "params"_a);
  nb::class_<Refit>(m, "Refit")
      .def(
          "__init__",
          [](Refit* self, std::shared_ptr<const ReshardPlan> plan, const TensorLists& src,
             const TensorLists& dst, CopyService& service,
             std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
             std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
             bool strict, std::vector<std::uint32_t> param_groups) {
            auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, service);
            ReshardOptions options =
                refit_options(staging_budget, quantize_colocated_on_sender, strict);
            options.param_groups = std::move(param_groups);
            nb::gil_scoped_release released;
            new (self) Refit(std::move(plan), std::move(src_map), std::move(dst_map), service,
                             std::move(transform), options, stream_of(stream));
          },
          "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(),
          "stream"_a = nb::none(), "staging_budget"_a = nb::none(),
          "quantize_colocated_on_sender"_a = true, "strict"_a = true,
          "param_groups"_a = std::vector<std::uint32_t>{}, nb::keep_alive<1, 5>())
      .def(
          "run",
          [](Refit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.run(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "run_groups",
          [](Refit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.run(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def_prop_ro("groups", [](const Refit& self) { return self.groups(); })
      .def(
          "update",
          [](Refit& self, const TensorLists& src, const TensorLists& dst,
             std::optional<std::uintptr_t> stream) {
            const auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, self.service());
            nb::gil_scoped_release released;
            return self.update(src_map, dst_map, stream_of(stream));
          },
          "src"_a, "dst"_a, "stream"_a = nb::none())
      .def_prop_ro("report", &Refit::report);
  nb::class_<StagedRefit>(m, "StagedRefit")
      .def(
          "__init__",
          [](StagedRefit* self, std::shared_ptr<const ReshardPlan> plan, const TensorLists& src,
             const TensorLists& dst, CopyService& service,
             std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
             std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
             bool strict, std::optional<std::uint64_t> max_staged_bytes,
             std::vector<std::uint32_t> param_groups) {
            auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, service);
            ReshardOptions options =
                refit_options(staging_budget, quantize_colocated_on_sender, strict);
            options.param_groups = std::move(param_groups);
            nb::gil_scoped_release released;
            new (self)
                StagedRefit(std::move(plan), std::move(src_map), std::move(dst_map), service,
                            std::move(transform), options, stream_of(stream), max_staged_bytes);
          },
          "plan"_a, "src"_a, "dst"_a, "service"_a, "transform"_a = nb::none(),
          "stream"_a = nb::none(), "staging_budget"_a = nb::none(),
          "quantize_colocated_on_sender"_a = true, "strict"_a = true,
          "max_staged_bytes"_a = nb::none(), "param_groups"_a = std::vector<std::uint32_t>{},
          nb::keep_alive<1, 5>())
      .def(
          "stage",
          [](StagedRefit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.stage(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "stage_groups",
          [](StagedRefit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            return self.stage(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def(
          "commit",
          [](StagedRefit& self, std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            self.commit(stream_of(stream));
          },
          "stream"_a = nb::none())
      .def(
          "commit_groups",
          [](StagedRefit& self, const std::vector<std::uint32_t>& groups,
             std::optional<std::uintptr_t> stream) {
            nb::gil_scoped_release released;
            self.commit(std::span<const std::uint32_t>(groups), stream_of(stream));
          },
          "groups"_a, "stream"_a = nb::none())
      .def_prop_ro("staged_groups", &StagedRefit::staged_groups)
      .def(
          "update",
          [](StagedRefit& self, const TensorLists& src, const TensorLists& dst,
             std::optional<std::uintptr_t> stream) {
            const auto [src_map, dst_map] = tensor_maps_or_refuse(src, dst, self.service());
            nb::gil_scoped_release released;
            return self.update(src_map, dst_map, stream_of(stream));
          },
          "src"_a, "dst"_a, "stream"_a = nb::none())
      .def_prop_ro("version", &StagedRefit::version)
      .def_prop_ro("staged", &StagedRefit::staged)
      .def_prop_ro("staged_bytes", &StagedRefit::staged_bytes)
      .def_prop_ro("report", &StagedRefit::report);
  m.def(
      "execute_as_prepared",
      [](const std::shared_ptr<const ReshardPlan>& plan, CopyService& service,
         std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream,
         std::optional<std::uint64_t> staging_budget, bool quantize_colocated_on_sender,
         bool strict) {
        const ReshardOptions options =
            refit_options(staging_budget, quantize_colocated_on_sender, strict);
        nb::gil_scoped_release released;
        return execution::execute_as_prepared(plan, service, transform, stream_of(stream), options);
      },
      "plan"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none(),
      "staging_budget"_a = nb::none(), "quantize_colocated_on_sender"_a = true, "strict"_a = true,
      "execute_reshard_plan with the tensors its last call prepared with, which the caller "
      "vouches it was given again (TensorSnapshot.matches); None, with nothing done, where the "
      "service keeps no such refit.");
  m.def(
      "rerun_reshard_plan",
      [](const std::shared_ptr<const ReshardPlan>& plan, CopyService& service,
         std::shared_ptr<ReshardTransform> transform, std::optional<std::uintptr_t> stream) {
        nb::gil_scoped_release released;
        return rerun_reshard_plan(plan, service, transform, stream_of(stream));
      },
      "plan"_a, "service"_a, "transform"_a = nb::none(), "stream"_a = nb::none());
}

}  // namespace
}  // namespace reshard::python

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

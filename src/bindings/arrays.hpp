// Arrays and streams as the bindings take them from Python: tensors arrive through DLPack or the
// buffer protocol (PyTorch, CuPy, NumPy, JAX), are never copied and must be contiguous; here they
// become reshard's buffers and tensor maps, with errors that name what was handed over.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "execution/verdicts.hpp"
#include "reshard/copy_service.hpp"
#include "reshard/error.hpp"
#include "reshard/layout.hpp"
#include "reshard/resharder.hpp"

namespace nb = nanobind;

namespace reshard::python {

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
inline StridedRange strided_range(TaskId task, std::size_t pos, std::size_t size,
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

inline void* stream_of(std::optional<std::uintptr_t> stream) {
  return stream ? reinterpret_cast<void*>(*stream) : nullptr;
}

// A CUDA stream given as None, an int handle, or an object with one (`cuda_stream`: PyTorch;
// `ptr`: CuPy), as reshard.copy_service.stream_handle reads it; refused naming `call` otherwise.
inline void* stream_handle_of(nb::handle stream, const char* call) {
  if (stream.is_none()) return nullptr;
  if (PyLong_Check(stream.ptr())) return reinterpret_cast<void*>(nb::cast<std::uintptr_t>(stream));
  for (const char* attribute : {"cuda_stream", "ptr"}) {
    if (nb::hasattr(stream, attribute)) {
      nb::object handle = stream.attr(attribute);
      if (PyLong_Check(handle.ptr()))
        return reinterpret_cast<void*>(nb::cast<std::uintptr_t>(handle));
    }
  }
  throw nb::type_error((std::string(call) + ": cannot use " + nb::type_name(stream.type()).c_str() +
                        " as a CUDA stream (pass an int handle, a torch.cuda.Stream or None)")
                           .c_str());
}

// What `object` exports through DLPack. PyTorch's Tensor.__dlpack__ is Python code (checks, then
// the export: about 2 us a tensor), where torch.utils.dlpack.to_dlpack is the export alone (0.4
// us); a refit of a MoE model passes thousands of tensors a call, so plain tensors and
// parameters (requires_grad too, which __dlpack__ refuses) are exported directly. Subclasses
// (DTensor, ...) keep their own __dlpack__.
inline nb::object dlpack_source(nb::handle object) {
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
inline std::pair<TensorMap, TensorMap> tensor_maps_or_refuse(const TensorLists& src,
                                                             const TensorLists& dst,
                                                             CopyService& service,
                                                             const char* meeting) {
  std::exception_ptr failure;
  try {
    return {tensor_map<ReadOnlyArray>(src, "source"), tensor_map<Array>(dst, "destination")};
  } catch (...) {
    failure = std::current_exception();
  }
  nb::gil_scoped_release released;
  execution::gather_verdicts(service, {}, failure, meeting);
  std::rethrow_exception(failure);  // not reached: the gather throws on every rank
}

inline std::vector<std::int64_t> extents(const Box& box) {
  return {box.extent.begin(), box.extent.begin() + box.ndim};
}
inline std::vector<std::int64_t> offsets(const Box& box) {
  return {box.offset.begin(), box.offset.begin() + box.ndim};
}

inline Box box_of(const std::vector<std::int64_t>& offset,
                  const std::vector<std::int64_t>& extent) {
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

}  // namespace reshard::python

// TensorSnapshot: a record of two tensor dicts (names, value objects, their memory addresses)
// that a later call's dicts are compared with in one C++ pass: a few tens of nanoseconds a
// tensor where converting and checking each through DLPack costs half a microsecond or more.
#include "bindings/tensor_snapshot.hpp"

#include <structmember.h>  // T_OBJECT_EX: a __slots__ field's kind

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace reshard::python {
namespace {

// The address a data_ptr() call returned (a new reference, or null on an error); 0 on an error.
std::uintptr_t address_from(PyObject* result) {
  if (result == nullptr) {
    PyErr_Clear();
    return 0;
  }
  const auto address = static_cast<std::uintptr_t>(PyLong_AsUnsignedLongLongMask(result));
  Py_DECREF(result);
  if (PyErr_Occurred()) {
    PyErr_Clear();
    return 0;
  }
  return address;
}

// "data_ptr", interned once (at first use, the GIL held).
PyObject* data_ptr_name() {
  static PyObject* const name = PyUnicode_InternFromString("data_ptr");
  return name;
}

// The memory address of an array object: the buffer protocol's (NumPy), else its data_ptr()
// (PyTorch); 0 where it has neither (such an object is never vouched for).
std::uintptr_t address_of(PyObject* array) {
  if (PyObject_CheckBuffer(array)) {
    Py_buffer view;
    if (PyObject_GetBuffer(array, &view, PyBUF_RECORDS_RO) != 0) {
      PyErr_Clear();
      return 0;
    }
    const auto address = reinterpret_cast<std::uintptr_t>(view.buf);
    PyBuffer_Release(&view);
    return address;
  }
  PyObject* args[] = {array};
  return address_from(PyObject_VectorcallMethod(data_ptr_name(), args,
                                                1 | PY_VECTORCALL_ARGUMENTS_OFFSET, nullptr));
}

// NumPy's array object begins with its data pointer after the object header: the layout that
// NumPy's own PyArray_DATA reads in every compiled extension, so it cannot change.
struct NumpyArrayHead {
  PyObject_HEAD char* data;
};

// How one recorded array's address is read again at every matches(), the fastest way its type
// allows: a NumPy array's field; PyTorch's data_ptr (a C method without arguments) called
// directly, without looking the method up on the object and dispatching through the
// descriptor (about 20 of the 65 ns a tensor); else address_of.
class AddressReader {
 public:
  AddressReader() = default;
  explicit AddressReader(PyObject* array) : type_(Py_TYPE(array)) {
    if (std::strcmp(type_->tp_name, "numpy.ndarray") == 0) {
      numpy_ = true;
      return;
    }
    if (PyObject_CheckBuffer(array)) return;
    PyObject* method = PyObject_GetAttr(reinterpret_cast<PyObject*>(type_), data_ptr_name());
    if (method == nullptr) {
      PyErr_Clear();
      return;
    }
    if (Py_IS_TYPE(method, &PyMethodDescr_Type)) {
      const PyMethodDef* def = reinterpret_cast<PyMethodDescrObject*>(method)->d_method;
      if (def->ml_flags == METH_NOARGS) no_args_ = def->ml_meth;
    }
    Py_DECREF(method);
  }

  std::uintptr_t read(PyObject* array) const {
    // An object whose class was reassigned since is read the general way.
    if (Py_TYPE(array) != type_) return address_of(array);
    if (numpy_)
      return reinterpret_cast<std::uintptr_t>(reinterpret_cast<NumpyArrayHead*>(array)->data);
    if (no_args_ != nullptr) return address_from(no_args_(array, nullptr));
    return address_of(array);
  }

 private:
  PyTypeObject* type_ = nullptr;
  bool numpy_ = false;
  PyCFunction no_args_ = nullptr;
};

// How a LocalTensor's fields are read again at every matches(): where its class keeps them in
// __slots__ (reshard.LocalTensor does on Python 3.11 and later), loaded at their offsets in the
// object, as the slots' own descriptors do; else looked up by name (three lookups cost 30-40 ns
// a tensor).
class FieldReader {
 public:
  FieldReader() = default;
  explicit FieldReader(PyObject* type) : type_(reinterpret_cast<PyTypeObject*>(type)) {
    const Names& names = field_names();
    const std::ptrdiff_t data = slot_offset(names.data), scale = slot_offset(names.scale),
                         dtype = slot_offset(names.dtype);
    if (data >= 0 && scale >= 0 && dtype >= 0) offsets_ = {data, scale, dtype};
  }

  // Whether `object`'s fields are the objects `data`, `scale` and `dtype` themselves.
  bool fields_are(PyObject* object, PyObject* data, PyObject* scale, PyObject* dtype) const {
    // A subclass may define its fields otherwise: read by name.
    if (offsets_.empty() || Py_TYPE(object) != type_) {
      const Names& names = field_names();
      return field_is(object, names.data, data) && field_is(object, names.scale, scale) &&
             field_is(object, names.dtype, dtype);
    }
    const char* base = reinterpret_cast<const char*>(object);
    return *reinterpret_cast<PyObject* const*>(base + offsets_[0]) == data &&
           *reinterpret_cast<PyObject* const*>(base + offsets_[1]) == scale &&
           *reinterpret_cast<PyObject* const*>(base + offsets_[2]) == dtype;
  }

 private:
  // The field names, interned once (at first use, the GIL held): a name made from a C string at
  // every lookup cost as much as the lookup.
  struct Names {
    PyObject* data = PyUnicode_InternFromString("data");
    PyObject* scale = PyUnicode_InternFromString("scale");
    PyObject* dtype = PyUnicode_InternFromString("dtype");
  };
  static const Names& field_names() {
    static const Names names;
    return names;
  }

  // The offset of the slot holding attribute `name` in an object of type_, or -1 where the
  // attribute is not a plain object slot.
  std::ptrdiff_t slot_offset(PyObject* name) const {
    PyObject* descriptor = PyObject_GetAttr(reinterpret_cast<PyObject*>(type_), name);
    if (descriptor == nullptr) {
      PyErr_Clear();
      return -1;
    }
    std::ptrdiff_t offset = -1;
    if (Py_IS_TYPE(descriptor, &PyMemberDescr_Type)) {
      const PyMemberDef* member = reinterpret_cast<PyMemberDescrObject*>(descriptor)->d_member;
      if (member->type == T_OBJECT_EX && (member->flags & READONLY) == 0)
        offset = static_cast<std::ptrdiff_t>(member->offset);
    }
    Py_DECREF(descriptor);
    return offset;
  }

  // Whether `object`'s attribute `name` is `expected` itself.
  static bool field_is(PyObject* object, PyObject* name, PyObject* expected) {
    PyObject* value = PyObject_GetAttr(object, name);
    if (value == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_DECREF(value);  // only its identity is compared; `expected` is held by the entry
    return value == expected;
  }

  PyTypeObject* type_ = nullptr;
  std::vector<std::ptrdiff_t> offsets_;  // data, scale, dtype; empty: read by name
};

class TensorSnapshot {
 public:
  // `wrapper`: reshard.LocalTensor, whose data, scale and dtype are recorded too.
  TensorSnapshot(nb::dict src, nb::dict dst, nb::handle wrapper)
      : wrapper_(nb::borrow(wrapper)), fields_(wrapper.ptr()) {
    complete_ = record(src, src_) && record(dst, dst_);
  }

  // Whether `src` and `dst` hold what was recorded: the same names in the same order, the same
  // value objects, and each array still at the same address (a tensor given other storage in
  // place, such as `param.data = other`, is not the same tensor). Plain dicts only.
  bool matches(nb::handle src, nb::handle dst) const {
    return complete_ && same(src.ptr(), src_) && same(dst.ptr(), dst_);
  }

 private:
  struct Entry {
    nb::object name, value;
    // A LocalTensor's parts (recorded because its fields may be reassigned), else empty.
    nb::object data, scale, dtype;
    std::uintptr_t address = 0, scale_address = 0;
    AddressReader reader, scale_reader;  // how the addresses are read again
  };

  bool is_wrapper(PyObject* value) const {
    return PyObject_TypeCheck(value, reinterpret_cast<PyTypeObject*>(wrapper_.ptr()));
  }

  bool record(nb::dict map, std::vector<Entry>& into) {
    into.reserve(nb::len(map));
    Py_ssize_t position = 0;
    PyObject *name = nullptr, *value = nullptr;
    while (PyDict_Next(map.ptr(), &position, &name, &value)) {
      Entry entry{nb::borrow(name), nb::borrow(value), {}, {}, {}, 0, 0, {}, {}};
      PyObject* array = value;
      if (is_wrapper(value)) {
        entry.data = nb::borrow(value).attr("data");
        entry.scale = nb::borrow(value).attr("scale");
        entry.dtype = nb::borrow(value).attr("dtype");
        array = entry.data.ptr();
        if (!entry.scale.is_none()) {
          entry.scale_reader = AddressReader(entry.scale.ptr());
          entry.scale_address = entry.scale_reader.read(entry.scale.ptr());
          if (entry.scale_address == 0) return false;
        }
      }
      entry.reader = AddressReader(array);
      entry.address = entry.reader.read(array);
      if (entry.address == 0) return false;
      into.push_back(std::move(entry));
    }
    return true;
  }

  bool same(PyObject* map, const std::vector<Entry>& recorded) const {
    if (!PyDict_CheckExact(map) || PyDict_GET_SIZE(map) != static_cast<Py_ssize_t>(recorded.size()))
      return false;
    Py_ssize_t position = 0;
    PyObject *name = nullptr, *value = nullptr;
    std::size_t i = 0;
    while (PyDict_Next(map, &position, &name, &value)) {
      const Entry& entry = recorded[i++];
      if (value != entry.value.ptr()) return false;
      if (name != entry.name.ptr()) {
        const int equal = PyObject_RichCompareBool(name, entry.name.ptr(), Py_EQ);
        if (equal != 1) {
          if (equal < 0) PyErr_Clear();
          return false;
        }
      }
      PyObject* array = value;
      if (entry.data.is_valid()) {
        // The same LocalTensor object, its fields unchanged (each still the recorded object).
        if (!fields_.fields_are(value, entry.data.ptr(), entry.scale.ptr(), entry.dtype.ptr()))
          return false;
        if (!entry.scale.is_none() &&
            entry.scale_reader.read(entry.scale.ptr()) != entry.scale_address)
          return false;
        array = entry.data.ptr();
      }
      if (entry.reader.read(array) != entry.address) return false;
    }
    return true;
  }

  nb::object wrapper_;
  FieldReader fields_;
  std::vector<Entry> src_, dst_;
  bool complete_ = false;
};

}  // namespace

void bind_tensor_snapshot(nb::module_& m) {
  nb::class_<TensorSnapshot>(m, "TensorSnapshot")
      .def(nb::init<nb::dict, nb::dict, nb::handle>(), "src"_a, "dst"_a, "local_tensor_type"_a)
      .def("matches", &TensorSnapshot::matches, "src"_a, "dst"_a);
}

}  // namespace reshard::python

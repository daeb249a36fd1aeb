// pycomm.Handle: the Python object of an asynchronous collective, a plain CPython type.
//
// It holds a std::shared_ptr<Handle> (bindings.h) and nothing else. It is not a pybind11 class:
// pybind11 keeps every live instance of its classes in one table (a lookup when an object is
// returned, an insert, and an erase when it dies), and a gradient step makes and drops one handle
// per tensor. Its methods are C functions that call the Handle's; a C++ exception becomes the
// Python exception pybind11's translators give it (CommError, ValueError, ...), as in any binding.
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <new>
#include <string>

#include "bindings.h"
// after Python.h (bindings.h): PyMemberDef's T_PYSSIZET, READONLY
#include <structmember.h>

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

struct HandleObject {
  PyObject_HEAD
  std::shared_ptr<Handle> handle;  // never null once made
  PyObject* weakrefs;
};

PyTypeObject* handle_type = nullptr;  // made once by register_handle, owned by the module

Handle& of(PyObject* self) { return *reinterpret_cast<HandleObject*>(self)->handle; }

// f()'s new reference, or nullptr with the Python exception of what f threw.
template <class F>
PyObject* translated(F&& f) {
  try {
    return f();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

PyObject* handle_wait(PyObject* self, PyObject*) {
  return translated([&] { return THPVariable_Wrap(of(self).wait()); });
}

PyObject* handle_synchronize(PyObject* self, PyObject*) {
  return translated([&] { return THPVariable_Wrap(of(self).synchronize()); });
}

PyObject* handle_done(PyObject* self, PyObject*) { return PyBool_FromLong(of(self).done()); }

PyObject* handle_repr(PyObject* self) {
  return translated([&] {
    const Handle& h = of(self);
    const std::string text = "<pycomm.Handle " + h.description() + (h.done() ? " done>" : " pending>");
    return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
  });
}

PyObject* handle_wire_bytes(PyObject* self, void*) {
  return translated([&] { return PyLong_FromUnsignedLongLong(of(self).compressed_stats().wire_bytes); });
}

PyObject* handle_fp32_ring_bytes(PyObject* self, void*) {
  return translated([&] { return PyLong_FromUnsignedLongLong(of(self).compressed_stats().fp32_ring_bytes); });
}

// Only the bindings make handles (Python 3.9 has no Py_TPFLAGS_DISALLOW_INSTANTIATION).
PyObject* handle_new(PyTypeObject* type, PyObject*, PyObject*) {
  PyErr_Format(PyExc_TypeError, "cannot create '%s' instances", type->tp_name);
  return nullptr;
}

void handle_dealloc(PyObject* self) {
  auto* o = reinterpret_cast<HandleObject*>(self);
  PyTypeObject* type = Py_TYPE(self);
  if (o->weakrefs) PyObject_ClearWeakRefs(self);
  o->handle.~shared_ptr();
  type->tp_free(self);
  Py_DECREF(type);  // a heap type: each instance holds a reference to it
}

PyMethodDef handle_methods[] = {
    {"wait", handle_wait, METH_NOARGS,
     "wait($self, /)\n--\n\nWait until the engine has finished the collective (GIL released) and return its result tensor. "
     "For CUDA tensors the caller's current stream is then ordered after pycomm's device work (an event), "
     "without blocking the host on the device."},
    {"synchronize", handle_synchronize, METH_NOARGS,
     "synchronize($self, /)\n--\n\nwait(), then block the host until pycomm's device work on the result has finished."},
    {"done", handle_done, METH_NOARGS, "done($self, /)\n--\n\nTrue once the collective has finished (successfully or not)."},
    {nullptr, nullptr, 0, nullptr},
};

PyGetSetDef handle_getset[] = {
    {"wire_bytes", handle_wire_bytes, nullptr,
     "A compressed allreduce, after wait(): the bytes this rank sent to other ranks.", nullptr},
    {"fp32_ring_bytes", handle_fp32_ring_bytes, nullptr,
     "A compressed allreduce, after wait(): the bytes an uncompressed float32 ring allreduce of the same tensor "
     "would have sent.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyMemberDef handle_members[] = {
    {"__weaklistoffset__", T_PYSSIZET, offsetof(HandleObject, weakrefs), READONLY, nullptr},
    {nullptr, 0, 0, 0, nullptr},
};

}  // namespace

PyObject* wrap_handle(std::shared_ptr<Handle> handle) {
  PyObject* self = handle_type->tp_alloc(handle_type, 0);  // zeroed; holds a reference to the type
  if (!self) return nullptr;
  new (&reinterpret_cast<HandleObject*>(self)->handle) std::shared_ptr<Handle>(std::move(handle));
  return self;
}

const std::shared_ptr<Handle>* unwrap_handle(PyObject* o) {
  if (!handle_type || Py_TYPE(o) != handle_type) return nullptr;
  return &reinterpret_cast<HandleObject*>(o)->handle;
}

void register_handle(py::module_& m) {
  static PyType_Slot slots[] = {
      {Py_tp_doc, const_cast<char*>("An asynchronous collective in flight.")},
      {Py_tp_new, reinterpret_cast<void*>(&handle_new)},
      {Py_tp_dealloc, reinterpret_cast<void*>(&handle_dealloc)},
      {Py_tp_repr, reinterpret_cast<void*>(&handle_repr)},
      {Py_tp_methods, handle_methods},
      {Py_tp_getset, handle_getset},
      {Py_tp_members, handle_members},
      {0, nullptr},
  };
  static PyType_Spec spec = {
      "pycomm._C.Handle", sizeof(HandleObject), 0,
      Py_TPFLAGS_DEFAULT, slots,
  };
  PyObject* type = PyType_FromSpec(&spec);
  if (!type) throw py::error_already_set();
  handle_type = reinterpret_cast<PyTypeObject*>(type);
  m.attr("Handle") = py::reinterpret_steal<py::object>(type);  // the module keeps it alive
  m.attr("CompressedHandle") = m.attr("Handle");  // the name compressed allreduces had before they shared Handle
}

}  // namespace bindings
}  // namespace pycomm

// pycomm.allreduce_async as a C function (METH_FASTCALL | METH_KEYWORDS).
//
// A gradient hook submits one allreduce per tensor, so the cost of the call itself is the cost of a
// small asynchronous allreduce. The common call (in place, over all ranks, uncompressed, op and
// algorithm given as str) goes from here to allreduce_async (comm.cpp) with no Python frame and no
// pybind11 argument conversion. Every other call, valid or not, goes with all eight arguments to
// the Python function collectives.py hands over (its checks, their messages, compression and
// groups), as does a common call that allreduce_async refuses before queueing anything: the
// checked path then raises the message a user should see.
// bench/submit_cost.py times it (the pycomm.allreduce_async row, against _C.allreduce_async).
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <string>

#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

constexpr int kParams = 8;
enum Param { TENSOR, OP, ALGORITHM, OUT, NAME, BLOCKING, COMPRESSION, GROUP };
constexpr const char* kParamNames[kParams] = {"tensor", "op",        "algorithm",   "out",
                                              "name",   "_blocking", "compression", "group"};

// What _C.allreduce_entry makes, owned by a capsule that is the function object's `self`: the
// function holds the capsule, so `def` outlives it.
struct Entry {
  PyObject* names[kParams];      // interned parameter names
  PyObject* defaults[kParams];   // nullptr for `tensor`, which has none
  PyObject* checked = nullptr;   // collectives._checked_allreduce_async(tensor, op, ..., group)
  PyObject* note_unnamed = nullptr;  // _ops.note_unnamed(handle, stacklevel)
  PyObject* engine_ops = nullptr;    // _ops.ENGINE_OP: op -> (the engine's reduction, average)
  std::string doc;
  PyMethodDef def{};

  ~Entry() {
    for (PyObject* o : names) Py_XDECREF(o);
    for (PyObject* o : defaults) Py_XDECREF(o);
    Py_XDECREF(checked);
    Py_XDECREF(note_unnamed);
    Py_XDECREF(engine_ops);
  }
};

// Python's binding of (args, kwnames) to the eight parameters, defaults filled in; false with a
// TypeError set, worded as CPython words them.
bool bind(const Entry* entry, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames, PyObject** out) {
  if (nargs > kParams) {
    PyErr_Format(PyExc_TypeError, "allreduce_async() takes from 1 to %d positional arguments but %zd were given",
                 kParams, nargs);
    return false;
  }
  for (int i = 0; i < kParams; ++i) out[i] = i < nargs ? args[i] : nullptr;
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* key = PyTuple_GET_ITEM(kwnames, k);
    int found = -1;
    for (int i = 0; i < kParams && found < 0; ++i)
      if (key == entry->names[i]) found = i;  // keyword names are interned: the usual match
    for (int i = 0; i < kParams && found < 0; ++i)
      if (PyUnicode_Compare(key, entry->names[i]) == 0) found = i;
    if (found < 0) {
      PyErr_Format(PyExc_TypeError, "allreduce_async() got an unexpected keyword argument '%U'", key);
      return false;
    }
    if (out[found]) {
      PyErr_Format(PyExc_TypeError, "allreduce_async() got multiple values for argument '%s'", kParamNames[found]);
      return false;
    }
    out[found] = args[nargs + k];
  }
  if (!out[TENSOR]) {
    PyErr_SetString(PyExc_TypeError, "allreduce_async() missing 1 required positional argument: 'tensor'");
    return false;
  }
  for (int i = 1; i < kParams; ++i)
    if (!out[i]) out[i] = entry->defaults[i];
  return true;
}

bool is_str(PyObject* o, const char* s) { return PyUnicode_CheckExact(o) && PyUnicode_CompareWithASCIIString(o, s) == 0; }

// The common call's handle, or nullptr with no error set when it is not one or allreduce_async
// refused it; nullptr with an error set: note_unnamed raised (a warning filter set to "error"), or
// no memory was left for the handle.
PyObject* common_call(const Entry* entry, PyObject* const* a) {
  if (a[OUT] != Py_None || a[GROUP] != Py_None || !is_str(a[COMPRESSION], "none")) return nullptr;
  if (!PyUnicode_CheckExact(a[OP]) || !PyUnicode_CheckExact(a[ALGORITHM])) return nullptr;
  if (a[BLOCKING] != Py_True && a[BLOCKING] != Py_False) return nullptr;
  if (a[NAME] != Py_None && !PyUnicode_CheckExact(a[NAME])) return nullptr;
  if (!THPVariable_Check(a[TENSOR])) return nullptr;
  // op -> the engine's (reduction, average), from _ops.ENGINE_OP (avg is a sum the engine divides).
  PyObject* engine_op = PyDict_GetItemWithError(entry->engine_ops, a[OP]);  // borrowed
  if (!engine_op) {
    PyErr_Clear();  // an unknown op: the checked path names it
    return nullptr;
  }
  const char* reduce = PyUnicode_AsUTF8(PyTuple_GET_ITEM(engine_op, 0));
  const bool average = PyTuple_GET_ITEM(engine_op, 1) == Py_True;
  if (!reduce) {
    PyErr_Clear();
    return nullptr;
  }
  Py_ssize_t alen = 0, nlen = 0;
  const char* algorithm = PyUnicode_AsUTF8AndSize(a[ALGORITHM], &alen);
  const char* name = a[NAME] == Py_None ? "" : PyUnicode_AsUTF8AndSize(a[NAME], &nlen);
  if (!algorithm || !name) {
    PyErr_Clear();
    return nullptr;
  }
  const bool blocking = a[BLOCKING] == Py_True;
  std::shared_ptr<Handle> handle;
  try {
    const at::Tensor& t = THPVariable_Unpack(a[TENSOR]);
    handle = allreduce_async(t, t, reduce, average, std::string(algorithm, alen), std::string(name, nlen), blocking,
                             0, 1);
  } catch (...) {
    // allreduce_async throws only before it queues anything (an operation's own error reaches its
    // handle), so the checked path may run the call again and raise what the user should see.
    return nullptr;
  }
  PyObject* h = wrap_handle(std::move(handle));
  if (!h) return nullptr;  // out of memory, set
  if (!blocking && nlen == 0) {
    // Unnamed handles in flight: _ops.note_unnamed's warning, its stacklevel naming the caller's line
    // (no Python frame of ours between).
    PyObject* r = PyObject_CallFunction(entry->note_unnamed, "Oi", h, 2);
    if (!r) {
      Py_DECREF(h);
      return nullptr;
    }
    Py_DECREF(r);
  }
  return h;
}

PyObject* allreduce_async_entry(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  const auto* entry = static_cast<const Entry*>(PyCapsule_GetPointer(self, nullptr));
  PyObject* a[kParams];
  if (!bind(entry, args, nargs, kwnames, a)) return nullptr;
  if (PyObject* h = common_call(entry, a)) return h;
  if (PyErr_Occurred()) return nullptr;
  return PyObject_Vectorcall(entry->checked, a, kParams, nullptr);
}

}  // namespace

void register_allreduce_entry(py::module_& m) {
  m.def("allreduce_entry", [](py::object checked, py::object note_unnamed, py::dict engine_ops, py::dict defaults,
                              const std::string& module, const std::string& doc) -> py::object {
    auto owned = std::make_unique<Entry>();
    Entry* e = owned.get();
    for (int i = 0; i < kParams; ++i) {
      e->names[i] = PyUnicode_InternFromString(kParamNames[i]);
      e->defaults[i] = nullptr;
      if (i != TENSOR) {
        if (!defaults.contains(kParamNames[i]))
          throw py::value_error(std::string("allreduce_entry: no default for '") + kParamNames[i] + "'");
        e->defaults[i] = py::object(defaults[kParamNames[i]]).release().ptr();
      }
    }
    e->checked = checked.release().ptr();
    e->note_unnamed = note_unnamed.release().ptr();
    e->engine_ops = engine_ops.release().ptr();
    e->doc = doc;
    e->def.ml_name = "allreduce_async";
    e->def.ml_meth = reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&allreduce_async_entry));
    e->def.ml_flags = METH_FASTCALL | METH_KEYWORDS;
    e->def.ml_doc = e->doc.c_str();
    auto self = py::reinterpret_steal<py::object>(PyCapsule_New(e, nullptr, [](PyObject* capsule) {
      delete static_cast<Entry*>(PyCapsule_GetPointer(capsule, nullptr));
    }));
    if (!self) throw py::error_already_set();
    owned.release();  // the capsule owns it now
    py::str module_name(module);
    PyObject* f = PyCFunction_NewEx(&e->def, self.ptr(), module_name.ptr());
    if (!f) throw py::error_already_set();
    return py::reinterpret_steal<py::object>(f);
  }, py::arg("checked"), py::arg("note_unnamed"), py::arg("engine_ops"), py::arg("defaults"), py::arg("module"), py::arg("doc"),
     "pycomm.allreduce_async's C entry (allreduce_entry.cpp), made by pycomm.collectives at import: the common "
     "call straight to the engine, every other call to `checked` with all eight arguments.");
}

}  // namespace bindings
}  // namespace pycomm

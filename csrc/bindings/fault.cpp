// pycomm.RanksFailedError and the elastic-mode switches (csrc/comm/fault.h; pycomm/elastic/).
#include "../comm/fault.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {

namespace {
MPI_Comm from_fortran(int64_t handle) { return MPI_Comm_f2c(static_cast<MPI_Fint>(handle)); }
}  // namespace

void register_fault(py::module_& m) {
  // A subclass of CommError (registered by register_comm, before this): `except CommError` still catches it.
  static py::exception<comm::RanksFailedError> ranks_failed(m, "RanksFailedError", m.attr("CommError").ptr());
  // Registered after CommError's translator, so tried before it.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const comm::RanksFailedError& e) {
      py::tuple ranks(e.ranks().size());
      for (size_t i = 0; i < e.ranks().size(); ++i) ranks[i] = e.ranks()[i];
      py::object type = py::reinterpret_borrow<py::object>(ranks_failed.ptr());
      py::object value = type(py::str(e.what()));
      value.attr("ranks") = ranks;
      PyErr_SetObject(ranks_failed.ptr(), value.ptr());
    }
  });
  m.def("ulfm_unavailable", &comm::fault::ulfm_unavailable,
        "Why this MPI cannot run pycomm's elastic mode (no ULFM extension, or fault tolerance off); '' if it can. "
        "Call after MPI_Init.");
  m.def("fault_enable", [](int64_t world) { comm::fault::enable(from_fortran(world)); },
        "Elastic mode on: failures on watched communicators raise RanksFailedError naming ranks of `world` "
        "(a Fortran handle); forgets any earlier failure.");
  m.def("fault_disable", &comm::fault::disable, "Elastic mode off; forgets watched communicators and failures.");
  m.def("fault_enabled", &comm::fault::enabled);
  m.def("fault_watch", [](int64_t comm) { comm::fault::watch(from_fortran(comm)); },
        "Revoke this communicator (a Fortran handle) too when a failure is seen.");
  m.def("fault_unwatch", [](int64_t comm) { comm::fault::unwatch(from_fortran(comm)); });
  m.def("fault_failed", &comm::fault::failed, "Whether the engine has seen a rank fail.");
  m.def("fault_check", [] {
    py::gil_scoped_release release;
    comm::fault::check();
  }, "Raise the failure the engine has seen, if any.");
}

}  // namespace bindings
}  // namespace pycomm

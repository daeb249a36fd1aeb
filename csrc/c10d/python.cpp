// The Python face of the c10d backend: one constructor, called by
// pycomm/distributed/backend.py's creator for each process group.
#include <torch/csrc/utils/pybind.h>

#include "../bindings/bindings.h"
#include "process_group_pycomm.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {

void register_c10d(py::module_& m) {
  py::class_<c10d_backend::ProcessGroupPycomm, c10::intrusive_ptr<c10d_backend::ProcessGroupPycomm>, c10d::Backend>(
      m, "ProcessGroupPycomm",
      "torch.distributed backend over pycomm's engine (use backend='pycomm' after importing pycomm.distributed).")
      .def(py::init([](int rank, int size, int64_t group, int64_t p2p_fortran) {
             return c10::make_intrusive<c10d_backend::ProcessGroupPycomm>(
                 rank, size, group, MPI_Comm_f2c(static_cast<MPI_Fint>(p2p_fortran)));
           }),
           py::arg("rank"), py::arg("size"), py::arg("group"), py::arg("p2p_comm"))
      .def_property_readonly("group_id", &c10d_backend::ProcessGroupPycomm::group_id);
}

}  // namespace bindings
}  // namespace pycomm

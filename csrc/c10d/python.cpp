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
      .def(py::init([](int rank, int size, int64_t group, int64_t p2p_fortran, const std::string& compression) {
             return c10::make_intrusive<c10d_backend::ProcessGroupPycomm>(
                 rank, size, group, MPI_Comm_f2c(static_cast<MPI_Fint>(p2p_fortran)), compression);
           }),
           py::arg("rank"), py::arg("size"), py::arg("group"), py::arg("p2p_comm"), py::arg("compression") = "")
      .def_property_readonly("group_id", &c10d_backend::ProcessGroupPycomm::group_id)
      .def_property_readonly("compression", &c10d_backend::ProcessGroupPycomm::compression,
                             "PYCOMM_COMPRESSION as this process group applies it: none, fp16, bf16 or onebit.")
      .def(
          "compression_state",
          [](c10d_backend::ProcessGroupPycomm& pg) {
            auto s = pg.compression_state();
            auto site = [](const c10d_backend::ProcessGroupPycomm::Site& k, const c10d_backend::SiteKey& key) {
              return py::make_tuple(k.first, py::tuple(py::cast(key.shape)));
            };
            py::dict residuals;
            py::object last = py::none();
            for (auto& kv : s.residuals) {
              residuals[site(kv.first, kv.second.tag)] = py::make_tuple(kv.second.worker, kv.second.server);
              if (kv.first == s.last) last = site(kv.first, kv.second.tag);
            }
            py::dict d;
            d["compression"] = pg.compression();
            d["period"] = s.period;
            d["breaks"] = s.breaks;
            d["last"] = last;
            d["residuals"] = residuals;
            return d;
          },
          "onebit error feedback: the learned period (allreduces per step; 0 while learning), how often a fixed "
          "period broke, the site of the latest call, and {(position or -1 while learning, shape): (worker "
          "residual, server residual)} (live tensors).")
      .def("reset_compression", &c10d_backend::ProcessGroupPycomm::reset_compression, py::call_guard<py::gil_scoped_release>(),
           "Forget the learned call sites and every onebit residual.");
}

}  // namespace bindings
}  // namespace pycomm

// pycomm._C.BackupSession: the backup-worker sessions of comm/backup_allreduce.h, for
// pycomm.training.backup_sgd. Every call that may wait releases the GIL.
#include <memory>
#include <string>
#include <vector>

#include "../comm/backup_allreduce.h"
#include "../comm/engine.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

struct PyBackupSession {
  std::shared_ptr<comm::BackupSession> session;
  comm::WorkPtr work;
  int64_t group = 0;
};

const float* float_data(const at::Tensor& t, size_t numel, const char* what) {
  if (t.scalar_type() != at::kFloat) throw py::type_error(std::string(what) + ": a float32 tensor is needed");
  if (!t.is_cpu()) throw py::value_error(std::string(what) + ": the tensor must be in host (CPU) memory");
  if (!t.is_contiguous()) throw py::value_error(std::string(what) + ": the tensor must be contiguous");
  if (static_cast<size_t>(t.numel()) != numel)
    throw py::value_error(std::string(what) + ": " + std::to_string(t.numel()) + " elements, the session has " +
                          std::to_string(numel));
  return t.data_ptr<float>();
}

}  // namespace

void register_backup(py::module_& m) {
  py::class_<PyBackupSession>(m, "BackupSession",
                              "A backup-worker session (comm/backup_allreduce.h): each step averages the first N = "
                              "size - backups gradients to arrive.")
      .def(py::init([](int64_t numel, int backups, int64_t first_step, const std::string& name, int64_t group) {
             if (numel < 0) throw py::value_error("BackupSession: numel must be >= 0");
             PyBackupSession s;
             s.session = std::make_shared<comm::BackupSession>(static_cast<size_t>(numel), backups, first_step, name);
             s.group = group;
             return s;
           }),
           py::arg("numel"), py::arg("backups"), py::arg("first_step"), py::arg("name"), py::arg("group") = 0)
      .def(
          "open",
          [](PyBackupSession& s) {
            if (s.work) throw comm::CommError("BackupSession.open: the session is already open");
            comm::Engine& e = engine_of(s.group);
            py::gil_scoped_release release;
            s.work = e.backup_session(s.session);
          },
          "Queue the session on the engine (collective: every rank opens it; returns at once).")
      .def(
          "ready", [](PyBackupSession& s, int64_t step) { return s.session->ready(step); }, py::arg("step"),
          "Whether the average of `step` is in (decided, with or without this rank).")
      .def(
          "submit",
          [](PyBackupSession& s, const at::Tensor& grad, int64_t step) {
            const float* p = float_data(grad, s.session->numel(), "BackupSession.submit");
            py::gil_scoped_release release;
            return s.session->submit(p, step);
          },
          py::arg("grad"), py::arg("step"),
          "Hand in this rank's gradient for `step` (copied); False if the step was decided without it (dropped).")
      .def(
          "take",
          [](PyBackupSession& s, at::Tensor& out, int64_t step) {
            float* p = const_cast<float*>(float_data(out, s.session->numel(), "BackupSession.take"));
            std::vector<int> counted;
            bool mine = false;
            {
              py::gil_scoped_release release;
              mine = s.session->take(step, p, &counted);
            }
            return py::make_tuple(mine, counted);
          },
          py::arg("out"), py::arg("step"),
          "Wait for the average of `step`, write it to `out`; returns (this rank counted, the counted ranks).")
      .def(
          "close",
          [](PyBackupSession& s, int64_t steps_taken) {
            if (!s.work) throw comm::CommError("BackupSession.close: the session was never opened");
            py::gil_scoped_release release;
            s.session->close(steps_taken);
            s.work->wait();
          },
          py::arg("steps_taken"),
          "This rank takes no more steps; wait until every rank has closed (raises the session's error).")
      .def_property_readonly("numel", [](const PyBackupSession& s) { return s.session->numel(); })
      .def_property_readonly("backups", [](const PyBackupSession& s) { return s.session->backups(); })
      .def_property_readonly("first_step", [](const PyBackupSession& s) { return s.session->first_step(); })
      .def_property_readonly("is_open", [](const PyBackupSession& s) { return static_cast<bool>(s.work); });
}

}  // namespace bindings
}  // namespace pycomm

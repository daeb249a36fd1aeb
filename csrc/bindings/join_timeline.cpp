// pycomm.join (uneven inputs) and the timeline: bindings.
#include <memory>

#include "../comm/engine.h"
#include "../comm/timeline.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {

void register_join_timeline(py::module_& m) {
  m.def(
      "join",
      [](int64_t group, bool answer_gathers) {
        auto last = std::make_shared<int>(-1);
        py::gil_scoped_release release;
        engine_of(group).join(last, true, answer_gathers)->wait();
        return *last;
      },
      py::arg("group") = 0, py::arg("answer_gathers") = true,
      "This rank has no more work: answer the other ranks' operations until every rank has joined; returns the "
      "rank that joined last. answer_gathers=False: the others' allgathers and broadcasts raise instead "
      "(Horovod's join).");
  m.def(
      "timeline_start", [](const std::string& path, int rank) { comm::timeline::start(path, rank); }, py::arg("path"),
      py::arg("rank"), "Write a Chrome-trace timeline to `path` with '.rank<rank>' before its extension.");
  m.def("timeline_stop", [] {
    py::gil_scoped_release release;
    comm::timeline::stop();
  }, "Close the timeline's open ranges and its file (no-op when none runs).");
  m.def("timeline_path", [] { return comm::timeline::running_path(); }, "The timeline file being written, or ''.");
}

}  // namespace bindings
}  // namespace pycomm

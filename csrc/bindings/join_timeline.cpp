// pycomm.join (uneven inputs), the timeline and the stage clock: bindings.
#include <memory>

#include "../comm/engine.h"
#include "../comm/stage_clock.h"
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
  m.def(
      "stage_clock_run", [](bool on) { comm::stage_clock::set_running(on); }, py::arg("on"),
      "Start (True) or stop the stage clock (comm/stage_clock.h): per-stage time and bytes of the algorithms.");
  m.def("stage_clock_take", [] {
    namespace sc = comm::stage_clock;
    const sc::StageTotals t = sc::take();
    py::dict out;
    for (int s = 0; s < sc::kStageCount; ++s)
      out[sc::stage_name(static_cast<sc::Stage>(s))] =
          py::make_tuple(static_cast<double>(t.nanoseconds[s]) * 1e-9, t.bytes[s], t.marks[s]);
    return out;
  }, "The stage clock's totals since the last take, then zero: {stage: (seconds, bytes, marks)}.");
}

}  // namespace bindings
}  // namespace pycomm

// Python bindings of the parameter server: _C.PsServer, _C.PsClient, _C.PsRequest
// and the update-rule kernel (for tests). Tensors are checked here (float32,
// contiguous, CPU); every blocking call releases the GIL.
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "../kernels/ps_update.h"
#include "../ps/client.h"
#include "../ps/server.h"
#include "bindings.h"

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

float* float_data(const at::Tensor& t, const char* what) {
  if (t.scalar_type() != at::kFloat)
    throw py::type_error(std::string(what) + ": the parameter server holds float32; got " +
                         std::string(c10::toString(t.scalar_type())));
  if (!t.is_cpu()) throw py::value_error(std::string(what) + ": tensor must be on the CPU, got " + t.device().str());
  if (!t.is_contiguous()) throw py::value_error(std::string(what) + ": tensor is not contiguous; call .contiguous()");
  return t.data_ptr<float>();
}

kernels::PsUpdate update_from(const py::dict& d) {
  kernels::PsUpdate u;
  if (d.contains("lr")) u.alpha = d["lr"].cast<float>();
  if (d.contains("momentum")) u.momentum = d["momentum"].cast<float>();
  if (d.contains("weight_decay")) u.weight_decay = d["weight_decay"].cast<float>();
  if (d.contains("compensation")) {
    auto c = d["compensation"].cast<std::string>();
    if (c == "none") u.comp = kernels::PsCompensation::None;
    else if (c == "constant") u.comp = kernels::PsCompensation::Constant;
    else if (c == "adaptive") u.comp = kernels::PsCompensation::Adaptive;
    else throw py::value_error("compensation must be none, constant or adaptive, got '" + c + "'");
  }
  if (d.contains("lambda")) u.lambda = d["lambda"].cast<float>();
  if (d.contains("ms_decay")) u.ms_decay = d["ms_decay"].cast<float>();
  if (d.contains("eps")) u.eps = d["eps"].cast<float>();
  return u;
}

// The server loop on a thread of its own (co-located) or on the caller (dedicated).
class PyServer {
 public:
  PyServer(int64_t comm_f, std::vector<int> workers, const py::dict& cfg) {
    ps::ServerConfig c;
    c.update = update_from(cfg);
    if (cfg.contains("adadelay")) c.adadelay = cfg["adadelay"].cast<bool>();
    if (cfg.contains("adadelay_L")) c.adadelay_L = cfg["adadelay_L"].cast<double>();
    if (cfg.contains("adadelay_c")) c.adadelay_c = cfg["adadelay_c"].cast<double>();
    if (cfg.contains("staleness_bound")) c.staleness_bound = cfg["staleness_bound"].cast<int64_t>();
    if (cfg.contains("stall_report_s")) c.stall_report_s = cfg["stall_report_s"].cast<double>();
    if (cfg.contains("worker_pids")) c.worker_pids = cfg["worker_pids"].cast<std::vector<int>>();
    if (cfg.contains("liveness_check_s")) c.liveness_check_s = cfg["liveness_check_s"].cast<double>();
    server_ = std::make_unique<ps::Server>(MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f)), std::move(workers), c);
  }
  ~PyServer() {
    if (thread_.joinable()) thread_.detach();  // never block interpreter exit; join() is the clean path
  }
  void start() {
    if (thread_.joinable()) throw comm::CommError("pycomm.ps: server already started");
    thread_ = std::thread([this] { body(); });
  }
  void run() {
    py::gil_scoped_release nogil;
    body();
    check();
  }
  void join() {
    {
      py::gil_scoped_release nogil;
      if (thread_.joinable()) thread_.join();
    }
    check();
  }

 private:
  void body() {
    try {
      server_->run();
    } catch (const std::exception& e) {
      error_ = e.what();
      std::fprintf(stderr, "pycomm.ps: server failed: %s\n", e.what());
    }
  }
  void check() {
    if (!error_.empty()) throw comm::CommError("pycomm.ps: server failed: " + error_);
  }
  std::unique_ptr<ps::Server> server_;
  std::thread thread_;
  std::string error_;
};

struct PyRequest {
  std::unique_ptr<ps::Request> req;
  py::object keep;  // tensors MPI reads or writes until completion
  int64_t wait() {
    int64_t s;
    {
      py::gil_scoped_release nogil;
      s = req->wait();
    }
    keep = py::none();
    return s;
  }
  bool test() {
    bool d = req->test();
    if (d) keep = py::none();
    return d;
  }
  py::list payloads() {
    py::list out;
    for (auto& p : req->payloads()) out.append(py::bytes(p.data(), p.size()));
    return out;
  }
  py::list replies() {
    py::list out;
    for (auto& r : req->replies()) out.append(py::make_tuple(r[0], r[1]));
    return out;
  }
};

using Started = std::unique_ptr<ps::Request> (ps::Client::*)();

}  // namespace

void register_ps(py::module_& m) {
  py::class_<PyServer>(m, "PsServer")
      .def(py::init<int64_t, std::vector<int>, py::dict>(), py::arg("comm"), py::arg("workers"), py::arg("config"))
      .def("start", &PyServer::start, "serve on a thread of this process")
      .def("join", &PyServer::join, "wait until every worker is done")
      .def("run", &PyServer::run, "serve on the calling thread until every worker is done");

  py::class_<PyRequest>(m, "PsRequest")
      .def("wait", &PyRequest::wait, "wait; returns the first non-zero reply status (0: ok)")
      .def("test", &PyRequest::test)
      .def("payloads", &PyRequest::payloads)
      .def("replies", &PyRequest::replies);

  auto wrap = [](std::unique_ptr<ps::Request> r, py::object keep) {
    PyRequest p;
    p.req = std::move(r);
    p.keep = std::move(keep);
    return p;
  };
  py::class_<ps::Client>(m, "PsClient")
      .def(py::init([](int64_t comm_f, std::vector<int> servers) {
             return std::make_unique<ps::Client>(MPI_Comm_f2c(static_cast<MPI_Fint>(comm_f)), std::move(servers));
           }),
           py::arg("comm"), py::arg("servers"))
      .def("init", [wrap](ps::Client& c, int64_t key, const at::Tensor& t) {
        return wrap(c.init(key, t.numel(), float_data(t, "pycomm.ps.init")), py::cast(t));
      })
      .def("push", [wrap](ps::Client& c, int64_t key, const at::Tensor& t) {
        return wrap(c.push(key, t.numel(), float_data(t, "pycomm.ps.push")), py::cast(t));
      })
      .def("pull", [wrap](ps::Client& c, int64_t key, const at::Tensor& t) {
        return wrap(c.pull(key, t.numel(), float_data(t, "pycomm.ps.pull")), py::cast(t));
      })
      .def("set_shared", &ps::Client::set_shared, py::arg("server_indices"),
           "servers (by index) that read and write this process's memory directly")
      .def("push_pull", [wrap](ps::Client& c, int64_t key, const at::Tensor& g, const at::Tensor& out) {
        return wrap(c.push_pull(key, g.numel(), float_data(g, "pycomm.ps.push_pull"),
                                float_data(out, "pycomm.ps.push_pull")),
                    py::make_tuple(g, out));
      })
      .def("clock", [wrap](ps::Client& c, int64_t clock) { return wrap(c.clock(clock), py::none()); })
      .def("clock_pull", [wrap](ps::Client& c, int64_t clock, std::vector<at::Tensor> outs) {
        std::vector<int64_t> totals;
        std::vector<float*> ptrs;
        for (auto& t : outs) {
          totals.push_back(t.numel());
          ptrs.push_back(float_data(t, "pycomm.ps.clock"));
        }
        return wrap(c.clock_pull(clock, totals, ptrs), py::cast(outs));
      })
      .def("flush", [wrap](ps::Client& c) { return wrap(c.flush(), py::none()); })
      .def("done", [wrap](ps::Client& c) { return wrap(c.done(), py::none()); })
      .def("stats", [wrap](ps::Client& c) { return wrap(c.stats(), py::none()); })
      .def("save", [wrap](ps::Client& c, int server) { return wrap(c.save(server), py::none()); })
      .def("load", [wrap](ps::Client& c, int server, py::bytes blob) {
        std::string s = blob;
        return wrap(c.load(server, std::vector<char>(s.begin(), s.end())), py::none());
      });

  m.def("ps_update", [](at::Tensor w, py::object v, py::object ms, at::Tensor g, py::object bak, py::dict cfg) {
        auto ptr = [](py::object o, const char* what) -> float* {
          return o.is_none() ? nullptr : float_data(o.cast<at::Tensor>(), what);
        };
        float* wp = float_data(w, "ps_update w");
        float* gp = float_data(g, "ps_update g");
        float *vp = ptr(v, "ps_update v"), *mp = ptr(ms, "ps_update ms"), *bp = ptr(bak, "ps_update bak");
        size_t n = static_cast<size_t>(w.numel());
        for (auto o : {v, ms, bak})
          if (!o.is_none() && static_cast<size_t>(o.cast<at::Tensor>().numel()) != n)
            throw py::value_error("ps_update: every tensor must have as many elements as w");
        if (static_cast<size_t>(g.numel()) != n) throw py::value_error("ps_update: g and w differ in size");
        kernels::PsUpdate u = update_from(cfg);
        py::gil_scoped_release nogil;
        kernels::ps_update_cpu(wp, vp, mp, gp, bp, n, u);
      },
      py::arg("w"), py::arg("v"), py::arg("ms"), py::arg("g"), py::arg("bak"), py::arg("config"),
      "the server's update rule on one shard (kernels/ps_update.h), in place");
  m.def(
      "ps_memory_probe",
      [](int pid, int64_t address, size_t nbytes) {
        std::string buf(nbytes, '\0');
        int err = ps::memory_probe(pid, address, &buf[0], nbytes);
        return py::make_tuple(err, py::bytes(err ? std::string() : buf),
                              err ? std::string(std::strerror(err)) : std::string());
      },
      py::arg("pid"), py::arg("address"), py::arg("nbytes"),
      "read nbytes at address in process pid of this host (process_vm_readv): (errno, bytes, error text)");
  m.def("adadelay_alpha", &kernels::adadelay_alpha, py::arg("L"), py::arg("c"), py::arg("t"), py::arg("tau"));
}

}  // namespace bindings
}  // namespace pycomm

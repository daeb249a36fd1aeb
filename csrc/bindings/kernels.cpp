// torch-facing wrappers of the compute kernels (csrc/kernels/). Each checks
// its tensors (device, dtype, contiguity, sizes), then calls the CPU or CUDA
// kernel with the GIL released; CUDA kernels run on torch's current stream of
// the tensors' device. Allocation and friendly defaults live in
// pycomm/kernels.py.
#include <stdexcept>
#include <string>
#include <vector>

#include "../kernels/cast.h"
#include "../kernels/cpu_dispatch.h"
#include "../kernels/fusion.h"
#include "../kernels/onebit.h"
#include "../kernels/reduce.h"
#include "../kernels/sparse.h"
#include "bindings.h"

#ifdef PYCOMM_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace py = pybind11;

namespace pycomm {
namespace bindings {
namespace {

using kernels::DType;

std::string fq(const char* fn, const char* what) { return std::string(fn) + ": " + what; }

// Where a call runs: all tensors on one device, CPU or (CUDA builds) CUDA.
struct Where {
  bool cuda = false;
  at::Device device{at::kCPU};
};

Where where(const char* fn, std::initializer_list<const at::Tensor*> ts) {
  Where w;
  bool first = true;
  for (const at::Tensor* t : ts) {
    if (!t || !t->defined()) continue;
    if (first) {
      w.device = t->device();
      first = false;
    } else if (t->device() != w.device) {
      throw py::value_error(std::string(fn) + ": tensors on different devices (" + w.device.str() + " and " +
                            t->device().str() + "); put them on one device");
    }
  }
  if (w.device.is_cuda()) {
#ifdef PYCOMM_WITH_CUDA
    w.cuda = true;
#else
    throw py::value_error(std::string(fn) + ": tensor is on " + w.device.str() +
                          " but this pycomm was built without CUDA; reinstall with a CUDA build of torch "
                          "(PYCOMM_CUDA=1)");
#endif
  } else if (!w.device.is_cpu()) {
    throw py::value_error(std::string(fn) + ": tensors on " + w.device.str() + " are not supported");
  }
  return w;
}

#ifdef PYCOMM_WITH_CUDA
kernels::Stream stream_of(const Where& w) {
  return reinterpret_cast<kernels::Stream>(at::cuda::getCurrentCUDAStream(w.device.index()).stream());
}
#endif

// Runs `cpu()` or `cuda(stream)` with the GIL released (and, on CUDA, the device set).
template <class Cpu, class Cuda>
void dispatch(const Where& w, Cpu&& cpu, Cuda&& cuda) {
  if (w.cuda) {
#ifdef PYCOMM_WITH_CUDA
    c10::cuda::CUDAGuard guard(w.device);
    kernels::Stream s = stream_of(w);
    py::gil_scoped_release release;
    cuda(s);
    return;
#else
    (void)cuda;
#endif
  }
  py::gil_scoped_release release;
  cpu();
}

void need(const at::Tensor& t, at::ScalarType st, const char* fn, const char* what) {
  if (t.scalar_type() != st)
    throw py::type_error(fq(fn, what) + " must be " + std::string(c10::toString(st)) + ", got " +
                         std::string(c10::toString(t.scalar_type())));
  if (!t.is_contiguous()) throw py::value_error(fq(fn, what) + " is not contiguous; pass .contiguous()");
}

void need_numel(const at::Tensor& t, int64_t n, const char* fn, const char* what, bool at_least = false) {
  if (at_least ? t.numel() < n : t.numel() != n)
    throw py::value_error(fq(fn, what) + " has " + std::to_string(t.numel()) + " elements, expected " +
                          (at_least ? "at least " : "") + std::to_string(n));
}

DType half_type(const at::Tensor& t, const char* fn, const char* what) {
  if (t.scalar_type() == at::kHalf) return DType::F16;
  if (t.scalar_type() == at::kBFloat16) return DType::BF16;
  throw py::type_error(fq(fn, what) + " must be float16 or bfloat16, got " +
                       std::string(c10::toString(t.scalar_type())));
}

const uint8_t* mask_ptr(const c10::optional<at::Tensor>& mask, int64_t n, const char* fn) {
  if (!mask || !mask->defined()) return nullptr;
  if (mask->scalar_type() != at::kByte && mask->scalar_type() != at::kBool)
    throw py::type_error(std::string(fn) + ": mask must be uint8 or bool, got " +
                         std::string(c10::toString(mask->scalar_type())));
  if (!mask->is_contiguous()) throw py::value_error(std::string(fn) + ": mask is not contiguous");
  need_numel(*mask, n, fn, "mask");
  return static_cast<const uint8_t*>(mask->data_ptr());
}

size_t check_chunk(int64_t chunk, const char* fn) {
  if (chunk <= 0 || chunk % 8 != 0)
    throw py::value_error(std::string(fn) + ": chunk must be a positive multiple of 8, got " + std::to_string(chunk));
  return static_cast<size_t>(chunk);
}

kernels::ReduceOp parse_op(const std::string& op) {
  if (op == "sum") return kernels::ReduceOp::SUM;
  if (op == "min") return kernels::ReduceOp::MIN;
  if (op == "max") return kernels::ReduceOp::MAX;
  throw py::value_error("reduce_: unknown op '" + op + "'; choose sum, min or max");
}

// ---- reduce ----
void reduce_(at::Tensor dst, const at::Tensor& src, const std::string& op) {
  const char* fn = "reduce_";
  if (dst.scalar_type() != src.scalar_type() || dst.numel() != src.numel())
    throw py::value_error("reduce_: dst and src must have the same dtype and number of elements");
  Where w = where(fn, {&dst, &src});
  comm::Buffer d = to_buffer(dst, "reduce_ dst"), s = to_buffer(src, "reduce_ src");
  kernels::ReduceOp rop = parse_op(op);
  dispatch(
      w, [&] { kernels::reduce_cpu(d.data, s.data, d.count, d.dtype, rop); },
      [&](kernels::Stream st) { kernels::reduce_cuda(d.data, s.data, d.count, d.dtype, rop, st); });
}

void scale_(at::Tensor t, double factor) {
  Where w = where("scale_", {&t});
  comm::Buffer b = to_buffer(t, "scale_");
  if (!kernels::is_floating(b.dtype)) throw py::type_error("scale_: integer tensors cannot be scaled");
  dispatch(
      w, [&] { kernels::scale_cpu(b.data, b.count, b.dtype, factor); },
      [&](kernels::Stream st) { kernels::scale_cuda(b.data, b.count, b.dtype, factor, st); });
}

// ---- cast ----
void cast_to_half(const at::Tensor& x, at::Tensor out, double scale, at::Tensor nonfinite) {
  const char* fn = "cast_to_half";
  need(x, at::kFloat, fn, "input");
  DType h = half_type(out, fn, "out");
  if (!out.is_contiguous()) throw py::value_error(fq(fn, "out") + " is not contiguous");
  need_numel(out, x.numel(), fn, "out");
  need(nonfinite, at::kInt, fn, "nonfinite flag");
  need_numel(nonfinite, 1, fn, "nonfinite flag");
  Where w = where(fn, {&x, &out, &nonfinite});
  const float* xp = x.data_ptr<float>();
  void* yp = out.data_ptr();
  int* flag = nonfinite.data_ptr<int>();
  size_t n = static_cast<size_t>(x.numel());
  float s = static_cast<float>(scale);
  dispatch(
      w, [&] { kernels::cast_to_half_cpu(xp, yp, n, h, s, flag); },
      [&](kernels::Stream st) { kernels::cast_to_half_cuda(xp, yp, n, h, s, flag, st); });
}

void cast_to_float(const at::Tensor& x, at::Tensor out, double scale) {
  const char* fn = "cast_to_float";
  DType h = half_type(x, fn, "input");
  if (!x.is_contiguous()) throw py::value_error(fq(fn, "input") + " is not contiguous");
  need(out, at::kFloat, fn, "out");
  need_numel(out, x.numel(), fn, "out");
  Where w = where(fn, {&x, &out});
  const void* xp = x.data_ptr();
  float* yp = out.data_ptr<float>();
  size_t n = static_cast<size_t>(x.numel());
  float s = static_cast<float>(scale);
  dispatch(
      w, [&] { kernels::cast_to_float_cpu(xp, yp, n, h, s); },
      [&](kernels::Stream st) { kernels::cast_to_float_cuda(xp, yp, n, h, s, st); });
}

void accumulate_(at::Tensor acc, const at::Tensor& x) {
  const char* fn = "accumulate_";
  need(acc, at::kFloat, fn, "acc");
  DType h = half_type(x, fn, "input");
  if (!x.is_contiguous()) throw py::value_error(fq(fn, "input") + " is not contiguous");
  need_numel(x, acc.numel(), fn, "input");
  Where w = where(fn, {&acc, &x});
  float* ap = acc.data_ptr<float>();
  const void* xp = x.data_ptr();
  size_t n = static_cast<size_t>(acc.numel());
  dispatch(
      w, [&] { kernels::accumulate_half_cpu(ap, xp, n, h); },
      [&](kernels::Stream st) { kernels::accumulate_half_cuda(ap, xp, n, h, st); });
}

// ---- onebit ----
void onebit_compress(const at::Tensor& x, at::Tensor residual, int64_t chunk_, at::Tensor bits, at::Tensor scales,
                     const c10::optional<at::Tensor>& mask) {
  const char* fn = "onebit_compress";
  size_t chunk = check_chunk(chunk_, fn);
  need(x, at::kFloat, fn, "input");
  need(residual, at::kFloat, fn, "residual");
  need(bits, at::kByte, fn, "bits");
  need(scales, at::kFloat, fn, "scales");
  const int64_t n = x.numel();
  need_numel(residual, n, fn, "residual");
  need_numel(bits, static_cast<int64_t>(kernels::onebit_packed_bytes(n)), fn, "bits", true);
  need_numel(scales, static_cast<int64_t>(kernels::onebit_num_chunks(n, chunk)), fn, "scales", true);
  const at::Tensor* m = mask && mask->defined() ? &*mask : nullptr;
  Where w = where(fn, {&x, &residual, &bits, &scales, m});
  const uint8_t* mp = mask_ptr(mask, n, fn);
  if (x.data_ptr() == residual.data_ptr() && n > 0)
    throw py::value_error("onebit_compress: input and residual must be different tensors");
  const float* xp = x.data_ptr<float>();
  float* ep = residual.data_ptr<float>();
  uint8_t* bp = bits.data_ptr<uint8_t>();
  float* sp = scales.data_ptr<float>();
  dispatch(
      w, [&] { kernels::onebit_compress_cpu(xp, ep, n, chunk, bp, sp, mp); },
      [&](kernels::Stream st) { kernels::onebit_compress_cuda(xp, ep, n, chunk, bp, sp, mp, st); });
}

void onebit_decompress(const at::Tensor& bits, const at::Tensor& scales, int64_t chunk_, at::Tensor out, bool add,
                       double weight, const c10::optional<at::Tensor>& mask) {
  const char* fn = add ? "onebit_decompress_accumulate_" : "onebit_decompress";
  size_t chunk = check_chunk(chunk_, fn);
  need(bits, at::kByte, fn, "bits");
  need(scales, at::kFloat, fn, "scales");
  need(out, at::kFloat, fn, "out");
  const int64_t n = out.numel();
  need_numel(bits, static_cast<int64_t>(kernels::onebit_packed_bytes(n)), fn, "bits", true);
  need_numel(scales, static_cast<int64_t>(kernels::onebit_num_chunks(n, chunk)), fn, "scales", true);
  const at::Tensor* m = mask && mask->defined() ? &*mask : nullptr;
  Where w = where(fn, {&out, &bits, &scales, m});
  const uint8_t* mp = mask_ptr(mask, n, fn);
  const uint8_t* bp = bits.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float wt = static_cast<float>(weight);
  if (add) {
    dispatch(
        w, [&] { kernels::onebit_decompress_accumulate_cpu(bp, sp, n, chunk, op, wt, mp); },
        [&](kernels::Stream st) { kernels::onebit_decompress_accumulate_cuda(bp, sp, n, chunk, op, wt, mp, st); });
  } else {
    dispatch(
        w, [&] { kernels::onebit_decompress_cpu(bp, sp, n, chunk, op, mp); },
        [&](kernels::Stream st) { kernels::onebit_decompress_cuda(bp, sp, n, chunk, op, mp, st); });
  }
}

// ---- sparse (top-k / threshold with error feedback; kernels/sparse.h) ----
void check_sparse_n(int64_t n, const char* fn) {
  if (n >= (int64_t{1} << 31))
    throw py::value_error(std::string(fn) + ": " + std::to_string(n) +
                          " elements; the int32 indices of sparse compression address fewer than 2^31");
}

int64_t sparse_count_above(const at::Tensor& x, const at::Tensor& residual, double threshold) {
  const char* fn = "sparse_count_above";
  need(x, at::kFloat, fn, "input");
  need(residual, at::kFloat, fn, "residual");
  const int64_t n = x.numel();
  need_numel(residual, n, fn, "residual");
  check_sparse_n(n, fn);
  if (!(threshold >= 0)) throw py::value_error(std::string(fn) + ": threshold must be >= 0, got " +
                                               std::to_string(threshold));
  Where w = where(fn, {&x, &residual});
  const float* xp = x.data_ptr<float>();
  const float* ep = residual.data_ptr<float>();
  const float t = static_cast<float>(threshold);
  size_t count = 0;
  dispatch(
      w, [&] { count = kernels::sparse_count_above_cpu(xp, ep, n, t); },
      [&](kernels::Stream st) { count = kernels::sparse_count_above_cuda(xp, ep, n, t, st); });
  return static_cast<int64_t>(count);
}

void sparse_select(const at::Tensor& x, at::Tensor residual, int64_t k, at::Tensor indices, at::Tensor values) {
  const char* fn = "sparse_select";
  need(x, at::kFloat, fn, "input");
  need(residual, at::kFloat, fn, "residual");
  need(indices, at::kInt, fn, "indices");
  need(values, at::kFloat, fn, "values");
  const int64_t n = x.numel();
  need_numel(residual, n, fn, "residual");
  check_sparse_n(n, fn);
  if (k < 0 || k > n)
    throw py::value_error(std::string(fn) + ": k must be in [0, " + std::to_string(n) + "], got " + std::to_string(k));
  need_numel(indices, k, fn, "indices", true);
  need_numel(values, k, fn, "values", true);
  if (x.data_ptr() == residual.data_ptr() && n > 0)
    throw py::value_error("sparse_select: input and residual must be different tensors");
  Where w = where(fn, {&x, &residual, &indices, &values});
  const float* xp = x.data_ptr<float>();
  float* ep = residual.data_ptr<float>();
  int32_t* ip = indices.data_ptr<int32_t>();
  float* vp = values.data_ptr<float>();
  dispatch(
      w, [&] { kernels::sparse_select_cpu(xp, ep, n, k, ip, vp); },
      [&](kernels::Stream st) { kernels::sparse_select_cuda(xp, ep, n, k, ip, vp, st); });
}

void sparse_scatter(const at::Tensor& indices, const at::Tensor& values, int64_t rows, int64_t k, at::Tensor out,
                    double scale) {
  const char* fn = "sparse_scatter";
  need(indices, at::kInt, fn, "indices");
  need(values, at::kFloat, fn, "values");
  need(out, at::kFloat, fn, "out");
  if (rows < 0 || k < 0)
    throw py::value_error(std::string(fn) + ": rows and k must be >= 0");
  need_numel(indices, rows * k, fn, "indices");
  need_numel(values, rows * k, fn, "values");
  const int64_t n = out.numel();
  check_sparse_n(n, fn);
  Where w = where(fn, {&out, &indices, &values});
  const int32_t* ip = indices.data_ptr<int32_t>();
  const float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  dispatch(
      w, [&] { kernels::sparse_scatter_cpu(ip, vp, rows, k, op, n, sc); },
      [&](kernels::Stream st) { kernels::sparse_scatter_cuda(ip, vp, rows, k, op, n, sc, st); });
}

// ---- fusion ----
struct Table {
  std::vector<size_t> counts;
  std::vector<void*> ptrs;
  size_t total = 0;
};

Table fusion_table(const at::Tensor& flat, const std::vector<at::Tensor>& ts, const char* fn, Where* w) {
  if (!flat.is_contiguous()) throw py::value_error(std::string(fn) + ": flat buffer is not contiguous");
  DType dt = to_dtype(flat, fn);
  *w = where(fn, {&flat});
  Table t;
  for (size_t k = 0; k < ts.size(); ++k) {
    const at::Tensor& x = ts[k];
    std::string what = "tensor " + std::to_string(k);
    if (x.scalar_type() != flat.scalar_type())
      throw py::type_error(std::string(fn) + ": " + what + " is " + std::string(c10::toString(x.scalar_type())) +
                           ", the flat buffer is " + std::string(c10::toString(flat.scalar_type())) +
                           "; fuse one dtype at a time");
    if (x.device() != flat.device())
      throw py::value_error(std::string(fn) + ": " + what + " is on " + x.device().str() + ", the flat buffer on " +
                            flat.device().str());
    if (!x.is_contiguous()) throw py::value_error(std::string(fn) + ": " + what + " is not contiguous");
    t.counts.push_back(static_cast<size_t>(x.numel()));
    t.ptrs.push_back(x.numel() ? x.data_ptr() : nullptr);
    t.total += static_cast<size_t>(x.numel());
  }
  (void)dt;
  if (static_cast<size_t>(flat.numel()) < t.total)
    throw py::value_error(std::string(fn) + ": flat buffer has " + std::to_string(flat.numel()) +
                          " elements, the tensors need " + std::to_string(t.total));
  return t;
}

void fusion_pack(const std::vector<at::Tensor>& tensors, at::Tensor flat) {
  const char* fn = "fusion_pack";
  Where w;
  Table t = fusion_table(flat, tensors, fn, &w);
  DType dt = to_dtype(flat, fn);
  void* fp = flat.data_ptr();
  std::vector<const void*> srcs(t.ptrs.begin(), t.ptrs.end());
  dispatch(
      w, [&] { kernels::fusion_pack_cpu(srcs.data(), t.counts.data(), srcs.size(), fp, dt); },
      [&](kernels::Stream st) { kernels::fusion_pack_cuda(srcs.data(), t.counts.data(), srcs.size(), fp, dt, st); });
}

void fusion_unpack(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  const char* fn = "fusion_unpack";
  Where w;
  Table t = fusion_table(flat, tensors, fn, &w);
  DType dt = to_dtype(flat, fn);
  if (scale != 1.0 && !kernels::is_floating(dt))
    throw py::type_error(std::string(fn) + ": scale " + std::to_string(scale) + " on " + kernels::dtype_name(dt) +
                         " tensors; integer tensors take scale 1 only");
  const void* fp = flat.data_ptr();
  dispatch(
      w, [&] { kernels::fusion_unpack_cpu(fp, t.ptrs.data(), t.counts.data(), t.ptrs.size(), dt, scale); },
      [&](kernels::Stream st) {
        kernels::fusion_unpack_cuda(fp, t.ptrs.data(), t.counts.data(), t.ptrs.size(), dt, scale, st);
      });
}

kernels::CpuIsa parse_isa(const std::string& s) {
  if (s == "scalar") return kernels::CpuIsa::Scalar;
  if (s == "avx2") return kernels::CpuIsa::Avx2;
  if (s == "avx512") return kernels::CpuIsa::Avx512;
  throw py::value_error("unknown CPU ISA '" + s + "'; choose scalar, avx2 or avx512");
}

}  // namespace

void register_kernels(py::module_& m) {
  m.def("reduce_", &reduce_, py::arg("dst"), py::arg("src"), py::arg("op") = "sum",
        "dst = dst op src element-wise, in place (fp16/bf16 combined in fp32, rounded once).");
  m.def("scale_", &scale_, py::arg("tensor"), py::arg("factor"), "tensor *= factor in place (floating types).");
  m.def("cast_to_half", &cast_to_half, py::arg("x"), py::arg("out"), py::arg("scale"), py::arg("nonfinite"),
        "out = half(x * scale); nonfinite[0] = 1 if any output is inf/NaN else 0.");
  m.def("cast_to_float", &cast_to_float, py::arg("x"), py::arg("out"), py::arg("scale"),
        "out = float(x) * scale.");
  m.def("accumulate_", &accumulate_, py::arg("acc"), py::arg("x"), "acc += float(x).");
  m.def("onebit_compress", &onebit_compress, py::arg("x"), py::arg("residual"), py::arg("chunk"), py::arg("bits"),
        py::arg("scales"), py::arg("mask") = py::none(), "1-bit compression with error feedback (see onebit.h).");
  m.def("onebit_decompress", &onebit_decompress, py::arg("bits"), py::arg("scales"), py::arg("chunk"),
        py::arg("out"), py::arg("accumulate"), py::arg("weight"), py::arg("mask") = py::none(),
        "out = q (accumulate=False) or out += weight*q (accumulate=True).");
  m.def("onebit_packed_bytes", [](int64_t n) { return kernels::onebit_packed_bytes(static_cast<size_t>(n)); });
  m.def("sparse_count_above", &sparse_count_above, py::arg("x"), py::arg("residual"), py::arg("threshold"),
        "#{i : |x_i + residual_i| >= threshold} (see sparse.h).");
  m.def("sparse_select", &sparse_select, py::arg("x"), py::arg("residual"), py::arg("k"), py::arg("indices"),
        py::arg("values"), "Top-k of |x + residual| with error feedback (see sparse.h).");
  m.def("sparse_scatter", &sparse_scatter, py::arg("indices"), py::arg("values"), py::arg("rows"), py::arg("k"),
        py::arg("out"), py::arg("scale"), "out = scale * sum over rows of the (index, value) pairs (see sparse.h).");
  m.def("fusion_pack", &fusion_pack, py::arg("tensors"), py::arg("flat"), "flat = concat(tensors).");
  m.def("fusion_unpack", &fusion_unpack, py::arg("flat"), py::arg("tensors"), py::arg("scale"),
        "tensors[k] = flat[off_k : off_k + numel_k] * scale.");
  m.def("cpu_isa", [] { return std::string(kernels::cpu_isa_name(kernels::cpu_isa())); },
        "The CPU variant the hand-written kernels use: scalar, avx2 or avx512.");
  m.def("cpu_isa_supported", [] { return std::string(kernels::cpu_isa_name(kernels::cpu_isa_supported())); });
  m.def("set_cpu_isa", [](const std::string& s) { return std::string(kernels::cpu_isa_name(kernels::set_cpu_isa(parse_isa(s)))); },
        "Choose the CPU variant (lowered to what the CPU supports); returns the one in use.");
  m.def("set_cpu_threads", &kernels::set_cpu_threads, py::arg("n"),
        "OpenMP threads for kernels above 1 MiB; 0 = OpenMP's default.");
  m.def("cpu_threads", &kernels::cpu_threads);
}

}  // namespace bindings
}  // namespace pycomm

#include "mpi_types.h"

#include "fault.h"

#include "../kernels/reduce.h"

namespace pycomm {
namespace comm {
namespace {

bool g_ready = false;
int g_users = 0;  // engines using the types (one per process group)
MPI_Datatype g_f16 = MPI_DATATYPE_NULL, g_bf16 = MPI_DATATYPE_NULL;
MPI_Op g_half_ops[2][4];  // [f16, bf16][sum, min, max, prod]

template <int Half, int Op>
void half_op(void* in, void* inout, int* len, MPI_Datatype*) {
  constexpr DType dt = Half == 0 ? DType::F16 : DType::BF16;
  kernels::reduce_cpu(inout, in, static_cast<size_t>(*len), dt, static_cast<ReduceOp>(Op));
}

template <int Half>
void create_half_ops() {
  PYCOMM_MPI_CHECK(MPI_Op_create(&half_op<Half, 0>, 1, &g_half_ops[Half][0]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&half_op<Half, 1>, 1, &g_half_ops[Half][1]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&half_op<Half, 2>, 1, &g_half_ops[Half][2]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&half_op<Half, 3>, 1, &g_half_ops[Half][3]));
}

// MPI_MIN/MAX on floats may drop a NaN (the result depends on which rank
// holds it); these call pycomm's kernel, which propagates NaN like
// torch.minimum, so `mpi` gives what ring and shm give.
MPI_Op g_nan_ops[2][2];  // [f32, f64][min, max]

template <int Float, int Op>
void nan_op(void* in, void* inout, int* len, MPI_Datatype*) {
  constexpr DType dt = Float == 0 ? DType::F32 : DType::F64;
  kernels::reduce_cpu(inout, in, static_cast<size_t>(*len), dt, static_cast<ReduceOp>(Op));
}

// uint8, int8, int16 and bool reduce with pycomm's kernel too: Open MPI's vectorized MPI_SUM on
// 8-bit integers saturates instead of wrapping, and bool needs or/and (reduce.h).
constexpr int kNarrowFirst = static_cast<int>(DType::U8);
constexpr int kNarrowCount = static_cast<int>(DType::BOOL) - kNarrowFirst + 1;
MPI_Op g_narrow_ops[kNarrowCount][4];  // [u8, i8, i16, bool][sum, min, max, prod]

template <int D, int Op>
void narrow_op(void* in, void* inout, int* len, MPI_Datatype*) {
  kernels::reduce_cpu(inout, in, static_cast<size_t>(*len), static_cast<DType>(D), static_cast<ReduceOp>(Op));
}

template <int D>
void create_narrow_ops() {
  MPI_Op* ops = g_narrow_ops[D - kNarrowFirst];
  PYCOMM_MPI_CHECK(MPI_Op_create(&narrow_op<D, 0>, 1, &ops[0]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&narrow_op<D, 1>, 1, &ops[1]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&narrow_op<D, 2>, 1, &ops[2]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&narrow_op<D, 3>, 1, &ops[3]));
}

}  // namespace

void mpi_types_init() {
  ++g_users;
  if (g_ready) return;
  PYCOMM_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_f16));
  PYCOMM_MPI_CHECK(MPI_Type_commit(&g_f16));
  PYCOMM_MPI_CHECK(MPI_Type_contiguous(2, MPI_BYTE, &g_bf16));
  PYCOMM_MPI_CHECK(MPI_Type_commit(&g_bf16));
  create_half_ops<0>();
  create_half_ops<1>();
  PYCOMM_MPI_CHECK(MPI_Op_create(&nan_op<0, 1>, 1, &g_nan_ops[0][0]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&nan_op<0, 2>, 1, &g_nan_ops[0][1]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&nan_op<1, 1>, 1, &g_nan_ops[1][0]));
  PYCOMM_MPI_CHECK(MPI_Op_create(&nan_op<1, 2>, 1, &g_nan_ops[1][1]));
  create_narrow_ops<static_cast<int>(DType::U8)>();
  create_narrow_ops<static_cast<int>(DType::I8)>();
  create_narrow_ops<static_cast<int>(DType::I16)>();
  create_narrow_ops<static_cast<int>(DType::BOOL)>();
  g_ready = true;
}

void mpi_types_finalize() {
  if (g_users > 0 && --g_users > 0) return;
  if (!g_ready) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) {
    MPI_Type_free(&g_f16);
    MPI_Type_free(&g_bf16);
    for (auto& row : g_half_ops)
      for (auto& op : row) MPI_Op_free(&op);
    for (auto& row : g_nan_ops)
      for (auto& op : row) MPI_Op_free(&op);
    for (auto& row : g_narrow_ops)
      for (auto& op : row) MPI_Op_free(&op);
  }
  g_ready = false;
}

MPI_Datatype mpi_datatype(DType dtype) {
  switch (dtype) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::F16: return g_f16;
    case DType::BF16: return g_bf16;
    case DType::U8: return MPI_UINT8_T;
    case DType::I8: return MPI_INT8_T;
    case DType::I16: return MPI_INT16_T;
    case DType::BOOL: return MPI_UINT8_T;  // one byte, 0 or 1; reduced as or/and by pycomm's kernel (mpi_op)
  }
  throw CommError("mpi_datatype: unsupported dtype");
}

MPI_Op mpi_op(DType dtype, ReduceOp op) {
  if (dtype == DType::F16 || dtype == DType::BF16)
    return g_half_ops[dtype == DType::F16 ? 0 : 1][static_cast<int>(op)];
  if ((dtype == DType::F32 || dtype == DType::F64) && (op == ReduceOp::MIN || op == ReduceOp::MAX))
    return g_nan_ops[dtype == DType::F32 ? 0 : 1][op == ReduceOp::MIN ? 0 : 1];
  if (static_cast<int>(dtype) >= kNarrowFirst && static_cast<int>(dtype) < kNarrowFirst + kNarrowCount)
    return g_narrow_ops[static_cast<int>(dtype) - kNarrowFirst][static_cast<int>(op)];
  switch (op) {
    case ReduceOp::SUM: return MPI_SUM;
    case ReduceOp::MIN: return MPI_MIN;
    case ReduceOp::MAX: return MPI_MAX;
    case ReduceOp::PROD: return MPI_PROD;
  }
  throw CommError("mpi_op: unsupported op");
}

void throw_mpi_error(int rc, const char* call, const char* file, int line) {
  if (fault::enabled() && fault::is_failure(rc)) fault::raise(rc, call);  // elastic mode: a rank died (fault.h)
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, msg, &len) != MPI_SUCCESS) len = 0;
  throw CommError(std::string("MPI call failed: ") + call + " -> " + std::string(msg, static_cast<size_t>(len)) +
                  " (" + file + ":" + std::to_string(line) + ")");
}

}  // namespace comm
}  // namespace pycomm

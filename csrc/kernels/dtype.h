// Element types and reduction operators shared by every kernel and the engine.
// No torch or MPI here: the bindings map torch dtypes onto DType, the engine
// maps DType onto MPI datatypes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {
namespace kernels {

// The one table of element types that every layer reads: the kernels and the
// engine (this enum, sizes, names), the bindings (torch's ScalarType, last
// column) and Python (pycomm._C.dtype_names() -> pycomm.SUPPORTED_DTYPES).
// X(enum, value, name as in torch/numpy, bytes, c10::ScalarType enumerator).
// Reductions (docs/compatibility.md): integers wrap around (two's complement);
// bool reduces as logical or for sum and max, logical and for min and prod.
#define PYCOMM_DTYPES(X)          \
  X(F32, 0, "float32", 4, Float)  \
  X(F64, 1, "float64", 8, Double) \
  X(F16, 2, "float16", 2, Half)   \
  X(BF16, 3, "bfloat16", 2, BFloat16) \
  X(I32, 4, "int32", 4, Int)      \
  X(I64, 5, "int64", 8, Long)     \
  X(U8, 6, "uint8", 1, Byte)      \
  X(I8, 7, "int8", 1, Char)       \
  X(I16, 8, "int16", 2, Short)    \
  X(BOOL, 9, "bool", 1, Bool)

#define PYCOMM_DTYPE_ENUM(e, v, n, s, st) e = v,
enum class DType : int32_t { PYCOMM_DTYPES(PYCOMM_DTYPE_ENUM) };
#undef PYCOMM_DTYPE_ENUM
enum class ReduceOp : int32_t { SUM = 0, MIN = 1, MAX = 2, PROD = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
#define PYCOMM_DTYPE_SIZE(e, v, n, s, st) \
  case DType::e: return s;
    PYCOMM_DTYPES(PYCOMM_DTYPE_SIZE)
#undef PYCOMM_DTYPE_SIZE
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
#define PYCOMM_DTYPE_NAME(e, v, n, s, st) \
  case DType::e: return n;
    PYCOMM_DTYPES(PYCOMM_DTYPE_NAME)
#undef PYCOMM_DTYPE_NAME
  }
  return "unknown";
}

// "float32, float64, ..." for error messages.
inline std::string dtype_list() {
  std::string out;
#define PYCOMM_DTYPE_LIST(e, v, n, s, st) out += std::string(out.empty() ? "" : ", ") + n;
  PYCOMM_DTYPES(PYCOMM_DTYPE_LIST)
#undef PYCOMM_DTYPE_LIST
  return out;
}

inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::SUM: return "sum";
    case ReduceOp::MIN: return "min";
    case ReduceOp::MAX: return "max";
    case ReduceOp::PROD: return "prod";
  }
  return "unknown";
}

inline bool is_floating(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::F16 || t == DType::BF16;
}

}  // namespace kernels
}  // namespace pycomm

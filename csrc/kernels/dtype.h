// Element types and reduction operators shared by every kernel and the engine.
// No torch or MPI here: the bindings map torch dtypes onto DType, the engine
// maps DType onto MPI datatypes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace pycomm {
namespace kernels {

enum class DType : int32_t { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I32 = 4, I64 = 5 };
enum class ReduceOp : int32_t { SUM = 0, MIN = 1, MAX = 2, PROD = 3 };

inline size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: return 4;
    case DType::F64: return 8;
    case DType::F16: return 2;
    case DType::BF16: return 2;
    case DType::I32: return 4;
    case DType::I64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::F64: return "float64";
    case DType::F16: return "float16";
    case DType::BF16: return "bfloat16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
  }
  return "unknown";
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

// DType/ReduceOp -> MPI_Datatype/MPI_Op. fp16 and bf16 have no MPI type in
// MPI-3, so they get committed 2-byte types and user-defined ops that call the
// pycomm reduce kernel (fp32 arithmetic, one rounding).
#pragma once
#include <mpi.h>

#include "common.h"

namespace pycomm {
namespace comm {

void mpi_types_init();      // after MPI_Init; idempotent
void mpi_types_finalize();  // before MPI_Finalize
MPI_Datatype mpi_datatype(DType dtype);
MPI_Op mpi_op(DType dtype, ReduceOp op);

}  // namespace comm
}  // namespace pycomm

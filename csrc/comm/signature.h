// Cross-rank agreement check. Before a collective every rank contributes a
// fixed-size description of its call (kind, dtype, shape, op, algorithm,
// root, name); one MPI_Allgather of these lets every rank see every other
// rank's call, so a disagreement raises the same error everywhere instead of
// a hang or silently mixed data.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

enum class Collective : int32_t { ALLREDUCE = 1, BROADCAST = 2, ALLGATHER = 3, BARRIER = 4 };

struct Signature {
  static constexpr int kMaxDims = 6;
  static constexpr int kNameLen = 48;
  int32_t kind = 0;
  int32_t dtype = -1;
  int32_t op = -1;         // ReduceOp, or -1
  int32_t algorithm = -1;  // Algorithm, or -1
  int32_t root = -1;
  int32_t ndim = 0;        // -1: shape not compared (allgather's first dimension may differ)
  int32_t extra = 0;       // average flag
  int32_t pad = 0;
  int64_t numel = 0;
  int64_t dims[kMaxDims] = {0};
  char name[kNameLen] = {0};

  void set_name(const std::string& n);
  std::string describe() const;  // e.g. "allreduce float16[1000, 3] op=sum algorithm=ring"
};

// Throws CommError on every rank (with the same message) if the ranks disagree.
void check_agreement(const Signature& mine, MPI_Comm comm, const char* what);

}  // namespace comm
}  // namespace pycomm

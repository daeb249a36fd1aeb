#include "signature.h"

#include <cstring>
#include <map>
#include <sstream>

#include "engine.h"

namespace pycomm {
namespace comm {

void Signature::set_name(const std::string& n) {
  std::memset(name, 0, sizeof name);
  std::memcpy(name, n.data(), std::min(n.size(), sizeof name - 1));
}

static const char* kind_name(int32_t kind) {
  switch (static_cast<Collective>(kind)) {
    case Collective::ALLREDUCE: return "allreduce";
    case Collective::BROADCAST: return "broadcast";
    case Collective::ALLGATHER: return "allgather";
    case Collective::BARRIER: return "barrier";
  }
  return "unknown";
}

std::string Signature::describe() const {
  std::ostringstream s;
  s << kind_name(kind);
  if (static_cast<Collective>(kind) == Collective::BARRIER) return s.str();
  if (name[0]) s << " '" << name << "'";
  s << " " << kernels::dtype_name(static_cast<DType>(dtype)) << "[";
  int shown = std::min(ndim, kMaxDims);
  for (int i = 0; i < shown; ++i) {
    if (i) s << ", ";
    if (i == 0 && numel < 0) s << "*";  // allgather: first dimension may differ
    else s << dims[i];
  }
  if (ndim > kMaxDims) s << ", ...";
  s << "]";
  if (ndim > kMaxDims) s << " (" << numel << " elements)";
  if (op >= 0) s << " op=" << (extra ? "avg" : kernels::reduce_op_name(static_cast<ReduceOp>(op)));
  if (algorithm >= 0) s << " algorithm=" << algorithm_name(static_cast<Algorithm>(algorithm));
  if (root >= 0) s << " root=" << root;
  return s.str();
}

void check_agreement(const Signature& mine, MPI_Comm comm, const char* what) {
  int rank = 0, size = 1;
  PYCOMM_MPI_CHECK(MPI_Comm_rank(comm, &rank));
  PYCOMM_MPI_CHECK(MPI_Comm_size(comm, &size));
  if (size == 1) return;
  std::vector<Signature> all(static_cast<size_t>(size));
  PYCOMM_MPI_CHECK(MPI_Allgather(&mine, sizeof(Signature), MPI_BYTE, all.data(), sizeof(Signature), MPI_BYTE, comm));
  bool agree = true;
  for (int r = 1; r < size && agree; ++r) agree = std::memcmp(&all[r], &all[0], sizeof(Signature)) == 0;
  if (agree) return;

  // Group ranks by what they passed; name each group once.
  std::map<std::string, std::vector<int>> groups;
  std::vector<std::string> order;
  for (int r = 0; r < size; ++r) {
    std::string d = all[r].describe();
    if (!groups.count(d)) order.push_back(d);
    groups[d].push_back(r);
  }
  std::ostringstream msg;
  msg << what << ": ranks disagree on the call: ";
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& ranks = groups[order[i]];
    if (i) msg << "; ";
    msg << (ranks.size() == 1 ? "rank " : "ranks ");
    for (size_t k = 0; k < ranks.size(); ++k) msg << (k ? "," : "") << ranks[k];
    msg << " passed " << order[i];
  }
  msg << ". Every rank must make the same collective calls in the same order (this is rank " << rank << ").";
  throw CommError(msg.str());
}

}  // namespace comm
}  // namespace pycomm

// Elastic mode (docs/elastic.md): what the engine does when a rank of the job dies.
//
// Under Open MPI's fault tolerance (ULFM, `mpirun --with-ft ulfm`) an MPI call
// that involves a dead process returns MPI_ERR_PROC_FAILED instead of ending
// the job, and a communicator revoked by any rank fails every pending and
// later call on it with MPI_ERR_REVOKED on every rank. pycomm's response:
//
//  - the first MPI call that sees a failure (throw_mpi_error, mpi_types.cpp)
//    revokes every communicator pycomm watches (the world, control, node and
//    cross-node communicators, and those of process groups), so that survivors
//    blocked on live peers are interrupted too, names the dead ranks and throws
//    RanksFailedError;
//  - the failure is remembered: every later coordination round throws the same
//    error at once (Coordinator::agree), so queued operations fail too;
//  - waits past their spin (Waiter::pause, wait_policy.h) drive MPI's progress
//    engine and look at its list of failed processes every kPollInterval, so
//    no wait outlives the failure by more than that: a wait on shared memory
//    makes no MPI call, and MPI learns of a death only inside one.
//
// Recovery (shrinking the world, starting a new engine) is pycomm.elastic's;
// it calls disable() and enable() around the new communicators.
#pragma once
#include <mpi.h>

#include <string>
#include <vector>

#include "common.h"

namespace pycomm {
namespace comm {

// Ranks of the job (pycomm's world communicator) have died. `ranks` are world ranks, sorted.
class RanksFailedError : public CommError {
 public:
  RanksFailedError(const std::string& what, std::vector<int> ranks) : CommError(what), ranks_(std::move(ranks)) {}
  const std::vector<int>& ranks() const { return ranks_; }

 private:
  std::vector<int> ranks_;
};

namespace fault {

// Whether this MPI was built with the ULFM extension (mpi-ext.h), and whether it is switched on in
// this process (Open MPI's MCA parameter mpi_ft_enable, set by `mpirun --with-ft ulfm`). Empty when
// both hold, else the reason it does not.
std::string ulfm_unavailable();

// Turn elastic mode on: failures on watched communicators become RanksFailedError naming ranks of
// `world`. Clears any remembered failure. `world` is watched too.
void enable(MPI_Comm world);
// Elastic mode off; forgets the watched communicators and any failure.
void disable();
bool enabled();
void watch(MPI_Comm comm);
void unwatch(MPI_Comm comm);

// An MPI return code that means a process failure or a revoked communicator.
bool is_failure(int rc);
// Revoke the watched communicators, name the dead ranks, remember and throw (`call`: the MPI call).
[[noreturn]] void raise(int rc, const char* call);
// A failure has been seen (by this process's engine).
bool failed();
// Throw the remembered failure, if any.
void check();
// In spin-waits: every kPollInterval at most, ask MPI whether a process of the world has failed; if
// one has, raise().
void poll();

}  // namespace fault
}  // namespace comm
}  // namespace pycomm

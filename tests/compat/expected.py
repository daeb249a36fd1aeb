"""What docs/compatibility.md documents about the two suites; tests/test_compat.py holds pycomm to it.

HOROVOD_FAILURES: tests of Horovod's test_torch.py that fail on pycomm, each with its cause.
GLOO_ONLY: tests of torch's DistributedTest that gloo passes and that do not run on pycomm, with the reason.
"""

_MUON = ("torch 2.13's optim.Muon rejects 1-D parameters (the test builds every torch optimizer); Horovod "
         "itself fails it the same way")
_BY_NAME = ("the test submits an operation on rank 0 before hvd.barrier() and on the other ranks after it; "
            "Horovod pairs operations by name in any order, pycomm's engine by submission order, so the ranks "
            "disagree (CommError on every rank). The duplicate-name ValueError itself is raised.")
_AFTER_DUP = ("may fail only as the test run right after a *_duplicate_name_error test in the same job: it stalls "
              "on the operation that test leaves queued on one rank; alone it passes")
_THREE = ("at 3 ranks: a result one rounding step (at most 2e-4) from the test's reference, which it compares "
          "with tolerance 0 up to 3 ranks; the cause (which dtype's rounding order) is not isolated yet")
_JOIN = ("Horovod raises on allgather and broadcast while a rank has joined; pycomm's joined ranks answer "
         "them (pycomm.join's documented semantics), so the call succeeds")

HOROVOD_FAILURES = {
    "test_broadcast_state": _MUON,
    "test_broadcast_state_options": _MUON,
    "test_force_allreduce": _MUON,
    "test_horovod_allgather_duplicate_name_error": _BY_NAME,
    "test_horovod_allreduce_duplicate_name_error": _BY_NAME,
    "test_horovod_broadcast_duplicate_name_error": _BY_NAME,
    "test_horovod_reducescatter_duplicate_name_error": _BY_NAME,
    # Collateral: the *_error test that runs right after a duplicate-name test in the same job may stall
    # on the operation that test left queued on one rank (which one varies from run to run); alone each
    # passes (every rank gets pycomm's disagreement error).
    "test_horovod_allgather_error": _AFTER_DUP,
    "test_horovod_allreduce_error": _AFTER_DUP,
    "test_horovod_broadcast_error": _AFTER_DUP,
    "test_horovod_reducescatter_error": _AFTER_DUP,
    # At 3 ranks only (2 ranks pass them); not compared with Horovod itself at 3 ranks.
    "test_horovod_allreduce_prescale": _THREE,
    "test_horovod_reducescatter_prescale": _THREE,
    "test_horovod_grouped_reducescatter_prescale": _THREE,
    "test_horovod_join_allreduce": ("at 3 ranks: pycomm averages as Horovod's engine does, the sum times 1/N, "
                                    "which differs by one rounding step from the test's reference "
                                    "t * (N - 1) / N (a division), compared with tolerance 0 up to 3 ranks"),
    "test_horovod_join_allgather": _JOIN,
    "test_horovod_join_broadcast": _JOIN,
}

GLOO_ONLY = {
    "test_accumulate_gradients_no_sync": ("gloo-only by name: the test builds its model only `if BACKEND == "
                                          "'mpi' or BACKEND == 'gloo'` (else UnboundLocalError); pycomm runs DDP's "
                                          "no_sync in test_grads_same_across_ranks_with_no_sync, which passes"),
    "test_accumulate_gradients_no_sync_allreduce_hook": "as test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": "as test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_grad_is_view": "as test_accumulate_gradients_no_sync",
    "test_barrier_timeout_full_group": ("not offered: gloo's per-call barrier timeout (the test expects a barrier "
                                        "to raise after 1 s); pycomm's stall watchdog (PYCOMM_STALL_WARNING_S, "
                                        "PYCOMM_STALL_ABORT_S) bounds every wait instead"),
    "test_monitored_barrier_gloo": ("torch's dist.monitored_barrier() accepts gloo only (ValueError); pycomm "
                                    "offers the monitored barrier on its backend object "
                                    "(tests/parallel/test_c10d.py::test_monitored_barrier_names_the_late_rank)"),
    "test_monitored_barrier_gloo_subgroup": "as test_monitored_barrier_gloo",
    "test_ddp_logging_data_cpu": ("not gloo-only: torch's ProcessGroup reports a backend registered through "
                                  "Backend.register_backend as 'custom' in DDP's logging data, where the test "
                                  "expects the name given to init_process_group ('pycomm'); the name comes from "
                                  "torch, not from the backend"),
}

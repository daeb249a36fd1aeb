"""What docs/compatibility.md documents about the two suites; tests/test_compat.py holds pycomm to it.

HOROVOD_FAILURES: tests of Horovod's test_torch.py that fail on pycomm, each with its cause; every one of
them fails on Horovod itself too.
GLOO_ONLY: tests of torch's DistributedTest that gloo passes and that do not run on pycomm, with the reason.
"""

_MUON = ("torch 2.13's optim.Muon rejects 1-D parameters (the test builds every torch optimizer); Horovod "
         "itself fails it the same way")
HALF_AT_3 = ("at 3 ranks, for float16 only: the test compares the fp16 result with the exact float32 value "
              "3 * h (h the prescaled fp16 input, the same on every rank) with tolerance 0, and 3 * h needs up "
              "to 13 significant bits where fp16 has 11, so no fp16 result can equal it "
             "(for test_horovod_allreduce_prescale's data, 142 of the 200 possible inputs); Horovod's fp16 sum "
             "returns fp16 too, so it fails the same way. "
              "2 and 4 ranks pass")

# Every failure left, each with its cause. Each one fails on Horovod itself as well.
HOROVOD_FAILURES = {
    "test_broadcast_state": _MUON,
    "test_broadcast_state_options": _MUON,
    "test_force_allreduce": _MUON,
    "test_horovod_allreduce_prescale": HALF_AT_3,
    "test_horovod_reducescatter_prescale": HALF_AT_3,
    "test_horovod_grouped_reducescatter_prescale": HALF_AT_3,
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

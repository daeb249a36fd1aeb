"""What docs/compatibility.md documents about the two suites; tests/test_compat.py holds pycomm to it.

HOROVOD_FAILURES: tests of Horovod's test_torch.py that fail on pycomm, each with its cause.
GLOO_ONLY: tests of torch's DistributedTest that gloo passes and pycomm does not run, with the reason.
"""

HOROVOD_FAILURES = {
}

GLOO_ONLY = {
}

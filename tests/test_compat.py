"""Other people's test suites on pycomm (bench/compat.py; docs/compatibility.md).

- Horovod's test_torch.py, unchanged, with `horovod.torch` resolving to
  pycomm.horovod: every failure is one that docs/compatibility.md names with
  its cause and that Horovod itself fails too (tests/compat/expected.py), and
  at least 97% of the rest pass.
- torch's DistributedTest with backend "pycomm": every test that gloo passes
  in the same harness, at the same world size, passes too, except the
  gloo-only tests listed with their reasons.

World sizes: PYCOMM_COMPAT_RANKS (CI: 2,3,4; `make compat` prints 2, 3 and 4; torch's
suite runs at the sizes up to 3). Without it the file skips: the suites take
minutes, so `make test` leaves them to CI and `make compat`. The Horovod suite comes from ../shared/peer/horovod;
where it is absent the test skips and says why.
"""
import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "compat"))
_spec = importlib.util.spec_from_file_location("pycomm_bench_compat",
                                               os.path.join(os.path.dirname(HERE), "bench", "compat.py"))
compat = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compat)

from expected import GLOO_ONLY, HALF_AT_3, HOROVOD_FAILURES  # noqa: E402  (tests/compat/expected.py)

RANKS = [int(n) for n in os.environ.get("PYCOMM_COMPAT_RANKS", "").split(",") if n]
pytestmark = pytest.mark.skipif(not RANKS, reason="set PYCOMM_COMPAT_RANKS=2,3,4 to run other projects' suites "
                                                   "(CI does; see docs/compatibility.md)")
TORCH_RANKS = [n for n in RANKS if n <= 3]


def _log(msg):
    print(msg, flush=True)


def _failed(res):
    return {t: m for t, (o, m) in res.items() if o == "failed"}


@pytest.mark.mpi
@pytest.mark.parametrize("np", RANKS)
def test_horovod_suite(np):
    why = compat.horovod_missing()
    if why:
        pytest.skip(why)
    res = compat.run_suite("horovod", np, job_timeout=1800, test_timeout=180, log=_log)
    ran = [o for o, _ in res.values() if o != "skipped"]
    passed = ran.count("passed")
    failed = _failed(res)
    unexplained = {t: m for t, m in failed.items() if t not in HOROVOD_FAILURES}
    assert not unexplained, (f"Horovod's suite at {np} ranks: failures not named in docs/compatibility.md "
                             f"(tests/compat/expected.py):\n" + "\n".join(f"{t}: {m[-400:]}" for t, m in
                                                                         sorted(unexplained.items())))
    assert ran, f"Horovod's suite at {np} ranks ran no test"
    # 97% of the tests that run, as on Horovod itself (100 of 103 at 2 ranks). At 3 ranks three fp16
    # tests cannot pass on any implementation (expected.HALF_AT_3): they leave the count there.
    arithmetic = [t for t in failed if HOROVOD_FAILURES[t] is HALF_AT_3]
    counted = len(ran) - len(arithmetic)
    _log(f"Horovod's suite at {np} ranks: {passed} of {len(ran)} pass; {passed} of {counted} without the "
         f"fp16 tests no implementation passes")
    assert passed / counted >= 0.97, f"{passed} of {counted} Horovod tests pass at {np} ranks, below 97%"


@pytest.mark.mpi
@pytest.mark.parametrize("np", TORCH_RANKS)
def test_torch_distributed_suite(np):
    gloo = compat.run_suite("torch-gloo", np, job_timeout=1800, test_timeout=120, log=_log)
    mine = compat.run_suite("torch", np, job_timeout=1800, test_timeout=120, log=_log)
    gloo_passed = {t for t, (o, _) in gloo.items() if o == "passed"}
    missing = {t: mine.get(t, ("absent", ""))[1] or mine.get(t, ("absent", ""))[0]
               for t in gloo_passed if mine.get(t, ("absent", ""))[0] != "passed" and t not in GLOO_ONLY}
    assert not missing, (f"torch's DistributedTest at {np} ranks: gloo passes these, pycomm does not:\n" +
                         "\n".join(f"{t}: {m[-400:]}" for t, m in sorted(missing.items())))

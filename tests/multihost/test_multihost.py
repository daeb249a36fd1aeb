"""pycomm across two emulated hosts joined by a 1 Gbit/s shaped link (pycomm-testbed).

One job of 2 hosts x 2 ranks runs tests/multihost/rank_checks.py; the tests
here read its report. Skipped, with the reason, where a bed cannot be made
(not root, no network namespaces, no iproute2).
"""
import json
import os
import sys
import time

import pytest

from pycomm import collectives
from pycomm.tools import testbed

HOSTS, RANKS_PER_HOST, LINK_GBPS = 2, 2, 1.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANK_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_checks.py")
MPI_PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_probe.py")

_ok, _why = testbed.available()
if not _ok:
    pytest.skip(f"multi-host test bed unavailable: {_why}", allow_module_level=True)

ALGORITHMS = tuple(collectives.ALLREDUCE_ALGORITHMS)
COMPRESSIONS = tuple(getattr(collectives, "COMPRESSIONS", ("none",)))
# Bytes a host must send across the link per allreduce of S bytes, as a multiple of S.
# Flat ring over 2x2 (ranks 0,1 | 2,3): the ring crosses the link once each way and every rank
# sends 2(N-1)/N S = 1.5 S. Hierarchical forms move 2(M-1)/M S = S. Any allreduce between 2 hosts
# moves at least S each way: that lower bound applies to the rest (mpi, auto).
LINK_FACTOR = {"ring": 1.5, "hierarchical": 1.0, "hierarchical_master": 1.0}
# Where the model knows the bytes, also bound them from above: TCP/IP and Ethernet headers, the ACKs
# of the other direction and retransmissions on the shaped link add to the model's bytes. Measured
# over 12 runs of this file on a 2-core machine (sent / model): hierarchical 1.061-1.123,
# hierarchical_master 1.048-1.079, ring 1.048-1.088; one CI run saw hierarchical at 1.155. A bound of
# 1.25 stays clear of that spread and still fails traffic that crosses the link a second time (1.5x).
UPPER_MARGIN = 1.25
# Fraction of the uncompressed bytes a compression puts on the wire (lower bound; a compression not
# listed here is checked for correctness only).
WIRE_FRACTION = {"none": 1.0, "fp16": 0.5, "bf16": 0.5, "onebit": 1 / 32}


# Algorithms that reduce within one node only: across hosts they must refuse, naming the problem.
SINGLE_NODE_ALGORITHMS = {"shm"}


def _entry(report, algorithm, compression):
    entry = report["checks"][f"{algorithm}/{compression}"]
    if "unsupported" in entry:
        pytest.skip(f"{algorithm} with {compression}: {entry['unsupported']}")
    if algorithm in SINGLE_NODE_ALGORITHMS:
        assert "refused" in entry and "node" in entry["refused"], entry
        pytest.skip(f"{algorithm} is single-node; refused as expected: {entry['refused']}")
    assert "refused" not in entry, f"{algorithm}/{compression} failed across hosts: {entry.get('refused')}"
    return entry


def expected_link_bytes(algorithm: str, compression: str, nbytes: int) -> float:
    return LINK_FACTOR.get(algorithm, 1.0) * WIRE_FRACTION.get(compression, 0.0) * nbytes


@pytest.fixture(scope="module")
def report():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["PYCOMM_RANKS_PER_NODE"] = "1"  # the bed must not pass it on: nodes come from MPI there
    t0 = time.monotonic()
    with testbed.Testbed(hosts=HOSTS, link_gbps=LINK_GBPS) as bed:
        before = bed.link_bytes()
        res = bed.run(HOSTS * RANKS_PER_HOST, [sys.executable, RANK_PROGRAM], ranks_per_host=RANKS_PER_HOST,
                      env=env, timeout=300, capture=True, cwd=ROOT)
        after = bed.link_bytes()
    out = res.stdout or ""
    lines = [ln for ln in out.splitlines() if ln.startswith("MULTIHOST-RESULT ")]
    if res.returncode != 0 or not lines:
        pytest.fail(f"the job across the bed failed (exit {res.returncode}):\n{out[-12000:]}", pytrace=False)
    data = json.loads(lines[-1][len("MULTIHOST-RESULT "):])
    data["outside"] = {h: after[h] - before[h] for h in before}
    data["seconds"] = time.monotonic() - t0
    print(f"\nmulti-host job: {data['seconds']:.1f} s; bytes sent per host over the links: {data['outside']}")
    for key, entry in data["checks"].items():
        sent = entry.get("sent_by_host")
        ratio = ", ".join(f"{s / data['link_bytes']:.3f}" for s in sent) if sent else "-"
        note = entry.get("error") or entry.get("unsupported") or entry.get("refused") or ""
        print(f"  {key:<24} link bytes per host / S: {ratio}  {note}")
    return data


def test_topology_is_two_nodes_from_mpi(report):
    ranks = sorted(report["ranks"], key=lambda r: r["rank"])
    assert len(ranks) == HOSTS * RANKS_PER_HOST
    for r in ranks:
        assert r["ranks_per_node_env"] is None, "PYCOMM_RANKS_PER_NODE reached the ranks"
        assert not r["virtual_nodes"]
        assert r["num_nodes"] == HOSTS, f"rank {r['rank']} sees {r['num_nodes']} nodes"
        assert r["local_size"] == RANKS_PER_HOST
        assert r["node_rank"] == r["rank"] // RANKS_PER_HOST
        assert r["local_rank"] == r["rank"] % RANKS_PER_HOST
    hosts = [r["host"] for r in ranks]
    assert hosts[0] == hosts[1] != hosts[2] == hosts[3], f"hostnames {hosts}"


def _check_result(entry):
    assert entry["error"] is None, entry["error"]


def _check_traffic(entry, algorithm, compression, nbytes):
    want = expected_link_bytes(algorithm, compression, nbytes)
    sent = entry["sent_by_host"]
    assert len(sent) == HOSTS
    for host, got in enumerate(sent):
        assert got >= want, (f"host {host} sent {got} bytes through its shaped link during an allreduce of "
                             f"{nbytes} bytes with {algorithm}/{compression}; expected at least {want:.0f} "
                             "(traffic bypassed the link?)")
        if algorithm in LINK_FACTOR and compression == "none":
            assert got <= want * UPPER_MARGIN, (f"host {host} sent {got / nbytes:.3f} S over its link with "
                                                f"{algorithm}/{compression}; the model says {want / nbytes:.3f} S")


def _compressed_entries(report, compression):
    """(algorithm, entry) for every algorithm that takes this compression; at least one must."""
    out, refusals = [], []
    for algorithm in ALGORITHMS:
        entry = report["checks"][f"{algorithm}/{compression}"]
        if "unsupported" in entry:
            refusals.append(f"{algorithm}: {entry['unsupported']}")
            continue
        if algorithm in SINGLE_NODE_ALGORITHMS and "refused" in entry:
            continue
        assert "refused" not in entry, f"{algorithm}/{compression} failed across hosts: {entry['refused']}"
        out.append((algorithm, entry))
    assert out, f"no allreduce algorithm takes compression {compression}:\n" + "\n".join(refusals)
    return out


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_allreduce_matches_mpi4py(report, algorithm):
    _check_result(_entry(report, algorithm, "none"))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_traffic_crossed_the_shaped_link(report, algorithm):
    _check_traffic(_entry(report, algorithm, "none"), algorithm, "none", report["link_bytes"])


@pytest.mark.parametrize("compression", [c for c in COMPRESSIONS if c != "none"])
def test_compressed_allreduce_matches_mpi4py(report, compression):
    """Every algorithm that takes the compression (combinations refused up front are listed in the job log)."""
    for algorithm, entry in _compressed_entries(report, compression):
        _check_result(entry)


@pytest.mark.parametrize("compression", [c for c in COMPRESSIONS if c != "none"])
def test_compressed_traffic_crossed_the_shaped_link(report, compression):
    for algorithm, entry in _compressed_entries(report, compression):
        _check_traffic(entry, algorithm, compression, report["link_bytes"])


def test_link_counters_seen_from_outside(report):
    """The root namespace's view of the qdisc counters covers every measured allreduce."""
    total = sum(expected_link_bytes(k.split("/")[0], k.split("/")[1], report["link_bytes"])
                for k, e in report["checks"].items() if "sent_by_host" in e)
    for host, sent in report["outside"].items():
        assert sent >= total, f"{host} sent {sent} bytes, expected at least {total:.0f}"


@pytest.mark.skipif(not os.environ.get("PYCOMM_TEST_MPICH_PREFIX"),
                    reason="set PYCOMM_TEST_MPICH_PREFIX to an environment with mpi4py on MPICH (bin/python, "
                           "bin/mpiexec) to check the hydra launch across the bed")
def test_mpich_launch_crosses_the_link():
    prefix = os.environ["PYCOMM_TEST_MPICH_PREFIX"]
    with testbed.Testbed(hosts=HOSTS, link_gbps=LINK_GBPS) as bed:
        res = bed.run(HOSTS * RANKS_PER_HOST, [os.path.join(prefix, "bin", "python"), MPI_PROBE],
                      ranks_per_host=RANKS_PER_HOST, launcher=os.path.join(prefix, "bin", "mpiexec"),
                      timeout=120, capture=True)
    lines = [ln for ln in (res.stdout or "").splitlines() if ln.startswith("MPI-PROBE ")]
    assert res.returncode == 0 and lines, res.stdout[-8000:]
    probe = json.loads(lines[-1][len("MPI-PROBE "):])
    assert "MPICH" in probe["library"], probe["library"]
    assert probe["correct"]
    assert probe["local_sizes"] == [RANKS_PER_HOST] * (HOSTS * RANKS_PER_HOST)
    assert len(set(probe["hosts"])) == HOSTS
    for got in probe["sent_by_host"]:
        assert got >= probe["bytes"], f"a host sent {got} bytes for an Allreduce of {probe['bytes']}: shared memory?"

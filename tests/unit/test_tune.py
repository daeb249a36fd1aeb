"""pycomm-tune's table: crossovers from measured winners, and loading only what fits the topology."""
import json

from pycomm.runtime import Topology
from pycomm.tools.tune import available_algorithms, crossover_table, load_table, table_path


def topo(**kw):
    base = dict(rank=0, size=4, local_rank=0, local_size=2, node_rank=0, num_nodes=2, homogeneous=True,
                virtual_nodes=True)
    base.update(kw)
    return Topology(**base)


def test_crossover_merges_neighbours_and_covers_everything_above():
    best = [(1024, "mpi"), (4096, "mpi"), (16384, "ring"), (65536, "hierarchical"), (262144, "hierarchical")]
    assert crossover_table(best) == [(4096, "mpi"), (16384, "ring"), (2 ** 62, "hierarchical")]


def test_available_algorithms_follow_topology():
    assert "hierarchical" in available_algorithms(topo())
    assert "shm" not in available_algorithms(topo())
    assert "shm" in available_algorithms(topo(num_nodes=1, local_size=4))
    assert "hierarchical" not in available_algorithms(topo(homogeneous=False))


def test_load_table_checks_what_it_reads(tmp_path, monkeypatch):
    monkeypatch.setenv("PYCOMM_TUNE_DIR", str(tmp_path))
    t = topo()
    assert load_table(t) is None
    path = table_path(t)
    with open(path, "w") as f:
        json.dump(dict(version=1, virtual_nodes=True, table=[[4096, "mpi"], [2 ** 62, "hierarchical"]]), f)
    assert load_table(t) == [(4096, "mpi"), (2 ** 62, "hierarchical")]
    with open(path, "w") as f:  # shm cannot run across nodes: the file is not for this topology
        json.dump(dict(version=1, virtual_nodes=True, table=[[2 ** 62, "shm"]]), f)
    assert load_table(t) is None
    with open(path, "w") as f:
        f.write("not json")
    assert load_table(t) is None

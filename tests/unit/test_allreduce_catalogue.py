"""The allreduce catalogue (csrc/comm/allreduce_catalogue.cpp) is the one list of algorithms:
the Python validators, the cost model and pycomm-tune read it through _C."""
import itertools

import pytest
import torch

import pycomm
from pycomm import _C, _ops, auto_choice, cost_model

NAMES = [entry["name"] for entry in _C.allreduce_algorithms()]


def offered_by_rule(ranks, nodes, homogeneous):
    """The shapes each algorithm was written for, stated independently of the table:
    shm needs one node of at least two ranks, the hierarchical forms nodes of equal size
    and more than one node; ring and mpi run anywhere."""
    out = {"ring", "mpi"}
    if nodes == 1 and ranks > 1:
        out.add("shm")
    if nodes > 1 and homogeneous:
        out |= {"hierarchical", "hierarchical_master"}
    return out


def test_entries_are_named_and_described():
    assert len(NAMES) == len(set(NAMES)) >= 5
    for entry in _C.allreduce_algorithms():
        assert entry["name"] and entry["summary"], entry
        assert entry["phase"].endswith("_ALLREDUCE"), entry
        assert entry["window_fusion"] in ("none", "local", "cross"), entry


def test_python_validators_read_the_catalogue():
    assert _ops.ALLREDUCE_ALGORITHMS == ("auto", *NAMES)


def test_cost_model_has_a_formula_for_every_entry():
    assert set(cost_model.ALGORITHMS) == set(NAMES)
    m = cost_model.Machine(alpha=2e-6, beta=1e-10, gamma=2e-10, delta=1e-10, sync=1e-6, alpha_x=2e-5,
                           beta_x=8e-10, kappa=1e-10, omega=1e-10)
    for name in NAMES:
        nodes = 1 if _C.allreduce_refusal(name, 4, 2, 2, True) else 2  # each on a shape it runs on
        assert cost_model.predict(name, 1 << 20, m, ranks=4, nodes=nodes) > 0, name


def test_cost_model_has_a_formula_for_every_compression():
    assert set(cost_model.COMPRESSED) == set(_C.engine_compressions())
    m = cost_model.Machine(alpha=2e-6, beta=1e-10, gamma=2e-10, delta=1e-10, sync=1e-6, alpha_x=2e-5,
                           beta_x=8e-10, kappa=1e-10, omega=1e-10)
    plain = cost_model.predict("ring", 1 << 20, m, ranks=4, nodes=2)
    for name in cost_model.COMPRESSED:  # each adds its casts or compression passes to a ring of fewer bytes
        assert cost_model.predict(name, 1 << 20, m, ranks=4, nodes=2) > 0, name
    assert cost_model.predict("fp16", 1 << 20, m, ranks=4, nodes=2) != plain


@pytest.mark.parametrize("ranks,nodes,homogeneous", [
    (1, 1, True), (2, 1, True), (4, 1, True), (4, 2, True), (2, 2, True), (8, 2, True), (5, 2, False), (3, 2, False)])
def test_offered_matches_the_shapes_each_algorithm_needs(ranks, nodes, homogeneous):
    local = ranks // nodes
    offered = _C.allreduce_offered(ranks, nodes, local, homogeneous)
    assert set(offered) == offered_by_rule(ranks, nodes, homogeneous)
    assert offered == [n for n in NAMES if n in offered]  # catalogue order
    if homogeneous:
        assert set(cost_model.available(ranks, nodes)) == set(offered)
    topo = pycomm.Topology(rank=0, size=ranks, local_rank=0, local_size=local, node_rank=0, num_nodes=nodes,
                           homogeneous=homogeneous, virtual_nodes=nodes > 1)
    assert auto_choice.available_algorithms(topo) == offered


def test_refusals_name_the_reason():
    for name, (ranks, nodes, local, homogeneous) in itertools.product(NAMES, [(4, 2, 2, True), (5, 2, 3, False)]):
        why = _C.allreduce_refusal(name, ranks, nodes, local, homogeneous)
        runs = name in ("ring", "mpi") or (name.startswith("hierarchical") and homogeneous)
        assert (why == "") == runs, (name, why)
        if why:
            assert f"'{name}'" in why
    assert _C.allreduce_refusal("auto", 5, 2, 3, False) == ""


def test_unknown_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="choose auto, ring, mpi"):
        _C.allreduce_refusal("butterfly", 4, 1, 4, True)
    pycomm.init()
    with pytest.raises(ValueError, match="hierarchical_master"):
        _C.set_options({"auto_table": [(1024, "butterfly")]})
    with pytest.raises(ValueError, match="butterfly"):
        pycomm.allreduce(torch.ones(3), algorithm="butterfly")

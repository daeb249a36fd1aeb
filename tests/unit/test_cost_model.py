"""pycomm.cost_model: each formula against values computed by hand from the module's equations.

The expected numbers below are exact decimal results of the stated arithmetic; the only error is
float64 rounding (a few ulp), hence rel=1e-12.
"""
import json

import pytest

from pycomm import cost_model
from pycomm.cost_model import Machine, predict

M = Machine(alpha=1e-6, beta=1e-9, gamma=2e-10, delta=1e-10, sync=3e-6, alpha_x=1e-5, beta_x=8e-9,
            kappa=5e-11, omega=4e-10)
S = 1 << 20  # 1,048,576 bytes


def approx(x):
    return pytest.approx(x, rel=1e-12)


def test_ring():
    # 2*3*1e-6 + 2*3/4*S*1e-9 + 3/4*S*2e-10 = 6e-6 + 1.572864e-3 + 1.572864e-4
    assert predict("ring", S, M, ranks=4) == approx(1.7361504e-3)


def test_ring_across_nodes_uses_the_slow_link():
    # 2*3*1e-5 + 2*3/4*S*8e-9 + 3/4*S*2e-10 = 6e-5 + 1.2582912e-2 + 1.572864e-4
    assert predict("ring", S, M, ranks=4, nodes=2) == approx(1.28001984e-2)


def test_mpi_takes_the_cheaper_of_doubling_and_rabenseifner():
    # 8 B, 4 ranks: doubling 2*(1e-6 + 8e-9 + 1.6e-9) = 2.0192e-6; Rabenseifner 4e-6 + 1.2e-8 + 1.2e-9
    assert predict("mpi", 8, M, ranks=4) == approx(2.0192e-6)
    # 1 MiB: doubling 2*(1e-6 + 1.048576e-3 + 2.097152e-4) = 2.5185824e-3;
    # Rabenseifner 4e-6 + 1.572864e-3 + 1.572864e-4 = 1.7341504e-3
    assert predict("mpi", S, M, ranks=4) == approx(1.7341504e-3)


def test_shm():
    # 3*3e-6 + 3/2*S*1e-10 + 1/2*S*2e-10 = 9e-6 + 1.572864e-4 + 1.048576e-4
    assert predict("shm", S, M, ranks=2) == approx(2.71144e-4)


def test_shm_one_fence_up_to_32_kib():
    # 4 ranks, 32 KiB: 3e-6 + 32768*1e-10 + 3*32768*2e-10 (gamma_c unset: gamma) = 3e-6 + 3.2768e-6 + 1.96608e-5
    assert predict("shm", 32 << 10, M, ranks=4) == approx(2.593760e-5)
    # one byte more: the three-fence form, 9e-6 + 7/4*32769*1e-10 + 3/4*32769*2e-10
    assert predict("shm", (32 << 10) + 1, M, ranks=4) == approx(9e-6 + 5.734575e-6 + 4.91535e-6)


def test_shm_chunk_by_chunk_above_the_pipeline_threshold():
    Mc = Machine(**{**M.to_dict(), "gamma_c": 5e-11})
    # 2 ranks, S = 1 MiB in 256 KiB chunks, chunked above 512 KiB: (2*4 + 1)*3e-6 + S*1e-10 + 1/2*S*5e-11
    assert predict("shm", S, Mc, ranks=2, shm_chunk_bytes=256 << 10, shm_chunked_above=512 << 10) == approx(
        2.7e-5 + 1.048576e-4 + 2.62144e-5)
    # at or below the threshold, or with chunking off: the one-pass form
    assert predict("shm", S, Mc, ranks=2, shm_chunk_bytes=256 << 10, shm_chunked_above=S) == approx(2.71144e-4)
    assert predict("shm", S, Mc, ranks=2, shm_chunk_bytes=0, shm_chunked_above=512 << 10) == approx(2.71144e-4)


def test_gamma_c_is_optional_in_stored_constants():
    old = {k: v for k, v in M.to_dict().items() if k != "gamma_c"}  # stored before gamma_c existed
    m = Machine.from_dict(old)
    assert m.gamma_c is None and m.gamma_cache == m.gamma
    assert Machine.from_dict({**old, "gamma_c": 1e-11}).gamma_cache == 1e-11
    with pytest.raises(ValueError, match="gamma_c must be a finite number >= 0"):
        Machine(**{**M.to_dict(), "gamma_c": float("nan")})


def test_hierarchical():
    # shm part (L=2) 3.235728e-4 + ring of S/2 over 2 nodes: 2e-5 + 524288*8e-9 + 1/2*524288*2e-10
    assert predict("hierarchical", S, M, ranks=4, nodes=2) == approx(3.235728e-4 + 2e-5 + 4.194304e-3 + 5.24288e-5)


def test_hierarchical_master():
    # shm part 3.235728e-4 + sync 3e-6 + collect 1/2*S*1e-10 + ring of S over 2 masters: 2e-5 + S*8e-9 + 1/2*S*2e-10
    assert predict("hierarchical_master", S, M, ranks=4, nodes=2) == approx(
        3.235728e-4 + 3e-6 + 5.24288e-5 + 2e-5 + 8.388608e-3 + 1.048576e-4)


def test_one_rank_per_node_hierarchical_is_the_ring_across_nodes():
    assert predict("hierarchical", S, M, ranks=2, nodes=2) == approx(2e-5 + S * 8e-9 + S / 2 * 2e-10)


def test_fp16_and_onebit():
    # fp16, 2 ranks: 2*S*5e-11 + ring(S/2, 2) = 1.048576e-4 + 2e-6 + 5.24288e-4 + 5.24288e-5
    assert predict("fp16", S, M, ranks=2) == approx(6.835744e-4)
    assert predict("bf16", S, M, ranks=2) == predict("fp16", S, M, ranks=2)
    # onebit, 4 ranks: 6e-6 + 2*3/4*(S/32 + 16)*1e-9 + 2.5*S*4e-10 + S/4*2e-10
    assert predict("onebit", S, M, ranks=4) == approx(6e-6 + 4.9176e-5 + 1.048576e-3 + 5.24288e-5)


def test_nothing_to_do_costs_nothing():
    assert predict("ring", S, M, ranks=1) == 0.0
    assert predict("shm", 0, M, ranks=4) == 0.0


def test_best_and_auto_table_follow_the_crossover():
    # mpi: 2.0192e-6 at 8 B beats shm's 9e-6 of fences; at 1 MiB shm (2.7e-4) beats mpi (1.7e-3).
    assert cost_model.best(8, M, ranks=4)[0] == "mpi"
    assert cost_model.best(S, M, ranks=4)[0] == "shm"
    table = cost_model.auto_table(M, ranks=4, min_bytes=8, max_bytes=1 << 24)
    assert [a for _, a in table] == ["mpi", "shm"]
    assert table[-1][0] == 2 ** 62
    # The crossover: the largest size where mpi still wins, and the next one where shm does.
    cut = table[0][0]
    assert predict("mpi", cut, M, 4) <= predict("shm", cut, M, 4)
    assert predict("shm", 2 * cut, M, 4) < predict("mpi", 2 * cut, M, 4)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown algorithm 'tree'"):
        predict("tree", S, M, ranks=4)
    with pytest.raises(ValueError, match="'shm' runs on one node only"):
        predict("shm", S, M, ranks=4, nodes=2)
    with pytest.raises(ValueError, match="3 ranks on 2 nodes"):
        predict("ring", S, M, ranks=3, nodes=2)
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        Machine(**{**M.to_dict(), "beta": -1.0})
    with pytest.raises(ValueError, match="missing omega"):
        Machine.from_dict({k: v for k, v in M.to_dict().items() if k != "omega"})


def test_stored_constants_round_trip(tmp_path, monkeypatch):
    from pycomm import auto_choice

    monkeypatch.setenv("PYCOMM_TUNE_DIR", str(tmp_path))
    assert auto_choice.load_model() is None
    with open(auto_choice.model_path(), "w") as f:
        json.dump(dict(version=auto_choice.TUNE_VERSION, constants=M.to_dict()), f)
    assert auto_choice.load_model() == M
    with open(auto_choice.model_path(), "w") as f:
        json.dump(dict(version=auto_choice.TUNE_VERSION + 1, constants=M.to_dict()), f)
    assert auto_choice.load_model() is None  # stale


def test_measuring_is_a_tool():
    from pycomm.tools import machine, tune

    assert tune.measure_machine is machine.measure
    with pytest.raises(AttributeError, match="moved to pycomm.tools.machine.measure"):
        cost_model.measure

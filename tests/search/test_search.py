"""Search algorithms against brute-force enumeration; ties, memory, determinism, errors."""

import itertools

import jax
import numpy as np
import pytest

import sbpjax as sj
import sbpjax.search as ss


def _small():
    return ss.mlp("mlp", 256, [512, 256, 128, 64]), ss.Grid(16, "x")


def _brute(ops, grid, memory=None):
    """Every assignment priced from the strategy's own per-layer breakdown."""
    memory = memory or ss.MemoryModel()
    t = ss.tables_for(ops, grid, memory=memory)
    best = None
    for combo in itertools.product(*t.options):
        st = ss.evaluate(ops, grid, dict(zip(t.groups, combo)), tables=t)
        if memory.limit is not None and st.memory > memory.limit:
            continue
        if best is None or st.cost < best.cost:
            best = st
    return best


def test_exhaustive_finds_the_brute_force_optimum():
    ops, grid = _small()
    want = _brute(ops, grid)
    got = ss.search(ops, grid, method="exhaustive")
    assert got.cost == pytest.approx(want.cost, rel=1e-12)
    assert got.time == pytest.approx(sum(lp.redistribution.time + lp.sync.time for lp in got.layers))


@pytest.mark.parametrize("method", ["coordinate_descent", "metropolis_hastings"])
def test_heuristics_are_deterministic_and_near_the_optimum(method):
    ops, grid = _small()
    opt = ss.search(ops, grid, method="exhaustive").cost
    a = ss.search(ops, grid, method=method, seed=3)
    b = ss.search(ops, grid, method=method, seed=3)
    assert [lp.choice for lp in a.layers] == [lp.choice for lp in b.layers]
    assert a.cost == b.cost
    assert a.cost <= 1.01 * opt


def test_memory_limit_is_respected():
    ops, grid = _small()
    free = ss.search(ops, grid, method="exhaustive")
    limit = 0.5 * free.memory
    mm = ss.MemoryModel(limit=limit)
    want = _brute(ops, grid, mm)
    for method in ss.METHODS:
        st = ss.search(ops, grid, method=method, memory=mm)
        assert st.memory <= limit
    assert ss.search(ops, grid, method="exhaustive", memory=mm).cost == pytest.approx(want.cost, rel=1e-12)
    with pytest.raises(sj.SBPError, match="memory limit"):
        ss.search(ops, grid, memory=ss.MemoryModel(limit=1.0))


def test_tied_layers_share_one_choice():
    ops = ss.repeat(lambda name, tie: ss.dense(name, 64, 64, 64, tie=tie), 6)
    st = ss.search(ops, ss.Grid(8, "x"), method="exhaustive")
    assert len({lp.choice for lp in st.layers}) == 1
    assert st.rules() == {"layers.*": st.layers[0].w_sbp}


def test_three_d_matmul_is_in_the_space_and_wins_at_scale():
    """AutoDDL 4.4.2: the 3-D factorization's bytes shrink as n^2 / p^(2/3); on 64
    devices a square chain of layers picks a factorization using all three roles."""
    grid = ss.Grid(64, "x")
    three_d = next(c for c in ss.choices(grid) if c.degrees(grid) == (4, 4, 4))
    assert three_d.x_sbp()[0] == sj.S(0) and three_d.x_sbp()[2] == sj.B and three_d.x_sbp()[4] == sj.S(1)
    ops = ss.repeat(lambda name, tie: ss.dense(name, 4096, 4096, 4096, tie=tie), 4)
    st = ss.search(
        ops, grid, method="exhaustive", objective="bytes", memory=ss.MemoryModel(activations=False)
    )
    assert all(d > 1 for d in st.layers[0].choice.degrees(grid))


def test_layers_from_a_traced_program():
    params = {
        "w1": np.zeros((16, 32), np.float32),
        "w2": np.zeros((32, 8), np.float32),
        "b": np.zeros((32,), np.float32),
    }

    def fwd(p, x):
        return jax.nn.relu(x @ p["w1"] + p["b"]) @ p["w2"]

    ops = ss.from_program(fwd, params, np.zeros((4, 6, 16), np.float32))
    assert [(o.param, o.m, o.k, o.n, o.from_data) for o in ops] == [
        ("['w1']", 24, 16, 32, True),
        ("['w2']", 24, 32, 8, False),
    ]
    with pytest.raises(sj.SBPError, match="no matmul"):
        ss.from_program(lambda p, x: x * 2, params, np.zeros((4, 16), np.float32))


def test_cluster_grid_prices_each_axis():
    """8 GPUs per node on NVLink, nodes on 100 Gb/s: the search keeps the heavy
    traffic on the fast axis."""
    cm = sj.CostModel(alpha={"node": 2e-5, "gpu": 2e-6}, beta={"node": 8e-11, "gpu": 4e-12})
    grid = ss.Grid((4, 8), ("node", "gpu"), cost_model=cm)
    ops = ss.repeat(lambda name, tie: ss.transformer(name, 8, 512, 1024, 16, tie=tie), 2)
    st = ss.search(ops, grid)
    assert "node:" in st.table() and st.time > 0
    slow = ss.search(ops, ss.Grid((4, 8), ("node", "gpu"), cost_model=sj.CostModel(alpha=2e-5, beta=8e-11)))
    assert st.time < slow.time


def test_errors():
    ops, grid = _small()
    with pytest.raises(sj.SBPError, match="unknown method"):
        ss.search(ops, grid, method="random")
    with pytest.raises(sj.SBPError, match="unique"):
        ss.search(ops + ops, grid)
    with pytest.raises(sj.SBPError, match="divides"):
        ss.search(ss.dense("odd", 7, 7, 7), grid)
    with pytest.raises(sj.SBPError, match="no layer"):
        ss.search(ops, grid)["nope"]
    with pytest.raises(sj.SBPError, match="abstract Grid"):
        _ = ss.search(ops, grid).placement
    with pytest.raises(sj.SBPError, match="positive"):
        ss.Grid(0, "x")
    with pytest.raises(sj.SBPError, match="objective"):
        ss.search(ops, grid, objective="flops")


def test_table_is_readable():
    ops, grid = _small()
    text = str(ss.search(ops, grid))
    assert "mlp.0" in text and "grad sync" in text and "total" in text

"""Strategies applied to real programs on 8 devices: the bytes the search predicts
are the bytes the compiled program moves, and the values are right."""

import pathlib

import jax
import numpy as np
import pytest
from conftest import assert_close, load_module

import sbpjax as sj
import sbpjax.search as ss


def _benchmark_module():
    """benchmarks/search.py, whose ``mlp_program`` (an SGD step of an MLP laid
    out by a strategy) these tests check against its predictions."""
    return load_module(
        pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "search.py", "search_benchmark"
    )


mlp_program = _benchmark_module().mlp_program
DIMS, TOKENS = [64, 128, 32, 16], 64


def setup(seed=0):
    ops = ss.mlp("mlp", TOKENS, DIMS)
    names = [o.name for o in ops]
    r = np.random.default_rng(seed)
    params = {n: (r.normal(size=(o.k, o.n)) / np.sqrt(o.k)).astype(np.float32) for n, o in zip(names, ops)}
    x = r.normal(size=(TOKENS, DIMS[0])).astype(np.float32)
    y = r.normal(size=(TOKENS, DIMS[-1])).astype(np.float32)
    return ops, names, params, x, y


def compile_strategy(st, names, params):
    step, _ = mlp_program(st, names)
    return sj.jit(
        step,
        placement=st.placement,
        in_sbp=(st.param_sbp(params), st.input_sbp(), st.output_sbp()),
        out_sbp=(st.param_sbp(params), None),
    )


def measured(f, *args):
    return sum(c.bytes for c in sj.collectives(f.lower(*args).compile()))


def strategies(n, seed=1):
    """The searched strategy and ``n - 1`` random ones (planner-priced)."""
    ops, names, params, x, y = setup()
    pl = sj.placement(8, "x")
    grid = ss.Grid.from_placement(pl)
    t = ss.tables_for(ops, grid, placement=pl, objective="bytes")
    out = [ss.search(ops, grid, placement=pl, tables=t, method="exhaustive")]
    rng = np.random.default_rng(seed)
    while len(out) < n:
        pick = {g: opts[rng.integers(len(opts))] for g, opts in zip(t.groups, t.options)}
        out.append(ss.evaluate(ops, grid, pick, placement=pl, tables=t))
    return out, names, params, x, y


def check(st, names, params, x, y):
    f = compile_strategy(st, names, params)
    assert measured(f, params, x, y) == st.bytes, st.table()
    new, loss = f(params, x, y)
    _, ref_loss = mlp_program(st, names)  # outside sj.jit the pins are identities
    want_loss, want_grads = jax.value_and_grad(ref_loss)(params, x, y)
    assert_close(loss.numpy(), want_loss, rtol=1e-5)
    for k in params:
        np.testing.assert_allclose(
            new[k].numpy(), params[k] - 0.1 * np.asarray(want_grads[k]), rtol=1e-4, atol=1e-6, err_msg=k
        )


def test_searched_strategy_moves_the_predicted_bytes():
    sts, names, params, x, y = strategies(2)
    for st in sts:
        check(st, names, params, x, y)
    assert sts[0].bytes <= sts[1].bytes


@pytest.mark.slow
def test_ten_strategies_move_the_predicted_bytes():
    sts, names, params, x, y = strategies(10, seed=2)
    for st in sts:
        check(st, names, params, x, y)


def test_annotations_for_jit_and_flax():
    sts, names, params, *_ = strategies(1)
    st = sts[0]
    tree = st.param_sbp(params)
    assert set(tree) == set(params) and all(tree[k] == st[k].w_sbp for k in names)
    assert st.rules() == {k: st[k].w_sbp for k in names}
    assert st.placement.shape == (2, 2, 2) and st.placement.axis_names == ("x0", "x1", "x2")
    assert list(st.placement.device_ids) == list(sj.placement(8, "x").device_ids)  # order kept
    with pytest.raises(sj.SBPError, match="no parameter"):
        st.param_sbp({"other": params[names[0]]})

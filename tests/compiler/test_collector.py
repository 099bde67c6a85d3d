"""sj.jit pauses Python's cyclic collector while it plans, and restores it."""

import gc

import numpy as np
import pytest

import sbpjax as sj


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_the_collector_is_off_while_planning_and_on_after(pl8, collector_on):
    seen = []

    def f(x, w):
        seen.append(gc.isenabled())  # runs while sj.jit traces the function
        return (x @ w).sum()

    x = np.ones((16, 8), np.float32)
    w = np.ones((8, 4), np.float32)
    g = sj.jit(f, placement=pl8, in_sbp=(sj.S(0), sj.B))
    out = g(x, w)
    assert seen == [False]
    assert gc.isenabled()
    np.testing.assert_allclose(np.asarray(out.numpy()), (x @ w).sum(), rtol=1e-6, atol=1e-6 * 16 * 8 * 4)
    g(x, w)  # a second call plans nothing and leaves the collector alone
    assert gc.isenabled() and seen == [False]


def test_a_failed_plan_leaves_the_collector_on(pl8, collector_on):
    def f(x):
        raise ValueError("the user's function fails while traced")

    with pytest.raises(ValueError, match="fails while traced"):
        sj.jit(f, placement=pl8)(np.ones((8,), np.float32))
    assert gc.isenabled()
    g = sj.jit(lambda x: x * 2, placement=pl8, out_sbp=sj.AUTO)  # refused after the trace
    with pytest.raises(sj.SBPError, match="cannot be sj.AUTO"):
        g(np.ones((8,), np.float32))
    assert gc.isenabled()


def test_a_collector_the_caller_paused_stays_paused(pl8, collector_on):
    gc.disable()
    try:
        out = sj.jit(lambda x: x + 1, placement=pl8, in_sbp=(sj.S(0),))(np.zeros((8,), np.float32))
        assert not gc.isenabled()
    finally:
        gc.enable()
    np.testing.assert_array_equal(np.asarray(out.numpy()), np.ones(8, np.float32))

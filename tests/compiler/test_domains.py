"""The candidate screen's bitset index (sbpjax.compiler.screen.OperandIndex)
keeps exactly the candidates a test of each candidate's operands keeps, in
order; the local slices offered to a broadcast operand move no bytes."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_close, gspmd_bytes, moved_bytes

import sbpjax as sj
from sbpjax import B, P, S
from sbpjax.compiler.reachable import local_slices, partly_gathered
from sbpjax.compiler.screen import OperandIndex

LAYOUTS = [(B, B), (S(0), B), (B, S(0)), (S(1), S(0)), (P, B), (B, P), (S(0), S(1))]


def _candidates(rng, n_ins):
    n = int(rng.integers(1, 40))
    return [
        ([LAYOUTS[int(rng.integers(len(LAYOUTS)))] for _ in range(n_ins)], [LAYOUTS[int(rng.integers(3))]])
        for _ in range(n)
    ]


@pytest.mark.parametrize("seed", range(30))
def test_the_index_keeps_what_a_candidate_by_candidate_screen_keeps(seed):
    rng = np.random.default_rng(seed)
    n_ins = int(rng.integers(1, 4))
    cs = _candidates(rng, n_ins)
    index = OperandIndex()
    for _ in range(5):  # one list, screened for several ops (the index is built once)
        allow = [
            None if rng.random() < 0.2 else {nd for nd in LAYOUTS if rng.random() < 0.5} for _ in range(n_ins)
        ]
        want = [c for c in cs if all(al is None or nd in al for al, nd in zip(allow, c[0]))]
        got = index.reading(cs, allow)
        assert [id(c) for c in got] == [id(c) for c in want]
    assert index.reading([], []) == []


@pytest.mark.parametrize("seed", range(30))
def test_a_broadcast_operand_is_offered_exactly_its_free_local_slices(seed):
    """``local_slices`` offers exactly the splits of a layout's whole axes on
    dims longer than 1 that the boxing planner reaches moving no bytes."""
    rng = np.random.default_rng(seed)
    shape = tuple(int(rng.choice([1, 4, 8])) for _ in range(int(rng.integers(1, 4))))
    pl = sj.placement((2, 4), ("x", "y"))
    per_axis = [B, P] + [S(d) for d in range(len(shape)) if shape[d] >= 4]
    src = tuple(per_axis[int(rng.integers(len(per_axis)))] for _ in range(2))
    whole = [a for a, q in enumerate(src) if q == B]
    dims = [None] + [S(d) for d, n in enumerate(shape) if n > 1]
    want = set()
    for pick in itertools.product(dims, repeat=len(whole)):
        nd = list(src)
        for a, q in zip(whole, pick):
            if q is not None:
                nd[a] = q
        if sj.plan_boxing(shape, np.float32, pl, src, tuple(nd)).bytes == 0:
            want.add(tuple(nd))
    assert local_slices({src}, shape) == want


def test_partly_gathered_lists_the_gathers_between():
    made, whole = (S(0), S(1)), (B, B)
    assert partly_gathered(made, whole) == {(B, S(1)), (S(0), B)}
    assert partly_gathered((S(0), S(1), S(2)), (B, B, S(2))) == {(B, S(1), S(2)), (S(0), B, S(2))}
    assert partly_gathered(made, (S(0), B)) == set()  # one axis gathered: nothing between
    assert partly_gathered(made, (S(1), B)) == set()  # more than a gather


@pytest.mark.parametrize(
    "fn",
    [lambda x: jnp.abs(jnp.fft.rfft(x, axis=1)), lambda x: jnp.sort(x, axis=1)[:, -4:]],
    ids=["rfft", "sort"],
)
def test_an_op_needing_one_dim_whole_gathers_only_the_axes_splitting_it(pl24, fn):
    """``abs(rfft(x, axis=1))`` of an (S(0), S(1)) ``x``: the greedy pass gathers
    ``x`` whole (43,008 B); gathering the columns over y alone keeps the rows
    split for the FFT (30,976 B with the result's gather, GSPMD's count)."""
    x = np.random.default_rng(0).normal(size=(16, 96)).astype(np.float32)
    f = sj.jit(fn, placement=pl24, in_sbp=((S(0), S(1)),), out_sbp=(B, B))
    assert_close(f(x).numpy(), np.asarray(jax.jit(fn)(x)), rtol=1e-5)
    whole = 8 * 16 * 96 * 4 * 7 // 8  # every device gathers the 7/8 of x it lacks
    moved = moved_bytes(f, x)
    assert moved == f.explain(x).bytes < whole
    assert moved <= gspmd_bytes(fn, pl24, ((S(0), S(1)),), (B, B), (x,))

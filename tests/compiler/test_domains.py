"""The candidate screen's bitset index (sbpjax.compiler.screen.OperandIndex)
keeps exactly the candidates a test of each candidate's operands keeps, in
order; the local slices offered to a broadcast operand move no bytes."""

import itertools

import numpy as np
import pytest

import sbpjax as sj
from sbpjax import B, P, S
from sbpjax.compiler.reachable import local_slices
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

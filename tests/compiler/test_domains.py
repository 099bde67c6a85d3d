"""The candidate screen's bitset index (sbpjax.compiler.domains.OperandIndex)
keeps exactly the candidates a test of each candidate's operands keeps, in order."""

import numpy as np
import pytest

from sbpjax import B, P, S
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

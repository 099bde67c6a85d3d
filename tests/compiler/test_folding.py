"""Folding a formulation's links: a refold after some tables change equals a
fold from scratch, to the bit, and leaves the previous fold's arrays alone."""

import numpy as np
import pytest

from sbpjax.compiler.folding import Folded


class _Table:
    def __init__(self, values):
        self.values = values


def _random_links(rng, n_nodes, k):
    """Links between nodes, nodes and fixed ends, and fixed ends; some tables
    shared by several links (alike layers), some links with u == v (a group)."""
    tables = []
    links = []
    for _ in range(6 * n_nodes):
        kind = rng.integers(5)
        u = None if kind in (0, 1) else int(rng.integers(n_nodes))
        v = None if kind in (0, 2) else int(rng.integers(n_nodes))
        if kind == 4:
            v = u  # both ends in one group
        rows = 1 if u is None else k[u]
        cols = 1 if v is None else k[v]
        same = [t for t in tables if t.values.shape == (rows, cols)]
        if same and rng.random() < 0.4:
            table = same[int(rng.integers(len(same)))]
        else:
            table = _Table(rng.integers(0, 1000, (rows, cols)).astype(np.float64) / 7)
            tables.append(table)
        links.append((table, u, v, float(rng.choice([1.0, 0.5, 1 / 3]))))
    return tables, links


@pytest.mark.parametrize("seed", range(5))
def test_a_refold_equals_a_fold_from_scratch(seed):
    rng = np.random.default_rng(seed)
    n = 12
    k = [int(x) for x in rng.integers(1, 5, n)]
    own = [rng.random(size) for size in k]
    tables, links = _random_links(rng, n, k)
    folded = Folded(own, 3.25, links)
    for _ in range(4):  # settling rounds: a few tables change each time
        before = ([c.copy() for c in folded.costs], {e: t.copy() for e, t in folded.edges.items()})
        changed = [tables[int(i)] for i in rng.choice(len(tables), 3, replace=False)]
        for t in changed:
            t.values = t.values + rng.integers(0, 50, t.values.shape) / 3
        again = folded.refold({id(t) for t in changed})
        fresh = Folded(own, 3.25, links)
        assert again.const == fresh.const
        assert all(np.array_equal(a, b) for a, b in zip(again.costs, fresh.costs))
        assert again.edges.keys() == fresh.edges.keys()
        assert all(np.array_equal(again.edges[e], fresh.edges[e]) for e in fresh.edges)
        # the previous fold (the last round's problem) is as it was
        assert all(np.array_equal(a, b) for a, b in zip(folded.costs, before[0]))
        assert all(np.array_equal(folded.edges[e], before[1][e]) for e in before[1])
        folded = again


def test_a_fold_by_hand():
    t = _Table(np.array([[1.0, 2.0], [3.0, 4.0]]))
    fixed = _Table(np.array([[5.0, 7.0]]))
    both = _Table(np.array([[9.0]]))
    own = [np.zeros(2), np.zeros(2)]
    links = [(t, 1, 0, 1.0), (fixed, None, 0, 0.5), (t, 0, 0, 1.0), (both, None, None, 2.0)]
    f = Folded(own, 1.0, links)
    np.testing.assert_array_equal(f.edges[0, 1], t.values.T)  # stored with the smaller node first
    np.testing.assert_array_equal(f.costs[0], [2.5 + 1.0, 3.5 + 4.0])  # half the fixed row, the diagonal
    np.testing.assert_array_equal(f.costs[1], [0.0, 0.0])
    assert f.const == 1.0 + 18.0

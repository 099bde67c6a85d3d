"""Large-neighbourhood moves: re-solve a whole induced forest exactly, the rest held fixed.

Given a solution, pick a set of nodes whose pairs among themselves form a forest (no
cycle). With every other node fixed, a pair to an outside node is just a unary cost, so
the best strategies of the whole set are one dynamic program (leaf rounds of the
elimination engine). The move never makes the total worse, and it changes many nodes at
once, which single-node moves cannot.

The sets are grown greedily in an order given by the caller (a seeded permutation, so the
result is a pure function of the seed).
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver import _eliminate, _plan
from sbpjax.solver._model import Model, plain_model, segment_ids


class Blocks:
    def __init__(self, model: Model):
        self.model = model
        self.rows, self.cols = model.entry_index()
        self.epair = segment_ids(model.k[model.pu] * model.k[model.pv])
        ptr, _, other = _eliminate.adjacency(model)
        self.neighbours = [other[ptr[i] : ptr[i + 1]].tolist() for i in range(model.n)]

    def forest(self, order: np.ndarray, free: np.ndarray | None = None) -> np.ndarray:
        """A maximal induced forest, taking nodes in ``order`` (only ``free`` ones, if given)."""
        n = self.model.n
        parent = list(range(n))
        inside = [False] * n
        allowed = [True] * n if free is None else free.tolist()

        def find(a: int) -> int:
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for x in order.tolist():
            if not allowed[x]:
                continue
            roots = []
            for y in self.neighbours[x]:
                if inside[y]:
                    r = find(y)
                    if r in roots:
                        break
                    roots.append(r)
            else:
                inside[x] = True
                for r in roots:
                    parent[r] = x
        return np.array(inside, dtype=bool)

    def solve_block(self, s: np.ndarray, inside: np.ndarray, unary: np.ndarray) -> np.ndarray:
        """``s`` with the nodes ``inside`` (an induced forest) re-chosen optimally for costs
        ``unary`` (flat) plus the pairs, the other nodes fixed."""
        m = self.model
        chosen = np.zeros(len(m.unary), dtype=bool)
        chosen[m.noff[:-1] + s] = True
        in_u, in_v = inside[m.pu], inside[m.pv]
        eu, ev = in_u[self.epair], in_v[self.epair]
        u = unary.copy()
        to_rows = eu & ~ev & chosen[self.cols]
        to_cols = ev & ~eu & chosen[self.rows]
        u += np.bincount(self.rows[to_rows], weights=m.pflat[to_rows], minlength=len(u))
        u += np.bincount(self.cols[to_cols], weights=m.pflat[to_cols], minlength=len(u))
        nodes = np.flatnonzero(inside)
        new_index = np.full(m.n, -1, dtype=np.int64)
        new_index[nodes] = np.arange(len(nodes))
        pairs = np.flatnonzero(in_u & in_v)
        sub = plain_model(
            m.k[nodes],
            u[inside[m.node_of()]],
            new_index[m.pu[pairs]],
            new_index[m.pv[pairs]],
            m.pflat[(in_u & in_v)[self.epair]],
        )
        plan = _plan.plan(sub, min_batch=1)
        assert plan is not None and plan.exact and not plan.steps, (
            "an induced forest is eliminated by leaf rounds alone"
        )
        _, sub_s = _eliminate.run(plan, sub, sub.unary)
        out = s.copy()
        out[nodes] = sub_s
        return out

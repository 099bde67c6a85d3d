"""Solving a :class:`~sbpjax.compiler.formulate.Formulation` (interim: the pairwise ILP by HiGHS).

The integer program of the pairwise form (the local polytope: a binary per
node strategy, a column per edge entry whose sums over a row or a column
equal the strategies at its ends) is solved by HiGHS without a time limit,
so its plan does not depend on the clock.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Solved:
    """``strategies``: one per node (None when no solution exists);
    ``cost``: its cost, in the form's units (1/64 bytes), ``const``
    included; ``bound``: a proven lower bound of the optimum; ``status``:
    how the solve ended."""

    strategies: list | None
    cost: float | None
    bound: float | None
    status: str
    rounds: int = 1  # solves until every table entry the solution uses was exact


def solve_settled(form, effort: int, start=None, usage_limit=None) -> Solved:
    """Solve ``form``, plan the table entries its solution uses exactly
    (``Formulation.settle``) and solve again, until the solution's entries
    are all exact (:mod:`sbpjax.compiler.tables`)."""
    rounds = 0
    if start is not None:
        form.settle(start)  # the plan in hand's costs exact from the first solve on
    while True:
        solved = solve_form(form, effort, start, usage_limit)
        rounds += 1
        if solved.strategies is None or not form.settle(solved.strategies):
            solved.rounds = rounds
            return solved
        start = solved.strategies


def solve_form(form, effort: int, start=None, usage_limit=None) -> Solved:
    from scipy.sparse import coo_array

    from sbpjax.compiler.milp import solve_binary

    costs, edges = form.costs, form.edges
    if not costs:
        return Solved([], form.const, form.const, "no choice to make")
    offsets, c = [], []
    rows, cols, vals, lo, hi = [], [], [], [], []
    r = col = 0
    for x in costs:
        offsets.append(col)
        c.extend(np.minimum(x, 1e15))
        for k in range(len(x)):
            rows.append(r)
            cols.append(col + k)
            vals.append(1.0)
        lo.append(1.0)
        hi.append(1.0)
        r += 1
        col += len(x)
    for (u, v), table in edges.items():
        k, l = table.shape
        base = col
        c.extend(np.minimum(table.ravel(), 1e15))
        col += k * l
        for a in range(k):
            rows.extend([r] * (l + 1))
            cols.extend(list(range(base + a * l, base + a * l + l)) + [offsets[u] + a])
            vals.extend([1.0] * l + [-1.0])
            lo.append(0.0)
            hi.append(0.0)
            r += 1
        for b in range(l):
            rows.extend([r] * (k + 1))
            cols.extend([base + a * l + b for a in range(k)] + [offsets[v] + b])
            vals.extend([1.0] * k + [-1.0])
            lo.append(0.0)
            hi.append(0.0)
            r += 1
    if usage_limit is not None:
        for n, u in enumerate(form.usages):
            for k, x in enumerate(u):
                if x:
                    rows.append(r)
                    cols.append(offsets[n] + k)
                    vals.append(float(x))
        lo.append(-np.inf)
        hi.append(float(usage_limit - form.const_usage))
        r += 1
    A = coo_array((vals, (rows, cols)), shape=(r, col)).tocsr()
    res = solve_binary(np.asarray(c), A, lo, hi, time_limit=np.inf, rel_gap=0.0)
    if res.x is None:
        return Solved(None, None, None, res.message)
    strategies = [int(np.argmax(res.x[o : o + len(x)])) for o, x in zip(offsets, costs)]
    bound = None if res.bound is None else res.bound + form.const
    return Solved(strategies, res.objective + form.const, bound, res.message)

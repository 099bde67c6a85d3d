"""The pairwise relaxation's dual (``sbpjax.solver._dual``): its bound against brute
force, the reparametrization identity it rests on, and solves it ends."""

from __future__ import annotations

import importlib

import numpy as np
from solver_cases import brute_force, close, random_problem

from sbpjax.solver import Problem, solve
from sbpjax.solver._budget import Budget
from sbpjax.solver._dual import PROVEN, Relaxation, ascend
from sbpjax.solver._model import raw_model


def _relaxed(p: Problem, sweeps: int) -> Relaxation:
    rel = Relaxation(raw_model(p))
    for _ in range(sweeps):
        rel.sweep()
    return rel


def test_reparametrization_keeps_every_assignments_cost():
    rng = np.random.default_rng(3)
    for _ in range(20):
        p = random_problem(rng, 6, 9, kmax=4, forbid=0.0, follow=0.0)
        rel = _relaxed(p, 7)
        m = rel.m
        rest = rel.remaining()
        for _ in range(10):
            x = np.array([rng.integers(0, k) for k in m.k])
            nodes = sum(rel.b[m.noff[i] + x[i]] for i in range(m.n))
            pairs = sum(rest[m.poff[q] + x[m.pu[q]] * m.k[m.pv[q]] + x[m.pv[q]]] for q in range(m.npairs))
            want = m.costs(x)
            assert np.isclose(nodes + pairs, want, rtol=1e-12, atol=1e-9 * max(1.0, abs(want)))


def test_bound_never_exceeds_the_optimum():
    # random graphs with cycles, multi-edges and forbidden strategies: the relaxation
    # need not be tight, but its bound is a bound at every sweep
    rng = np.random.default_rng(5)
    for _ in range(40):
        n = int(rng.integers(2, 8))
        p = random_problem(rng, n, int(rng.integers(n, 2 * n + 3)), kmax=4)
        best, _ = brute_force(p)
        rel = Relaxation(raw_model(p))
        for _ in range(6):
            rel.sweep()
            value = rel.bound()
            assert not np.isnan(value)
            assert value <= best or close(value, best)


def test_a_tree_is_solved_and_proven():
    # on a tree the relaxation is tight: the decoded solution is optimal and the bound
    # reaches it
    rng = np.random.default_rng(7)
    for _ in range(15):
        n = int(rng.integers(3, 9))
        k = rng.integers(1, 5, n)
        costs = [rng.integers(0, 50, x).astype(float) for x in k]
        edges = []
        for v in range(1, n):
            u = int(rng.integers(0, v))
            edges.append((u, v, rng.integers(0, 50, (k[u], k[v])).astype(float)))
        p = Problem(costs, edges)
        best, _ = brute_force(p)
        model = raw_model(p)
        found: list = []
        bound, _ = ascend(model, Budget(1e9), lambda s, m=model, f=found: f.append(m.costs(s)) or min(f), {})
        assert close(min(found), best)
        assert best - bound <= PROVEN * abs(best) + 1e-9


def _submodular_grid(rng, rows: int, cols: int) -> Problem:
    """Two strategies a node on a grid, each pair cheaper when its ends agree: the
    relaxation of such a (submodular) problem is tight."""
    n = rows * cols
    costs = [rng.integers(0, 30, 2).astype(float) for _ in range(n)]
    edges = []
    for r in range(rows):
        for c in range(cols):
            i = r * cols + c
            for j in ([i + 1] if c + 1 < cols else []) + ([i + cols] if r + 1 < rows else []):
                agree, differ = sorted(rng.integers(0, 30, 2).tolist())
                edges.append((i, j, np.array([[agree, differ], [differ, agree]], dtype=float)))
    return Problem(costs, edges)


def test_a_wide_graph_is_proven_without_search(monkeypatch):
    # no exact plan fits caps of 4 entries; the grid's relaxation is tight, so the solve
    # ends with the relaxation's solution, proven, and no search rounds
    solve_module = importlib.import_module("sbpjax.solver.solve")
    monkeypatch.setattr(solve_module, "TABLE_CAP", 4.0)
    monkeypatch.setattr(solve_module, "MOVE_CAP", 4.0)
    p = _submodular_grid(np.random.default_rng(13), 3, 4)
    best, _ = brute_force(p)
    sol = solve(p)
    assert not sol.stats["exact"] and sol.stats["dual_sweeps"] > 0 and sol.stats["dual_stop"] == "proven"
    assert "rounds" not in sol.stats
    assert close(sol.cost, best) and sol.gap <= PROVEN


def test_the_bound_is_the_same_on_every_run():
    rng = np.random.default_rng(17)
    p = random_problem(rng, 8, 14, kmax=4)
    a, b = _relaxed(p, 12), _relaxed(p, 12)
    assert a.bound() == b.bound()
    assert (a.decode() == b.decode()).all()


def test_an_ascent_cut_short_ends_the_solve(monkeypatch):
    # too little effort for the ascent to finish: the solve ends with its best decoded
    # solution, and a larger effort, which runs the same ascent further, is never worse
    solve_module = importlib.import_module("sbpjax.solver.solve")
    monkeypatch.setattr(solve_module, "TABLE_CAP", 4.0)
    monkeypatch.setattr(solve_module, "MOVE_CAP", 4.0)
    p = _submodular_grid(np.random.default_rng(19), 4, 5)
    short, full = solve(p, effort=3e3), solve(p)
    assert short.stats["dual_stop"] == "effort" and "rounds" not in short.stats
    assert full.stats["dual_stop"] == "proven"
    assert full.cost <= short.cost and short.lower_bound <= full.cost

"""The least-fill elimination order (``_fill_order``): exact in any order, its width bound a
true lower bound, and a solve that falls back to it where min-size's order is too wide."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
from solver_cases import brute_force, random_problem

from sbpjax.solver import _eliminate, _fill_order, _kept_plans, _plan, solve
from sbpjax.solver._model import LOG_SCALE, raw_model
from sbpjax.solver._reduce import reduce

solve_module = importlib.import_module("sbpjax.solver.solve")  # the package's name is the function


def _model(seed: int, n: int, m: int):
    p = random_problem(np.random.default_rng(seed), n, m, kmax=4, forbid=0.0, follow=0.0)
    return p, reduce(raw_model(p))


@pytest.mark.parametrize("seed", range(6))
def test_the_fill_orders_elimination_is_exact(seed):
    """Eliminated in the least-fill order, a small random graph's optimum is brute force's."""
    p, m = _model(seed, 8, 14)
    leaves = _eliminate.leaf_rounds(m, 16)
    plan = _plan.plan(m, np.inf, "fill", leaves=leaves)
    assert plan is not None and plan.exact
    _, s = _eliminate.run(plan, m, m.unary)
    assert math.isclose(p.evaluate(m.to_original(s))[0], brute_force(p)[0])


@pytest.mark.parametrize("seed", range(6))
def test_the_width_bound_is_below_both_orders_widest_table(seed):
    _, m = _model(seed, 40, 120)
    leaves = _eliminate.leaf_rounds(m, 16)
    bound = 2 ** (_fill_order.least_widest(m, leaves) / LOG_SCALE)
    by_size = _plan.plan(m, np.inf, "exact", leaves=leaves)
    by_fill = _plan.plan(m, np.inf, "fill", leaves=leaves)
    assert bound <= by_size.max_table * (1 + 1e-9) and bound <= by_fill.max_table * (1 + 1e-9)


def test_a_solve_falls_back_to_the_fill_order_and_proves_its_plan(monkeypatch):
    """With the cap between the fill order's widest table and min-size's, the solve is
    exact (the optimum, brute force's) rather than heuristic."""
    for seed in range(200):
        p, m = _model(seed, 10, 22)
        leaves = _eliminate.leaf_rounds(m, 16)
        by_size = _plan.plan(m, np.inf, "exact", leaves=leaves)
        by_fill = _plan.plan(m, np.inf, "fill", leaves=leaves)
        if by_fill.max_table < by_size.max_table:
            break
    else:
        pytest.fail("no random graph where the fill order is narrower")
    _kept_plans.clear()
    monkeypatch.setattr(solve_module, "TABLE_CAP", by_fill.max_table)
    sol = solve(p, effort=1e7)
    _kept_plans.clear()
    assert sol.optimal and math.isclose(sol.cost, brute_force(p)[0])

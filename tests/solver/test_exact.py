"""Reductions and elimination against brute force on many random small problems
(multi-edges, forbidden strategies and pairs, dependent pairs, memory)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from solver_cases import brute_force, close, random_problem

from sbpjax.solver import _eliminate, _plan
from sbpjax.solver._model import raw_model
from sbpjax.solver._reduce import reduce


def _cases(seed: int, count: int, memory: bool, nmax: int = 7, dense: int = 2):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(2, nmax + 1))
        yield rng, random_problem(rng, n, int(rng.integers(0, dense * n + 2)), memory=memory)


def _model_assignments(model):
    for s in itertools.product(*[range(int(k)) for k in model.k]):
        yield np.array(s, dtype=np.int64)


@pytest.mark.parametrize("seed", range(4))
def test_reductions_keep_the_optimum_and_map_back(seed):
    for _, p in _cases(seed, 60, memory=True, nmax=6):
        best, _ = brute_force(p)
        model = reduce(raw_model(p))
        if model.infeasible is not None:
            assert best == np.inf, model.infeasible  # pruning proved what brute force finds
            continue
        reduced_best = np.inf
        for s in _model_assignments(model):
            orig = model.to_original(s)
            cost, feasible, peak = p.evaluate(orig)
            if np.isfinite(cost):
                assert close(model.costs(s), cost)
                assert (model.peak(s) <= p.usage_limit) == feasible
            back = model.from_original(orig)
            assert back is not None and (back == s).all()
            if feasible:
                reduced_best = min(reduced_best, cost)
        assert reduced_best == best


@pytest.mark.parametrize("seed", range(4))
def test_exact_elimination_finds_the_optimum(seed):
    for rng, p in _cases(100 + seed, 80, memory=False):
        best, _ = brute_force(p)
        model = reduce(raw_model(p))
        if model.infeasible is not None:
            assert best == np.inf
            continue
        plan = _plan.plan(model, np.inf, "exact", min_batch=int(rng.choice([1, 1000])))
        assert plan is not None and plan.exact
        value, s = _eliminate.run(plan, model, model.unary)
        assert close(value, best)
        assert close(p.evaluate(model.to_original(s))[0], best)


@pytest.mark.parametrize("seed", range(3))
def test_minibucket_value_is_a_lower_bound(seed):
    bounded = 0
    for rng, p in _cases(200 + seed, 80, memory=False, dense=3):
        best, _ = brute_force(p)
        model = raw_model(p)  # unreduced: wider graphs, so that buckets split
        plan = _plan.plan(model, float(rng.choice([2, 4, 9])), "minibucket", min_batch=1000)
        value, s = _eliminate.run(plan, model, model.unary)
        assert value <= best or close(value, best)
        cost = p.evaluate(model.to_original(s))[0]
        assert cost >= best or close(cost, best)
        bounded += not plan.exact
    assert bounded > 10  # the small caps did split buckets


@pytest.mark.parametrize("seed", range(3))
def test_a_move_is_the_best_with_the_held_nodes_fixed(seed):
    held_some = 0
    for rng, p in _cases(300 + seed, 80, memory=False, dense=3):
        model = raw_model(p)  # unreduced: wider graphs, so that nodes are held
        plan = _plan.plan(
            model,
            float(rng.choice([2, 4, 8])),
            "condition",
            rng.permutation(model.n),
            rng.random(model.n) < 0.3,
        )
        fixed = np.array([rng.integers(0, k) for k in model.k])
        value, s = _eliminate.run(plan, model, model.unary, fixed)
        held = [st.x for st in plan.steps if isinstance(st, _eliminate.Condition)]
        held_some += bool(held)
        assert (s[held] == fixed[held]).all()
        best = min(
            (model.costs(a) for a in _model_assignments(model) if (a[held] == fixed[held]).all()),
            default=np.inf,
        )
        assert close(value, best) and close(model.costs(s), best)
    assert held_some > 10

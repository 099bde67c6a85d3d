"""The layout choice's integer-program solver (sbpjax/compiler/milp.py):
optima against enumeration of every binary assignment, MIP starts, and the
solves of sj.jit starting from the plan in hand."""

import itertools
import subprocess
import sys

import numpy as np
import optax
import pytest
from scipy.sparse import csr_array
from test_solve import gpt_case

import sbpjax as sj
import sbpjax.compiler.milp as milp
import sbpjax.compiler.solve as solve_module
from sbpjax.compiler.propagate import propagate


def random_program(rng):
    """A binary program of 3-10 columns: costs of either sign, rows with
    coefficients in -1..2 and bounds that keep some assignments feasible
    (most of the time: some programs are infeasible)."""
    n = int(rng.integers(3, 11))
    m = int(rng.integers(1, 6))
    A = rng.integers(-1, 3, size=(m, n)).astype(float)
    cost = rng.integers(-20, 21, size=n).astype(float)
    lo = np.where(rng.random(m) < 0.5, -np.inf, rng.integers(-2, 3, size=m).astype(float))
    hi = np.where(rng.random(m) < 0.3, np.inf, lo + rng.integers(0, 3, size=m))
    hi = np.where(np.isinf(lo) & np.isinf(hi), rng.integers(0, 4, size=m).astype(float), hi)
    return cost, A, lo, hi


def enumerate_optimum(cost, A, lo, hi):
    """(optimum, its assignments) by trying all 2^n assignments; (None, []) if none is feasible."""
    best, argbest = None, []
    for bits in itertools.product((0.0, 1.0), repeat=len(cost)):
        x = np.array(bits)
        r = A @ x
        if np.all(r >= lo - 1e-9) and np.all(r <= hi + 1e-9):
            v = float(cost @ x)
            if best is None or v < best - 1e-9:
                best, argbest = v, [x]
            elif abs(v - best) <= 1e-9:
                argbest.append(x)
    return best, argbest


def test_binary_programs_match_enumeration():
    """200 random programs: HiGHS's optimum (gap 0) equals the best of every
    assignment, its solution is binary and meets every row, and an
    infeasible program returns no solution."""
    rng = np.random.default_rng(0)
    infeasible = 0
    for _ in range(200):
        cost, A, lo, hi = random_program(rng)
        best, _ = enumerate_optimum(cost, A, lo, hi)
        res = milp.solve_binary(cost, csr_array(A), lo, hi, time_limit=10.0, rel_gap=0.0)
        if best is None:
            infeasible += 1
            assert res.x is None, (cost, A, lo, hi, res)
            continue
        assert res.x is not None, (cost, A, lo, hi, res.message)
        x = np.round(res.x)
        assert np.allclose(res.x, x, atol=1e-6) and set(np.unique(x)) <= {0.0, 1.0}
        r = A @ x
        assert np.all(r >= lo - 1e-6) and np.all(r <= hi + 1e-6)
        assert res.objective == pytest.approx(best, abs=1e-6)
        assert float(cost @ x) == pytest.approx(best, abs=1e-6)
        assert res.bound is not None and res.bound <= best + 1e-6
    # the generator makes both kinds
    assert 0 < infeasible < 100


def test_a_start_is_completed_and_a_broken_one_ignored():
    """A partial start that can be completed is accepted, and one that breaks
    a row is refused; either way the optimum is found."""
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(100):
        cost, A, lo, hi = random_program(rng)
        best, argbest = enumerate_optimum(cost, A, lo, hi)
        if best is None:
            continue
        # a start giving the first half of an optimal assignment's columns
        opt = argbest[0]
        half = {j: float(opt[j]) for j in range(len(cost) // 2)}
        res = milp.solve_binary(cost, csr_array(A), lo, hi, time_limit=10.0, rel_gap=0.0, start=half)
        assert res.started and res.objective == pytest.approx(best, abs=1e-6)
        # a start no assignment completes: every column 1 where some row forbids it
        ones = np.ones(len(cost))
        if np.any(A @ ones < lo - 1e-9) or np.any(A @ ones > hi + 1e-9):
            full = dict.fromkeys(range(len(cost)), 1.0)
            res = milp.solve_binary(cost, csr_array(A), lo, hi, time_limit=10.0, rel_gap=0.0, start=full)
            assert res.objective == pytest.approx(best, abs=1e-6)
        checked += 1
    assert checked > 50


def test_the_solver_prints_nothing():
    """HiGHS prints a banner on stdout when the first solver object of a
    process is made; sbpjax's solves print nothing (a notebook's or a
    script's output stays the user's)."""
    code = (
        "import numpy as np; from scipy.sparse import csr_array\n"
        "from sbpjax.compiler.milp import solve_binary\n"
        "r = solve_binary(np.array([1.0, -1.0]), csr_array(np.array([[1.0, 1.0]])),"
        " np.array([1.0]), np.array([1.0]), time_limit=5.0, rel_gap=0.0)\n"
        "import sys; sys.stderr.write(','.join(str(round(v)) for v in r.x))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout == ""
    assert out.stderr.strip().endswith("0,1")  # the optimum: x = (0, 1)


def test_each_solve_starts_from_the_plan_in_hand(pl24, monkeypatch):
    """sj.jit's solves start from greedy's plan: HiGHS is given one column
    per op (the op's own signature in that plan, for every op whose
    signature is among its candidates), and accepts the start; a solve
    given half a second returns a plan that costs no more than greedy's."""
    step, args, in_sbp, out_sbp = gpt_case(pl24, "megatron", 32, 1, optax.sgd(0.1))
    starts = []
    real = milp.solve_binary

    def spy(*a, **k):
        res = real(*a, **k)
        starts.append((k.get("start"), res))
        return res

    monkeypatch.setattr(milp, "solve_binary", spy)
    f = sj.jit(step, placement=pl24, in_sbp=in_sbp, out_sbp=out_sbp)
    e = f.explain(*args)
    assert starts
    for start, res in starts:
        assert start and set(start.values()) == {1.0}
        assert res.started
    # the same program with half a second: never costlier than the start
    program, ins, outs = e.propagation.program, list(e.propagation.in_sbp), list(e.propagation.out_sbp)
    greedy = propagate(program, pl24, ins, outs)
    prop, choice = solve_module.solve(program, pl24, ins, outs, greedy, time_limit=0.5, start=greedy)
    assert prop is not None, choice.reason
    assert solve_module.price(prop) <= solve_module.price(greedy) + 1e-6

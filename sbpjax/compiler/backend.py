"""Solving a :class:`~sbpjax.compiler.formulate.Formulation` with :mod:`sbpjax.solver`.

The formulation is handed to the solver in the contest's form (nodes with
strategy costs and usages, edges with cost tables, a usage limit) and solved
within a work limit, never a wall clock: the same formulation and effort give
the same strategies on any machine. Its cost tables start as lower bounds
(:mod:`sbpjax.compiler.tables`); :func:`solve_settled` plans the entries a
solution uses and solves again until they are all exact.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sbpjax.solver import Problem, solve

# The most of the effort left a heuristic settling round may spend (see solve_settled).
HEURISTIC_SHARE = 1 / 4


def spent(left: int, effort: int) -> bool:
    """Whether ``effort`` is spent: less than ``1/64`` of it is ``left``. Where
    the settling rounds stop (:func:`solve_settled`) and a later solve of the
    same choice is not started (``second_looks.fewer_collectives``). The fraction is
    a cut-off, not a derived figure: with a quarter of what is left per
    heuristic round, it ends the rounds after about fifteen."""
    return left < effort // 64


@dataclasses.dataclass
class Solved:
    """``strategies``: one per node (None when no solution exists);
    ``cost``: its cost in the form's units (1/64 bytes), ``const``
    included; ``bound``: a proven lower bound of the optimum (None: none
    known); ``status``: how the solve ended; ``rounds``: solves until every
    cost table entry the solution uses was exact; ``work``: the effort
    the rounds spent together."""

    strategies: list | None
    cost: float | None
    bound: float | None
    status: str
    rounds: int = 1
    work: int = 0


def solve_settled(form, effort: int, start=None, usage_limit=None) -> Solved:
    """Solve ``form``, plan the table entries its solution uses exactly
    (``Formulation.settle``) and solve again from that solution, until the
    entries it uses are all exact. The tables' bounds never exceed their
    costs, so the last solve's lower bound holds for the exact tables.

    ``effort`` is the work of all the rounds together. A round the solver
    proves optimal (an exact elimination) may spend all that is left, and
    spends only what that needs; a heuristic round (no exact elimination
    fits) at most a quarter of what is left (``HEURISTIC_SHARE``), so
    the rounds after it, whose tables are more exact, still get work. When
    less than ``1/64`` of it is left the last solution stands; its entries
    are then planned exactly and its cost priced on them, so the plan and
    its objective always agree.

    Decisions: not ``effort`` per round, because a problem the solver cannot
    prove (tied layers, a binding memory budget, a 2-D GPT with hundreds of
    strategies a node) would spend it ten to twenty times over. Not all
    that is left per heuristic round: the first round, whose entries are
    mostly lower bounds, then spent two thirds of the effort on a plan the
    settling showed optimistic, and the rounds that corrected it got
    scraps. The share was swept on the 3-layer 2-D GPT steps of
    ``tests/compiler/test_choose.py``'s sweep, where the solve is heuristic
    (2x2x2, seed 603; bytes moved, GSPMD 7.88 MB): all 7.95 MB, 1/2 6.83 MB,
    1/4 5.61 MB, 1/8 5.55 MB (the same objective as 1/4, in more rounds).
    Many rounds of search from the last settled plan beat one deep search
    on optimistic tables; below 1/4 nothing more was gained."""
    rounds = 0
    left = int(effort)
    if start is not None:
        form.settle(start)  # the plan in hand's costs exact from the first solve on
    while True:
        solved, work = solve_form(
            form, max(left, 1), start, usage_limit, search_effort=max(int(left * HEURISTIC_SHARE), 1)
        )
        left -= work
        rounds += 1
        solved.rounds, solved.work = rounds, int(effort) - left
        if solved.strategies is None or not form.settle(solved.strategies):
            return solved
        start = solved.strategies
        if spent(left, effort):
            solved.cost = float(form_problem(form, usage_limit).evaluate(start)[0]) + form.const
            solved.status += "; its cost tables settled after the effort was spent"
            return solved


def form_problem(form, usage_limit=None) -> Problem:
    """``form`` as it stands in the solver's form. Without a memory budget its
    tables (float64 arrays of the right shapes, made by the formulation) go in
    unchecked (``Problem._prechecked``)."""
    edges = [(u, v, t) for (u, v), t in form.edges.items()]
    if usage_limit is None:
        return Problem._prechecked(form.costs, edges)
    return Problem(
        form.costs,
        edges,
        usages=form.usages,
        intervals=np.array([[0, 1]] * len(form.costs)),
        usage_limit=float(usage_limit - form.const_usage),
    )


def solve_form(
    form, effort: int, start=None, usage_limit=None, search_effort: int | None = None
) -> tuple[Solved, int]:
    """One solve of ``form`` as it stands (see :func:`solve_settled`), and
    the work it did."""
    costs = form.costs
    if not costs:
        if usage_limit is not None and form.const_usage > usage_limit:
            # every layout fixed and over the budget (it was returned as if it fit)
            return Solved(None, None, None, "no layout fits the memory budget"), 0
        return Solved([], form.const, form.const, "no choice to make"), 0
    problem = form_problem(form, usage_limit)
    if start is not None:
        # a strategy the plan in hand does not name: the node's cheapest of its own
        start = [s if s >= 0 else int(np.argmin(c)) for s, c in zip(start, costs)]
    sol = solve(problem, effort=effort, start=start, search_effort=search_effort)
    work = int(sol.stats.get("work", effort))
    if not sol.feasible:
        why = "no layout fits the memory budget" if np.isfinite(sol.cost) else "no allowed strategy"
        return Solved(None, None, None, why), work
    bound = None if not np.isfinite(sol.lower_bound) else sol.lower_bound + form.const
    status = "optimal" if sol.optimal else f"stopped at its effort, gap {100 * sol.gap:.2f}%"
    return Solved([int(s) for s in sol.strategies], sol.cost + form.const, bound, status), work


__all__ = ["Solved", "solve_settled", "solve_form", "form_problem", "spent"]

"""``solve``: one strategy per node, at least cost within the usage limit.

The steps (each counts its work against the budget):

1. exact reductions (``_reduce``): pruning, merging dependent nodes, additive pairs;
2. elimination (``_eliminate``, ``_plan``): when the reduced graph is narrow enough that no
   table exceeds ``TABLE_CAP`` entries in the min-size order, or else in the least-fill
   order (``_fill_order``), one elimination gives the optimum without the usage limit,
   which is the answer when it fits the limit (``lower_bound == cost``); otherwise
   mini-bucket elimination gives a lower bound and a first solution;
3. otherwise, the pairwise relaxation's dual (``_dual``) raises the bound and decodes a
   solution, which ends the solve where the two meet (the relaxation is tight);
4. large-neighbourhood moves and, with a binding usage limit, Lagrangian multipliers
   with repair and single-node moves (``_search``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.solver import _dual, _eliminate, _kept_plans
from sbpjax.solver._budget import Budget
from sbpjax.solver._eliminate import Plan
from sbpjax.solver._memory import MemorySearch
from sbpjax.solver._model import Model, raw_model, separate_minima
from sbpjax.solver._reduce import reduce
from sbpjax.solver._search import Incumbent, Search
from sbpjax.solver.problem import Problem

# The largest table an exact elimination may build: 2**24 float64 entries, 128 MiB (the
# step that builds it holds up to three such arrays, a few hundred MB at the very worst).
# Wider graphs go to the heuristic. Decision: 2**24, not 2**22 (32 MiB) as before: the model
# zoo's scanned 4-layer decoder needs 9.7e6 entries in its least-fill order; at 2**22 its
# solve ran to the end of its effort (28 s, a 10.99% gap), at 2**24 it is exact in about a
# second, the solver's memory at 100 MB (tracemalloc). A graph far wider than that gains
# nothing from a larger cap within a laptop's memory.
TABLE_CAP = float(2**24)
# Tables of a move (conditioning) and of the mini-bucket bound: swept over 1e4-1e6 on the
# IOPDDL instances and the synthetic train steps; 1e5 reached the best cost per unit of
# work on each (1e4 conditions too many nodes, 1e6 makes each move ten times dearer).
MOVE_CAP = 1e5
# Default effort in table entries. An exact solve of the largest synthetic train step of
# the tests (400 layers, 16,002 nodes, up to 30 strategies a node) needs 5.1e8; four times
# that leaves room for wider programs of the same size, and for a heuristic solve it is
# about 40 moves of the largest IOPDDL instance's reduced graph.
DEFAULT_EFFORT = 2e9
# Library mode stops after this many rounds in a row without a better solution (contest
# mode runs until the time is up): on the IOPDDL instance G a round finds nothing twice
# in a row, then the optimum, in some runs; three covers that at a round's cost.
IDLE_ROUNDS = 3


@dataclass(frozen=True)
class Solution:
    """The result of :func:`solve`.

    :ivar strategies: one strategy index per node (int64).
    :ivar cost: its total cost (inf if it uses a strategy that is not allowed).
    :ivar lower_bound: a proven lower bound on the least cost of a feasible solution
        (inf when none exists, -inf when nothing better is known).
    :ivar feasible: finite cost and within the usage limit.
    :ivar stats: what the reductions left, which steps ran, the work done.
    """

    strategies: np.ndarray
    cost: float
    lower_bound: float
    feasible: bool
    stats: dict = field(default_factory=dict)

    @property
    def optimal(self) -> bool:
        """Proven optimal: feasible and the lower bound reaches the cost."""
        return self.feasible and self.lower_bound >= self.cost

    @property
    def gap(self) -> float:
        """(cost - lower_bound) / cost: 0 when proven optimal."""
        if not self.feasible:
            return np.inf
        if self.lower_bound >= self.cost:
            return 0.0
        return (self.cost - self.lower_bound) / max(abs(self.cost), 1e-300)


def solve(
    problem: Problem,
    *,
    effort: float | None = None,
    time_limit: float | None = None,
    start=None,
    search_effort: float | None = None,
) -> Solution:
    """The cheapest strategies found for ``problem``.

    :param effort: the work limit, in table entries built or read (library mode, the
        default ``DEFAULT_EFFORT``: see its comment for how it was set). The result is a pure
        function of ``(problem, effort, start)``: no clock, no unseeded randomness, no
        order that depends on hashing or memory addresses, one thread. A larger effort never
        gives a worse solution: the solve follows the same steps and only stops later.
    :param time_limit: seconds (contest mode): run until then, as the IOPDDL contest did;
        the result then depends on the machine's speed. Exclusive with ``effort``.
    :param start: a solution to start from (one strategy per node); the answer is never
        worse than it.
    :param search_effort: library mode: the most work (of ``effort``, counted from the
        start) a heuristic solve may do when no exact elimination fits ``effort``; an exact
        elimination may still spend all of ``effort``. For callers that solve a problem
        again with better costs and want work left for the later solves.
    """
    if effort is not None and time_limit is not None:
        raise SBPError("solve: give effort (deterministic) or time_limit (wall clock), not both.")
    if effort is not None and not effort > 0:
        raise SBPError(f"solve: effort must be a positive number of table entries, got {effort!r}.")
    if time_limit is not None and not time_limit > 0:
        raise SBPError(f"solve: time_limit must be positive seconds, got {time_limit!r}.")
    s_start = None if start is None else problem.check_strategies(start)
    if time_limit is not None:
        budget = Budget(np.inf, time.monotonic() + float(time_limit))
    else:
        budget = Budget(DEFAULT_EFFORT if effort is None else float(effort))
    if search_effort is not None and not search_effort > 0:
        raise SBPError(
            f"solve: search_effort must be a positive number of table entries, got {search_effort!r}."
        )
    return _Solve(problem, budget, s_start, search_effort).run()


class _Solve:
    def __init__(
        self, problem: Problem, budget: Budget, start: np.ndarray | None, search_effort: float | None = None
    ):
        self.p, self.budget, self.start = problem, budget, start
        self.search_effort = search_effort
        self.stats: dict = {"nodes": problem.num_nodes, "edges": len(problem.edges)}
        self.lower_bound = -np.inf
        # the mini-bucket plan of a graph too wide for an exact one (None otherwise): the
        # usage limit's multiplier steps solve the whole priced model with it (``_memory``)
        self.bound_plan: Plan | None = None

    def run(self) -> Solution:
        raw = raw_model(self.p)
        self.budget.spend(len(raw.pflat) + len(raw.unary))
        model = reduce(raw)
        self.budget.spend(4 * (len(raw.pflat) + len(raw.unary)))  # a few passes per round
        self.stats.update(model_nodes=model.n, model_pairs=model.npairs, model_entries=len(model.pflat))
        if model.infeasible is not None:
            self.stats["infeasible"] = model.infeasible
            self.lower_bound = np.inf
            return self._finish(None, model)
        # a bound however little effort is left (the elimination's may not be afforded);
        # one pass over the tables, not charged so that plans stay as they were
        self.lower_bound = separate_minima(model, model.unary, model.pflat)
        inc = Incumbent(model, self.budget)
        if self.start is not None:
            s0 = model.from_original(self.start)
            if s0 is not None:
                inc.offer(s0)
        inc.offer(_argmin(model))
        exact = self._eliminate(model, inc)
        mem_binds = model.memory is not None and not inc.feasible
        if exact is not None and not mem_binds:
            self.lower_bound = max(self.lower_bound, inc.cost)
        else:
            if self.search_effort is not None:
                self.budget.effort = min(self.budget.effort, float(self.search_effort))
            if exact is None and not mem_binds:
                # the relaxation drops the usage limit: where the limit binds its bound is
                # the unlimited optimum's and its solutions break the limit, so the time
                # goes to the multiplier steps (IOPDDL's S: 1.060 of the best submitted
                # cost with the relaxation first, 1.044 without)
                spent = self._relax(model, inc)
            else:
                spent = False
            if not spent and not self._proven(inc):
                self._search(model, inc, exact)
        return self._finish(inc, model)

    def _relax(self, model: Model, inc: Incumbent) -> bool:
        """The relaxation's bound, and its decoded solutions offered to ``inc``.
        True when it stopped for want of effort: the solve then ends there, so that a
        larger effort runs the same ascent further and is never worse (a search from an
        ascent cut short could find what the longer ascent's search does not)."""

        def offer(s):
            inc.offer(s)
            return inc.cost if inc.feasible else None

        bound, spent = _dual.ascend(model, self.budget, offer, self.stats)
        self.lower_bound = max(self.lower_bound, bound)
        return spent

    def _proven(self, inc: Incumbent) -> bool:
        """The best solution is within ``_dual.PROVEN`` of the lower bound."""
        return inc.feasible and inc.cost - self.lower_bound <= _dual.PROVEN * abs(inc.cost)

    def _eliminate(self, model: Model, inc: Incumbent) -> _eliminate.Plan | None:
        """The exact plan when the graph is narrow enough (its run offered to ``inc``),
        else None after a mini-bucket bound and first solution."""
        plan = _kept_plans.elimination_plan(model, TABLE_CAP, "exact")
        self.budget.spend(len(model.pflat) + model.n)
        if plan is None:  # min-size's order too wide: the least-fill order may not be
            plan = _kept_plans.elimination_plan(model, TABLE_CAP, "fill")
            self.budget.spend(len(model.pflat) + model.n)
        if plan is None:
            self.stats["exact"] = False
            plan = _kept_plans.elimination_plan(model, MOVE_CAP, "minibucket")
            assert plan is not None
        else:
            self.stats["exact"] = True
        self.stats["elimination_work"] = plan.work
        if not self.budget.affords(plan.work):
            self.stats["exact"] = False
            return None
        self.budget.spend(plan.work)
        value, s = _eliminate.run(plan, model, model.unary)
        self.lower_bound = max(self.lower_bound, value)
        inc.offer(s)
        if not plan.exact:
            self.bound_plan = plan
        return plan if plan.exact else None

    def _search(self, model: Model, inc: Incumbent, exact: Plan | None) -> None:
        """Rounds of moves (and multiplier steps), each from the best solution so far with
        fresh plans, until a round improves nothing (library mode) or time is up."""
        search = Search(model, self.budget, inc, MOVE_CAP)
        whole = exact
        if whole is None and self.budget.deadline is not None:
            # contest mode only: in library mode, at the effort of a solve within sj.jit,
            # the moves' steps did as well or better (train_step(30, shared=4, memory=1.15)
            # at 5e8: 34,555 with moves, 34,564 with mini-bucket steps), so library mode
            # keeps them and its answers stay as they were
            whole = self.bound_plan
        memory = MemorySearch(search, whole) if model.memory is not None else None
        rounds = idle = 0
        while not self.budget.over():
            assert inc.s is not None
            before = inc.improvements
            first = rounds * 1000
            if memory is None:
                search.descend_moves(inc.s, Search.POOL, first)
            else:
                shape, scale = memory.weights(inc.s, first + 100)
                memory.centred(scale * shape, scale, first + 500, Search.POOL)
            rounds += 1
            idle = 0 if inc.improvements > before else idle + 1
            if (memory is not None and memory.proven()) or (
                self.budget.deadline is None and idle >= IDLE_ROUNDS
            ):
                break
        if memory is not None:
            self.lower_bound = max(self.lower_bound, memory.lower_bound)
            self.stats["priced_steps"] = memory.steps
        self.stats.update(rounds=rounds, moves=search.moves)
        self.stats["trace"] = [(w, k[2]) for w, k in inc.trace if k[0] == 0]

    def _finish(self, inc: Incumbent | None, model: Model) -> Solution:
        if inc is not None and inc.s is not None:
            s = model.to_original(inc.s)
        else:
            s = np.array([int(np.argmin(c)) for c in self.p.costs], dtype=np.int64)
        if self.start is not None and _better(self.p, self.start, s):
            s = self.start.copy()
        cost, feasible, peak = self.p.evaluate(s)
        lb = self.lower_bound
        if feasible:
            lb = min(lb, cost)  # float sums of integer costs can round above the exact total
        self.stats.update(work=self.budget.spent, peak_usage=peak)
        return Solution(s, cost, lb, feasible, self.stats)


def _argmin(model: Model) -> np.ndarray:
    """Each node's cheapest strategy on its own."""
    _, arg = _eliminate.seg_argmin(model.unary, model.k)
    return arg


def _better(problem: Problem, a: np.ndarray, b: np.ndarray) -> bool:
    ca, fa, pa = problem.evaluate(a)
    cb, fb, pb = problem.evaluate(b)
    return (not fa, pa if not fa else 0.0, ca) < (not fb, pb if not fb else 0.0, cb)

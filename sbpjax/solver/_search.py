"""The heuristic part of a solve: large-neighbourhood moves and Lagrangian multipliers.

*Moves.* A move re-solves the whole model by elimination with a few nodes held where they
are (``_plan`` in conditioning mode): the nodes held are the ones of most neighbours,
outside a *protected* region (a breadth-first ball around a seed node) that the move may
change freely. A move never makes the solution worse for the costs it is given. Plans
depend only on the graph, so a pool of them (one per seed) is built once and reused.

*Memory.* The usage limit is relaxed with one multiplier per time segment (only
*maximal* segments, where some piece starts and some ends, can bind when usages are not
negative). The multipliers price usage into the unary costs; moves optimize the priced
problem; each result is repaired into the limit and improved by single-node moves
(``_local``); the multipliers follow the subgradient (usage minus limit) with a
Polyak-type step toward the best cost found. When the priced problem is solved exactly
(an exact plan), each step also gives a lower bound: the priced minimum minus the
multipliers times the limit.

Every choice is made by a generator seeded from the iteration number, and every step's
work is counted, so the trajectory is the same at any effort; a larger effort only lets it
run longer.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver import _eliminate, _plan
from sbpjax.solver._budget import Budget
from sbpjax.solver._local import State, Steps
from sbpjax.solver._model import Model


class Incumbent:
    """The best solution seen: feasible before infeasible, then by cost (feasible) or by
    excess usage, then cost (infeasible)."""

    def __init__(self, model: Model, budget: Budget):
        self.m = model
        self.budget = budget
        self.s: np.ndarray | None = None
        self.key: tuple = (2, np.inf, np.inf)
        self.improvements = 0
        self.trace: list = []  # (work spent, key) at each improvement

    def key_of(self, s: np.ndarray) -> tuple:
        cost = self.m.costs(s)
        mem = self.m.memory
        excess = 0.0
        if mem is not None and mem.nseg:
            excess = float(np.maximum(mem.profile(self.m.noff, s) - mem.limit, 0).sum())
        if not np.isfinite(cost):
            return (2, excess, cost)
        return (0, 0.0, cost) if excess == 0 else (1, excess, cost)

    def offer(self, s: np.ndarray) -> bool:
        key = self.key_of(s)
        if key < self.key:
            self.key, self.s = key, s.copy()
            self.improvements += 1
            self.trace.append((self.budget.spent, key))
            return True
        return False

    @property
    def feasible(self) -> bool:
        return self.key[0] == 0

    @property
    def cost(self) -> float:
        return self.key[2]


class Search:
    # Each move protects this share of the nodes (a ball) from conditioning. Swept over
    # 0.02-0.3 on the IOPDDL instances and the synthetic train steps: 0.05 was best or
    # within 1% of best on each; smaller balls leave hubs frozen, larger ones force
    # conditioning of ordinary nodes, which freezes more of the graph.
    BALL = 0.05
    POOL = 16  # plans kept (by seed); the multiplier steps cycle through these
    CYCLE = 1 << 20  # seeds repeat after this many moves

    def __init__(self, model: Model, budget: Budget, incumbent: Incumbent, cap: float):
        self.m, self.budget, self.inc, self.cap = model, budget, incumbent, cap
        ptr, _, other = _eliminate.adjacency(model)
        self.nb = [other[ptr[i] : ptr[i + 1]].tolist() for i in range(model.n)]
        self.plans: dict = {}
        self.leaves = _eliminate.leaf_rounds(model, 16)
        self.steps = Steps(model) if model.memory is not None else None
        self.moves = 0
        self.lower_bound = -np.inf
        self.lagrange_steps = 0

    # ---- moves ----------------------------------------------------------------------

    def _ball(self, rng: np.random.Generator) -> np.ndarray:
        n = self.m.n
        inside = np.zeros(n, dtype=bool)
        size = max(1, int(self.BALL * n))
        seed = int(rng.integers(n))
        inside[seed] = True
        count, front = 1, [seed]
        while front and count < size:
            nxt = []
            for x in front:
                for y in self.nb[x]:
                    if not inside[y] and count < size:
                        inside[y] = True
                        count += 1
                        nxt.append(y)
            front = nxt
        return inside

    def _plan(self, seed: int) -> _eliminate.Plan:
        seed %= self.CYCLE
        plan = self.plans.get(seed)
        if plan is None:
            rng = np.random.default_rng(seed)
            protect = self._ball(rng)
            plan = _plan.plan(self.m, self.cap, "condition", rng.permutation(self.m.n), protect, leaves=self.leaves)
            assert plan is not None
            self.budget.spend(len(self.m.pflat) + self.m.n)
            if seed < self.POOL:
                self.plans[seed] = plan
        return plan

    def move(self, s: np.ndarray, unary: np.ndarray, seed: int) -> np.ndarray | None:
        """The move of plan ``seed`` from ``s`` with these costs, or None when the budget
        cannot pay it."""
        plan = self._plan(seed)
        if not self.budget.affords(plan.work):
            return None
        self.budget.spend(plan.work)
        self.moves += 1
        return _eliminate.run(plan, self.m, unary, s)[1]

    def descend_moves(self, s: np.ndarray, patience: int, first: int = 0) -> np.ndarray:
        """Moves with the plain costs (plans ``first``, ``first + 1``, ...) until ``patience``
        in a row find nothing better."""
        cost, idle, j = self.m.costs(s), 0, first
        while idle < patience:
            nxt = self.move(s, self.m.unary, j)
            j += 1
            if nxt is None:
                break
            c = self.m.costs(nxt)
            idle = 0 if c < cost - 1e-9 * (1 + abs(cost)) else idle + 1
            s, cost = nxt, c
            self.inc.offer(s)
            if self.steps is not None:
                self.polish(s, self.budget.spent + 20.0 * (len(self.m.pflat) + len(self.m.unary)))
        return s

    # ---- memory ---------------------------------------------------------------------

    def polish(self, s: np.ndarray, limit: float) -> np.ndarray:
        """``s`` repaired into the usage limit and improved by single-node moves."""
        assert self.steps is not None
        state = State(self.m, self.steps, s)
        cap = min(limit, self.budget.left())
        ok = state.repair(cap)
        if ok:
            state.descend(cap)
        self.budget.spend(state.work)
        self.inc.offer(state.s)
        return state.s

    def lagrange(self, s: np.ndarray, exact: _eliminate.Plan | None, patience: int, inner: int, first: int = 0) -> None:
        """Multiplier steps until ``patience`` steps in a row improve nothing (the step size
        halves each time) or the budget ends."""
        m = self.m
        mem = m.memory
        assert mem is not None
        starts = np.zeros(mem.nseg + 1, bool)
        ends = np.zeros(mem.nseg + 1, bool)
        starts[mem.qlo] = True
        ends[mem.qhi] = True
        binding = starts[:-1] & ends[1:] if (mem.qusage >= 0).all() else np.ones(mem.nseg, bool)
        lam = np.zeros(mem.nseg)
        theta, idle, j = 1.0, 0, first
        polish_work = 20.0 * (len(m.pflat) + len(m.unary))
        while not self.budget.over() and theta > 1e-3:
            unary = m.unary + mem.penalty(m.noff, len(m.unary), lam)
            self.budget.spend(len(mem.qusage))
            if exact is not None:
                if not self.budget.affords(exact.work):
                    return
                self.budget.spend(exact.work)
                value, s = _eliminate.run(exact, m, unary)
                self.lower_bound = max(self.lower_bound, value - float(lam.sum()) * mem.limit)
            else:
                for _ in range(inner):
                    nxt = self.move(s, unary, j)
                    j += 1
                    if nxt is None:
                        return
                    s = nxt
            before = self.inc.improvements
            self.inc.offer(s)
            self.polish(s, self.budget.spent + polish_work)
            self.lagrange_steps += 1
            if self.inc.feasible and self.lower_bound >= self.inc.cost - 1e-9 * abs(self.inc.cost):
                return  # proven optimal
            g = np.where(binding, mem.profile(m.noff, s) - mem.limit, 0.0)
            priced = m.costs(s) + float(lam @ g)
            target = self.inc.cost if self.inc.feasible else 1.05 * m.costs(s)
            norm = float(g @ g)
            if norm > 0 and np.isfinite(target):
                lam = np.maximum(0.0, lam + theta * max(target - priced, 0.01 * abs(target)) / norm * g)
            idle = 0 if self.inc.improvements > before else idle + 1
            if idle >= patience:
                theta, idle = theta / 2, 0

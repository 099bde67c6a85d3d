"""Large-neighbourhood moves: the heuristic part of a solve.

A move re-solves the whole model by elimination with a few nodes held where they are
(``_plan`` in conditioning mode): the nodes held are the ones of most neighbours, outside
a *protected* region (a breadth-first ball around a seed node) that the move may change
freely. A move never makes the solution worse for the costs it is given. Plans depend
only on the graph, so they are built once per seed and reused with any costs (those with
usage priced in, see ``_memory``).

Every choice is made by a generator seeded from the move's number, and every step's work
is counted, so the trajectory is the same at any effort; a larger effort only lets it run
longer.

Plans are also kept across solves of the same graph (:mod:`sbpjax.solver._kept_plans`),
charged to the budget as if built.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver import _eliminate, _kept_plans, _plan
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
    POOL = 16  # seeds a phase cycles through (twice as many plans are kept)
    CYCLE = 1 << 20  # seeds repeat after this many moves
    POLISH = 20  # a repair or a descent may read the model's tables this many times

    def __init__(self, model: Model, budget: Budget, incumbent: Incumbent, cap: float):
        self.m, self.budget, self.inc, self.cap = model, budget, incumbent, cap
        ptr, _, other = _eliminate.adjacency(model)
        self.nb = [other[ptr[i] : ptr[i + 1]].tolist() for i in range(model.n)]
        self.cumdeg = np.cumsum(np.diff(ptr), dtype=np.float64) if model.n else np.zeros(1)
        self.plans: dict = {}
        self.graph = _kept_plans.graph_key(model, cap)
        self.leaves = _kept_plans.leaves(model)
        self.steps = Steps(model) if model.memory is not None else None
        self.moves = 0

    # ---- moves ----------------------------------------------------------------------

    def _ball(self, rng: np.random.Generator) -> np.ndarray:
        n = self.m.n
        inside = np.zeros(n, dtype=bool)
        size = max(1, int(self.BALL * n))
        # centres: any node, or (every other plan) a node drawn in proportion to its degree,
        # so that the nodes of many neighbours, which are the ones held, get freed too
        if rng.random() < 0.5 or not self.cumdeg[-1] > 0:
            seed = int(rng.integers(n))
        else:
            seed = int(np.searchsorted(self.cumdeg, rng.random() * self.cumdeg[-1], side="right"))
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
            plan = _kept_plans.kept(
                _kept_plans.GRAPH_PLANS, (self.graph, seed), lambda: self._build(seed), _kept_plans.PLANS_KEPT
            )
            self.budget.spend(len(self.m.pflat) + self.m.n)  # as if built (module docstring)
            if len(self.plans) >= 2 * self.POOL:  # keep the newest: phases reuse a window of seeds
                del self.plans[next(iter(self.plans))]
            self.plans[seed] = plan
        return plan

    def _build(self, seed: int) -> _eliminate.Plan:
        rng = np.random.default_rng(seed)
        protect = self._ball(rng)
        plan = _plan.plan(
            self.m, self.cap, "condition", rng.permutation(self.m.n), protect, leaves=self.leaves
        )
        assert plan is not None
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
            self.polish(s)
        return s

    # ---- memory ---------------------------------------------------------------------

    def polish(self, s: np.ndarray) -> np.ndarray:
        """``s`` repaired into the usage limit and improved by single-node moves (each at
        most ``POLISH`` passes over the model's tables)."""
        assert self.steps is not None
        state = State(self.m, self.steps, s, self.budget.late)
        ok = state.repair(min(self._polish_work(), self.budget.left()))
        if ok:
            state.descend(state.work + min(self._polish_work(), self.budget.left()))
        self.budget.spend(state.work)
        self.inc.offer(state.s)
        return state.s

    def descend_local(self, s: np.ndarray) -> np.ndarray:
        """``s`` (within the limit) improved by single-node moves that keep it so."""
        assert self.steps is not None
        state = State(self.m, self.steps, s, self.budget.late)
        state.descend(min(self._polish_work(), self.budget.left()))
        self.budget.spend(state.work)
        return state.s

    def _polish_work(self) -> float:
        return self.POLISH * float(len(self.m.pflat) + len(self.m.unary))

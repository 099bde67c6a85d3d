"""The usage limit: priced into the costs, Lagrangian-style, then kept exactly.

The limit on each time segment t is relaxed with a multiplier ``lam[t] >= 0``: a node's
strategy then costs its usage in t times ``lam[t]``, summed over the segments it is live
in. Moves (``_search``) optimize the priced costs; the result is repaired into the limit
and improved by single-node moves (``_local``). Two phases, after the published IOPDDL
solvers' ideas (penalties on usage tuned between feasible and infeasible results; repair
and local search), in our own form:

1. *Weights*: ``lam = w * v``, where ``v`` accumulates each segment's relative excess
   over the steps (where the limit bites, and how often) and the scale ``w`` is bisected
   between the largest one whose priced optimum broke the limit and the smallest one
   whose did not (doubling until one does not). Each step solves the whole priced model
   with one elimination plan when there is one: the exact plan, or on a graph too wide
   for it, in contest mode only, the mini-bucket plan (``solve``'s bound; library mode
   keeps the moves there, see ``solve._Solve._search``). Either way each step also proves a
   lower bound: the plan's value (the priced minimum, or a bound of it) minus
   ``sum(lam) * limit``. Without a plan, a step is two moves (``_search``), which only
   change a ball of the graph: on the IOPDDL instances M and S, whose limits need most
   nodes to shard in step, moves alone stalled at 1.69x and 1.26x the best submitted
   costs, where mini-bucket steps reach a feasible 1.03x and 1.18x in about ten steps.
2. *Centred moves*: from the best solution within the limit, moves with the priced costs;
   a result within the limit and cheaper (after single-node moves) is kept, and the
   prices relax (x0.8); one over the limit raises the prices of the segments it broke and
   is repaired (kept if that makes it cheaper). The prices carry over to the next round.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver import _eliminate
from sbpjax.solver._search import Search


class MemorySearch:
    WEIGHT_STEPS = 24  # bisection steps at most (a factor 2**-24 between the bracket ends)
    RELAX = 0.8  # prices after a kept move

    def __init__(self, search: Search, whole: _eliminate.Plan | None):
        self.se = search
        self.m = search.m
        memory = search.m.memory
        assert memory is not None
        self.mem = memory
        self.whole = whole  # an exact or mini-bucket plan of the whole model, or None
        self.lower_bound = -np.inf
        self.steps = 0
        self.lam: np.ndarray | None = None  # the centred phase's prices, kept for the next round

    def _excess(self, s: np.ndarray) -> np.ndarray:
        return np.maximum(self.mem.profile(self.m.noff, s) - self.mem.limit, 0.0) / self.mem.limit

    def _priced(self, lam: np.ndarray) -> np.ndarray:
        self.se.budget.spend(len(self.mem.qusage))
        return self.m.unary + self.mem.penalty(self.m.noff, len(self.m.unary), lam)

    def _scale(self, s: np.ndarray, shape: np.ndarray) -> float:
        """A price scale that makes the priced usage of ``s`` about as large as its cost."""
        priced = self.mem.penalty(self.m.noff, len(self.m.unary), shape)[self.m.noff[:-1] + s].sum()
        return abs(self.m.costs(s)) / priced if priced > 0 else 1.0

    def _inner(self, s: np.ndarray, lam: np.ndarray, seed: int, moves: int) -> np.ndarray | None:
        """The priced optimum (exact plan), the mini-bucket read-back of it, or ``moves``
        moves from ``s``; None: no budget."""
        unary = self._priced(lam)
        if self.whole is not None:
            if not self.se.budget.affords(self.whole.work):
                return None
            self.se.budget.spend(self.whole.work)
            value, s = _eliminate.run(self.whole, self.m, unary)
            self.lower_bound = max(self.lower_bound, value - float(lam.sum()) * self.mem.limit)
            return s
        for j in range(moves):
            nxt = self.se.move(s, unary, seed + j)
            if nxt is None:
                return None
            s = nxt
        return s

    def weights(self, s: np.ndarray, first: int, moves: int = 2) -> tuple[np.ndarray, float]:
        """Phase 1 from ``s``: the accumulated shape ``v`` and the last scale ``w``."""
        v = np.zeros(self.mem.nseg)
        w, lo, hi = 0.0, 0.0, np.inf
        for step in range(self.WEIGHT_STEPS):
            over = self._excess(s)
            if not over.any() and not v.any():
                return v, 0.0  # within the limit unpriced: nothing to price yet
            v += over
            w = w or self._scale(s, v)
            nxt = self._inner(s, w * v, first + (step * moves) % self.se.POOL, moves)
            if nxt is None:
                break
            s = nxt
            self.steps += 1
            self.se.inc.offer(s)
            self.se.polish(s)
            if self._excess(s).any():
                lo = max(lo, w)
            else:
                hi = min(hi, w)
            if self.proven() or (lo > 0 and hi < 1.1 * lo):
                break
            w = 2 * w if not np.isfinite(hi) else (np.sqrt(lo * hi) if lo > 0 else hi / 2)
        return v, w

    def centred(self, lam: np.ndarray, scale: float, first: int, patience: int) -> None:
        """Phase 2: priced moves from the best solution within the limit (plans ``first`` ..
        ``first + POOL - 1`` in turn), until ``patience`` in a row keep nothing. A result
        over the limit raises the prices where it broke it, and is repaired."""
        inc, se = self.se.inc, self.se
        if not inc.feasible:
            return
        assert inc.s is not None
        lam = np.maximum(lam, self.lam) if self.lam is not None else lam
        cur, cost = inc.s.copy(), inc.cost
        idle = j = 0
        while idle < patience and not se.budget.over():
            nxt = se.move(cur, self._priced(lam), first + j % se.POOL)
            j += 1
            if nxt is None:
                break
            self.steps += 1
            over = self._excess(nxt)
            if over.any():
                scale = scale or self._scale(nxt, over)
                lam = lam + scale * over
                nxt = se.polish(nxt)
                if self._excess(nxt).any():
                    idle += 1
                    continue
            else:
                nxt = se.descend_local(nxt)
                lam = lam * self.RELAX
            if self.m.costs(nxt) < cost:
                cur, cost, idle = nxt, self.m.costs(nxt), 0
                inc.offer(cur)
            else:
                idle += 1
        self.lam = lam

    def proven(self) -> bool:
        inc = self.se.inc
        return inc.feasible and self.lower_bound >= inc.cost - 1e-9 * abs(inc.cost)

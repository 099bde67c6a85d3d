"""A lower bound, and often the optimum, from the pairwise relaxation of the model.

The model's cost is a sum of unary and pairwise terms. Its linear relaxation over the
local polytope has a dual whose every point is a *reparametrization*: messages
``lu[p](a)`` and ``lv[p](b)`` move cost from pair ``p`` into its two nodes, so that for
every assignment ``x``

    sum_i b_i(x_i) + sum_p (T_p(x_u, x_v) - lu_p(x_u) - lv_p(x_v)) = cost(x),

with ``b_i = unary_i + the messages into i``. Hence each node's least ``b_i`` plus each
pair's least remaining entry is a lower bound of every solution's cost, whatever the
messages (the identity is exact; only float rounding separates it from the bound).

The messages are raised by MPLP's edge updates (Globerson and Jaakkola, NIPS 2007), block
coordinate ascent on that dual: each update of pair ``(u, v)`` splits the pair's least
cost given each side evenly between its two nodes, which never lowers the bound. Pairs
that share no node are updated together (one class of a greedy edge colouring), so a
sweep is a few numpy operations per class. Where the relaxation is tight, as it is on
the layout problems of train steps measured so far (the scanned FSDP + tensor-parallel
GPTs: 448-449 nodes, 515-517 pairs, 2-4 layers, d_model 64-128, on 2x4 and 4x2; each
settling solve proven within 170-520 sweeps), the decoded solution (``decode``) is
optimal and the bound proves it, so the solve needs no search.

Strategies that are not allowed (infinite cost) take a finite cost above any allowed
solution's (``_finite``): the relaxation of that problem bounds the same optimum.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver._budget import Budget
from sbpjax.solver._model import Model, local_index, offsets, separate_minima

# Sweeps between two looks at the bound and the decoded solution (a look reads about
# half what a sweep does).
CHECK = 10
# Ascent stops when a look finds the bound grown by less than this share of itself over
# the last CHECK sweeps (the ascent has converged, up to float rounding of the sums), or
# by less than SLOW of the gap left to the best solution: closing it at that pace would
# take 1e6 sweeps. The bound creeps up to the optimum in ever smaller steps, and the
# decoded solutions meet it only near the end: on the scanned FSDP GPT with d_model 128
# the bound grew by 1e-4 of the gap per look 17 looks before the decoded solution
# reached the optimum (1e-3 and 1e-4 stopped short, 1.3% above it).
STALL = 1e-9
SLOW = 1e-5
# A solution within this share of the bound is taken as proven optimal: float64 sums
# of 1e5-1e6 terms round by up to about 1e-11 of their size, and a better solution
# could only gain less than this.
PROVEN = 1e-9


def _finite(values: np.ndarray, big: float) -> np.ndarray:
    out = np.asarray(values, dtype=np.float64).copy()
    out[~np.isfinite(out)] = big
    return out


class Relaxation:
    """The messages of one model, and the index arrays of its colour classes."""

    def __init__(self, model: Model):
        m = self.m = model
        k = m.k.astype(np.int64)
        pu, pv = m.pu.astype(np.int64), m.pv.astype(np.int64)
        ku, kv = k[pu], k[pv]
        # above twice any allowed solution's cost (n + npairs terms, none above the
        # largest finite entry), so a disallowed strategy is never cheaper; a max, not a
        # sum, so that it is exactly the same on every machine
        top = max(float(np.abs(a[np.isfinite(a)]).max(initial=0.0)) for a in (m.unary, m.pflat))
        big = 1.0 + 2.0 * (m.n + m.npairs) * top
        self.unary = _finite(m.unary, big)
        self.pairs = _finite(m.pflat, big)
        self.b = self.unary.copy()
        self.luoff, self.lvoff = offsets(ku), offsets(kv)
        self.lu = np.zeros(int(self.luoff[-1]))
        self.lv = np.zeros(int(self.lvoff[-1]))
        # each pair entry's u-side and v-side message position (pairs are stored by rows)
        sizes = ku * kv
        entry = local_index(sizes)
        kv_e = np.repeat(kv, sizes)
        self.eu = np.repeat(self.luoff[:-1], sizes) + entry // kv_e
        self.ev = np.repeat(self.lvoff[:-1], sizes) + entry % kv_e
        self.classes = [self._class(np.asarray(c, dtype=np.int64), ku, kv) for c in _colour(pu, pv, m.n)]
        # work in entries read, as elimination counts it: a sweep reads each pair entry
        # once for each side and each message twice; a look reads each entry and strategy
        self.sweep_work = 2.0 * (len(self.pairs) + len(self.lu) + len(self.lv))
        self.look_work = float(len(self.pairs) + len(self.unary))
        # per node, its pairs with earlier nodes (a pair's u precedes its v): (pair, u)
        self.earlier: list[list[tuple[int, int]]] = [[] for _ in range(m.n)]
        for p, (u, v) in enumerate(zip(pu.tolist(), pv.tolist())):
            self.earlier[v].append((p, u))

    def _class(self, ps: np.ndarray, ku: np.ndarray, kv: np.ndarray) -> tuple:
        m = self.m
        pu, pv = m.pu[ps].astype(np.int64), m.pv[ps].astype(np.int64)
        cu, cv = ku[ps], kv[ps]
        ent = np.concatenate([np.arange(m.poff[p], m.poff[p + 1]) for p in ps.tolist()])
        pos_u = np.repeat(m.noff[pu], cu) + local_index(cu)
        pos_v = np.repeat(m.noff[pv], cv) + local_index(cv)
        msg_u = np.repeat(self.luoff[ps], cu) + local_index(cu)
        msg_v = np.repeat(self.lvoff[ps], cv) + local_index(cv)
        # each entry's row (u strategy) and column (v strategy) in the class's vectors:
        # its message positions (``eu``, ``ev``) renumbered within the class
        at_u, at_v = np.empty(len(self.lu), np.int64), np.empty(len(self.lv), np.int64)
        at_u[msg_u], at_v[msg_v] = np.arange(len(msg_u)), np.arange(len(msg_v))
        ridx, cidx = at_u[self.eu[ent]], at_v[self.ev[ent]]
        row_starts = offsets(np.repeat(cv, cu))[:-1]
        perm = np.argsort(cidx, kind="stable")
        col_starts = offsets(np.repeat(cu, cv))[:-1]
        return (self.pairs[ent], pos_u, pos_v, msg_u, msg_v, ridx, cidx, row_starts, perm, col_starts)

    def sweep(self) -> None:
        """One MPLP update of every pair, class by class."""
        b, lu, lv = self.b, self.lu, self.lv
        for t, pos_u, pos_v, msg_u, msg_v, ridx, cidx, row_starts, perm, col_starts in self.classes:
            bu = b[pos_u] - lu[msg_u]  # each node's cost without this pair's message
            bv = b[pos_v] - lv[msg_v]
            nu = 0.5 * (np.minimum.reduceat(t + bv[cidx], row_starts) - bu)
            nv = 0.5 * (np.minimum.reduceat((t + bu[ridx])[perm], col_starts) - bv)
            b[pos_u] = bu + nu
            b[pos_v] = bv + nv
            lu[msg_u] = nu
            lv[msg_v] = nv

    def remaining(self) -> np.ndarray:
        """Each pair entry's cost less the two messages it sends (flat as ``pflat``)."""
        return self.pairs - self.lu[self.eu] - self.lv[self.ev]

    def bound(self, rest: np.ndarray | None = None) -> float:
        """Each node's least reparametrized cost plus each pair's least remaining entry
        (``rest``: ``remaining()``, passed where it is at hand)."""
        return separate_minima(self.m, self.b, self.remaining() if rest is None else rest)

    def decode(self, rest: np.ndarray | None = None) -> np.ndarray:
        """A solution read off the messages: nodes in order, each taking its least
        reparametrized cost given the pairs' remaining costs to the nodes already
        chosen. Conditioning breaks the ties the messages leave (at the relaxation's
        optimum many strategies cost the same at a node) consistently with the choices
        made, so a tight relaxation decodes its optimum."""
        m = self.m
        rest = self.remaining() if rest is None else rest
        x = np.zeros(m.n, dtype=np.int64)
        for i in range(m.n):
            score = self.b[m.noff[i] : m.noff[i + 1]].copy()
            ki = int(m.k[i])
            for p, j in self.earlier[i]:  # the row of the earlier node's choice
                score += rest[m.poff[p] + x[j] * ki : m.poff[p] + (x[j] + 1) * ki]
            x[i] = int(np.argmin(score))
        return x


def _colour(pu: np.ndarray, pv: np.ndarray, n: int) -> list[list[int]]:
    """Pairs in classes that share no node: each pair, in order, takes the first class
    neither of its nodes is in yet (at most twice the largest degree classes)."""
    used: list[set] = [set() for _ in range(n)]
    classes: list[list[int]] = []
    for p, (u, v) in enumerate(zip(pu.tolist(), pv.tolist())):
        c = 0
        while c in used[u] or c in used[v]:
            c += 1
        if c == len(classes):
            classes.append([])
        classes[c].append(p)
        used[u].add(c)
        used[v].add(c)
    return classes


def ascend(model: Model, budget: Budget, offer, stats: dict) -> tuple[float, bool]:
    """Raise the relaxation's bound while it grows and ``budget`` affords it, offering
    each look's decoded solution to ``offer`` (a callable returning the best solution's
    cost, or None while no feasible one is known). Returns the best bound seen, and
    whether the ascent stopped for want of effort (rather than proven, or no longer
    growing); ``stats["dual_stop"]`` says which."""
    if model.npairs == 0:
        return -np.inf, False
    rel = Relaxation(model)
    budget.spend(len(rel.pairs) + len(rel.unary))
    best, sweeps, stop = -np.inf, 0, "effort"
    while budget.affords(CHECK * rel.sweep_work + rel.look_work):
        for _ in range(CHECK):
            rel.sweep()
        sweeps += CHECK
        budget.spend(CHECK * rel.sweep_work + rel.look_work)
        rest = rel.remaining()
        value = rel.bound(rest)
        cost = offer(rel.decode(rest))
        grown = value - best
        best = max(best, value)
        if cost is not None and cost - best <= PROVEN * abs(cost):
            stop = "proven"
            break
        if grown <= STALL * abs(best) or (cost is not None and grown < SLOW * (cost - best)):
            stop = "converged"
            break
    stats.update(dual_sweeps=sweeps, dual_bound=best, dual_stop=stop)
    return best, stop == "effort"


__all__ = ["CHECK", "PROVEN", "Relaxation", "ascend"]

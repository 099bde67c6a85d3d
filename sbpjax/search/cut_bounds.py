"""The bounds of a pipeline configuration's cuts: per-stage tables over layer
ranges and, where a device group runs several stages, bounds of a partial cut
by its groups (the walk of :func:`sbpjax.search.cuts.cut_candidates` uses both;
the module docstring there says why each bound holds).

``Tables`` are the stage tables of one configuration, ``GroupBounds`` prices
the ends a stage may take given what the stages placed already give each
group (``PartialCut``). What depends on a configuration's prices alone is kept
with the prices (:func:`derived`), for every schedule priced with them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from sbpjax.pipeline.balance import range_costs
from sbpjax.search.pipeline_cost import ConfigCosts

if TYPE_CHECKING:  # cuts imports this module; a Setting only passes through here
    from sbpjax.search.cuts import Setting


def derived(costs: ConfigCosts, key, make: Callable[[], np.ndarray]) -> np.ndarray:
    """``make()``, kept in ``costs.derived`` under ``key``: what depends on a
    configuration's prices alone is computed once for every schedule priced with them."""
    if key not in costs.derived:
        costs.derived[key] = make()
    return costs.derived[key]


class Tables:
    """Per stage ``s`` of one configuration, over layers ``a .. b-1`` (``(L+1, L+1)``
    arrays): ``bound(s)``, the decomposable stage bound (``inf`` where the stage
    alone holds more than the budget: its device group holds at least that);
    ``work(s)``, the busy time it gives its device group, ``m (F + B + k T)``;
    ``held(s)``, the bytes per device it adds to its group. What does not depend
    on ``s`` is computed once."""

    def __init__(self, st: Setting):
        self.st = st
        c, m, L = st.costs, st.microbatches, st.costs.layers
        ov = c.action_s
        self.F = derived(c, "F", lambda: range_costs(c.f) + ov)
        self.B = derived(c, "B", lambda: range_costs(c.b) + ov)
        self.pre_f = np.concatenate([[0.0], np.cumsum(c.f)])[:, None]
        self.pre_b = np.concatenate([[0.0], np.cumsum(c.b)])[:, None]
        self.t_min = float(c.transfer[1:].min()) if L > 1 else 0.0
        self.by_end = np.append(c.transfer, 0.0)  # by_end[j]: the boundary before layer j (none at the end)
        self.edges = self.pre_f + (0.0 if st.split else self.pre_b)  # the head's and tail's layers
        self.busy = derived(c, ("busy", m), lambda: m * (self.F + self.B))
        if not st.split:

            def stashed():
                after = (self.pre_f[L, 0] - self.pre_f + self.pre_b[L, 0] - self.pre_b).T  # by end b
                return self.edges + self.F + after + m * self.B

            self.stashed = derived(c, ("stashed", m), stashed)  # the later stages' layers, by end b
        if st.budget is not None:
            self.params = derived(c, "params", lambda: range_costs(c.param_bytes))
            self.stash = derived(c, "stash", lambda: range_costs(c.stash_bytes))
            self.kept = derived(c, "kept", lambda: range_costs(c.kept_bytes)) if st.kept is not None else None
        self._work: dict = {}
        self._held: dict = {}

    def lands(self, s: int) -> int:
        """Transfers landing on stage ``s`` per microbatch: its input, and the gradient of its output."""
        return (s > 0) + (s < self.st.stages - 1)

    def work(self, s: int) -> np.ndarray:
        key = (s > 0, self.lands(s))  # what work depends on
        if key not in self._work:
            # a stage's transfers are priced at its input boundary (at a), stage 0's at its output (at b)
            landing = self.by_end[:, None] if s > 0 else self.by_end[None, :]
            self._work[key] = self.busy + (self.st.microbatches * self.lands(s)) * landing
        return self._work[key]

    def held(self, s: int) -> np.ndarray:
        st = self.st
        key = (st.stash[s], st.kept[s] if st.kept is not None else None)  # what held depends on
        if key not in self._held:
            held = self.params + st.stash[s] * self.stash
            if self.kept is not None and st.kept is not None:
                held = held + st.kept[s] * self.kept
            self._held[key] = held
        return self._held[key]

    def bound(self, s: int) -> np.ndarray:
        st, ov, t_min = self.st, self.st.costs.action_s, self.t_min
        n, m = st.stages, st.microbatches
        # the head's and tail's actions and transfers (the transfers bounded by the cheapest)
        chains = s * ov + max(s - 1, 0) * t_min + (0.0 if st.split else s * (ov + t_min))
        bound = self.edges + self.work(s) + chains
        if not st.split:
            ahead = max(0, m - st.stash[s])
            trip = (n - 1 - s) * (2 * ov + 2 * t_min)
            bound = np.maximum(bound, self.stashed + (chains + trip) + (ahead * self.F if ahead else 0.0))
        if st.budget is not None:
            bound = np.where(self.held(s) + st.costs.recompute_bytes > st.budget, np.inf, bound)
        return bound

    def mean_load(self) -> float:
        """The device groups' mean busy time, which the busiest reaches: every
        stage's actions, each transfer at least the cheapest boundary's."""
        st, c = self.st, self.st.costs
        n, m = st.stages, st.microbatches
        total = m * (c.f.sum() + c.b.sum() + 2 * n * c.action_s + 2 * (n - 1) * self.t_min)
        return float(total / st.groups)


@dataclasses.dataclass(frozen=True)
class PartialCut:
    """The first stages of a cut as the device groups see them: per group, the busy
    time those stages give it (``load``), the bytes per device they hold
    (``held``) and ``start``, the head plus tail of its first stage (``-inf``
    before it has one); ``head``, ``tail``: those of the next stage."""

    load: np.ndarray
    held: np.ndarray
    start: np.ndarray
    head: float
    tail: float

    @classmethod
    def empty(cls, groups: int) -> PartialCut:
        return cls(np.zeros(groups), np.zeros(groups), np.full(groups, -np.inf), 0.0, 0.0)


class GroupBounds:
    """The device-group bound of the module docstring on partial cuts, for
    configurations where a group runs several stages (the stage tables see one
    stage of it). A group with stages left ends no sooner than ``x + r``: ``x``
    its first stage's head and tail (for a group without a stage yet, the next
    stage's), its load so far and its stages' fixed costs (two launches and
    the transfers landing, per microbatch), ``r`` the work of the layers its
    stages get. The layers left go to the stages left, so the ``r`` sum to
    their work; each stage takes at least one layer (``r >= lo``: the least
    layer it can start with, the last stage the last layer); and the group's
    memory caps how many layers it can take (the cheapest, at its stages'
    least stash and kept counts), so ``r`` is at most the work of that many of
    the heaviest layers left. The least largest ``x + r`` under these is water
    filling with caps (:func:`_level_capped`)."""

    def __init__(self, tb: Tables):
        st, c = tb.st, tb.st.costs
        n, L, m, G = st.stages, c.layers, st.microbatches, st.groups
        self.tb, self.st = tb, st
        w = m * (c.f + c.b)  # each layer's work per step
        self.work_left = np.append(np.cumsum(w[::-1])[::-1], 0.0)  # [a]: layers a ..
        # [a, k]: the k heaviest of layers a .. (read for k <= L - a)
        self.heavy = derived(c, ("heavy", m), lambda: -_sorted_sums(-w))
        # whole layers: a layer holds floor(work / piece) pieces of the typical layer's work (a
        # model of repeated blocks: one piece each), and a group gets whole layers, so whole pieces
        positive = w[w > 0]
        self.piece = float(np.median(positive)) if len(positive) else 0.0
        units = np.floor(w / self.piece) if self.piece > 0 else np.zeros(L)
        self.units_left = np.append(np.cumsum(units[::-1])[::-1], 0.0)
        # [a, k]: the pieces of the k richest of layers a ..
        self.heavy_units = derived(c, ("heavy units", m), lambda: -_sorted_sums(-units))
        # the last stage holds the last layer: its work past whole pieces is its group's too
        self.last_rest = np.zeros(G)
        self.last_rest[st.where[n - 1]] = w[L - 1] - units[L - 1] * self.piece
        # per stage s and group g, what its stages s .. need: [s, g] or, by first layer left, [s, g, a]
        where = np.asarray(st.where)
        self.pending = _by_group(np.ones(n), where, G) > 0
        self.count = _by_group(np.ones(n), where, G).astype(np.int64)
        lands = np.asarray([tb.lands(s) for s in range(n)])
        self.fixed = _by_group(m * (2 * c.action_s + lands * tb.t_min), where, G)
        self.lo = _by_group(derived(c, ("least work", m, n), lambda: _least_layer(w, n)), where, G)
        least = derived(c, ("least units", m, n), lambda: _least_layer(units, n))
        self.lo_units = _by_group(least, where, G)
        if st.budget is not None:
            stash = np.asarray(st.stash, dtype=np.float64)
            kept = np.asarray(st.kept if st.kept is not None else [0] * n, dtype=np.float64)
            # the least of a sum is at least the sum of the leasts (exact for alike layers)
            layer = {
                name: derived(c, ("least", name, n), functools.partial(_least_layer, v, n))
                for name, v in (("params", c.param_bytes), ("stash", c.stash_bytes), ("kept", c.kept_bytes))
            }
            least = layer["params"] + stash[:, None] * layer["stash"]
            if st.kept is not None:
                least = least + kept[:, None] * layer["kept"]
            self.need_held = _by_group(least, where, G)
            # a group's layers hold at least what its stages' least stash and kept counts make them
            least = np.stack([_least_after(v, where, G) for v in (stash, kept)], axis=-1)  # [s, g, 2]
            counts, self.profile = np.unique(least.reshape(-1, 2), axis=0, return_inverse=True)
            self.profile = self.profile.reshape(n + 1, G)  # [s, g]: its row of self.cheap
            usable = np.isfinite(counts).all(axis=1)
            per_layer = c.param_bytes + np.where(usable, counts[:, 0], 0)[:, None] * c.stash_bytes
            per_layer = per_layer + np.where(usable, counts[:, 1], 0)[:, None] * c.kept_bytes
            self.cheap = _sorted_sums(per_layer)  # [i, a, k]: the k cheapest

    def layers(self, held: np.ndarray, s: int, ends: np.ndarray) -> np.ndarray:
        """``[i, j]``: the most layers from ``ends[i]`` on the ``j``-th group with
        stages ``s ..`` can hold, its bytes so far ``held[i, j]`` (``-1``: none)."""
        st, pending = self.st, self.pending[s]
        assert st.budget is not None  # only built for a configuration with a budget
        free = st.budget - st.costs.recompute_bytes - held
        cheap = self.cheap[self.profile[s, pending][None, :], ends[:, None]]
        return (cheap <= free[..., None]).sum(axis=-1) - 1  # the prefix of 0 layers always fits

    def spread(self, x: np.ndarray, layers: np.ndarray | None, s: int, ends: np.ndarray):
        """Per end: the least largest ``x + r`` over the groups with stages ``s ..``
        (``[i, j]`` arrays), each taking at least ``lo`` and at most ``layers`` of
        the layers left (None: no memory cap): as work poured to one level, and in
        whole pieces."""
        pending = self.pending[s]
        fits = True if layers is None else layers >= self.count[s, pending]  # one layer per stage

        def room(lo: np.ndarray, most: np.ndarray) -> np.ndarray:
            """What a group can take beyond ``lo``; ``most[a, k]``: of the k richest layers from a."""
            cap = np.inf if layers is None else most[ends[:, None], np.clip(layers, 0, None)]
            return np.where(fits, cap - lo, -np.inf)

        lo = self.lo[s][pending][:, ends].T
        work = _level_capped(x + lo, room(lo, self.heavy), self.work_left[ends] - lo.sum(axis=1))
        bound = np.maximum((x + lo).max(axis=1), work)
        if self.piece > 0:
            lo = self.lo_units[s][pending][:, ends].T
            base = x + lo * self.piece + self.last_rest[pending]
            left = self.units_left[ends] - lo.sum(axis=1)
            bound = np.maximum(bound, _level_whole(base, room(lo, self.heavy_units), left, self.piece))
        return bound

    def extend(self, p: PartialCut, s: int, a: int, ends: np.ndarray):
        """Stage ``s`` on ``a .. b-1`` for each ``b`` in ``ends``: per end, the bound
        every completion has, and ``child(i)``: the partial cut of ``ends[i]``."""
        st, tb, g = self.st, self.tb, self.st.where[s]
        t = tb.by_end[a] if s > 0 else tb.by_end[ends]
        start = p.start[g] if np.isfinite(p.start[g]) else p.head + p.tail
        load = p.load[g] + tb.work(s)[a, ends]
        head = p.head + tb.F[a, ends] + (t if s > 0 else 0.0)
        tail = p.tail + (tb.B[a, ends] + t if not st.split else np.zeros(len(ends)))
        placed = np.repeat((p.start + p.load)[None, :], len(ends), axis=0)  # -inf: no stage yet
        placed[:, g] = start + load
        keys = placed.max(axis=1)
        held = np.repeat(p.held[None, :], len(ends), axis=0)  # [i, group]: bytes per device
        if st.budget is not None:
            held[:, g] += tb.held(s)[a, ends]
            # the stages left hold at least one layer each
            fullest = (held + self.need_held[s + 1][:, ends].T).max(axis=1)
            keys = np.where(fullest + st.costs.recompute_bytes > st.budget, np.inf, keys)
        pending = self.pending[s + 1]
        if pending.any():
            # a group still without a stage starts it no sooner than the next stage's head and tail
            x = np.where(np.isneginf(placed), (head + tail)[:, None], placed)[:, pending]
            x = x + self.fixed[s + 1, pending]
            layers = None if st.budget is None else self.layers(held[:, pending], s + 1, ends)
            keys = np.maximum(keys, self.spread(x, layers, s + 1, ends))

        def child(i: int) -> PartialCut:
            out = PartialCut(p.load.copy(), held[i].copy(), p.start.copy(), float(head[i]), float(tail[i]))
            out.load[g], out.start[g] = load[i], start
            return out

        return keys, child


def _by_group(values: np.ndarray, where: np.ndarray, groups: int) -> np.ndarray:
    """``[s, g, ...]``: the sum of ``values[t]`` over the stages ``t >= s`` of group ``g``."""
    n = len(where)
    out = np.zeros((n + 1, groups, *values.shape[1:]))
    out[np.arange(n), where] = values
    return np.flip(np.cumsum(np.flip(out, axis=0), axis=0), axis=0)


def _least_after(values: np.ndarray, where: np.ndarray, groups: int) -> np.ndarray:
    """``[s, g]``: the least ``values[t]`` over the stages ``t >= s`` of group ``g`` (``inf``: none)."""
    n = len(where)
    out = np.full((n + 1, groups), np.inf)
    out[np.arange(n), where] = values
    return np.flip(np.minimum.accumulate(np.flip(out, axis=0), axis=0), axis=0)


def _least_layer(v: np.ndarray, n: int) -> np.ndarray:
    """``[s, a]``: the least ``v[j]`` of a layer stage ``s`` (of ``n``) must hold when
    layers ``a ..`` are left to it and the stages after it: it starts at a layer
    ``j`` with ``a <= j <= L - n + s`` (one layer for each later stage), and the
    last stage holds the last layer."""
    L = len(v)
    # [a, t]: min v[a:t], from running minima along each row of the layers from a on
    ahead = np.where(np.arange(L)[None, :] >= np.arange(L + 1)[:, None], v[None, :], np.inf)
    low = np.minimum.accumulate(ahead, axis=1)
    out = low[:, L - n : L].T.copy()  # t - 1 = L - n + s
    out[n - 1] = v[L - 1]
    return out


def _sorted_sums(v: np.ndarray) -> np.ndarray:
    """``[..., a, k]``: the sum of the ``k`` least of ``v[..., a:]`` (``inf`` past its length)."""
    L = v.shape[-1]
    j = np.arange(L)
    ahead = np.where(j >= np.arange(L + 1)[:, None], v[..., None, :], np.inf)
    sums = np.cumsum(np.sort(ahead, axis=-1), axis=-1)
    return np.concatenate([np.zeros((*sums.shape[:-1], 1)), sums], axis=-1)


def _level(base: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """Per row ``i``: the least largest ``base[i, j] + r_j`` over ``r >= 0`` that sum
    to ``rest[i]`` (water filling). Raising the ``j`` lowest entries to one level
    takes that level to ``(rest + their sum) / j``; the least of these over ``j``
    is the level where exactly the entries below it are raised."""
    low = np.sort(base, axis=1)
    return np.min((rest[:, None] + np.cumsum(low, axis=1)) / np.arange(1, low.shape[1] + 1), axis=1)


def _level_capped(base: np.ndarray, room: np.ndarray, rest: np.ndarray) -> np.ndarray:
    """:func:`_level` with ``r_j <= room[i, j]`` (``inf`` where the rooms cannot take
    ``rest``). The level without caps is at most the one with; an entry whose room
    ends below it ends there in both, so it is filled and taken out, and the
    rest poured again until no room ends below the level. Rounding must not
    fill an entry that is not full (that would lift the level too high), so an
    entry counts as full only when its room ends clearly below."""
    slack = 1e-9 * (np.abs(base).max(axis=1, initial=0.0, where=np.isfinite(base)) + np.abs(rest))
    full = np.zeros(base.shape, dtype=bool)
    while True:
        level = _level(np.where(full, np.inf, base), rest - np.where(full, room, 0.0).sum(axis=1))
        now = full | (base + room < (level - slack)[:, None])
        if (now == full).all():
            return np.where(room.sum(axis=1) < rest - slack, np.inf, level)
        full = now


def _level_whole(base: np.ndarray, room: np.ndarray, pieces: np.ndarray, piece: float) -> np.ndarray:
    """Per row ``i``: the least largest ``base[i, j] + k_j piece`` over whole
    ``0 <= k_j <= room[i, j]`` that sum to ``pieces[i]``. Giving each piece to the
    lowest entry reaches it: the ``pieces``-th least of the values ``base + k
    piece``. That lies within one piece above the level of :func:`_level_capped`:
    the values below the level are counted and each entry's next two are sorted
    (two, in case rounding counts one too few)."""
    level = _level_capped(base, room * piece, np.maximum(pieces, 0.0) * piece)
    below = np.clip(np.floor((level[:, None] - base) / piece - 1e-9), 0, room)
    nxt = below[..., None] + np.array([1.0, 2.0])  # [i, j, c]: the next two whole counts
    value = np.where(nxt <= room[..., None], base[..., None] + nxt * piece, np.inf)
    value = np.sort(value.reshape(len(base), -1), axis=1)
    rank = pieces - below.sum(axis=1)  # the rank among the values sorted (none past an inf level)
    rank = np.where(np.isfinite(rank), rank, 0).astype(np.int64)
    ok = (rank >= 1) & (rank <= value.shape[1])
    picked = value[np.arange(len(base)), np.clip(rank, 1, value.shape[1]) - 1]
    return np.where(ok, np.maximum(picked, level), level)


__all__ = ["GroupBounds", "PartialCut", "Tables", "derived"]

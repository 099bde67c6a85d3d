"""The problem the algorithms work on, kept flat (numpy arrays with offsets).

- Model node ``i`` has strategies at the flat positions ``noff[i] .. noff[i + 1] - 1`` of
  ``unary``.
- Pair ``p`` joins model nodes ``pu[p] < pv[p]``; its ``k[pu] x k[pv]`` matrix (the sum of
  every edge between them) is ``pflat[poff[p]:poff[p + 1]]``, by rows.
- A model node stands for one or more nodes of the problem (its *members*, see
  :mod:`sbpjax.solver._reduce`): problem node ``v`` is in model node ``mroot[v]`` and takes
  the strategy ``mmap[moff[v] + a]`` when that model node takes its strategy ``a``.
- Memory: each problem node that holds memory is a *piece* ``q`` of model node
  ``qnode[q]``, live in the compressed time segments ``qlo[q] <= t < qhi[q]``, using
  ``qusage[qoff[q] + a]`` when its model node takes strategy ``a``. Each segment is one
  constraint: the usages of the pieces live in it sum to at most ``limit``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from sbpjax.solver.problem import Problem

# Fixed-point scale of log2 domain sizes: elimination orders (``_plan``, ``_fill_order``)
# score nodes by exact integer sums of these, so an order never depends on float rounding.
LOG_SCALE = 1 << 20


def log_sizes(k) -> list:
    """log2 of each domain size in ``k``, in fixed point (``LOG_SCALE``); 0 for an empty one."""
    return [round(math.log2(v) * LOG_SCALE) if v > 0 else 0 for v in np.asarray(k).tolist()]


def log_cap(cap: float) -> float:
    """``cap`` entries on the scale of :func:`log_sizes` (inf for no cap)."""
    return math.log2(cap) * LOG_SCALE if cap < np.inf else np.inf


def offsets(sizes: np.ndarray) -> np.ndarray:
    """``[0, sizes[0], sizes[0] + sizes[1], ...]`` (int64)."""
    out = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=out[1:])
    return out


def separate_minima(model: Model, unary: np.ndarray, pflat: np.ndarray) -> float:
    """Each node's cheapest entry of ``unary`` plus each pair's cheapest entry of
    ``pflat`` (flat as ``model``'s own), taken separately: a lower bound of any
    solution's cost under those tables. Exactly rounded sums, the same on every
    machine."""
    nodes = np.minimum.reduceat(unary, model.noff[:-1]).tolist() if model.n else []
    pairs = np.minimum.reduceat(pflat, model.poff[:-1]).tolist() if model.npairs else []
    return math.fsum(nodes) + math.fsum(pairs)


def segment_ids(sizes: np.ndarray) -> np.ndarray:
    """``[0]*sizes[0] + [1]*sizes[1] + ...`` (int64)."""
    return np.repeat(np.arange(len(sizes), dtype=np.int64), sizes)


def local_index(sizes: np.ndarray) -> np.ndarray:
    """The position of each element inside its segment: ``0..sizes[0]-1, 0..sizes[1]-1, ...``."""
    off = offsets(sizes)
    return np.arange(off[-1], dtype=np.int64) - np.repeat(off[:-1], sizes)


@dataclass
class Memory:
    qnode: np.ndarray
    qlo: np.ndarray
    qhi: np.ndarray
    qoff: np.ndarray
    qusage: np.ndarray
    nseg: int
    limit: float

    def positions(self, noff: np.ndarray) -> np.ndarray:
        """The flat strategy position of each ``qusage`` entry."""
        sizes = np.diff(self.qoff)
        return np.repeat(noff[self.qnode], sizes) + local_index(sizes)

    def profile(self, noff: np.ndarray, s: np.ndarray) -> np.ndarray:
        """Usage per segment of model strategies ``s``."""
        return self.sum_live(self.qusage[self.qoff[:-1] + s[self.qnode]])

    def sum_live(self, per_piece: np.ndarray) -> np.ndarray:
        """Per segment, the sum of ``per_piece`` over the pieces live in it."""
        diff = np.zeros(self.nseg + 1)
        np.add.at(diff, self.qlo, per_piece)
        np.add.at(diff, self.qhi, -per_piece)
        return np.cumsum(diff)[:-1]

    def penalty(self, noff: np.ndarray, size: int, weight_per_segment: np.ndarray) -> np.ndarray:
        """Flat per-strategy sum over pieces of usage x (sum of ``weight_per_segment`` over
        the piece's segments): the Lagrangian term of a multiplier per segment."""
        cum = np.concatenate([[0.0], np.cumsum(weight_per_segment)])
        per_piece = cum[self.qhi] - cum[self.qlo]
        sizes = np.diff(self.qoff)
        return np.bincount(
            self.positions(noff), weights=self.qusage * np.repeat(per_piece, sizes), minlength=size
        )


@dataclass
class Model:
    k: np.ndarray
    noff: np.ndarray
    unary: np.ndarray
    pu: np.ndarray
    pv: np.ndarray
    poff: np.ndarray
    pflat: np.ndarray
    mroot: np.ndarray
    moff: np.ndarray
    mmap: np.ndarray
    memory: Memory | None
    infeasible: str | None = None  # why no solution exists, when the reductions proved it
    _cache: dict = field(default_factory=dict, repr=False, compare=False)  # index arrays, made once

    @property
    def n(self) -> int:
        return len(self.k)

    @property
    def npairs(self) -> int:
        return len(self.pu)

    def pair(self, p: int) -> np.ndarray:
        return self.pflat[self.poff[p] : self.poff[p + 1]].reshape(self.k[self.pu[p]], self.k[self.pv[p]])

    def node_of(self) -> np.ndarray:
        """The model node of each flat strategy position."""
        return segment_ids(self.k)

    def entry_index(self) -> tuple[np.ndarray, np.ndarray]:
        """For each entry of ``pflat``, the flat positions of its row strategy and column strategy."""
        if "entry" not in self._cache:
            self._cache["entry"] = self._entry_index()
        return self._cache["entry"]

    def _entry_index(self) -> tuple[np.ndarray, np.ndarray]:
        sizes = self.k[self.pu] * self.k[self.pv]
        loc = local_index(sizes)
        kv = np.repeat(self.k[self.pv], sizes)
        rows = np.repeat(self.noff[self.pu], sizes) + loc // kv
        cols = np.repeat(self.noff[self.pv], sizes) + loc % kv
        return rows, cols

    def line_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Each entry's row and column of its pair, numbered over all pairs, and the flat strategy
        position of each such row and column."""
        if "line" not in self._cache:
            self._cache["line"] = self._line_index()
        return self._cache["line"]

    def _line_index(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        sizes = self.k[self.pu] * self.k[self.pv]
        loc = local_index(sizes)
        kv = np.repeat(self.k[self.pv], sizes)
        roff, coff = offsets(self.k[self.pu]), offsets(self.k[self.pv])
        rkey = np.repeat(roff[:-1], sizes) + loc // kv
        ckey = np.repeat(coff[:-1], sizes) + loc % kv
        rpos = np.repeat(self.noff[self.pu], self.k[self.pu]) + local_index(self.k[self.pu])
        cpos = np.repeat(self.noff[self.pv], self.k[self.pv]) + local_index(self.k[self.pv])
        return rkey, ckey, rpos, cpos

    def to_original(self, s: np.ndarray) -> np.ndarray:
        """The problem's strategies (one per problem node) of model strategies ``s``."""
        return self.mmap[self.moff[:-1] + s[self.mroot]]

    def from_original(self, s_orig: np.ndarray) -> np.ndarray | None:
        """Model strategies that give exactly ``s_orig``, or None if no such exist (it uses a
        pruned strategy, or breaks a dependency the reductions relied on)."""
        sizes = np.diff(self.moff)
        member = segment_ids(sizes)
        hit = self.mmap == s_orig[member]
        # a model strategy fits when every member agrees with it
        pos = np.repeat(self.noff[self.mroot], sizes) + local_index(sizes)
        agree = np.bincount(pos, weights=hit, minlength=len(self.unary))
        need = np.bincount(self.mroot, minlength=self.n)[self.node_of()]
        fits = agree == need
        node = self.node_of()
        first = np.full(self.n, -1, dtype=np.int64)
        idx = np.flatnonzero(fits)[::-1]
        first[node[idx]] = idx
        if (first < 0).any():
            return None
        return first - self.noff[:-1]

    def costs(self, s: np.ndarray) -> float:
        """Total cost of model strategies ``s`` (no usage check)."""
        c = self.unary[self.noff[:-1] + s].sum()
        if self.npairs:
            c += self.pflat[self.poff[:-1] + s[self.pu] * self.k[self.pv] + s[self.pv]].sum()
        return float(c)

    def peak(self, s: np.ndarray) -> float:
        if self.memory is None or not self.memory.nseg:
            return 0.0
        return float(self.memory.profile(self.noff, s).max())


def _merge_edges(problem: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One matrix per unordered pair (u < v), the sum of the problem's edges between them."""
    _, _, ends, _, edge_flat = problem._flat
    k = problem.num_strategies
    if not len(ends):
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0)
    u, v = ends[:, 0], ends[:, 1]
    swap = u > v
    a, b = np.where(swap, v, u), np.where(swap, u, v)
    sizes = k[u] * k[v]
    loc = local_index(sizes)
    kv = np.repeat(k[v], sizes)
    ku = np.repeat(k[u], sizes)
    row, col = loc // kv, loc % kv
    canon = np.where(np.repeat(swap, sizes), col * ku + row, loc)  # position in the (a, b) matrix
    _, first, inv = np.unique(a * len(k) + b, return_index=True, return_inverse=True)
    moff = offsets(sizes[first])
    target = np.repeat(moff[:-1][inv], sizes) + canon
    merged = np.bincount(target, weights=edge_flat, minlength=int(moff[-1]))  # inf + x stays inf
    return a[first], b[first], merged


def _memory(problem: Problem, node_off: np.ndarray) -> Memory | None:
    if problem.usage_limit is None or problem.usages is None or problem.intervals is None:
        return None
    usage = np.concatenate(problem.usages) if problem.usages else np.zeros(0)
    k = problem.num_strategies
    iv = problem.intervals
    top = np.maximum.reduceat(np.abs(usage), node_off[:-1]) if usage.size else np.zeros(len(k))
    live = np.flatnonzero((iv[:, 0] < iv[:, 1]) & (top > 0))
    points = np.unique(np.concatenate([iv[live, 0], iv[live, 1]]))
    sizes = k[live]
    qusage = usage[np.repeat(node_off[live], sizes) + local_index(sizes)]
    return Memory(
        qnode=live.astype(np.int64),
        qlo=np.searchsorted(points, iv[live, 0]).astype(np.int64),
        qhi=np.searchsorted(points, iv[live, 1]).astype(np.int64),
        qoff=offsets(sizes),
        qusage=qusage,
        nseg=max(len(points) - 1, 0),
        limit=float(problem.usage_limit),
    )


def raw_model(problem: Problem) -> Model:
    """The problem as a model: one model node per problem node, multi-edges summed."""
    k = problem.num_strategies.copy()
    node_off, node_flat, _, _, _ = problem._flat
    pu, pv, pflat = _merge_edges(problem)
    n = len(k)
    return Model(
        k=k,
        noff=node_off.copy(),
        unary=node_flat.copy(),
        pu=pu,
        pv=pv,
        poff=offsets(k[pu] * k[pv]),
        pflat=pflat,
        mroot=np.arange(n, dtype=np.int64),
        moff=node_off.copy(),
        mmap=local_index(k),
        memory=_memory(problem, node_off),
    )


def plain_model(k: np.ndarray, unary: np.ndarray, pu: np.ndarray, pv: np.ndarray, pflat: np.ndarray) -> Model:
    """A model of its own nodes only (no members to map back, no memory): a sub-problem."""
    noff = offsets(k)
    n = len(k)
    return Model(
        k, noff, unary, pu, pv, offsets(k[pu] * k[pv]), pflat, np.arange(n), noff, local_index(k), None
    )

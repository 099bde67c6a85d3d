"""Single-node moves on a full solution, with the usage limit kept exactly.

``State`` holds one solution, each node's *local cost* vector (its unary costs plus its
pairs priced at the neighbours' current strategies, so the change of the total when node
i moves to b is ``local[i, b] - local[i, s_i]``), and the usage per time segment.

- :meth:`State.descend`: best-improvement moves that keep the solution within the limit,
  until none is left (iterated conditional modes under the constraint).
- :meth:`State.repair`: while some segment is over the limit, the move that removes the
  most excess per unit of cost added.

Both are sequences of moves fixed by the data (ties by node, then strategy), and each
counts its work in table entries.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver._model import Model, local_index, offsets


class Pieces:
    """Each node's usage over time as a step function: node i changes the usage of segments
    ``brk[i][j] <= t < brk[i][j + 1]`` by ``val[i][a, j]`` under strategy a."""

    def __init__(self, model: Model):
        mem = model.memory
        n = model.n
        self.brk: list = [None] * n
        self.val: list = [None] * n
        if mem is None or not len(mem.qnode):
            return
        order = np.argsort(mem.qnode, kind="stable")
        counts = np.bincount(mem.qnode, minlength=n)
        starts = offsets(counts)
        for i in np.flatnonzero(counts).tolist():
            qs = order[starts[i] : starts[i + 1]]
            lo, hi = mem.qlo[qs], mem.qhi[qs]
            brk = np.unique(np.concatenate([lo, hi]))
            k = int(model.k[i])
            diff = np.zeros((k, len(brk)))
            u = mem.qusage[mem.qoff[qs][:, None] + np.arange(k)[None, :]]  # pieces x k
            np.add.at(diff.T, np.searchsorted(brk, lo), u)
            np.add.at(diff.T, np.searchsorted(brk, hi), -u)
            self.brk[i] = brk
            self.val[i] = np.cumsum(diff, axis=1)[:, :-1]


class State:
    def __init__(self, model: Model, pieces: Pieces, s: np.ndarray, unary: np.ndarray | None = None):
        self.m = model
        self.pieces = pieces
        self.unary = model.unary if unary is None else unary
        self.s = s.copy()
        self.work = 0.0
        m = model
        # each node's pairs: (pair, other node, node is the row side)
        self.adj: list = [[] for _ in range(m.n)]
        for p, (u, v) in enumerate(zip(m.pu.tolist(), m.pv.tolist())):
            self.adj[u].append((p, v, True))
            self.adj[v].append((p, u, False))
        self.local = self._local_costs()
        mem = m.memory
        self.limit = np.inf if mem is None else mem.limit
        self.profile = mem.profile(m.noff, self.s) if mem is not None and mem.nseg else np.zeros(0)

    def _local_costs(self) -> np.ndarray:
        m = self.m
        local = self.unary.copy()
        sizes = m.k[m.pu] * m.k[m.pv]
        if len(sizes):
            kv = np.repeat(m.k[m.pv], sizes)
            loc = local_index(sizes)
            a, b = loc // kv, loc % kv
            su, sv = np.repeat(self.s[m.pu], sizes), np.repeat(self.s[m.pv], sizes)
            rows = np.repeat(m.noff[m.pu], sizes) + a
            cols = np.repeat(m.noff[m.pv], sizes) + b
            local += np.bincount(rows[b == sv], weights=m.pflat[b == sv], minlength=len(local))
            local += np.bincount(cols[a == su], weights=m.pflat[a == su], minlength=len(local))
            self.work += float(sizes.sum())
        return local

    def vec(self, i: int) -> np.ndarray:
        return self.local[self.m.noff[i] : self.m.noff[i + 1]]

    @property
    def cost(self) -> float:
        return self.m.costs(self.s) if self.unary is self.m.unary else float("nan")

    @property
    def excess(self) -> float:
        return float(np.maximum(self.profile - self.limit, 0).sum()) if self.profile.size else 0.0

    def delta_profile(self, i: int, b: int) -> tuple[int, int, np.ndarray] | None:
        """The usage change of moving node i to b, densely over its span, or None."""
        brk = self.pieces.brk[i]
        if brk is None:
            return None
        val = self.pieces.val[i]
        d = val[b] - val[self.s[i]]
        return int(brk[0]), int(brk[-1]), np.repeat(d, np.diff(brk))

    def fits(self, i: int, b: int) -> bool:
        """Moving node i to b keeps every segment within the limit (or makes none worse)."""
        dp = self.delta_profile(i, b)
        if dp is None:
            return True
        lo, hi, d = dp
        self.work += hi - lo
        new = self.profile[lo:hi] + d
        up = d > 0
        return not up.any() or bool((new[up] <= self.limit).all())

    def move(self, i: int, b: int) -> None:
        a = int(self.s[i])
        if a == b:
            return
        m = self.m
        for p, o, is_row in self.adj[i]:
            mat = m.pair(p)
            seg = slice(m.noff[o], m.noff[o + 1])
            self.local[seg] += (mat[b] - mat[a]) if is_row else (mat[:, b] - mat[:, a])
            self.work += mat.shape[1] if is_row else mat.shape[0]
        dp = self.delta_profile(i, b)
        if dp is not None:
            lo, hi, d = dp
            self.profile[lo:hi] += d
        self.s[i] = b

    def descend(self, budget: float, nodes: np.ndarray | None = None) -> int:
        """Improving moves that keep the limit, best first per sweep, until none or the
        budget (table entries) is spent. Returns the number of moves."""
        moves = 0
        m = self.m
        todo = np.arange(m.n) if nodes is None else nodes
        while self.work < budget:
            improved = False
            for i in todo.tolist():
                if m.k[i] < 2:
                    continue
                v = self.vec(i)
                cur = v[self.s[i]]
                for b in np.argsort(v, kind="stable").tolist():
                    if not v[b] < cur - 1e-9 * (1 + abs(cur)):
                        break
                    if self.fits(i, b):
                        self.move(i, b)
                        moves += 1
                        improved = True
                        break
                if self.work >= budget:
                    break
            if not improved:
                break
        return moves

    def repair(self, budget: float) -> bool:
        """Moves that cut the usage over the limit, most excess removed per cost first,
        until within the limit (True) or out of budget or moves (False)."""
        m = self.m
        holders = [i for i in range(m.n) if self.pieces.brk[i] is not None and m.k[i] > 1]
        while self.excess > 0:
            if self.work >= budget:
                return False
            over = np.maximum(self.profile - self.limit, 0)
            cum = np.concatenate([[0.0], np.cumsum(over > 0)])
            best, best_key = None, None
            for i in holders:
                brk = self.pieces.brk[i]
                hits = cum[brk[1:]] - cum[brk[:-1]]  # over-limit segments in each step
                if not hits.any():
                    continue
                val = self.pieces.val[i]
                gain = (val[self.s[i]] - val) @ hits  # usage removed from the over-limit segments
                v = self.vec(i)
                dcost = v - v[self.s[i]]
                self.work += val.size
                for b in np.flatnonzero(gain > 0).tolist():
                    key = max(dcost[b], 0.0) / gain[b]
                    if best_key is None or key < best_key:
                        best, best_key = (i, b), key
            if best is None:
                return False
            self.move(*best)
        return True

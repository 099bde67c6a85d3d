"""Single-node moves on a full solution, with the usage limit kept exactly.

``State`` holds one solution, each node's *local cost* vector (its unary costs plus its
pairs priced at the neighbours' current strategies, so the change of the total when node
i moves to b is ``local[i, b] - local[i, s_i]``), and the usage per time segment.

- :meth:`State.descend`: improving moves that keep every segment within the limit, in
  node order, sweep after sweep until none is left (iterated conditional modes under the
  constraint).
- :meth:`State.repair`: while some segment is over the limit, the move that removes the
  most excess usage per unit of cost added.

Both are sequences of moves fixed by the data (ties by node, then strategy), and count
their work in table entries.
"""

from __future__ import annotations

import numpy as np

from sbpjax.solver._model import Model, local_index, offsets, segment_ids


class Steps:
    """Each node's usage over time as a step function, flat: node i has steps
    ``soff[i] .. soff[i+1]-1``; step j covers segments ``lo[j] <= t < hi[j]`` and adds
    ``val[voff[i] + a * ns_i + (j - soff[i])]`` under strategy a (ns_i: i's step count)."""

    def __init__(self, model: Model):
        mem = model.memory
        n = model.n
        counts = np.zeros(n, dtype=np.int64)
        los, his, vals = [], [], []
        if mem is not None and len(mem.qnode):
            order = np.argsort(mem.qnode, kind="stable")
            qcount = np.bincount(mem.qnode, minlength=n)
            starts = offsets(qcount)
            for i in np.flatnonzero(qcount).tolist():
                qs = order[starts[i] : starts[i + 1]]
                lo, hi = mem.qlo[qs], mem.qhi[qs]
                brk = np.unique(np.concatenate([lo, hi]))
                k = int(model.k[i])
                u = mem.qusage[mem.qoff[qs][:, None] + np.arange(k)[None, :]]  # pieces x k
                diff = np.zeros((len(brk), k))
                np.add.at(diff, np.searchsorted(brk, lo), u)
                np.add.at(diff, np.searchsorted(brk, hi), -u)
                val = np.cumsum(diff, axis=0)[:-1]  # steps x k
                keep = np.abs(val).max(axis=1) > 0
                counts[i] = int(keep.sum())
                los.append(brk[:-1][keep])
                his.append(brk[1:][keep])
                vals.append(val[keep].T.reshape(-1))
        self.ns = counts
        self.soff = offsets(counts)
        self.lo = np.concatenate(los) if los else np.zeros(0, np.int64)
        self.hi = np.concatenate(his) if his else np.zeros(0, np.int64)
        self.voff = offsets(counts * model.k)
        self.val = np.concatenate(vals) if vals else np.zeros(0)
        # for each value entry: its node, strategy position (flat) and step
        sizes = counts * model.k
        self.e_node = segment_ids(sizes)
        loc = local_index(sizes)
        ns_e = np.repeat(counts, sizes)
        self.e_pos = model.noff[self.e_node] + loc // np.maximum(ns_e, 1)
        self.e_step = self.soff[self.e_node] + loc % np.maximum(ns_e, 1)

    def rows(self, i: int) -> np.ndarray:
        """Node i's values: strategies x steps."""
        return (
            self.val[self.voff[i] : self.voff[i + 1]].reshape(-1, self.ns[i])
            if self.ns[i]
            else np.zeros((0, 0))
        )


class State:
    def __init__(self, model: Model, steps: Steps, s: np.ndarray, late=lambda: False):
        self.late = late  # contest mode: the deadline has passed (library mode: never)
        self.m = model
        self.steps = steps
        self.unary = model.unary
        self.s = s.copy()
        self.work = 0.0
        m = model
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
            by_col = b == np.repeat(self.s[m.pv], sizes)
            by_row = a == np.repeat(self.s[m.pu], sizes)
            rows = np.repeat(m.noff[m.pu], sizes) + a
            cols = np.repeat(m.noff[m.pv], sizes) + b
            local += np.bincount(rows[by_col], weights=m.pflat[by_col], minlength=len(local))
            local += np.bincount(cols[by_row], weights=m.pflat[by_row], minlength=len(local))
            self.work += float(sizes.sum())
        return local

    def vec(self, i: int) -> np.ndarray:
        return self.local[self.m.noff[i] : self.m.noff[i + 1]]

    def cost(self) -> float:
        return (
            float(self.local[self.m.noff[:-1] + self.s].sum() + self.unary[self.m.noff[:-1] + self.s].sum())
            / 2
        )

    def excess(self) -> float:
        return float(np.maximum(self.profile - self.limit, 0).sum()) if self.profile.size else 0.0

    def _delta(self, i: int, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        st = self.steps
        if not st.ns[i]:
            return None
        rows = st.rows(i)
        sl = slice(st.soff[i], st.soff[i + 1])
        return st.lo[sl], st.hi[sl], rows[b] - rows[self.s[i]]

    def fits(self, i: int, b: int) -> bool:
        """Moving node i to b keeps every segment it raises within the limit."""
        d = self._delta(i, b)
        if d is None:
            return True
        lo, hi, dv = d
        up = dv > 0
        if not up.any():
            return True
        bounds = np.empty(2 * int(up.sum()), dtype=np.int64)
        bounds[0::2], bounds[1::2] = lo[up], hi[up]
        peak = np.maximum.reduceat(np.append(self.profile, -np.inf), bounds)[0::2]
        self.work += float((hi[up] - lo[up]).sum())
        return bool((peak + dv[up] <= self.limit).all())

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
        d = self._delta(i, b)
        if d is not None:
            lo, hi, dv = d
            diff = np.zeros(len(self.profile) + 1)
            np.add.at(diff, lo, dv)
            np.add.at(diff, hi, -dv)
            self.profile += np.cumsum(diff)[:-1]
            self.work += len(self.profile)
        self.s[i] = b

    def descend(self, limit: float) -> int:
        """Improving moves that keep the limit, sweep after sweep, until none is left or the
        work reaches ``limit``. Returns the number of moves."""
        m = self.m
        moves = 0
        node = m.node_of()
        while self.work < limit and not self.late():
            cur = self.local[m.noff[:-1] + self.s]
            gain = cur[node] - self.local
            tol = 1e-9 * (1.0 + np.abs(cur[node]))
            todo = np.unique(node[gain > tol])
            self.work += len(self.local)
            swept = 0
            for i in todo.tolist():
                v = self.vec(i)
                c = v[self.s[i]]
                for b in np.argsort(v, kind="stable").tolist():
                    if not v[b] < c - 1e-9 * (1.0 + abs(c)):
                        break
                    if self.fits(i, b):
                        self.move(i, b)
                        swept += 1
                        break
                if self.work >= limit or self.late():
                    break
            moves += swept
            if not swept:
                break
        return moves

    def repair(self, limit: float, batch: int = 64) -> bool:
        """Moves that cut the usage over the limit, the most excess removed per unit of cost
        added first, until within the limit (True) or out of work or moves (False). Each
        round prices every move, then takes up to ``batch`` of the best, each re-priced
        against the usage as it is then, on nodes not next to one moved in the round."""
        m, st = self.m, self.steps
        node = m.node_of()
        while self.excess() > 0:
            if self.work >= limit or self.late():
                return False
            over = np.concatenate([[0], np.cumsum(self.profile > self.limit)])
            hits = (over[st.hi] - over[st.lo]).astype(np.float64)
            cur = self.s[st.e_node]
            ns_e = st.ns[st.e_node]
            cur_val = st.val[st.voff[st.e_node] + cur * ns_e + (st.e_step - st.soff[st.e_node])]
            gain = np.bincount(
                st.e_pos, weights=(cur_val - st.val) * hits[st.e_step], minlength=len(self.local)
            )
            dcost = self.local - self.local[m.noff[:-1] + self.s][node]
            self.work += len(st.val) + len(self.local)
            ok = gain > 0
            if not ok.any():
                return False
            key = np.where(ok, np.maximum(dcost, 0.0) / np.where(ok, gain, 1.0), np.inf)
            order = np.argsort(key, kind="stable")[: 4 * batch]
            moved: set = set()
            blocked: set = set()
            for pos in order.tolist():
                if len(moved) >= batch or not np.isfinite(key[pos]) or self.excess() == 0:
                    break
                i = int(node[pos])
                if i in blocked:
                    continue
                b = pos - int(m.noff[i])
                if self._gain(i, b) <= 0:
                    continue
                self.move(i, b)
                moved.add(i)
                blocked.add(i)
                blocked.update(o for _, o, _ in self.adj[i])
        return True

    def _gain(self, i: int, b: int) -> float:
        """Usage that moving node i to b removes from the segments now over the limit."""
        d = self._delta(i, b)
        if d is None:
            return 0.0
        lo, hi, dv = d
        over = np.concatenate([[0], np.cumsum(self.profile > self.limit)])
        self.work += len(self.profile)
        return float(-(dv * (over[hi] - over[lo])).sum())

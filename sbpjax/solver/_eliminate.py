"""Variable (bucket) elimination: exact dynamic programming on the cost graph.

Eliminating node x replaces every factor that mentions x by one factor over x's neighbours:
``m(N) = min_x [unary_x(x) + sum of x's factors]``. On a leaf that is PBQP's R1 (a unary
term on the neighbour), on a node of degree two R2 (a matrix between its neighbours), on a
tree or a series-parallel graph the whole of dynamic programming. The order is greedy
min-size (the node whose new factor has the fewest entries first; ties by index), and the
solution is read back in reverse order: each node takes its best strategy given its
already-decided neighbours.

A *plan* is the order and the factor bookkeeping, made once from the graph's shape; running
it with any unary costs (those of a Lagrangian step, say) is then numpy work only. Leaves
are eliminated in vectorized batches (rounds); what remains goes node by node.

When a node's full factor would exceed ``cap`` entries, its factors are split into
*mini-buckets* each within the cap (Dechter and Rish's mini-bucket elimination). The sum
of the mini-buckets' minima is at most the true minimum, so the value found is then a
lower bound instead of the optimum, and the read-back an ordinary heuristic solution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sbpjax.solver._model import Model, local_index, offsets


@dataclass
class LeafBatch:
    """Leaves x, each with one pair p to a neighbour y: unary_y += min_x (unary_x + M_p)."""

    x: np.ndarray
    y: np.ndarray
    p: np.ndarray
    pos: np.ndarray  # pflat positions, grouped by (leaf, y strategy)
    xidx: np.ndarray  # the flat unary position of x's strategy for each entry
    starts: np.ndarray  # start of each (leaf, y strategy) group in pos
    ytarget: np.ndarray  # the flat unary position of each group's y strategy


@dataclass
class Bucket:
    """One mini-bucket of node x: the factors ``inputs`` (slot id, -1 for x's unary, and
    its shape broadcast over the sorted ``scope``) summed in this order, minimized over
    axis ``axis``, go to ``out`` (a slot id, or -1: the unary of the single remaining node,
    or -2: the constant); ``rest`` is the scope without x. From input ``full_from`` on, the
    running sum already spans the whole scope (and grows in place)."""

    inputs: tuple
    scope: tuple
    axis: int
    out: int
    rest: tuple
    full_from: int


@dataclass
class Step:
    """Node x eliminated: its ``buckets``; ``decode``: each of its factors as (slot id,
    x's position in the slot's scope, the scope's other nodes), to read back its strategy."""

    x: int
    buckets: list
    decode: list


@dataclass
class Condition:
    """Node x held at the strategy the run is handed: each of its factors (slot, x's axis,
    remaining scope, output as in :class:`Bucket`) is sliced there."""

    x: int
    items: list


@dataclass
class Plan:
    batches: list
    steps: list
    isolated: np.ndarray  # nodes with no neighbour left at the end (min of unary)
    slot_scopes: list  # scope of each factor slot (the pairs first)
    work: float  # table entries a run touches
    exact: bool  # no mini-bucket was needed: a run gives the optimum
    max_table: float = 0.0
    stats: dict = field(default_factory=dict)


def adjacency(model: Model) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """CSR adjacency: node x's pairs are ``pair[ptr[x]:ptr[x+1]]``, to nodes ``other[...]``."""
    ends = np.concatenate([model.pu, model.pv])
    others = np.concatenate([model.pv, model.pu])
    pairs = np.concatenate([np.arange(model.npairs)] * 2)
    order = np.lexsort((pairs, ends))
    ptr = offsets(np.bincount(ends, minlength=model.n))
    return ptr, pairs[order], others[order]


def leaf_rounds(model: Model, min_batch: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Batches of leaves, until a round has fewer than ``min_batch``; the nodes and pairs left."""
    ptr, apair, aother = adjacency(model)
    alive = np.ones(model.n, bool)
    pair_alive = np.ones(model.npairs, bool)
    deg = np.diff(ptr).astype(np.int64)
    k, noff, poff = model.k, model.noff, model.poff
    batches = []
    while True:
        leaves = np.flatnonzero(alive & (deg == 1))
        if len(leaves) < max(min_batch, 1):
            break
        # each leaf's one live pair
        cnt = ptr[leaves + 1] - ptr[leaves]
        ent = np.repeat(ptr[leaves], cnt) + local_index(cnt)
        live = pair_alive[apair[ent]]
        p = apair[ent][live]
        y = aother[ent][live]
        x = leaves
        # two leaves joined to each other: the larger one goes now, the other is isolated after
        both = (deg[y] == 1) & alive[y]
        go = ~both | (x > y)
        x, y, p = x[go], y[go], p[go]
        x_row = model.pu[p] == x
        kx, ky = k[x], k[y]
        kv = k[model.pv[p]]
        # entries grouped by (leaf, y strategy b), each group running over x's strategies a
        sizes = kx * ky
        loc = local_index(sizes)
        kx_r = np.repeat(kx, sizes)
        b, a = loc // kx_r, loc % kx_r
        row = np.where(np.repeat(x_row, sizes), a, b)
        col = np.where(np.repeat(x_row, sizes), b, a)
        pos = np.repeat(poff[p], sizes) + row * np.repeat(kv, sizes) + col
        xidx = np.repeat(noff[x], sizes) + a
        group_sizes = np.repeat(kx, ky)
        starts = offsets(group_sizes)[:-1]
        ytarget = np.repeat(noff[y], ky) + local_index(ky)
        batches.append(LeafBatch(x, y, p, pos, xidx, starts, ytarget))
        alive[x] = False
        pair_alive[p] = False
        np.subtract.at(deg, y, 1)
        deg[x] = 0
    return batches, alive, pair_alive


def seg_argmin(vals: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum and first argmin of each consecutive segment of ``vals`` (sizes > 0)."""
    starts = offsets(sizes)[:-1]
    mins = np.minimum.reduceat(vals, starts)
    loc = local_index(sizes)
    big = np.iinfo(np.int64).max
    hit = np.where(vals == np.repeat(mins, sizes), loc, big)
    arg = np.minimum.reduceat(hit, starts)
    return mins, np.where(arg == big, 0, arg)  # an all-NaN segment cannot occur; inf rows give 0


def run(
    plan_: Plan, model: Model, unary: np.ndarray, fixed: np.ndarray | None = None
) -> tuple[float, np.ndarray]:
    """Run the plan with these unary costs: (value, strategies). Conditioned nodes keep their
    strategy in ``fixed``. The value is the least total cost with them there when
    ``plan_.exact``, and a lower bound on it otherwise."""
    r = _Run(plan_, model, unary, fixed)
    r.forward()
    s = r.decode()
    return r.const, s


class _Run:
    """One run of a plan. ``forward`` and ``decode`` are the solver's inner loop (a
    heuristic solve runs hundreds of plans of a few hundred steps each, many on small
    tables, where Python's overhead per step is much of the time), so the plan holds
    each step's bookkeeping ready (``Bucket.rest``, ``full_from``, ``Step.decode``) and the
    tables are summed in the order written, in place where the sum is full size already:
    the same values, bit for bit, as summing them anew."""

    def __init__(self, plan_: Plan, model: Model, unary: np.ndarray, fixed: np.ndarray | None):
        self.plan, self.m = plan_, model
        self.u = unary.copy()
        noff = model.noff.tolist()
        self.uv = [self.u[a:b] for a, b in zip(noff[:-1], noff[1:])]  # views: writes reach u
        self.fixed = fixed
        self.slots: list = [None] * len(plan_.slot_scopes)
        self.owned = [False] * len(self.slots)
        self.const = 0.0

    def slot(self, f: int) -> np.ndarray:
        t = self.slots[f]
        if t is None and f < self.m.npairs:
            t = self.slots[f] = self.m.pair(f)
        if t is None:
            raise AssertionError(f"factor slot {f} read before it was written")
        return t

    def emit(self, out: int, table: np.ndarray, rest: tuple) -> None:
        """Add ``table`` (over ``rest``) to the constant, a unary, or a slot."""
        if out == -2:
            self.const += float(table)
        elif out == -1:
            self.uv[rest[0]] += table.reshape(-1)
        elif self.owned[out]:
            self.slots[out] += table
        else:  # a new slot, or a pair's matrix that must stay unchanged in the model
            self.slots[out] = table if out >= self.m.npairs else self.m.pair(out) + table
            self.owned[out] = True

    def forward(self) -> None:
        m, u = self.m, self.u
        for b in self.plan.batches:
            vals = m.pflat[b.pos] + u[b.xidx]
            np.add.at(u, b.ytarget, np.minimum.reduceat(vals, b.starts))
        uv, slots, slot, emit = self.uv, self.slots, self.slot, self.emit
        for step in self.plan.steps:
            x = step.x
            if isinstance(step, Condition):
                assert self.fixed is not None, "a plan with conditioned nodes needs the fixed strategies"
                a = int(self.fixed[x])
                self.const += float(uv[x][a])
                for f, axis, rest, out in step.items:
                    emit(out, np.take(slot(f), a, axis=axis), rest)
                continue
            for bk in step.buckets:
                acc = None
                for i, (f, shape) in enumerate(bk.inputs):
                    if f < 0:
                        t = uv[x].reshape(shape)
                    else:
                        t = slots[f]
                        t = (t if t is not None else slot(f)).reshape(shape)
                    if acc is None:
                        acc = t
                    elif i >= bk.full_from:  # a sum made here, full size already
                        acc += t
                    else:
                        acc = acc + t
                assert acc is not None  # a bucket has one input at least
                emit(bk.out, acc.min(axis=bk.axis), bk.rest)

    def decode(self) -> np.ndarray:
        m, k, noff = self.m, self.m.k, self.m.noff
        s = np.zeros(m.n, dtype=np.int64)
        iso = self.plan.isolated
        if len(iso):
            sizes = k[iso]
            mins, arg = seg_argmin(self.u[np.repeat(noff[iso], sizes) + local_index(sizes)], sizes)
            self.const += float(mins.sum())
            s[iso] = arg
        sl = s.tolist()
        uv, slots, slot = self.uv, self.slots, self.slot
        for step in reversed(self.plan.steps):
            x = step.x
            if isinstance(step, Condition):
                assert self.fixed is not None
                sl[x] = int(self.fixed[x])
                continue
            vec = None
            for f, xpos, others in step.decode:
                t = slots[f]
                if t is None:
                    t = slot(f)
                if len(others) == 1:  # a pair's matrix: a column or a row
                    row = t[:, sl[others[0]]] if xpos == 0 else t[sl[others[0]]]
                else:
                    idx: list = [sl[v] for v in others]
                    idx.insert(xpos, slice(None))
                    row = t[tuple(idx)]
                if vec is None:
                    vec = uv[x] + row
                else:
                    vec += row
            sl[x] = int((uv[x] if vec is None else vec).argmin())
        s = np.asarray(sl, dtype=np.int64)
        rep = np.repeat
        for b in reversed(self.plan.batches):
            x_row = m.pu[b.p] == b.x
            kx = k[b.x]
            sy = s[b.y]
            loc = local_index(kx)
            row = np.where(rep(x_row, kx), loc, rep(sy, kx))
            col = np.where(rep(x_row, kx), rep(sy, kx), loc)
            pos = rep(m.poff[b.p], kx) + row * rep(k[m.pv[b.p]], kx) + col
            _, arg = seg_argmin(m.pflat[pos] + self.u[rep(noff[b.x], kx) + loc], kx)
            s[b.x] = arg
        return s

"""The elimination order and its factor bookkeeping, made from the graph's shape alone.

Nodes go greedily by *min-size*: the node whose new factor has the fewest entries first,
ties by node index. Scores are log2 of entry counts in exact fixed point, kept up to date
incrementally, so the order is a pure function of the graph and the domain sizes.

When the cheapest node's factor would exceed ``cap`` entries, the planner gives up
(``mode="exact"``: None, the graph is too wide for the cap), or

- splits that node's factors into *mini-buckets* within the cap (``mode="minibucket"``: a
  run then gives a lower bound and a heuristic solution), or
- *conditions* a node (``mode="condition"``): the remaining node of most neighbours (ties
  by ``priority``, highest first; ``protect``-ed nodes only when no other is left) is fixed
  at the strategy it has in the solution handed to the run, its factors sliced there. A
  run is then an exact large-neighbourhood move: the best solution with the conditioned
  nodes where they are.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from sbpjax.solver._eliminate import Bucket, Condition, Plan, Step, leaf_rounds
from sbpjax.solver._fill_order import fill_order
from sbpjax.solver._model import Model, log_cap, log_sizes


class _Planner:
    def __init__(self, model: Model, cap: float, mode: str, priority, protect, leaves: tuple):
        self.batches, alive, pair_alive = leaves
        self.k = [int(v) for v in model.k]
        self.cap, self.mode = cap, mode
        self.logcap = log_cap(cap)
        n = model.n
        self.priority = [0] * n if priority is None else priority.tolist()
        self.protect = [False] * n if protect is None else protect.tolist()
        self.scopes: list = list(zip(model.pu.tolist(), model.pv.tolist()))
        self.by_scope: dict = {sc: i for i, sc in enumerate(self.scopes) if pair_alive[i]}
        self.var_slots: list = [set() for _ in range(n)]
        self.nb: list = [set() for _ in range(n)]
        for (u, v), i in self.by_scope.items():
            self.var_slots[u].add(i)
            self.var_slots[v].add(i)
            self.nb[u].add(v)
            self.nb[v].add(u)
        self.logk = log_sizes(self.k)
        self.score = [self.logk[x] + sum(self.logk[y] for y in self.nb[x]) for x in range(n)]
        self.version = [0] * n
        self.done = (~alive).tolist()
        live = [x for x in np.flatnonzero(alive).tolist() if self.nb[x]]
        self.heap = [(self.score[x], x, 0) for x in live]
        heapq.heapify(self.heap)
        self.conditioning = mode == "condition"
        self.hubs = [self._hub_key(x) for x in live] if self.conditioning else []
        heapq.heapify(self.hubs)
        self.steps: list = []
        self.work = float(sum(int(b.pos.size) for b in self.batches))
        self.max_table = 0.0
        self.exact = True
        self.conditioned = 0

    def build(self, model: Model, order: list | None = None) -> Plan | None:
        for x in order or ():  # a given order (exact mode): each node with neighbours left
            if self.done[x] or not self.nb[x]:
                continue
            if self.score[x] > self.logcap:
                return None
            self._eliminate(x)
        while self.heap:
            sc, x, ver = heapq.heappop(self.heap)
            if self.done[x] or ver != self.version[x]:
                continue
            if sc > self.logcap and self.mode == "exact":
                return None
            if sc > self.logcap and self.mode == "condition":
                heapq.heappush(self.heap, (sc, x, ver))
                self._condition(self._hub())
            else:
                self._eliminate(x)
        gone = set(st.x for st in self.steps)
        isolated = np.array([x for x in range(model.n) if not self.done[x] and x not in gone], dtype=np.int64)
        stats = {"conditioned": self.conditioned, "eliminated": len(self.steps) - self.conditioned}
        return Plan(
            self.batches, self.steps, isolated, self.scopes, self.work, self.exact, self.max_table, stats
        )

    def _hub_key(self, x: int) -> tuple:
        return (self.protect[x], -len(self.nb[x]), -self.priority[x], x, self.version[x])

    def _hub(self) -> int:
        while True:
            *_, x, ver = heapq.heappop(self.hubs)
            if not self.done[x] and ver == self.version[x]:
                return x

    def _touch(self, nodes) -> None:
        version, heap, nb, done, score = self.version, self.heap, self.nb, self.done, self.score
        for v in sorted(nodes):
            version[v] += 1
            if nb[v] and not done[v]:
                heapq.heappush(heap, (score[v], v, version[v]))
                if self.conditioning:
                    heapq.heappush(self.hubs, self._hub_key(v))

    def _output(self, rest: tuple) -> int:
        """Where a factor over ``rest`` goes: -2 constant, -1 unary, else a slot (merged with
        one of the same scope)."""
        if len(rest) == 0:
            return -2
        if len(rest) == 1:
            return -1
        out = self.by_scope.get(rest)
        if out is None:
            out = len(self.scopes)
            self.scopes.append(rest)
            self.by_scope[rest] = out
            for v in rest:
                self.var_slots[v].add(out)
        return out

    def _connect(self, rest: tuple) -> None:
        for v in rest:
            new = set(rest) - self.nb[v]
            new.discard(v)
            if new:
                self.nb[v] |= new
                self.score[v] += sum(self.logk[y] for y in new)

    def _detach(self, x: int, factors: list) -> set:
        for f in factors:
            for v in self.scopes[f]:
                self.var_slots[v].discard(f)
            self.by_scope.pop(self.scopes[f], None)
        touched = set(self.nb[x])
        for v in self.nb[x]:
            self.nb[v].discard(x)
            self.score[v] -= self.logk[x]
        self.nb[x] = set()
        self.done[x] = True
        return touched

    def _eliminate(self, x: int) -> None:
        factors = sorted(self.var_slots[x])
        buckets = _split(x, factors, self.scopes, self.k, self.cap)
        self.exact &= len(buckets) == 1
        decode = []
        for f in factors:
            scope = self.scopes[f]
            decode.append((f, scope.index(x), tuple(v for v in scope if v != x)))
        step = Step(x, [], decode)
        touched: set = set()
        k = self.k
        for ins, scope in buckets:
            target = tuple(sorted(scope))
            rest = tuple(v for v in target if v != x)
            entries = float(math.prod(k[v] for v in target))
            self.work += entries
            self.max_table = max(self.max_table, entries)
            scopes = [(x,) if f < 0 else self.scopes[f] for f in ins]
            inputs = tuple((f, _shape(target, sc, k)) for f, sc in zip(ins, scopes))
            bucket = Bucket(
                inputs, target, target.index(x), self._output(rest), rest, _full_from(target, scopes)
            )
            step.buckets.append(bucket)
            self._connect(rest)
            touched.update(rest)
        touched |= self._detach(x, factors)
        self.steps.append(step)
        self._touch(touched)

    def _condition(self, c: int) -> None:
        factors = sorted(self.var_slots[c])
        items = []
        for f in factors:
            scope = self.scopes[f]
            rest = tuple(v for v in scope if v != c)
            self.work += float(math.prod(self.k[v] for v in rest))
            items.append((f, scope.index(c), rest))
        touched = self._detach(c, factors)
        cond = Condition(c, [(f, axis, rest, self._output(rest)) for f, axis, rest in items])
        self.steps.append(cond)
        self.conditioned += 1
        self._touch(touched)


def plan(
    model: Model,
    cap: float = np.inf,
    mode: str = "minibucket",
    priority: np.ndarray | None = None,
    protect: np.ndarray | None = None,
    min_batch: int = 16,
    leaves: tuple | None = None,
) -> Plan | None:
    """The elimination plan of ``model``'s graph (see the module docstring). ``leaves``: the
    model's ``leaf_rounds(model, min_batch)``, when the caller has them already (they do
    not depend on the mode, cap or priorities, and plans may share them).
    ``mode="fill"``: an exact plan in ``_fill_order``'s least-fill order rather than by
    min-size (None when that is too wide for ``cap`` too)."""
    if mode not in ("exact", "minibucket", "condition", "fill"):
        raise ValueError(f"mode {mode!r}")
    if leaves is None:
        leaves = leaf_rounds(model, min_batch)
    order = None
    if mode == "fill":
        order = fill_order(model, leaves, cap)
        if order is None:
            return None
        mode = "exact"
    return _Planner(model, cap, mode, priority, protect, leaves).build(model, order)


def _shape(target: tuple, scope: tuple, k: list) -> tuple:
    """A factor over ``scope`` broadcast over the sorted ``target``."""
    shape = [1] * len(target)
    for v in scope:
        shape[target.index(v)] = k[v]
    return tuple(shape)


def _full_from(target: tuple, scopes: list) -> int:
    """The first input a bucket's running sum, already spanning ``target``, takes in
    place (``Bucket.full_from``); at least 2: the first sum, of inputs 0 and 1, is a new
    array. ``len(scopes)`` where no input is added to a full sum."""
    covered: set = set()
    for i, sc in enumerate(scopes):
        if len(covered) == len(target):
            return max(i, 2)
        covered.update(sc)
    return len(scopes)


def _split(x: int, factors: list, scopes: list, k: list, cap: float) -> list:
    """Mini-buckets of x's factors (slot ids; -1 is x's unary), each within ``cap`` entries
    (one bucket when everything fits). Largest scopes are placed first, each in the first
    bucket it fits."""
    full = set().union(*(scopes[f] for f in factors)) | {x}
    if math.prod(k[v] for v in full) <= cap:
        return [([-1, *factors], full)]
    order = sorted(factors, key=lambda f: (-math.prod(k[v] for v in scopes[f]), f))
    buckets: list = []
    for f in order:
        for ins, scope in buckets:
            merged = scope | set(scopes[f])
            if math.prod(k[v] for v in merged) <= cap:
                ins.append(f)
                scope |= merged
                break
        else:
            buckets.append(([f], set(scopes[f]) | {x}))
    buckets[0][0].insert(0, -1)
    return buckets

"""Boxing cost tables, filled lazily: lower bounds first, exact costs where a plan uses them.

A table holds what boxing a value costs from each layout its producer's
strategies give it to each layout its consumer's strategies read it in
(``pricing.boxing_cost`` of the plan the lowering runs, in 1/64 bytes).
Planning a boxing exactly is a search (:func:`sbpjax.boxing.plan.plan_boxing`);
a program's tables ask for tens of thousands of them, and a plan uses one
entry per table. So an entry starts as a lower bound
(``plan.bytes_lower_bound``, the bytes no plan beats, plus the latency of one
collective where any byte moves), and the layout choice solves, plans
exactly the entries its solution uses (:meth:`Tables.settle`), and solves
again until every entry its solution uses is exact. Bounds never exceed the
costs, so that solution is optimal for the exact tables too (the lazy
constraint generation of integer programming). On the 2-layer GPT of
``examples/gpt_hybrid.py`` (37,586 entries in 2,412 tables) the choice
settles after planning a few percent of them.

Alike values of alike layers (the same shape, dtype and layout lists) share
one table, so a layer's exact entries serve every layer.
"""

from __future__ import annotations

import itertools

import numpy as np

from sbpjax.boxing.plan import launch_bytes, ring_latency_bytes
from sbpjax.compiler.pricing import boxing_cost
from sbpjax.dtypes import dtype_name


class Table:
    """Costs from each of ``src`` to each of ``dst`` layouts (1/64 bytes):
    ``values[a, c]``, exact where ``exact[a, c]``, a lower bound elsewhere."""

    __slots__ = ("src", "dst", "values", "exact", "atom")

    def __init__(self, atom, src, dst):
        self.atom, self.src, self.dst = atom, src, dst
        self.values = np.zeros((len(src), len(dst)))
        self.exact = np.zeros((len(src), len(dst)), dtype=bool)


class Tables:
    """The cost tables of one formulation, sharing plans through ``pr``
    (``Propagator.plan``'s cache). ``lazy``: entries start as lower bounds
    (:meth:`settle` makes them exact); else every entry is planned at once."""

    def __init__(self, pr, cost_model, options, ring: bool, lazy: bool = True):
        self.pr, self.cm, self.options, self.ring, self.lazy = pr, cost_model, options, ring, lazy
        self._tables: dict = {}
        self._plan_cost: dict = {}  # id(plan) -> (plan, its cost)
        self.planned = 0  # entries planned exactly
        self.entries = 0  # entries in all tables
        self._min_launch = _least_launch(cost_model, pr.pl, ring) if (options.latency or ring) else 0.0

    def table(self, atom, src_lays, dst_lays) -> Table:
        key = (
            tuple(atom.shape),
            dtype_name(atom.dtype),
            id(atom) in self.pr.zeros,
            tuple(src_lays),
            tuple(dst_lays),
        )
        hit = self._tables.get(key)
        if hit is None:
            hit = self._tables[key] = Table(atom, tuple(src_lays), tuple(dst_lays))
            self.entries += hit.values.size
            for a, s in enumerate(src_lays):
                for c, d in enumerate(dst_lays):
                    if s == d:
                        hit.exact[a, c] = True
                    elif self.lazy:
                        hit.values[a, c] = self._bound(atom, s, d)
                    else:
                        self._plan(hit, a, c)
        return hit

    def cost(self, plan) -> int:
        """A plan's cost in the tables' measure (``pricing.boxing_cost``)."""
        hit = self._plan_cost.get(id(plan))
        if hit is None:
            hit = self._plan_cost[id(plan)] = (plan, boxing_cost(plan, self.cm, self.options, ring=self.ring))
        return hit[1]

    def settle(self, table: Table, a: int, c: int) -> bool:
        """Make entry (a, c) exact; whether its value changed."""
        if table.exact[a, c]:
            return False
        before = table.values[a, c]
        self._plan(table, a, c)
        return table.values[a, c] != before

    def _plan(self, table: Table, a: int, c: int) -> None:
        table.values[a, c] = self.cost(self.pr.plan(table.atom, table.src[a], table.dst[c]))
        table.exact[a, c] = True
        self.planned += 1

    def _bound(self, atom, s, d) -> float:
        """A lower bound of the entry: the bytes no plan beats, and where a
        byte moves, one collective's launch at the least any group pays."""
        moved = self.pr.bound(atom, s, d)
        return 64 * moved + (round(64 * self._min_launch) if moved else 0)


def _least_launch(cost_model, placement, ring: bool) -> float:
    """The least latency, in bytes, of a collective over any group of the
    placement's axes: its launch (``plan.launch_bytes``), or with ``ring``
    the cost model's time of it (``plan.ring_latency_bytes``, any op)."""
    names = [n for n, p in zip(placement.axis_names, placement.shape) if p > 1]
    groups = [list(g) for k in range(1, len(names) + 1) for g in itertools.combinations(names, k)]
    if ring:
        ops = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "permute")
        return min(
            (ring_latency_bytes(cost_model, placement, op, g, 1) for g in groups for op in ops), default=0.0
        )
    return min((launch_bytes(cost_model, g) for g in groups), default=0.0)


__all__ = ["Table", "Tables"]

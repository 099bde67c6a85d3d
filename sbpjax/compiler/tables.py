"""Boxing cost tables, filled lazily: lower bounds first, exact costs where a plan uses them.

A table holds what boxing a value costs from each layout its producer's
strategies give it to each layout its consumer's strategies read it in
(``pricing.boxing_cost`` of the plan the lowering runs, in 1/64 bytes).
Planning a boxing exactly is a search (:func:`sbpjax.boxing.plan.plan_boxing`);
a program's tables ask for tens of thousands of them, and a plan uses one
entry per table. So an entry starts as a lower bound
(``plan.bytes_lower_bound``, the bytes no plan beats, plus, where any byte
moves, the least latency a plan can pay: one step over a group the data must
cross, and a reducing collective over each axis whose partial is summed,
:func:`least_latency`), and the layout choice solves, plans
exactly the entries its solution uses (:meth:`Tables.settle`), and solves
again until every entry its solution uses is exact. Bounds never exceed the
costs, so that solution is optimal for the exact tables too (the lazy
constraint generation of integer programming). On the 2-layer GPT of
``examples/gpt_hybrid.py`` (37,586 entries in 2,412 tables) the choice
settles after planning a few percent of them. The tighter the bounds, the
fewer the rounds: bounding a partial's sum by its reducing collective took the
ring-latency solve of the 32-layer scanned GPT from 11 rounds to 8.

Alike values of alike layers (the same shape, dtype and layout lists) share
one table, so a layer's exact entries serve every layer.
"""

from __future__ import annotations

import itertools

import numpy as np

from sbpjax.boxing.plan import launch_bytes, ring_latency_bytes, unit_bytes_lower_bound
from sbpjax.boxing.search import shape_unit
from sbpjax.compiler.pricing import boxing_cost
from sbpjax.compiler.propagation import even_on
from sbpjax.dtypes import dtype_name
from sbpjax.sbp import Broadcast, Partial, Split


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
        # per group of placement axes and op, one collective's latency (none priced: empty)
        self._launch = _launches(cost_model, pr.pl, ring) if (options.latency or ring) else {}
        # Bounds are kept per shape class (``boxing.search.shape_unit``: the
        # bytes bound of a shape is its class's times a factor, and evenness
        # is the class's) and per pair of layouts, by small ints: a 2-layer GPT
        # on 2x2x2 fills 780,000 entries, and hashing the nd-SBPs of each
        # (Python-level hashes per axis) was most of the tables' time.
        self._ids: dict = {}  # nd-SBP -> its int here
        self._latency = LatencyBound(self._launch, pr.pl.shape)
        self._least: dict = {}  # (src id, dst id) -> (crosses an axis, the least latency)
        self._unit_bounds: dict = {}  # (unit shape, src id, dst id) -> (unit bytes bound, latency or None)
        self._even: dict = {}  # (nd-SBP id, unit shape) -> even_on

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
            src_ids, dst_ids = self._ids_of(src_lays), self._ids_of(dst_lays)
            for a, i in enumerate(src_ids):
                for c, j in enumerate(dst_ids):
                    if i == j:
                        hit.exact[a, c] = True
                    elif not self.lazy:
                        self._plan(hit, a, c)
            # a zero tensor is made afresh in any layout: every bound 0
            if self.lazy and id(atom) not in self.pr.zeros:
                self._fill_bounds(hit, src_ids, dst_ids)
        return hit

    def _ids_of(self, lays) -> list:
        ids = self._ids
        return [ids.setdefault(nd, len(ids)) for nd in lays]

    def _fill_bounds(self, table: Table, src_ids: list, dst_ids: list) -> None:
        """Each inexact entry's lower bound: the bytes no plan beats, and
        where a byte moves (:func:`moves`), the latency no plan beats
        (:func:`least_latency`), in 1/64 bytes."""
        atom = table.atom
        unit, scale = shape_unit(tuple(int(d) for d in atom.shape), self.pr.pl.size)
        per_unit_byte = 64 * atom.dtype.itemsize * scale
        known = self._unit_bounds
        for a, i in enumerate(src_ids):
            row = table.values[a]
            for c, j in enumerate(dst_ids):
                if i == j:
                    continue
                hit = known.get((unit, i, j))
                if hit is None:
                    hit = known[unit, i, j] = self._unit_bound(unit, table.src[a], i, table.dst[c], j)
                moved, lat = hit
                if lat is not None:
                    row[c] = per_unit_byte * moved + round(64 * lat)

    def _unit_bound(self, unit: tuple, src, i: int, dst, j: int) -> tuple:
        """(the bytes bound of shape class ``unit``, the least latency where
        every plan moves a byte, else None)."""
        moved = unit_bytes_lower_bound(unit, self.pr.pl.shape, src, dst)
        least = self._least.get((i, j))
        if least is None:
            least = self._least[i, j] = self._latency(src, dst)
        crossed, lat = least
        # moves(), with the crossing at hand and evenness kept per layout and
        # class (a dim the device count divides splits evenly); calling moves()
        # itself built the 2x2x2 GPT's tables in 10.7 s against 7.6 s (one
        # run each on a busy 2-core machine)
        if moved or (crossed and self._even_on(src, i, unit) and self._even_on(dst, j, unit)):
            return moved, lat
        return 0, None

    def _even_on(self, nd, i: int, unit: tuple) -> bool:
        hit = self._even.get((i, unit))
        if hit is None:
            hit = self._even[i, unit] = even_on(nd, unit, self.pr.pl.shape)
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


def moves(moved: int, shape, src, dst, grid) -> bool:
    """Whether every plan from ``src`` to ``dst`` moves a byte: where the
    bytes bound ``moved`` says so, or where the layouts cross an axis
    (:func:`crossed_axes`) and every piece of both holds values (both are
    even: where a piece is empty, a dim of 1 split over two devices, the
    device at the crossed axis's other coordinate may need nothing). The
    bytes bound of a partial target is 0 (zero-filling is free, and so is which device holds which part of the
    sum), yet ``(S(1), P) -> (P, S(1))`` still sums over the second axis.
    Without the crossing such an entry was bounded by 0 where its plan costs
    a collective's latency and more: a 2-layer scanned GPT with FSDP and
    tensor parallelism (2x4) chose plans whose exact cost was 2.7 times
    their bounds', and took five settling rounds where it takes two now."""
    if moved:
        return True
    return bool(crossed_axes(src, dst, grid)) and even_on(src, shape, grid) and even_on(dst, shape, grid)


def least_latency(launch: dict, src, dst, grid) -> float:
    """The least latency a boxing plan from ``src`` to ``dst`` that moves
    bytes pays, by ``launch`` ({group of axis indices: {op: one step's
    latency}}, a permute at one round): the larger of two bounds.

    * A plan that moves bytes runs at least one step: one permute round over
      any group, or a collective over a group with an axis the data must
      cross (:func:`crossed_axes`; any group where none is found).
    * A partial over axis ``a`` that the target does not keep is summed by a
      reducing collective over a group with ``a`` (a reduction over a group
      without it sums devices of one coordinate of ``a``; a permute only
      moves tiles between layouts of equal partials). Over the tensor axis
      of a 2x4 placement that is the ring's reduce-scatter, 2.5 MB on the
      default cost model, where the least step over any group is one
      permute round, 0.9 MB: on the 32-layer scanned GPT of
      ``benchmarks/compiler.py`` the ring-latency solve
      (``second_looks.fewer_collectives``) settled in 8 rounds instead of
      11, to the same plan.
    * Where the target is whole over that axis, the sum must also reach
      every coordinate of it: an all-reduce, or a reduce-scatter (which
      leaves the sum split over the group, so over ``a``) followed by a
      step over a group with ``a``. ``(P, P) -> (B, B)`` on a 2x4 ring is
      bounded by 3.4 MB instead of the 2.5 MB of one reduce-scatter over y
      (its plan, one all-reduce over both axes, costs 11.3 MB): the demo's
      ring-latency solve settles in 6 rounds instead of 8, to the same
      plan."""
    return LatencyBound(launch, grid)(src, dst)[1]


class LatencyBound:
    """:func:`least_latency` for one ``launch`` table and grid, with its
    parts kept: the least step per set of crossed axes, and the least sum
    per partial axis and target kind (a 2-layer GPT on 2x2x2 asks for
    150,000 pairs, and recomputing both minima over the groups of three
    axes took most of the tables' time). Called with ``(src, dst)`` it
    returns ``(whether they cross an axis, the least latency)``."""

    def __init__(self, launch: dict, grid: tuple):
        self.launch, self.grid = launch, grid
        self._step: dict = {}  # frozenset of crossed axes -> the least step
        self._summed: dict = {}  # (axis, target whole there) -> the least sum

    def __call__(self, src, dst) -> tuple[bool, float]:
        crossed = crossed_axes(src, dst, self.grid)
        if not self.launch:
            return bool(crossed), 0.0
        step = self._step.get(crossed)
        if step is None:
            step = self._step[crossed] = min(
                lat
                for g, ops in self.launch.items()
                for op, lat in ops.items()
                if op == "permute" or not crossed or g & crossed
            )
        lat = step
        for a, (p, q) in enumerate(zip(src, dst)):
            if self.grid[a] > 1 and isinstance(p, Partial) and p != q:
                whole = isinstance(q, Broadcast)
                summed = self._summed.get((a, whole))
                if summed is None:
                    summed = self._summed[a, whole] = _least_sum(self.launch, a, whole)
                lat = max(lat, summed)
        return bool(crossed), lat


def _least_sum(launch: dict, a: int, whole: bool) -> float:
    """The least latency of summing axis ``a``'s partial (and, for a target
    ``whole`` over ``a``, of replicating the sum over it: an all-reduce, or a
    reduce-scatter, which leaves the sum split over ``a``, and then any step
    over a group with ``a``)."""
    spread = min(lat for g, ops in launch.items() if a in g for lat in ops.values())
    return min(
        min(ops["all_reduce"], ops["reduce_scatter"] + (spread if whole else 0.0))
        for g, ops in launch.items()
        if a in g
    )


def crossed_axes(src, dst, grid) -> frozenset:
    """The placement axes (of more than one device) where the 1-D layout
    changes other than locally (B -> S, B -> P and S -> P are slices and
    zero-fills): any plan from ``src`` to ``dst`` sends data across one of
    them. Why: take such an axis ``a`` and the devices at one coordinate of
    it. In the source they hold a ``1/p_a`` share of the split dim (or one
    of ``p_a`` partial contributions); in the target their blocks, taken
    together over the other axes, need all of it. The rest is held only at
    other coordinates of ``a``, and a collective over a group without ``a``
    joins devices of one coordinate only."""
    out = set()
    for a, (p, q) in enumerate(zip(src, dst)):
        if (
            grid[a] == 1
            or p == q
            or isinstance(p, Broadcast)
            or (isinstance(p, Split) and isinstance(q, Partial))
        ):
            continue
        out.add(a)
    return frozenset(out)


def _launches(cost_model, placement, ring: bool) -> dict:
    """{group (a frozenset of axis indices of more than one device): {op:
    the latency, in bytes, of one step of it over the group}}: its launch
    (``plan.launch_bytes``, alike for every op), or with ``ring`` the cost
    model's time of it (``plan.ring_latency_bytes``; a permute at one
    round)."""
    axes = [a for a, p in enumerate(placement.shape) if p > 1]
    names = placement.axis_names
    ops = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce", "permute")
    out: dict = {}
    for k in range(1, len(axes) + 1):
        for g in itertools.combinations(axes, k):
            group = [names[a] for a in g]
            out[frozenset(g)] = {
                op: ring_latency_bytes(cost_model, placement, op, group, 1)
                if ring
                else launch_bytes(cost_model, group)
                for op in ops
            }
    return out


__all__ = ["LatencyBound", "Table", "Tables", "crossed_axes", "least_latency", "moves"]

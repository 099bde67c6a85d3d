"""What a plan costs, in the layout choice's own measure.

A boxing costs the bytes it moves (OneFlow's Table 2 convention), plus each
collective's launch latency priced in bytes (``alpha / beta`` of its group
from the ``CostModel``: the bytes its links could carry meanwhile, 100 kB on
the default model), plus, for a zero-fill that turns a split value into a
partial, ``zero_fill_weight`` per byte the devices' blocks grow. Costs are
kept in 1/64 bytes and rounded, so the solver works on integers.

Decision: one ``alpha / beta`` per collective, not the ring's ``p - 1`` hops.
Priced by the ring (tried twice, see ``docs/concepts/compiler.md``),
collectives were bought with bytes everywhere: 14 of the 19 rows of
``benchmarks/compiler.py`` moved more bytes. Bytes come first; the ring's
latency decides only between plans close in bytes, in the second solve
(``CompileOptions.fewer_collectives``), where ``ring=True`` prices it.

Decision: ``zero_fill_weight`` 1/16. Device memory is some 10-50x faster than
the links between devices; with the weight 0 a height-split ResNet kept its
BatchNorm-backward activations as full-size (P, P) partials to save 0.5% of
the bytes and peaked at 1.5x GSPMD's memory (6.1 MB against 4.0 MB); at 1/16
it peaks at 4.0 MB.
"""

from __future__ import annotations

import numpy as np

from sbpjax.boxing.cost import CostModel
from sbpjax.boxing.plan import launch_bytes, ring_latency_bytes, step_launch_bytes
from sbpjax.compiler.buckets import emitted_collectives, launch_count, plan_buckets
from sbpjax.compiler.dead_code import unread_last_carries
from sbpjax.compiler.liveness import block_bytes
from sbpjax.compiler.options import DEFAULT_OPTIONS, CompileOptions
from sbpjax.compiler.program import common_path
from sbpjax.compiler.propagation import Propagation


def latency_bytes(plan, cost_model) -> float:
    """The launch latency of a boxing's collectives, in bytes: ``alpha /
    beta`` of each collective's group (a permute: one per round)."""
    return sum(step_launch_bytes(st, cost_model) for st in plan.steps)


def boxing_cost(
    plan, cost_model, options: CompileOptions = DEFAULT_OPTIONS, with_latency: bool = True, ring: bool = False
) -> int:
    """A boxing's cost in 1/64 bytes (an int): its bytes, each collective's
    latency (``latency_bytes``; ``ring``: the cost model's ring time,
    ``ring_latency_bytes``; ``options.latency`` False or ``cost_model``
    None: 1/64 B per collective, breaking ties; ``with_latency=False``:
    none, for a boxing whose bucket pays it), and the blocks a zero-fill of
    a split grows (``options.zero_fill_weight`` per byte)."""
    if not plan.bytes or not with_latency:
        latency = 0.0
    elif ring:
        latency = sum(
            ring_latency_bytes(cost_model, plan.placement, st.op, st.axes, st.rounds)
            for st in plan.steps
            if st.bytes > 0
        )
    elif options.latency and cost_model is not None:
        latency = latency_bytes(plan, cost_model)
    else:
        latency = sum(1 for st in plan.steps if st.bytes > 0) / 64
    grown = 0  # bytes a zero-fill of a split adds to the blocks, summed over devices
    if options.zero_fill_weight and any(st.op == "zero_fill" and st.dim is not None for st in plan.steps):
        grid = plan.placement.shape
        before = block_bytes(plan.shape, plan.dtype, plan.src_sbp, grid)
        after = block_bytes(plan.shape, plan.dtype, plan.dst_sbp, grid)
        grown = int(np.prod(grid)) * max(0, after - before)
    return 64 * plan.bytes + round(64 * latency) + round(64 * options.zero_fill_weight * grown)


def comm_cost(
    comm, placement, cost_model, options: CompileOptions = DEFAULT_OPTIONS, ring: bool = False
) -> int:
    """An op's own communication (a ``rules.Comm``: a halo exchange, a
    cumulative op's gather of its pieces' totals) in 1/64 bytes, priced as a
    boxing's collective is: its bytes and one launch (``ring``: the cost
    model's ring time of it; ``options.latency`` False or ``cost_model``
    None: 1/64 B, breaking ties), for each of its ``launches`` (one for an
    exchange as the lowering runs it, a halo one permute per side; a loop
    planned on its own, every collective of its iterations, each priced as
    an all-gather over the loop's axes by the ring).

    Decision: launches priced here as for boxings. Priced by bytes alone (as
    until 2026-12), an op's exchange looked free of latency beside a boxing,
    and the layout choice kept a cumulative sum and its reverse split along
    their axis on (8, 16) over 8 devices: two gathers of totals and two
    permutes of the reversal, 4,608 B in 4 collectives, where an all-to-all
    of 448 B lets all run whole (896 B in 2, with the one back)."""
    if not comm.bytes:
        return 0
    axes = [placement.axis_names[a] for a in comm.axes if placement.shape[a] > 1]
    if ring:
        op = "permute" if comm.what in ("permute", "halo_exchange") else "all_gather"
        latency = ring_latency_bytes(cost_model, placement, op, axes, 1)
    elif options.latency and cost_model is not None:
        latency = launch_bytes(cost_model, axes)
    else:
        latency = 1 / 64
    return 64 * comm.bytes + round(64 * latency * comm.launches)


def price(prop: Propagation, cost_model=None, options: CompileOptions = DEFAULT_OPTIONS) -> float:
    """A whole plan's cost in bytes (``boxing_cost`` of each boxing, weighted
    by the chance it runs, plus the ops' own communication and the boxings
    of ``dead_tail_boxings``): what the solver minimizes, by which the plan
    kept is compared with greedy's."""
    cm = cost_model if cost_model is not None else CostModel()
    return _weighted_sum(
        prop, lambda b: boxing_cost(b.plan, cm, options), lambda c: comm_cost(c, prop.placement, cm, options)
    )


def emitted_price(
    prop: Propagation,
    cost_model=None,
    ring: bool = False,
    launched: dict | None = None,
    options: CompileOptions = DEFAULT_OPTIONS,
) -> float:
    """``price`` with latency counted for the collectives the lowering emits:
    boxings that ride in one bucket (:mod:`sbpjax.compiler.buckets`) pay for
    the bucket's rounds once. ``ring``: the collectives of
    ``emitted_collectives`` (all-reduces combined as XLA combines them), each
    at the cost model's ring latency, by which the second solve's plan is
    compared (``CompileOptions.fewer_collectives``); ``launched``:
    ``emitted_collectives(prop)`` where the caller has it."""
    cm = cost_model if cost_model is not None else CostModel()
    if ring:
        if launched is None:
            launched = emitted_collectives(prop)

        def ring_cost(b) -> float:
            latency = sum(ring_latency_bytes(cm, prop.placement, *c) for c in launched[id(b)])
            return boxing_cost(b.plan, cm, options, with_latency=False) + round(64 * latency)

        return _weighted_sum(prop, ring_cost, lambda c: comm_cost(c, prop.placement, cm, options, ring=True))
    buckets, joined = plan_buckets(prop)
    names = prop.placement.axis_names

    def cost(b) -> float:
        if id(b) in joined:  # its bucket's first boxing pays the rounds
            return boxing_cost(b.plan, cm, options, with_latency=False)
        bucket = buckets.get(id(b))
        if bucket is None:
            return boxing_cost(b.plan, cm, options)
        rounds = 0.0
        for (_, group, _), _members in bucket.rounds:
            rounds += launch_bytes(cm, [names[g] for g in group]) if options.latency else 1 / 64
        return boxing_cost(b.plan, cm, options, with_latency=False) + round(64 * rounds)

    return _weighted_sum(prop, cost, lambda c: comm_cost(c, prop.placement, cm, options))


def count_collectives(prop: Propagation, launched: dict | None = None) -> int:
    """The collectives the compiled program runs: its boxings' as XLA runs
    them (all-reduces that do not depend on one another combined) and the
    ops' own communication (``Comm.launches``: a loop planned on its own runs
    every collective of its iterations)."""
    if launched is None:
        launched = emitted_collectives(prop)
    return launch_count(launched) + _own_launches(prop)


def priced_launches(prop: Propagation) -> int:
    """The collectives ``price`` charges a launch for: each boxing's
    collective steps, uncombined, and the ops' own communication's launches
    (against ``count_collectives``: fewer where XLA combines all-reduces)."""
    steps = [st for d in prop.decisions for b in d.boxings for st in b.plan.steps]
    steps += [st for b in prop.out_boxings for st in b.plan.steps]
    return sum(1 for st in steps if st.bytes > 0 and st.collective is not None) + _own_launches(prop)


def _own_launches(prop: Propagation) -> int:
    """The launches of the ops' own communication (a halo exchange; a loop
    planned on its own runs every collective of its iterations)."""
    return sum(c.launches for _, c in prop.comm if c.bytes)


def _weighted_sum(prop: Propagation, cost, own_cost) -> float:
    """A plan's price in bytes from ``cost(boxing)`` and ``own_cost(comm)``
    (in 1/64 bytes): each boxing and each op's own communication weighted
    by the chance that it runs (inside a cond's branch: less than 1)."""
    odds = BranchOdds(prop.program)
    readers: dict = {}
    for d in prop.decisions:
        for i, (a, nd) in enumerate(zip(d.node.ins, d.in_sbp)):
            readers.setdefault((id(a), nd), []).append(odds.read_path(d.node, i))
    total = sum(cost(b) for b in prop.out_boxings)
    for d in prop.decisions:
        for b in d.boxings:
            total += odds.boxing(readers.get((id(b.var), b.dst), [()])) * cost(b)
    total += sum(odds.chance(prop.decisions[i].node.branch) * own_cost(c) for i, c in prop.comm)
    total += sum(cost(b) for b in dead_tail_boxings(prop))
    return total / 64


def dead_tail_boxings(prop: Propagation) -> list:
    """The boxings a rolled loop runs at the end of its last iteration for
    a next one, of carries nothing reads (``Run.dead_tail``), as the layout
    choice prices them (``formulate._Builder._add_dead_tails``): each unread
    carry of a written-out scan's last iteration boxed as that iteration's
    own carries coming in were (the iterations share their layouts)."""
    if not prop.program.loops:
        return []
    read = {id(a) for d in prop.decisions for a in d.node.ins} | {id(a) for a in prop.program.outputs}
    made = {id(o) for d in prop.decisions for o in d.node.outs}
    boxed: dict = {}
    for d in prop.decisions:
        for b in d.boxings:
            boxed.setdefault(id(b.var), []).append(b)
    return [
        b for _, coming in unread_last_carries(prop.program, read, made) for b in boxed.get(id(coming), [])
    ]


class BranchOdds:
    """How often code inside a cond's branches runs, for pricing it.

    A cond runs as a ``lax.switch`` (:mod:`sbpjax.compiler.switches`), so
    what lies inside a branch runs only when that branch is taken; not
    knowing the index, each branch is taken alike often: 1 / branches per
    level of nesting. A boxing runs where all its readers are (the innermost
    branch holding them). Priced so, a reduction one branch needs is made
    inside it, not after the cond, where it would run on every step (every
    branch's result zero-filled into a partial to share one reduction)."""

    def __init__(self, program):
        conds = getattr(program, "conds", [])
        self.n_branches = {c.id: c.n_branches for c in conds}
        self.select_of = {id(n): c.id for c in conds for n in c.selects}

    def chance(self, path) -> float:
        return float(np.prod([1.0 / self.n_branches[c] for c, _ in path])) if path else 1.0

    def read_path(self, node, i) -> tuple:
        """Where ``node`` reads operand ``i``: a select reads case ``k`` in branch ``k``."""
        cond = self.select_of.get(id(node))
        return (*node.branch, (cond, i - 1)) if cond is not None and i > 0 else node.branch

    def boxing(self, reader_paths) -> float:
        """The chance a boxing read at ``reader_paths`` runs."""
        return self.chance(common_path(reader_paths)) if self.n_branches else 1.0


__all__ = [
    "boxing_cost",
    "comm_cost",
    "latency_bytes",
    "price",
    "emitted_price",
    "count_collectives",
    "priced_launches",
    "BranchOdds",
]

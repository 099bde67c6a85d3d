"""Whole-program layout choice: an integer program over every op's signature.

The greedy pass (:mod:`sbpjax.compiler.propagate`) picks each op's signature
from its inputs' layouts as it walks the program; what is cheap at one op can
be expensive later (a kernel gathered at a forward matmul, an Adam moment
reduce-scattered twice). Here the choice is made for the program as a whole,
as in Alpa's intra-operator ILP:

* one binary ``s[n, k]`` per op ``n`` and candidate nd-signature ``k``
  (exactly one per op); a value's layout is the one its producer's chosen
  signature gives it (program inputs: ``in_sbp``, fixed);
* one binary ``w[v, L]`` per value ``v`` and layout ``L`` some consumer may
  need ("``v`` exists in layout ``L``"): ``w[v, L] >= sum of s[c, k]`` over
  the signatures ``k`` of consumer ``c`` that take ``v`` as ``L``. A value is
  boxed once per layout and every consumer wanting that layout shares it, so
  a partial with several consumers is reduced once (exactly what the lowering
  runs: each version is boxed from the producer's layout);
* the version's cost is ``plan_boxing(S -> L).bytes`` (the planner the
  lowering runs) for the producer layout ``S``: columns ``u[v, L, S]`` with
  ``sum_S u = w[v, L]`` and ``u[v, L, S] <= x[v, S]`` (``x[v, S]``: the sum
  of the producer's signatures giving ``S``) carry it. This is the edge
  linearization of Alpa's ILP with one marginal relaxed to an inequality;
  the textbook ``y >= x + w - 1`` has an LP relaxation that is free at every
  fractional point (HiGHS proved a bound of 8 B on a 19 MB program with it).
  Where either side is fixed the product is linear and no column is made.

Minimize the bytes moved plus each collective's latency, priced in bytes
(``LATENCY``). Partial semantics need no special case: an op that
cannot take a partial has no candidate that takes one, so the reduction's
bytes appear on that edge; a partial kept through linear ops costs nothing
until some consumer needs it reduced, where it costs its reduction once.

Shrinking: ops with one candidate (constraints, unknown primitives) and
values with one possible layout make no variables; candidates that cannot
run on the pieces (uneven splits that move, see ``sbpjax.compiler.uneven``)
are dropped; elementwise ops take their same-shape
operands in their output's layout (halves the program on a GPT step and
removes near-ties: gpt_hybrid at d_model 128 on 2x4 solves to a 0.02% gap in
7 s instead of a 13% gap in 30 s); producer layouts that box to a needed layout
for the same bytes share one column; and each value's layouts are limited to
those flowing forward from the annotations (see ``_Domains``), which always
include the greedy choice.

Repeated layers: the ops of alike layers (same primitive, shapes, source
line and, a few producers back, alike operands: ``layer_classes``) share one
choice, and each version of a value is then priced once for all layers, so
an L-layer model has about one layer's columns. Even so, the relaxation of a
program of several layers is weak (on a 4-layer decoder HiGHS's bound stays
below half the optimum after 10 s), while that of about one layer is tight.
So a program of up to ``UNTIED_OPS`` ops (a 2-layer GPT step) is solved
whole without sharing, in the whole time limit; a larger one with sharing,
in half of it, stopping at a proven 1% gap (``WINDOWS_GAP``), and then, if
not proven, by windows (``_refine``, a large-neighbourhood search) from the
better of its plan and greedy's: the repeated layers with every other op
fixed, then the rest with the layers fixed (and each written-out scan's
loop as a window of its own), until a round improves nothing. On that
decoder the windows reach 0.60x GSPMD's bytes in about 3 s.

Solved with HiGHS (:mod:`sbpjax.compiler.milp`), each solve started from the
cheapest plan in hand (where the caller left an axis idle, the plan solved
with every value whole there: ``IDLE_START``). The caller compares the
result with the greedy choice and keeps the cheaper one, so a time-out never
makes a program worse.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re
import time

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import CostModel
from sbpjax.boxing.plan import launch_bytes, ring_latency_bytes, step_launch_bytes
from sbpjax.compiler.buckets import emitted_collectives, launch_count, plan_buckets
from sbpjax.compiler.liveness import block_bytes, live_bytes
from sbpjax.compiler.propagate import (
    CONSTRAIN,
    NESTED,
    Boxing,
    Decision,
    Propagation,
    Propagator,
    idle_axes,
    op_comm,
    op_key,
)
from sbpjax.compiler.trace import Const, Var, common_path
from sbpjax.rules import RULES
from sbpjax.rules.elementwise import ELEMENTWISE
from sbpjax.sbp import Broadcast, Partial, Split

# Beyond this many binaries the solve would not finish in interactive time on
# a laptop; the greedy choice is kept (and explain() says why).
MAX_VARIABLES = 400_000
# Up to this many binaries the solve goes on to the exact optimum (a 1-layer
# GPT step: ~1,100, solved in 0.05 s): a relative gap of 0.1% hides small
# differences. Before ``LATENCY`` (when a collective cost 1/64 of a byte) a
# data-parallel step reduce-scattered a LayerNorm gain's gradient and
# all-gathered it after the sum: the bytes of one all-reduce in two
# collectives. Larger programs stop at ``rel_gap``.
EXACT_VARIABLES = 4_000
# Zero-filling a split value into a partial (S -> P) moves no byte, but each
# device then holds, and every op after it computes on, a block as large as
# the value's unsplit extent: on a height-split ResNet the byte-optimal plan
# kept BatchNorm-backward activations as full-size (P, P) partials and its
# peak memory was 1.5x GSPMD's (6.1 MB against 4.0 MB) to save 0.5% of the
# bytes. Each byte a zero-fill adds to a device's block is priced at this
# fraction of a byte moved (device memory is some 10-50x faster than the
# links between devices): the same height-split step then planned 5,387,360 B
# and peaked at 4.0 MB.
ZERO_FILL_WEIGHT = 1 / 16
# Each collective also pays its launch latency, priced in bytes from the cost
# model (alpha / beta of its group: 100 kB on the default model), once per
# collective rather than the ring's (p - 1) hops. Bytes alone made plans
# that save a few kB with extra collectives: a data-parallel GPT step on 8x1
# moved its embedding's gradient by an all-gather, an all-to-all and a
# scatter-add (4 collectives, 0.5% fewer bytes than GSPMD's 1 all-reduce);
# with the latency it is GSPMD's one bucketed all-reduce. Gradient all-reduces
# are bucketed after the choice (``sbpjax.compiler.buckets``) and so cost less
# latency than the integer program counts; ``emitted_price``, by which the
# window search compares its plans, counts a bucket's collectives once.
# Decision: one alpha / beta per collective, not the cost model's ring time
# (p devices x (p - 1) hops x alpha / beta in the summed bytes counted here:
# 5.6 MB for an all-gather over 8). Tried twice on the benchmarks, the second
# time (2026-11) pricing each collective over a group of p that way and each permute
# round at p x alpha / beta. With that price every row of
# benchmarks/compiler.py runs within 2x GSPMD's collective count (the
# data-parallel transformer step GSPMD's one all-reduce, 73.4 MB, where the
# price here keeps 4 collectives and 68.0 MB), but collectives are bought
# with bytes everywhere else: 14 of the 19 rows move more (the
# tensor-parallel step 91.8 MB instead of 67.9, a 1-layer GPT on 2x4 2.72 MB
# instead of 2.14), ``auto=True`` on a small MLP on 2x4 keeps every weight
# replicated (1,048,576 B against Megatron's 311,296 B), a data-parallel step
# on 2x4 trades its one bucketed all-reduce for 3 all-reduces, 6
# reduce-scatters and an all-gather (the integer program prices each
# gradient's all-reduce as if it ran alone), and the height-split ResNet's
# solve takes 29 s instead of 4.5 s. Bytes come first; the ring's latency
# then decides, on small programs, only between plans close in bytes
# (``FEWER_COLLECTIVES``).
# False: bytes alone, ties broken by 1/64 B per collective.
LATENCY = True


class _Auto:
    """The layout of an argument the solver chooses (``sj.AUTO``)."""

    _instance = None

    def __new__(cls):
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self):
        return "sj.AUTO"

    def __reduce__(self):
        return (_Auto, ())


AUTO = _Auto()


def auto_layouts(shape, grid) -> list[tuple]:
    """The layouts an ``AUTO`` argument may take: on every placement axis B or
    a split of any dim, where no device would be left without a piece (a dim
    split by axes whose sizes multiply to more than its length). Partials are
    not offered: an argument is data the caller holds, and a partial one
    would mean the caller had summed nothing yet."""
    per_axis = [[Broadcast()] + ([Split(d) for d in range(len(shape))] if p > 1 else []) for p in grid]
    out = []
    for nd in itertools.product(*per_axis):
        pieces = [1] * len(shape)
        for a, q in enumerate(nd):
            if isinstance(q, Split):
                pieces[q.dim] *= grid[a]
        if all(n >= k for n, k in zip(shape, pieces)):
            out.append(tuple(nd))
    return out


@dataclasses.dataclass
class Choice:
    """How the layouts were chosen, for ``explain()``.

    ``method``: "ilp" or "greedy"; ``reason``: why greedy was kept when the
    ILP was asked for; ``objective``: the solution's cost in the ILP's own
    count, in bytes (bytes moved, plus collectives' latency and the price of
    zero-filled splits: ``price``);
    ``bound``: HiGHS's proven lower bound; ``gap``: (objective - bound) /
    objective; ``solve_s``: seconds in the solver (building included);
    ``greedy_bytes`` / ``ilp_bytes``: what each choice moves."""

    method: str
    reason: str = ""
    objective: float | None = None
    bound: float | None = None
    gap: float | None = None
    solve_s: float = 0.0
    build_s: float = 0.0
    greedy_bytes: int | None = None
    ilp_bytes: int | None = None
    # the greedy plan's estimated per-device peak (liveness.live_bytes): the
    # memory regather="auto" holds the chosen plan to (sbpjax.compiler.regather)
    greedy_peak: int | None = None
    variables: int = 0
    constraints: int = 0
    status: str = ""
    shared: bool = False  # the alike ops of repeated layers shared their choices
    # per-device bytes of arguments and results (a donated pair once), and the budget
    memory_bytes: int | None = None
    memory_budget: int | None = None
    auto: bool = False
    # the window search (see _refine): solves, seconds, its plan's bytes; and
    # the whole-program solve's bytes where the windows' plan was kept
    window_solves: int = 0
    window_s: float = 0.0
    window_bytes: int | None = None
    whole_bytes: int | None = None
    # why the solve by bytes alone was kept (see choose), or ""
    fallback: str = ""
    # the plan solved with ring latency replaced the bytes-first one (FEWER_COLLECTIVES), or ""
    latency_note: str = ""
    # the solve started from the plan with 2-D weights whole over the data axes (_gathered_plan)
    gathered_start: bool = False
    # the solve started from the plan with every value whole over the idle axes (IDLE_START)
    idle_start: bool = False

    def describe(self) -> str:
        if self.method == "greedy" and self.ilp_bytes is None and not self.reason:
            return "layouts: greedy pass (solver='greedy')"
        gap = "n/a" if self.gap is None else f"{100 * self.gap:.2f}%"
        if self.method == "ilp":
            text = (
                f"layouts: whole-program ILP (HiGHS, {self.variables} variables, {self.constraints} "
                f"constraints): objective {self.objective:.0f} B, proven gap {gap}"
                + (" (alike layers sharing choices)" if self.shared else "")
                + f", solve {self.solve_s:.2f} s (+{self.build_s:.2f} s building); "
                f"greedy would move {self.greedy_bytes} B"
            )
            if self.window_solves:
                text += f"; the window search reached {self.window_bytes} B"
            if self.fallback:
                text += f"; by bytes alone ({self.fallback})"
        elif self.method == "windows":
            whole = (
                f"the whole-program solve stopped at {self.whole_bytes} B ({self.status}; gap {gap})"
                if self.whole_bytes is not None
                else f"the whole-program solve found nothing ({self.status})"
            )
            text = (
                f"layouts: ILP by windows (HiGHS, {self.window_solves} solves, each of one part of the "
                f"program with the rest fixed, {self.window_s:.2f} s): {self.window_bytes} B; {whole}; greedy "
                f"would move {self.greedy_bytes} B"
            )
        else:
            text = f"layouts: greedy pass kept ({self.reason}); greedy {self.greedy_bytes} B"
        if self.gathered_start and self.method != "greedy":
            text += "; the solve started from the plan with 2-D weights whole over the data axes"
        if self.idle_start and self.method != "greedy":
            text += "; then" if self.gathered_start else "; the solve started"
            text += " from the best plan with every value whole over the idle axes"
        if self.latency_note:
            text += f"; {self.latency_note}"
        if self.auto:
            text += "; AUTO arguments chosen too (greedy starts them B)"
        if self.memory_bytes is not None and (self.auto or self.memory_budget is not None):
            budget = "" if self.memory_budget is None else f" of a {self.memory_budget} B budget"
            text += f"; arguments + results hold {self.memory_bytes} B per device{budget}"
        return text


def _percent(gap) -> str:
    return "n/a" if gap is None else f"{100 * gap:.2f}%"


def _latency_bytes(plan, cost_model) -> float:
    """The launch latency of a boxing's collectives, in bytes: for each
    collective it runs, ``alpha / beta`` of its group (the bytes its links
    would carry in that time; 100 kB on the default ``CostModel``). A permute
    runs one collective-permute per round. See ``LATENCY``."""
    return sum(step_launch_bytes(st, cost_model) for st in plan.steps)


def _cost(plan, cost_model, with_latency: bool = True, ring: bool = False) -> float:
    """A boxing's cost in the objective, in 1/64 bytes: its bytes, plus the
    latency of each collective it runs (``_latency_bytes``; ``cost_model``
    None: bytes alone, 1/64 B per collective breaking ties; ``with_latency=False``:
    none, for a boxing whose bucket pays it; ``ring``: the latency the cost
    model times, ``ring_latency_bytes``), plus, for a zero-fill that
    makes a split value a partial, the price of the block it grows
    (``ZERO_FILL_WEIGHT``)."""
    if not plan.bytes or not with_latency:
        latency = 0.0
    elif ring:
        latency = sum(
            ring_latency_bytes(cost_model, plan.placement, st.op, st.axes, st.rounds)
            for st in plan.steps
            if st.bytes > 0
        )
    elif LATENCY and cost_model is not None:
        latency = _latency_bytes(plan, cost_model)
    else:  # of two boxings moving the same bytes, the one with fewer collectives
        latency = sum(1 for st in plan.steps if st.bytes > 0) / 64
    grown = 0  # bytes a zero-fill of a split adds to the blocks, summed over devices
    if any(st.op == "zero_fill" and st.dim is not None for st in plan.steps):
        grid = plan.placement.shape
        before = block_bytes(plan.shape, plan.dtype, plan.src_sbp, grid)
        after = block_bytes(plan.shape, plan.dtype, plan.dst_sbp, grid)
        grown = int(np.prod(grid)) * max(0, after - before)
    # integral (in 1/64 bytes) so that HiGHS can round its bounds up
    return 64 * plan.bytes + round(64 * latency) + round(64 * ZERO_FILL_WEIGHT * grown)


def price(prop: Propagation, cost_model=None) -> float:
    """What the integer program minimizes, in bytes, for a whole plan: the
    bytes it moves, the latency of each boxing's collectives and the price of
    its zero-fills (``_cost``). The greedy pass's plan and the integer
    program's are compared by it, so the one kept is never worse than greedy
    by the solver's own measure (``emitted_price`` would let greedy, whose
    many small boxings bucket well, win with more bytes: a 3-layer GPT step
    on 4x2 then moved 1,855,544 B where GSPMD moves 1,668,144)."""
    cm = cost_model if cost_model is not None else CostModel()
    return _weighted_sum(prop, lambda b: _cost(b.plan, cm))


def emitted_price(
    prop: Propagation, cost_model=None, ring: bool = False, launched: dict | None = None
) -> float:
    """``price`` with latency counted for the collectives the lowering emits:
    boxings that ride in one bucket (:mod:`sbpjax.compiler.buckets`) pay for
    the bucket's rounds once. The window search compares its plans by it
    (and its result with the whole-program solve's): those are local optima
    of the same integer program, close in bytes, and the one kept should be
    the one with the fewest collectives the program runs. By ``price``, the
    2-D transformer step of ``benchmarks/compiler.py`` kept a plan of 23
    boxing collectives that compiles to 18 over one of 25 that compiles to 7
    (and moves 6 kB less). ``ring``: the collectives of
    ``emitted_collectives``, each at its latency as the cost model times it
    (``ring_latency_bytes``), by which ``FEWER_COLLECTIVES`` compares plans;
    ``launched``: ``emitted_collectives(prop)`` where the caller has it."""
    cm = cost_model if cost_model is not None else CostModel()
    if ring:
        if launched is None:
            launched = emitted_collectives(prop)

        def ring_cost(b) -> float:
            latency = sum(ring_latency_bytes(cm, prop.placement, *c) for c in launched[id(b)])
            return _cost(b.plan, cm, with_latency=False) + round(64 * latency)

        return _weighted_sum(prop, ring_cost)
    buckets, joined = plan_buckets(prop)
    names = prop.placement.axis_names

    def cost(b) -> float:
        if id(b) in joined:  # its bucket's first boxing pays the rounds
            return _cost(b.plan, cm, with_latency=False)
        bucket = buckets.get(id(b))
        if bucket is None:
            return _cost(b.plan, cm)
        rounds = 0.0
        for (_, group, _), _members in bucket.rounds:
            # as _cost prices a collective
            rounds += launch_bytes(cm, [names[g] for g in group]) if LATENCY else 1 / 64
        return _cost(b.plan, cm, with_latency=False) + round(64 * rounds)

    return _weighted_sum(prop, cost)


def _weighted_sum(prop: Propagation, cost) -> float:
    """A plan's price in bytes from ``cost(boxing)`` (in 1/64 bytes): each
    boxing weighted by the chance that it runs (inside a cond's branch: less
    than 1), plus the bytes of ops that communicate themselves."""
    odds = _BranchOdds(prop.program)
    readers: dict = {}
    for d in prop.decisions:
        for i, (a, nd) in enumerate(zip(d.node.ins, d.in_sbp)):
            readers.setdefault((id(a), nd), []).append(odds.read_path(d.node, i))
    total = sum(cost(b) for b in prop.out_boxings)
    for d in prop.decisions:
        for b in d.boxings:
            total += odds.boxing(readers.get((id(b.var), b.dst), [()])) * cost(b)
    total += 64 * sum(odds.chance(prop.decisions[i].node.branch) * c.bytes for i, c in prop.comm)
    return total / 64


class _BranchOdds:
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


class _Lin:
    """A linear expression over the ILP's columns: {column: coefficient} + constant."""

    __slots__ = ("terms", "const")

    def __init__(self, terms=None, const=0.0):
        self.terms = terms or {}
        self.const = const


def _candidates(pr: Propagator, node, grid):
    """The op's nd-signatures as (ins, outs) lists; one fixed candidate for
    constraints and ops without a rule (run whole, as the greedy pass does)."""
    rep = (Broadcast(),) * len(grid)
    if node.name == CONSTRAIN:
        want = node.eqn.params["sbp"]
        return [([want], [want])]
    rule = RULES.get(node.name)
    sigs = pr.candidates(node) if rule is not None else []
    if not sigs:
        return [([rep] * len(node.ins), [rep] * len(node.outs))]
    per_axis = []
    for p in grid:
        if p == 1:
            per_axis.append([None])
        else:
            per_axis.append(sigs)
    out, seen = [], set()
    for combo in itertools.product(*per_axis):
        ins = [tuple(Broadcast() if s is None else s.ins[j] for s in combo) for j in range(len(node.ins))]
        outs = [tuple(Broadcast() if s is None else s.outs[j] for s in combo) for j in range(len(node.outs))]
        if not pr._fits(node, ins, outs):
            continue
        if not all(pr._partial_ok(nd) for nd in ins + outs):
            continue
        if op_comm(node, ins, outs, pr.pl, pr._comms) is None:
            continue
        key = (tuple(ins), tuple(outs))
        if key in seen:
            continue
        seen.add(key)
        out.append((ins, outs))
    if not out:
        return [([rep] * len(node.ins), [rep] * len(node.outs))]
    return out


_HEAVY = ("dot_general", "conv_general_dilated")


def _two_d(nd, grid) -> bool:
    """Whether layout ``nd`` splits its value over two or more axes of
    ``grid`` (a 2-D weight: ``_Domains._gathered``, ``_weights_gathered``)."""
    return sum(isinstance(q, Split) for q, p in zip(nd, grid) if p > 1) >= 2


def _batch_axes(program, in_layouts, grid) -> frozenset:
    """The axes a batch is split over: an argument of rank 2 or more split
    along its first dimension alone, over axes of size > 1, that the model
    reads as data (its first contraction keeps its first dimension, an
    MLP's inputs; the indices of a gather, the tokens) and no op reads as a
    weight (its first contraction contracts its first dimension, a
    row-split kernel ``h @ w``; no gather or dynamic slice indexes into it,
    an embedding table split along the vocabulary). Optimizer state, read
    by neither, is not a batch (a row-split kernel's Adam moments on 1x8
    would make the tensor axis one). ``in_layouts``: per argument its
    possible layouts (one unless ``AUTO``). A weight split over such an
    axis (ZeRO-3 / FSDP) may be gathered there where a contraction reads it
    (``_Domains._gathered``), and the start plan makes 2-D weights whole
    over it (``_weights_gathered``)."""
    weightlike: set = set()
    data: set = set()
    producer: dict = {}
    for n in program.nodes:
        if n.name == "dot_general":
            # by its first contraction, in program order the forward pass's
            # (the weight gradient's product contracts the batch dimension)
            (lc, rc), _ = n.eqn.params["dimension_numbers"]
            for a, contracted in zip(n.ins, (lc, rc)):
                if isinstance(a, Var) and id(a) not in weightlike and id(a) not in data:
                    (weightlike if 0 in contracted else data).add(id(a))
        elif n.name in ("gather", "dynamic_slice") and n.ins and isinstance(n.ins[0], Var):
            weightlike.add(id(n.ins[0]))
            # the indices, and what they are computed from (``x[tokens]``
            # wraps negative ids and adds a dimension before its gather)
            todo = [a for a in n.ins[1:] if isinstance(a, Var)]
            while todo:
                a = todo.pop()
                if id(a) not in data:
                    data.add(id(a))
                    if id(a) in producer:
                        todo.extend(b for b in producer[id(a)].ins if isinstance(b, Var))
        for o in n.outs:
            producer[id(o)] = n
    axes: set = set()
    for v, lays in zip(program.inputs, in_layouts):
        if len(lays) != 1 or len(v.shape) < 2 or id(v) not in data or id(v) in weightlike:
            continue
        split = [(a, q) for a, (q, p) in enumerate(zip(lays[0], grid)) if p > 1 and isinstance(q, Split)]
        if split and all(q == Split(0) for _, q in split):
            axes.update(a for a, _ in split)
    return frozenset(axes)


class _Domains:
    """Which layouts each value may take, to keep the integer program small.

    A value's producer layouts are those its producer's kept candidates give;
    a consumer's candidates are kept when each input is used in a layout the
    value can be in without an invented conversion: a producer layout, one of
    its partials reduced (to B or to a split of any dim, the layouts a
    reduction makes), or the layout the greedy pass used. The greedy choice is
    kept (except a contraction computed whole on an axis, below), so the
    program's optimum is at most greedy's bytes; layouts
    flow forward from the annotations as they do in GSPMD's propagation, so a
    choice that keeps a parameter's split through its matmuls is in the space
    even where greedy gathered it. Contractions computed whole on an axis are
    left out where another candidate exists (see ``restrict``)."""

    def __init__(self, program, placement, in_layouts, greedy, idle=frozenset(), collapse_idle=False):
        self.grid = placement.shape
        self.dom: dict = {id(v): set(lays) for v, lays in zip(program.inputs, in_layouts)}
        # Weights split over the batch's axis alone (ZeRO-3 / FSDP) may be
        # gathered at contractions (``_gathered``) on a placement of one axis
        # of size > 1, which the batch then spans. Decision: not where other
        # axes exist. Offered on 2x4 with y idle (ZeRO-3 over x), the larger
        # integer program of a 2-layer GPT at d 64 stopped at its time limit
        # (gap 43%) where it had been proven: 5.87 MB instead of 4.86 MB
        # (GSPMD: 9.58 MB), the same 33 collectives.
        one_axis = sum(p > 1 for p in self.grid) == 1
        self.batch_axes = _batch_axes(program, in_layouts, self.grid) if one_axis else frozenset()
        self.args = {id(v) for v in program.inputs}
        # axis -> ids of the operands of products with a replicated weight there;
        # filled in program order, so before the weight's gradient reads them
        self.whole_operands: dict = {}
        self.greedy = greedy.decisions
        # Axes the caller left idle (``propagate.idle_axes``). Data parallelism
        # annotated on 4x2 splits the batch over x and nothing over y; GSPMD
        # then runs the step replicated over y and all-reduces the gradients
        # over x once. Holding contractions to "use every device" there made
        # the solve split attention's heads over y and regather them:
        # 1,479,728 B in 20 collectives on a 2-layer GPT at d 32 against
        # GSPMD's 1,382,448 B in 1. On an idle axis running a contraction
        # whole gathers nothing (see ``_whole_already``).
        self.idle = idle
        # keep only candidates whole over the idle axes, where an op has one (IDLE_START)
        self.collapse_idle = collapse_idle

    def _uses(self, atom) -> set:
        # An S or P over an axis of size 1 is B (a user's (B, S(1)) on an 8x1
        # placement): the normalized form too. Gathering a split value to B is
        # not offered (only greedy's own gathers are): bytes alone would then
        # gather a small batch and run the whole step replicated on every
        # device (Alpa likewise enumerates only strategies that use every
        # device).
        base = self.dom.get(id(atom), set())
        base = base | {tuple(Broadcast() if p == 1 else q for p, q in zip(self.grid, nd)) for nd in base}
        out = set(base)
        for nd in base:
            for a, q in enumerate(nd):
                if isinstance(q, Partial):
                    out.add(nd[:a] + (Broadcast(),) + nd[a + 1 :])
                    out.update(nd[:a] + (Split(d),) + nd[a + 1 :] for d in range(len(atom.shape)))
        return out

    def _gathered(self, arg) -> set:
        """A weight's layouts with its split over one axis gathered: an
        argument split over two or more axes (the data and the tensor axes,
        FSDP with tensor parallelism), all-gathered over one of them where a
        contraction reads it, as ZeRO-3 and GSPMD do; and on a placement of
        one axis of size > 1 an argument split over the batch's axis
        (``batch_axes``: FSDP on 8x1, where no weight is split over two
        axes; its kernels were otherwise kept split, their matmuls moving
        activations by all-to-alls: a 2-layer MLP at d 32 moved 301,112 B
        in 12 collectives, gathered 258,104 B in 8, GSPMD 344,120 B in 5).
        Only such arguments, and only at contractions: the contraction
        still uses every device
        (``restrict`` drops one computed whole on an axis), so the batch is
        not gathered by it. Without these a 3-layer MLP with kernels split
        over both axes of 4x2 kept its weights split and permuted
        activations around them: 302 kB where gathering each kernel once
        moves 188 kB (GSPMD: 324 kB).
        Decision: not for weights split over a tensor axis alone (Megatron's). Offered
        there too (gathering a tensor-parallel kernel to split the batch over
        the tensor axis), they moved no GPT sweep row of
        ``benchmarks/compiler.py`` to fewer bytes, slowed the 1- and 4-layer
        solves from 4 s to 12 s, and left the shared solves of the 8- and
        32-layer GPTs far from their bounds (71-73%), at 2.2x the bytes
        (36.2 MB and 139.9 MB against 16.2 MB and 63.5 MB)."""
        out = set()
        for nd in self._uses(arg):
            two_d = _two_d(nd, self.grid)
            for a, q in enumerate(nd):
                if isinstance(q, Split) and (two_d or a in self.batch_axes):
                    out.add(nd[:a] + (Broadcast(),) + nd[a + 1 :])
        return out

    def _whole_already(self, node, axis) -> bool:
        """Whether ``node`` is a product without batch dimensions that may
        run whole on ``axis``: one with a weight the caller replicated over
        ``axis`` (an argument whole there in every layout it may take), or
        that weight's gradient (a product reading an operand such a product
        read); and none of its operands exists only split over ``axis``
        (using it whole there would be a gather). Any contraction may run
        whole on an axis the caller left idle (``self.idle``)."""
        if axis in self.idle:
            return True
        if node.name != "dot_general" or node.eqn.params["dimension_numbers"][1][0]:
            return False
        if any(
            isinstance(a, Var) and all(isinstance(nd[axis], Split) for nd in self.dom.get(id(a), ()))
            for a in node.ins
        ):
            return False
        seen = self.whole_operands.setdefault(axis, set())
        weight = any(
            id(a) in self.args and all(isinstance(nd[axis], Broadcast) for nd in self.dom[id(a)])
            for a in node.ins
            if isinstance(a, Var)
        )
        if weight:
            seen.update(id(a) for a in node.ins if isinstance(a, Var))
        return weight or any(isinstance(a, Var) and id(a) in seen for a in node.ins)

    def restrict(self, index, node, cs):
        dec = self.greedy[index]
        keep_g = (list(dec.in_sbp), list(dec.out_sbp))
        if len(cs) > 1:
            uses = [self._uses(a) if isinstance(a, Var) else None for a in node.ins]
            if node.name in _HEAVY or node.name == "add_any":
                # A contraction or a sum of gradients may also take an operand in
                # a layout another operand of the same shape has (an activation
                # and its gradient meeting at a kernel gradient, or two gradients
                # of one value, one split along height, the other along the
                # batch): one is boxed to the other's layout, where the producer
                # layouts alone would leave a gather, or zero-filling both into a
                # partial that is reduced later at full size. (All elementwise
                # ops would triple the integer program for little more.)
                for i, a in enumerate(node.ins):
                    for j, b in enumerate(node.ins):
                        if i != j and uses[i] is not None and uses[j] is not None and a.shape == b.shape:
                            uses[i] = uses[i] | self._uses(b)
            if node.name in _HEAVY:
                for i, a in enumerate(node.ins):
                    if uses[i] is not None and id(a) in self.args:
                        uses[i] = uses[i] | self._gathered(a)
            kept = [
                c
                for c in cs
                if c == keep_g
                or all(u is None or nd in u or nd == g for u, nd, g in zip(uses, c[0], dec.in_sbp))
            ]
            if node.name in ELEMENTWISE:
                # Elementwise ops take their same-shape operands in the output's
                # layout (no operand zero-filled into a partial the others do not
                # have): the same bytes, since any reduction of the result
                # reduces a tensor of the same size, and far fewer near-equal
                # alternatives for the solver to tell apart.
                shape = node.outs[0].shape
                kept = [
                    c
                    for c in kept
                    if c == keep_g
                    or all(
                        nd == c[1][0]
                        for a, nd in zip(node.ins, c[0])
                        if isinstance(a, Var) and a.shape == shape
                    )
                ]
            if node.name in _HEAVY:
                # Alpa's rule: a contraction uses every device. Computing it whole
                # on every device of an axis moves the fewest bytes when weights
                # are smaller than activations (gather the weights, never reduce)
                # but multiplies its time by the axis size (8x a tensor-parallel
                # step); such candidates stay out unless nothing else is left.
                # The greedy choice may be one (it is then not kept), so the
                # guarantee against greedy is the comparison in choose().
                # The exception (_whole_already): a product with a weight the
                # caller left B on the axis, on operands that exist whole there
                # already (a head on a Megatron block's replicated residual
                # stream), and that weight's gradient. Nothing is gathered for
                # it and GSPMD computes it there whole; splitting the batch
                # over the tensor axis instead made the head's weight gradient
                # a partial over both axes: 23.5 MB on linen_mlp (models.py)
                # against GSPMD's 22.4 (now 21.9). Wider exceptions (any
                # product without batch dimensions whose operands may be whole
                # there, so also split weights' gradients) added near-ties that
                # left the scanned decoder's time-limited solve at 107 MB
                # instead of 94 on jax 0.12, above GSPMD's 99.
                excepted = {a for a, p in enumerate(self.grid) if p > 1 and self._whole_already(node, a)}
                spread = [
                    c
                    for c in kept
                    if not any(
                        p > 1
                        and a not in excepted
                        and all(isinstance(nd[a], Broadcast) for nd in c[0] + c[1])
                        for a, p in enumerate(self.grid)
                    )
                ]
                kept = spread or kept
            elif keep_g not in kept:
                kept.append(keep_g)
            cs = kept
        if self.collapse_idle and len(cs) > 1:
            whole = [
                c for c in cs if all(isinstance(nd[a], Broadcast) for nd in c[0] + c[1] for a in self.idle)
            ]
            cs = whole or cs
        for j, o in enumerate(node.outs):
            self.dom[id(o)] = {c[1][j] for c in cs}
        return cs


def solve(
    program,
    placement,
    in_sbp,
    out_sbp,
    greedy: Propagation,
    cost_model=None,
    time_limit: float = 10.0,
    caches=None,
    ties=None,
    memory_budget=None,
    objective="bytes",
    latency: bool = True,
    same_layout=None,
    classes=None,
    fixed=None,
    rel_gap: float = 1e-3,
    same_choice=None,
    start: Propagation | None = None,
    collapse_idle: bool = False,
):
    """The cheapest layouts of ``program`` (bytes and latency, ``_cost``):
    (Propagation, Choice), or (None, Choice) when no solution was found (the
    Choice says why). ``latency=False``: bytes alone; ``"ring"``: each
    collective's latency as the cost model times it (``FEWER_COLLECTIVES``).

    ``in_sbp`` entries may be ``AUTO``: the argument's layout is chosen too
    (one binary per layout of ``auto_layouts``). ``ties`` maps an output index
    to the index of an ``AUTO`` argument whose layout it must have (a donated
    train-step state: the step is a fixed point, and the result aliases the
    argument's buffer). ``memory_budget``: per-device bytes that arguments and
    results together may hold (a tied pair counted once); activations inside
    the program are not in it. ``objective="memory"`` minimizes those bytes
    instead (used to report the least a budget must allow). ``same_layout``
    maps an ``AUTO`` argument's index to an earlier ``AUTO`` argument's whose
    layout it takes (optimizer state mirroring a parameter). ``classes``:
    one layer class per op (:func:`layer_classes`): ops of a class share
    their columns (None: no sharing).
    ``rel_gap``: HiGHS stops once its solution is proven within this
    fraction of the optimum (models of at most ``EXACT_VARIABLES`` binaries
    are solved to the optimum).
    ``fixed``: {op index: (ins, outs)}, ops whose signature is given (the
    window search of :func:`_refine`). ``same_choice``: per op a key or None
    (:func:`loop_classes`): ops with one key take the same signature (their
    classes must share columns too). ``start``: a plan of the same program
    HiGHS starts from (its ops' signatures; see :mod:`sbpjax.compiler.milp`).
    ``collapse_idle``: each op keeps only its candidates whole over the idle
    axes, where it has one (``IDLE_START``)."""
    from scipy.sparse import coo_array

    from sbpjax.compiler.milp import solve_binary

    t0 = time.perf_counter()
    grid = placement.shape
    pr = Propagator(program, placement, cost_model)
    pr.idle = idle_axes(in_sbp, grid)
    pr.ring = latency == "ring"
    pr.quiet = True
    cm = cost_model if cost_model is not None else CostModel()
    if caches is not None:
        pr._plans, pr._bounds, pr._sigs, pr._choices, pr._evens = caches[:5]
    # an op's candidates depend on the op alone (op_key): computed once for alike
    # ops and for every solve of one choose() (the window search solves several)
    memo = caches[5] if caches is not None and len(caches) > 5 else {}

    ncols = 0
    cost: list = []

    def new_col(c=0.0) -> int:
        nonlocal ncols
        cost.append(float(c))
        ncols += 1
        return ncols - 1

    rows, cols, vals, lo, hi = [], [], [], [], []
    nrows = 0

    def add_row(terms: dict, low, high):
        nonlocal nrows
        for c, v in terms.items():
            rows.append(nrows)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        nrows += 1

    const_cost = 0.0

    def add_cost(expr: _Lin, c: float):
        nonlocal const_cost
        const_cost += c * expr.const
        for col, v in expr.terms.items():
            cost[col] += c * v

    ties = dict(ties or {})
    same_layout = dict(same_layout or {})
    by_bytes = objective == "bytes"
    # -- arguments: fixed, or one binary per layout (AUTO) ----------------------------
    produced: dict = {}  # id(var) -> {layout: _Lin}
    in_layouts: list = []  # per argument: the layouts it may take
    arg_cols: dict = {}  # argument index -> {layout: column} (AUTO arguments)
    for i, (v, nd) in enumerate(zip(program.inputs, in_sbp)):
        lays = auto_layouts(v.shape, grid) if nd is AUTO else [nd]
        in_layouts.append(lays)
        if len(lays) == 1:
            produced[id(v)] = {lays[0]: _Lin(const=1.0)}
            continue
        j = same_layout.get(i)
        if j is not None and j in arg_cols:
            arg_cols[i] = arg_cols[j]  # one layout for both (same shape: the caller checked)
        else:
            arg_cols[i] = {nd_: new_col() for nd_ in lays}
            add_row({c: 1.0 for c in arg_cols[i].values()}, 1.0, 1.0)
        produced[id(v)] = {nd_: _Lin({c: 1.0}) for nd_, c in arg_cols[i].items()}

    # -- ops: one binary per candidate, shared by the ops of a layer class -------------
    shared: dict = {}  # (class, signature) -> column
    cands: list = []
    sel: list[list[int] | None] = []  # per node: candidates; their columns (None when fixed)
    allowed = _Domains(program, placement, in_layouts, greedy, pr.idle, collapse_idle)
    for index, node in enumerate(program.nodes):
        if fixed is not None and index in fixed:
            cands.append(allowed.restrict(index, node, [fixed[index]]))
        elif node.name in NESTED:
            # the layouts its inner program was planned for: greedy's, from the
            # layouts its operands arrive in (sbpjax.compiler.inner_loops)
            dec = greedy.decisions[index]
            cands.append(allowed.restrict(index, node, [(list(dec.in_sbp), list(dec.out_sbp))]))
        else:
            key = op_key(node)
            if key not in memo:
                memo[key] = _candidates(pr, node, grid)
            cands.append(allowed.restrict(index, node, memo[key]))
    _same_candidates(cands, same_choice, fixed)
    odds = _BranchOdds(program)  # what runs inside a cond's branch is priced by its chance
    for index, node in enumerate(program.nodes):
        cs = cands[index]
        # the op's own communication (a halo exchange) is paid by the candidate
        own = [
            64
            * odds.chance(node.branch)
            * sum(c.bytes for c in op_comm(node, ins, outs, placement, pr._comms) or ())
            for ins, outs in cs
        ]
        if len(cs) == 1:
            sel.append(None)
            const_cost += own[0]
            for o, nd in zip(node.outs, cs[0][1]):
                produced[id(o)] = {nd: _Lin(const=1.0)}
            continue
        columns = []
        for (ins, outs), c in zip(cs, own):
            share = (classes[index], tuple(ins), tuple(outs)) if classes is not None else None
            col = shared.get(share) if share is not None else None
            if col is None:
                col = new_col()
                if share is not None:
                    shared[share] = col
            cost[col] += c
            columns.append(col)
        sel.append(columns)
        add_row({c: 1.0 for c in columns}, 1.0, 1.0)
        for j, o in enumerate(node.outs):
            lay: dict = {}
            for col, (_, outs) in zip(columns, cs):
                lay.setdefault(outs[j], _Lin()).terms[col] = 1.0
            produced[id(o)] = lay

    # -- uses: which layout each consumer needs ----------------------------------
    needs: dict = {}  # id(var) -> (var, {layout: [(columns or None)]})
    readers: dict = {}  # (id(var), layout) -> [branch path of each op that may read it so]
    for node, cs, node_cols in zip(program.nodes, cands, sel):
        for i, atom in enumerate(node.ins):
            if not isinstance(atom, Var):
                continue
            path = odds.read_path(node, i)
            by_layout: dict = {}
            for k, (ins, _) in enumerate(cs):
                by_layout.setdefault(ins[i], []).append(None if node_cols is None else node_cols[k])
            ent = needs.setdefault(id(atom), (atom, {}))[1]
            for nd, cl in by_layout.items():
                ent.setdefault(nd, []).append(cl)
                readers.setdefault((id(atom), nd), []).append(path)
    for k, atom in enumerate(program.outputs):
        if not isinstance(atom, Var):
            continue
        if k in ties:
            # the result takes its argument's layout: needed in L exactly when the argument is L
            i = ties[k]
            if i in arg_cols:
                for nd, col in arg_cols[i].items():
                    needs.setdefault(id(atom), (atom, {}))[1].setdefault(nd, []).append([col])
                    readers.setdefault((id(atom), nd), []).append(())
            else:
                needs.setdefault(id(atom), (atom, {}))[1].setdefault(in_layouts[i][0], []).append([None])
                readers.setdefault((id(atom), in_layouts[i][0]), []).append(())
            continue
        want = out_sbp[k] if out_sbp is not None else None
        if want is not None:
            needs.setdefault(id(atom), (atom, {}))[1].setdefault(want, []).append([None])
            readers.setdefault((id(atom), want), []).append(())

    # -- versions and boxing costs -----------------------------------------------
    versions: dict = {}  # rows' signature -> [(u column, its cost)]
    # A plan's cost, by the plan (plans are shared, pr.plan's cache): alike layers ask
    # for the same few plans' costs tens of thousands of times (a 32-layer GPT: 150,000
    # asks, 1.6-1.8 s of the 5.5 s its program took to build before).
    plan_costs: dict = {}

    def cost_of(plan) -> float:
        hit = plan_costs.get(id(plan))
        if hit is None:
            hit = plan_costs[id(plan)] = (plan, _cost(plan, cm if latency else None, ring=latency == "ring"))
        return hit[1]

    for key, (atom, layouts) in needs.items():
        src = produced[key]
        for nd, uses in layouts.items():
            w = odds.boxing(readers.get((key, nd), [()]))
            pay = [(s, w * cost_of(pr.plan(atom, s, nd))) for s in src if s != nd]
            pay = [(s, b) for s, b in pay if b > 0]
            if not pay:
                continue
            if any(None in cl for cl in uses):
                # some consumer needs it whatever it chooses: the producer pays
                for s_, b in pay:
                    add_cost(src[s_], b)
                continue
            costs = dict(pay)
            groups: dict = {}
            for s_ in src:
                groups.setdefault(costs.get(s_, 0), []).append(s_)
            # The same version of the same value in another layer (its producer's
            # and consumers' choices are the same columns): the same rows over
            # the same columns, so it shares them and adds its cost.
            sig = (
                tuple(sorted(tuple(sorted(cl)) for cl in uses)),
                tuple(
                    (
                        b,
                        tuple(sorted((c, v) for q in qs for c, v in src[q].terms.items())),
                        sum(src[q].const for q in qs),
                    )
                    for b, qs in sorted(groups.items(), key=lambda g: g[0])
                ),
            )
            seen = versions.get(sig)
            if seen is not None:
                for u, b in seen:
                    cost[u] += b
                continue
            # w: the version exists; w >= sum of each consumer's columns wanting nd
            wc = new_col()
            for cl in uses:
                t = {c: -1.0 for c in cl}
                t[wc] = 1.0
                add_row(t, 0.0, np.inf)
            # u[S]: the version is made from producer layout S; sum_S u = w and
            # u[S] <= x[S]. Tighter than y >= x + w - 1 (whose LP relaxation
            # is free at any fractional point): fractional needs must be met by
            # producer mass of matching layouts. Producer layouts costing the
            # same (free ones included) share one column.
            row = {wc: -1.0}
            made = []
            for b, layouts_ in sorted(groups.items(), key=lambda g: g[0]):
                u = new_col(b)
                made.append((u, b))
                row[u] = 1.0
                t = {u: 1.0}
                fixed = 0.0
                for q in layouts_:
                    fixed += src[q].const
                    for c, v in src[q].terms.items():
                        t[c] = t.get(c, 0.0) - v
                add_row(t, -np.inf, fixed)  # u - x[S] <= const part of x[S]
            add_row(row, 0.0, 0.0)
            versions[sig] = made
    # -- memory: what arguments and results hold per device ---------------------------
    memory = _Lin()
    for v in program.inputs:
        for nd, lin in produced[id(v)].items():
            _add(memory, lin, block_bytes(v.shape, v.dtype, nd, grid))
    for k, atom in enumerate(program.outputs):
        if not isinstance(atom, Var) or k in ties:
            continue  # a tied result reuses its argument's buffer
        want = out_sbp[k] if out_sbp is not None else None
        if want is not None:
            memory.const += block_bytes(atom.shape, atom.dtype, want, grid)
        else:
            for nd, lin in produced[id(atom)].items():
                _add(memory, lin, block_bytes(atom.shape, atom.dtype, nd, grid))
    if memory_budget is not None:
        add_row(dict(memory.terms), -np.inf, float(memory_budget) - memory.const)
    if not by_bytes:
        cost = [64 * memory.terms.get(col, 0.0) for col in range(ncols)]
        const_cost = 64 * memory.const
    build_s = time.perf_counter() - t0
    choice = Choice("ilp", variables=ncols, constraints=nrows, build_s=build_s, shared=classes is not None)
    if ncols > MAX_VARIABLES:
        choice.method, choice.reason = "greedy", f"{ncols} variables > {MAX_VARIABLES}"
        return None, choice

    x_sol = np.zeros(ncols)
    if ncols:
        c = np.asarray(cost)
        A = coo_array((vals, (rows, cols)), shape=(nrows, ncols)).tocsr()
        t1 = time.perf_counter()
        res = solve_binary(
            c,
            A,
            lo,
            hi,
            time_limit=time_limit,
            rel_gap=0.0 if ncols <= EXACT_VARIABLES else rel_gap,
            start=_start_columns(start, sel, cands),
        )
        choice.solve_s = time.perf_counter() - t1
        choice.status = res.message
        if res.x is None:
            choice.method, choice.reason = "greedy", f"HiGHS found no solution: {res.message}"
            return None, choice
        x_sol = res.x
        assert res.objective is not None  # given with every solution
        choice.objective = (res.objective + const_cost) / 64
        if res.bound is not None:
            choice.bound = (res.bound + const_cost) / 64
            choice.gap = (
                max(0.0, (choice.objective - choice.bound) / choice.objective) if choice.objective else 0.0
            )
    else:
        choice.objective = const_cost / 64
        choice.bound, choice.gap = choice.objective, 0.0
    chosen_in = []
    for i, lays in enumerate(in_layouts):
        cols_of = arg_cols.get(i)
        chosen_in.append(
            lays[0] if cols_of is None else lays[int(np.argmax([x_sol[cols_of[nd]] for nd in lays]))]
        )
    final_out = list(out_sbp) if out_sbp is not None else [None] * len(program.outputs)
    for k, i in ties.items():
        final_out[k] = chosen_in[i]
    choice.memory_bytes = int(round(memory.const + sum(v * x_sol[c] for c, v in memory.terms.items())))
    prop = _propagation(program, placement, chosen_in, final_out, pr, cands, sel, x_sol)
    return prop, choice


def _arg_class(name: str) -> str:
    """An argument's path with list and tuple positions dropped: the same
    parameter of every layer of a list of layers (``['layers'][3]['wq']`` ->
    ``['layers'][*]['wq']``)."""
    return re.sub(r"\[\d+\]", "[*]", name)


# How many producers back two ops must look alike to share their choice: deep
# enough that an op is known by the ops it reads (so layer 3's attention
# matmul matches layer 2's, not the first layer's, which reads the
# embedding), shallow enough that the residual stream's history (different
# in every layer) is not part of it.
CLASS_DEPTH = 3


def layer_classes(program, arg_names) -> list:
    """A class per op. Two ops share a class when their primitive, parameters,
    shapes and source line are alike and their operands come, ``CLASS_DEPTH``
    producers back, from alike ops or from the same parameter of different
    layers (``_arg_class``). The layers of a model written as a loop (a
    Python loop, or a scan the tracer writes out) then fall into one class
    per op of a layer, and the solver gives every op of a class the same
    signature: an L-layer model has about one layer's choices, and each
    version of a value is priced once for all layers (see ``versions`` in
    :func:`solve`). It is a restriction (layers could choose differently),
    which choose() backs with the comparison against greedy."""
    producer = {}
    own = []
    for index, node in enumerate(program.nodes):
        for j, o in enumerate(node.outs):
            producer[id(o)] = (index, j)
        own.append(_own_class(node))
    args = {id(v): hash(("arg", _arg_class(n), tuple(v.shape))) for v, n in zip(program.inputs, arg_names)}
    level = list(own)
    for _ in range(CLASS_DEPTH):
        prev, level = level, []
        for index, node in enumerate(program.nodes):
            operands: list = []
            for a in node.ins:
                if id(a) in args:
                    operands.append(args[id(a)])
                elif id(a) in producer:
                    i, j = producer[id(a)]
                    operands.append((prev[i], j))
                else:
                    operands.append(("const", tuple(a.shape)))
            level.append(hash((own[index], tuple(operands))))
    return level


def _same_candidates(cands, same_choice, fixed) -> None:
    """Give the ops of each ``same_choice`` key one candidate list (in place):
    the union of theirs (each op's domain is cut by its own producers'
    layouts, so alike ops may keep different lists, and shared columns would
    then not tie them), or the signature one of them is fixed to."""
    if same_choice is None:
        return
    groups: dict = {}
    for i, key in enumerate(same_choice):
        if key is not None:
            groups.setdefault(key, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        pinned = [cands[i] for i in members if fixed is not None and i in fixed]
        if pinned:
            common = pinned[0]
        else:
            common, seen = [], set()
            for i in members:
                for c in cands[i]:
                    k = (tuple(map(tuple, c[0])), tuple(map(tuple, c[1])))
                    if k not in seen:
                        seen.add(k)
                        common.append(c)
        for i in members:
            cands[i] = list(common)


def _own_class(node) -> int:
    """What an op is, apart from where its operands come from."""
    params = tuple(sorted((k, str(v)[:200]) for k, v in node.eqn.params.items()))
    return hash(
        (
            node.name,
            node.source,
            node.region > 0,
            tuple((tuple(a.shape), str(a.dtype)) for a in node.ins),
            tuple(tuple(o.shape) for o in node.outs),
            params,
        )
    )


def loop_classes(program) -> list:
    """Per op, its class among the iterations of a written-out scan (None
    outside scans): the k-th op of a kind in one iteration's body shares its
    class with the k-th of that kind in every other iteration of the loop (the
    outermost loop, for nested ones). Sharing their choices, the iterations
    take the same layouts, their carries a fixed point, and the lowering rolls
    them back into one loop (``sbpjax.compiler.loops``); an iteration whose
    carry arrives in another layout boxes it on entry, outside the loop.

    The ops that index each iteration's slices out of the stacked operands
    (``Iteration.slicing``) share theirs too, the k-th of one iteration with
    the k-th of every other: a slice's layout is otherwise a tie between
    making it in the layout the body reads and a free boxing in the body, and
    iterations that break the tie differently cannot roll into one loop. On
    the model zoo's scanned decoder (jax 0.10.2) the backward loop kept 2 of
    its 4 iterations, writing out the 2 whose slices came the other way, and
    peaked at 11.0 MB; sharing, it keeps all 4 and peaks at 7.9 MB (GSPMD:
    8.9 MB), with the same bytes."""
    out: list = []
    seen: dict = {}
    sliced: dict = {}  # id(node) -> its class, for the ops slicing the outermost loops' xs
    for loop in program.loops:
        for it in loop.iterations:
            for k, node in enumerate(it.slicing):
                # what the op is apart from its index (a slice merged with an equal one
                # before the loop, trace.LOOP_SLICES = False, shifts k: no class then joins
                # ops of different shapes)
                shapes = (tuple(tuple(a.shape) for a in node.ins), tuple(tuple(o.shape) for o in node.outs))
                sliced[id(node)] = hash(("slice", id(loop), k, node.name, shapes))
    for node, where in zip(program.nodes, _loop_owners(program)):
        if where is None:
            out.append(sliced.get(id(node)))
            continue
        loop, q = where
        kind = _own_class(node)
        k = seen.get((id(loop), q, kind), 0)
        seen[(id(loop), q, kind)] = k + 1
        out.append(hash(("loop", id(loop), kind, k)))
    return out


def _loop_owners(program) -> list:
    """Per op, ``(loop, iteration position)`` of the outermost written-out scan
    whose iteration computes it, or None outside scans."""
    owner: dict = {}  # id(Var) -> (loop, iteration position); outer loops come last and win
    for loop in program.loops:
        for q, it in enumerate(loop.iterations):
            for vid in it.made:
                owner[vid] = (loop, q)
    return [owner.get(id(node.outs[0])) if node.outs else None for node in program.nodes]


def _add(acc: _Lin, lin: _Lin, weight: float) -> None:
    """``acc += weight * lin``."""
    acc.const += weight * lin.const
    for col, v in lin.terms.items():
        acc.terms[col] = acc.terms.get(col, 0.0) + weight * v


def _start_columns(start: Propagation | None, sel, cands) -> dict[int, float] | None:
    """The MIP start of ``start``'s plan: each op's column of the signature
    the plan gave it (HiGHS completes the rest). Left to HiGHS: an op whose
    signature is not among its candidates, and an op whose column would
    break another op's one-of row. Ops of a layer class share columns, but
    each op has its own candidates (``_Domains`` narrows them op by op), so
    two ops of a class may hold overlapping, different sets of columns, and
    the plan may have chosen differently for them: a column is given only
    where no op holding it has another column given already, and where no
    op is then left without a column that may still be 1.

    Decision: checked here, since HiGHS rejects an infeasible start whole
    (its completion's presolve finds it infeasible) and says so only in its
    log. Before this check the 8-layer GPT step of ``benchmarks/compiler.py``
    gave 256 columns, 49 of its one-of rows held two, and every solve of it
    started from nothing."""
    if start is None:
        return None
    holders: dict[int, list[int]] = {}  # column -> the ops whose one-of row holds it
    for index, columns in enumerate(sel):
        for col in columns or ():
            holders.setdefault(col, []).append(index)
    given: dict[int, float] = {}
    zero: set[int] = set()  # columns a given column's rows make 0
    for index, columns in enumerate(sel):
        if columns is None or any(c in given for c in columns):
            continue
        d = start.decisions[index]
        want = (tuple(d.in_sbp), tuple(d.out_sbp))
        col = next(
            (c for c, (ins, outs) in zip(columns, cands[index]) if (tuple(ins), tuple(outs)) == want),
            None,
        )
        if col is None or col in zero:
            continue
        others = {c for j in holders[col] for c in sel[j]} - {col}
        if not others.isdisjoint(given):
            continue
        newly = others - zero
        touched = {j for c in newly for j in holders[c]}
        if any(col not in sel[j] and all(c in zero or c in newly for c in sel[j]) for j in touched):
            continue
        given[col] = 1.0
        zero |= newly
    return given


def _propagation(program, placement, in_sbp, out_sbp, pr, cands, sel, x_sol) -> Propagation:
    """The chosen signatures as the Propagation the lowering and explain() read:
    each version of a value boxed once (from its producer's layout or an
    earlier version, whichever is cheaper), at its first consumer."""
    layout: dict = {id(v): nd for v, nd in zip(program.inputs, in_sbp)}
    boxed: dict = {}  # id(atom) -> the layouts boxings made of it, in order
    rep = (Broadcast(),) * len(placement.shape)

    def box(atom, nd, where, index, out):
        src = rep if isinstance(atom, Const) else layout[id(atom)]
        made = boxed.setdefault(id(atom), [])
        if src == nd or nd in made:
            return
        src, plan = pr.cheapest_source(atom, src, nd, made)
        made.append(nd)
        out.append(Boxing(atom, src, nd, plan, where, index))

    decisions = []
    for index, (node, cs, columns) in enumerate(zip(program.nodes, cands, sel)):
        k = 0 if columns is None else int(np.argmax([x_sol[c] for c in columns]))
        ins, outs = cs[k]
        boxings: list = []
        for atom, nd in zip(node.ins, ins):
            box(atom, nd, f"{node.name} at {node.source}", index, boxings)
        for v, nd in zip(node.outs, outs):
            layout[id(v)] = nd
        comm = op_comm(node, ins, outs, placement, pr._comms) or []
        decisions.append(Decision(node, list(ins), list(outs), boxings, comm))
    out_boxings: list = []
    final: list = []
    for k, atom in enumerate(program.outputs):
        want = out_sbp[k] if out_sbp is not None else None
        have = rep if isinstance(atom, Const) else layout[id(atom)]
        if want is None or want == have:
            final.append(have)
            continue
        box(atom, want, f"output {k}", None, out_boxings)
        final.append(want)
    return Propagation(program, placement, list(in_sbp), decisions, out_boxings, final, [])


def total_bytes(prop: Propagation) -> int:
    return prop.bytes


SOLVERS = ("ilp", "greedy")


def choose(
    program,
    placement,
    in_sbp,
    out_sbp,
    cost_model=None,
    solver: str = "ilp",
    time_limit: float = 10.0,
    ties=None,
    memory_budget=None,
    same_layout=None,
    arg_names=None,
) -> Propagation:
    """The layouts of every value: the greedy pass, then (``solver="ilp"``) the
    integer program, keeping whichever is cheaper by ``price`` (the ILP is never
    worse than greedy: a time-out or a failed solve keeps greedy, and the
    Choice attached to the result says so).

    ``AUTO`` arguments, ``ties`` and ``memory_budget``: see :func:`solve`. The
    greedy pass starts ``AUTO`` arguments (and their tied results) B; it is
    kept only where it fits the budget."""
    from sbpjax.compiler.propagate import propagate

    if solver not in SOLVERS:
        raise SBPError(
            f"sj.jit: solver={solver!r} is not one of {SOLVERS}; use 'ilp' (whole-program "
            "choice, the default) or 'greedy' (a fast op-by-op pass for prototyping)."
        )
    ties = dict(ties or {})
    auto = any(nd is AUTO for nd in in_sbp)
    if solver == "greedy" and (auto or memory_budget is not None):
        raise SBPError(
            "sj.jit: AUTO layouts and memory_budget are chosen by the whole-program solver, not "
            "the greedy pass; use solver='ilp' (the default), or annotate every argument."
        )
    grid = placement.shape
    idle = idle_axes(in_sbp, grid)
    rep = (Broadcast(),) * len(grid)
    greedy_in = [rep if nd is AUTO else nd for nd in in_sbp]
    greedy_out = list(out_sbp) if out_sbp is not None else [None] * len(program.outputs)
    for k, i in ties.items():
        greedy_out[k] = greedy_in[i]
    caches: tuple[dict, ...] = ({}, {}, {}, {}, {}, {})
    greedy = propagate(
        program,
        placement,
        greedy_in,
        greedy_out if (out_sbp is not None or ties) else None,
        cost_model,
        caches=caches,
        # the caller's arguments' (greedy_in makes AUTO ones B, which would idle axes)
        idle=idle,
    )
    g_bytes = total_bytes(greedy)
    g_price = price(greedy, cost_model)
    g_memory = _held_bytes(program, greedy, ties, grid)
    if solver == "greedy":
        greedy.choice = Choice("greedy", greedy_bytes=g_bytes)
        return greedy
    g_fits = memory_budget is None or g_memory <= memory_budget
    # a small program is solved with every op choosing on its own (UNTIED_OPS)
    untied = arg_names is None or len(program.nodes) <= UNTIED_OPS
    classes = None if untied else layer_classes(program, arg_names)
    # the iterations of a written-out scan always share their choices (loop_classes)
    in_loops = loop_classes(program)
    shared = classes
    if any(c is not None for c in in_loops):
        shared = [
            lc if lc is not None else (("op", i) if classes is None else classes[i])
            for i, lc in enumerate(in_loops)
        ]
    extra = dict(
        ties=ties,
        memory_budget=memory_budget,
        same_layout=same_layout,
        classes=shared,
        same_choice=in_loops if any(c is not None for c in in_loops) else None,
    )
    # every solve of this program differs only in its time limit and fixed ops
    run = functools.partial(
        solve, program, placement, in_sbp, out_sbp, greedy, cost_model, caches=caches, **extra
    )
    t0 = time.perf_counter()
    try:
        # The whole program first (on small programs it proves the optimum);
        # then, unless it was proven, windows from the best plan so far: the
        # repeated layers and the rest, or stretches of the program.
        windows = _windows(classes, program)
        share, gap = (WHOLE_SHARE, WINDOWS_GAP) if len(windows) > 1 else (1.0, 1e-3)
        # each solve starts from the cheapest plan in hand (sbpjax.compiler.milp)
        gathered = None if auto or memory_budget is not None else _weights_gathered(program, in_sbp, grid)
        if gathered is not None:
            gathered = _gathered_plan(
                program, placement, gathered, out_sbp, cost_model, caches, extra, share * time_limit, gap
            )
        start = greedy if gathered is None else gathered[0]
        collapsed = idle_choice = None
        if IDLE_START and idle and memory_budget is None:
            collapsed, idle_choice = run(
                time_limit=share * time_limit / 2, rel_gap=gap, start=start, collapse_idle=True
            )
            if collapsed is not None:
                start = collapsed
        ilp, choice = run(time_limit=share * time_limit, rel_gap=gap, start=start)
        if gathered is not None:
            choice.gathered_start = True
            choice.solve_s += gathered[1].solve_s
            choice.build_s += gathered[1].build_s
        if idle_choice is not None:
            choice.idle_start = collapsed is not None
            choice.solve_s += idle_choice.solve_s
            choice.build_s += idle_choice.build_s
        refined = None
        proven = choice.gap is not None and choice.gap <= gap
        if LATENCY and not proven:
            # Latency makes near-ties that HiGHS can take long to settle (a
            # height-split ResNet step ended its 10 s 37% from the optimum,
            # at 3.2x GSPMD's bytes; an 8-layer GPT's shared solve 51%): the
            # solve by bytes alone, whose plans were the tested ones, is then
            # tried too (in the same time) and the cheaper kept.
            best = ilp if ilp is not None and price(ilp, cost_model) < g_price else greedy
            by_bytes, b_choice = run(time_limit=share * time_limit, rel_gap=gap, latency=False, start=best)
            # the time of both solves is reported, whichever plan is kept
            spent = (choice.solve_s + b_choice.solve_s, choice.build_s + b_choice.build_s)
            if by_bytes is not None and (ilp is None or price(by_bytes, cost_model) < price(ilp, cost_model)):
                b_choice.fallback = f"the solve by bytes and latency stopped at gap {_percent(choice.gap)}"
                b_choice.gathered_start = choice.gathered_start
                b_choice.idle_start = choice.idle_start
                ilp, choice = by_bytes, b_choice
            choice.solve_s, choice.build_s = spent
        if len(windows) <= 1 and not proven:
            windows = _stretches(program)
        if len(windows) > 1 and not proven:
            start = ilp if ilp is not None and (price(ilp, cost_model) < g_price or not g_fits) else greedy
            if start is not greedy or g_fits:
                # the windows' share of the time, after the whole-program solve's (or, where
                # the solve by bytes alone ran too, after both: up to 1.7x time_limit in all,
                # 2.3x where the whole-program solves had the whole time limit each)
                deadline = max(t0 + time_limit, time.perf_counter() + (1 - WHOLE_SHARE) * time_limit)
                starts = [start] + ([greedy] if start is not greedy and g_fits else [])
                refined = _refine(run, starts, deadline, windows, cost_model)
    except ImportError as e:  # highspy and scipy are dependencies; a broken install still compiles
        if not g_fits or auto:
            raise SBPError(
                f"sj.jit: AUTO layouts and memory_budget need the integer program's solver "
                f"(highspy and scipy.sparse: {e}); pip install highspy scipy."
            ) from None
        greedy.choice = Choice(
            "greedy", reason=f"the integer program's solver is unavailable ({e})", greedy_bytes=g_bytes
        )
        return greedy
    choice.greedy_bytes = g_bytes
    choice.greedy_peak = int(live_bytes(greedy).max())
    choice.auto, choice.memory_budget = auto, memory_budget
    if refined is not None:
        prop, rounds, spent = refined
        choice.window_solves, choice.window_s = rounds, spent
        choice.window_bytes = total_bytes(prop)
        if prop is not ilp and (
            ilp is None or emitted_price(prop, cost_model) < emitted_price(ilp, cost_model)
        ):
            if ilp is not None:
                choice.whole_bytes = total_bytes(ilp)
            choice.method, ilp = "windows", prop
    if ilp is None:
        if not g_fits:
            raise _over_budget(program, placement, in_sbp, out_sbp, greedy, time_limit, caches, extra, choice)
        choice.memory_bytes = g_memory
        greedy.choice = choice
        return _fewer_collectives(program, greedy, run, time_limit, cost_model)
    choice.ilp_bytes = total_bytes(ilp)
    ilp_price = price(ilp, cost_model)
    # On an equal price greedy's choice is kept: its tie-breaks (alpha-beta
    # time, fewer boxings, no splits made from nothing) are finer than the
    # ILP's objective. Except where scans were written out: the ILP gives their
    # iterations the same layouts (loop_classes), so the lowering can keep the
    # loop (sbpjax.compiler.loops); greedy's iterations may each differ.
    if (ilp_price > g_price or (ilp_price == g_price and not program.loops)) and g_fits:
        choice.method = "greedy"
        choice.reason = (
            f"the ILP's solution moves {choice.ilp_bytes} B (objective {ilp_price:.0f} B), "
            f"greedy's {g_bytes} B (objective {g_price:.0f} B)"
        ) + (" (greedy is optimal)" if ilp_price == g_price and choice.gap == 0 else f"; {choice.status}")
        choice.memory_bytes = g_memory
        greedy.choice = choice
        return _fewer_collectives(program, greedy, run, time_limit, cost_model)
    ilp.warnings = greedy.warnings
    ilp.choice = choice
    return _fewer_collectives(program, ilp, run, time_limit, cost_model)


def _weights_gathered(program, in_sbp, grid) -> list | None:
    """``in_sbp`` with each weight's splits over the batch's axes
    (``_batch_axes``) made B, or None where no weight is split so (see
    ``_gathered_plan``). A weight: a floating argument a contraction reads,
    split over two or more axes. A heuristic for a start only: the solve
    that follows is free to split the weights again.
    Decision: the batch's axes (read as data), not every axis some argument
    of rank 2 or more is split along its first dimension alone over. That
    older rule also counted a Megatron row kernel (S(0) over the tensor
    axis) and its optimizer state, making the tensor axis a data axis (both
    axes of 2x4 on the benchmark's 2-D transformer step); the same bytes
    are planned without it on every row of benchmarks/compiler.py. An
    earlier one counted a 2-D weight's optimizer state ((S(1), S(0)) for a
    row kernel), which made both axes of 4x2 data axes and the start the
    replicated data-parallel plan, from which the solve stopped far from
    GSPMD: a 2-layer GPT at d_model 32 with 2-D weights moved 2.24 MB
    against GSPMD's 1.70 MB (with the tokens' axis alone 1.24 MB)."""
    readers = {id(a) for n in program.nodes if n.name in _HEAVY for a in n.ins if isinstance(a, Var)}

    def weight(v, nd) -> bool:
        return (
            nd is not AUTO and id(v) in readers and np.issubdtype(v.dtype, np.floating) and _two_d(nd, grid)
        )

    data_axes = _batch_axes(program, [() if nd is AUTO else (nd,) for nd in in_sbp], grid)
    relaxed, changed = [], False
    for v, nd in zip(program.inputs, in_sbp):
        if weight(v, nd) and any(isinstance(nd[a], Split) for a in data_axes):
            nd = tuple(Broadcast() if a in data_axes else q for a, q in enumerate(nd))
            changed = True
        relaxed.append(nd)
    return relaxed if changed else None


def _gathered_plan(program, placement, relaxed_in, out_sbp, cost_model, caches, extra, time_limit, gap):
    """``(plan, Choice)``: the plan of ``program`` with its weights whole over
    the data axes (``relaxed_in``, ``_weights_gathered``), from which the
    whole-program solve starts; None if none was found.

    Weights split over both the data and the tensor axes (2-D layouts, FSDP
    with tensor parallelism) make the integer program hard: its relaxation
    bounds nothing (gaps of 99%). On a 3-layer GPT at d 128 on 4x2 (695 ops)
    HiGHS ended its 10 s at the greedy plan it started from (28.5 MB in 193
    collectives; GSPMD 31.5 MB in 53), and 120 s did not close the gap. With
    the data-axis splits made B the program is the tensor-parallel one,
    which HiGHS proves optimal in under a second there. Its choices, each
    weight now all-gathered over the data axis where a contraction reads it
    (``_Domains._gathered``), are a plan of the real program (HiGHS
    completes the ops whose choice is not among their candidates; greedy is
    still compared by ``price`` in ``choose``), and the real solve starts
    from it: 16.5 MB in 22 collectives on that GPT (21.6-21.8 MB in 58-66
    while the weights' 2-D optimizer state made both axes data axes, see
    ``_weights_gathered``)."""
    from sbpjax.compiler.propagate import propagate

    greedy = propagate(program, placement, relaxed_in, out_sbp, cost_model, caches=caches)
    relaxed, choice = solve(
        program,
        placement,
        relaxed_in,
        out_sbp,
        greedy,
        cost_model,
        caches=caches,
        time_limit=time_limit,
        rel_gap=gap,
        start=greedy,
        **extra,
    )
    return None if relaxed is None else (relaxed, choice)


# Where the caller left an axis idle (``propagate.idle_axes``: no argument is
# split or partial over it), the whole-program solve starts from the best plan
# with every value whole over the idle axes (``solve(collapse_idle=True)``:
# each op's candidates B there, where it has such a candidate). That is the
# program on the other axes alone, an integer program a tenth the size,
# proven optimal in about a second, and GSPMD's kind of plan (it runs such a
# step replicated over the idle axes). The full solve may still use the idle
# axes (splitting the batch further) wherever that is cheaper. Without this
# start a 2-layer GPT at d 32 with 2-D weights on 2x2x2 (y idle; 67,000
# binaries) ended its time-limited solve at 1,828,896 B, above GSPMD's
# 1,781,792; the collapsed solve (6,000 binaries, 1.7 s) proves 1,089,584 B,
# and the full solve from it keeps 1.09-1.30 MB. The collapsed solve has half
# the whole-program solve's time (it is proven long before on every program
# tried). No program of benchmarks/compiler.py has an idle axis, and
# benchmarks/models.py, rerun, planned the same bytes on every model.
# False: the full solve starts from the greedy or gathered plan alone.
IDLE_START = True


# Bytes come first (``LATENCY``), but not at any price in collectives: a plan
# that moves a few percent fewer bytes through several more collectives is
# slower wherever a collective's latency is not negligible. On the compiler
# benchmark's data-parallel transformer step the bytes-first plan saves 7%
# (67,967,032 B against the 73,414,712 B of one bucketed all-reduce) by
# gathering the tokens, moving the embedding's output gradient by an
# all-to-all and all-gathering the embedding's gradient: 4 collectives where
# GSPMD runs 1, and by the cost model's own alpha-beta time (each collective
# paying the ring's hops, ``ring_latency_bytes``: 5.6 MB for 8 devices) the
# slower plan. So the kept plan is solved once more with that latency (its
# boxings planned by it too: plan_boxing's launch_priced="ring"), started
# from it, and the result replaces it when it runs fewer collectives
# (``emitted_collectives``: what the compiled program runs, all-reduces
# combined as XLA combines them) and is faster by the cost model
# (``emitted_price(ring=True)``) while moving at most ``FEWER_COLLECTIVES``
# more bytes (a share of the kept plan's), or while running at most half the
# collectives with an estimated peak (``liveness.live_bytes``) no larger
# than the kept plan's. The second way takes GSPMD's one all-reduce for a
# data-parallel MLP at width 256 on 4x2 (6,291,504 B in 1 collective; bytes
# first sliced each gradient over y, reduce-scattered it over x and
# all-gathered it over all 8 devices: 5,242,928 B in 3), which the cost
# model times faster (11.2 against 18.3 MB-equivalent). The peak condition
# is what keeps FSDP plans: an 8-device FSDP MLP's bytes-first plan
# reduce-scatters each gradient as it is made (974,848 B in 12 collectives,
# estimated peak 139,268 B), where the second solve's holds the gathered
# weights and whole gradients (5,132,288 B in 6, peak 456,708 B); taken
# without that condition (tried), XLA's temp memory no longer fell with
# regathering (tests/compiler/test_regather.py).
# Decision: these three conditions rather than pricing every collective at the
# ring's latency throughout (tried, see ``LATENCY``: collectives were then
# bought with bytes everywhere, up to 35% more on the tensor-parallel step,
# and a replicated MLP where Megatron's layouts move 3.4x fewer bytes).
# "Faster" alone is not enough: the ring's latency grows with the group, so
# on 2x4 the model preferred several reductions over 4 devices to one over 8
# (measured while ring_latency_bytes summed a group's devices alone), and
# accepting such plans (tried) moved 4-9% more bytes on 7 GPT sweep rows, and
# on 4x2 ran 17 collectives in place of 11. With all the conditions two rows
# of benchmarks/compiler.py change: the data-parallel step above, and the GPT
# step at d_model 128 on 8x8 (42,664,384 B in 12 collectives, as many as
# GSPMD's 50,291,136 B; bytes first: 39,969,216 B in 18). On a program of
# more than UNTIED_OPS ops the second solve keeps every op's signature (the
# kept plan's layouts) and re-plans only its boxings at the ring's latency:
# a deep stack's whole-program solve is the time-limited one, and freeing
# the layouts there (tried) doubled the solve of the compiler benchmark's
# 4- to 32-layer GPT steps (L32: 11.2 s, over its 10 s target) and changed
# none of their plans. With the layouts kept it costs about a second (L32:
# 6.1 s in all, 5.5 s without it) and finds what is lost in boxings alone: a
# 3-layer data-parallel GPT at d_model 64 with AdamW on 4x2 (1,066 ops) runs
# GSPMD's one all-reduce (7,489,584 B) where bytes first ran three collectives.
# 0: bytes first throughout.
FEWER_COLLECTIVES = 0.10


def _count(prop: Propagation, launched: dict | None = None) -> int:
    """The collectives the compiled program runs: its boxings' as XLA runs
    them (``buckets.count_collectives(combined_all_reduces=True)``) and the
    ops' own communication. ``launched``: ``emitted_collectives(prop)``
    where the caller has it."""
    if launched is None:
        launched = emitted_collectives(prop)
    return launch_count(launched) + sum(1 for _, c in prop.comm if c.bytes)


def _signatures(plan: Propagation, free=()) -> dict:
    """``solve``'s ``fixed`` for ``plan``: each op's signature, but those of ``free``."""
    return {i: (list(d.in_sbp), list(d.out_sbp)) for i, d in enumerate(plan.decisions) if i not in free}


def _fewer_collectives(program, kept: Propagation, run, time_limit, cost_model) -> Propagation:
    """``kept``, or the plan solved with each collective's ring latency (see
    ``FEWER_COLLECTIVES``) when that one runs fewer collectives, is faster by
    the cost model and moves at most ``FEWER_COLLECTIVES`` more bytes, or
    runs at most half the collectives without a larger estimated peak
    (``liveness.live_bytes``). On a program of more than ``UNTIED_OPS`` ops
    the layouts are ``kept``'s and only the boxings are planned again."""
    if not FEWER_COLLECTIVES:
        return kept
    kept_bytes = total_bytes(kept)
    reboxed = len(program.nodes) > UNTIED_OPS
    fixed = None
    if reboxed:
        fixed = _signatures(kept)
    # half the limit: it only ever replaces a plan in hand
    alt, alt_choice = run(time_limit=time_limit / 2, rel_gap=1e-3, latency="ring", start=kept, fixed=fixed)
    choice = kept.choice
    # the time of the solve is reported, whichever plan is kept
    choice.solve_s += alt_choice.solve_s
    choice.build_s += alt_choice.build_s
    if alt is None:
        return kept
    alt_bytes = total_bytes(alt)
    # what each plan's compiled program runs, read by the count and the price
    # alike: each plan's buckets are planned once
    kept_launched, alt_launched = emitted_collectives(kept), emitted_collectives(alt)
    kept_count, alt_count = _count(kept, kept_launched), _count(alt, alt_launched)
    within = alt_bytes <= (1 + FEWER_COLLECTIVES) * kept_bytes
    if not within and (2 * alt_count > kept_count or live_bytes(alt).max() > live_bytes(kept).max()):
        return kept
    kept_time, alt_time = (
        emitted_price(kept, cost_model, ring=True, launched=kept_launched),
        emitted_price(alt, cost_model, ring=True, launched=alt_launched),
    )
    if alt_time >= kept_time or alt_count >= kept_count:
        return kept
    why = f"within {100 * FEWER_COLLECTIVES:.0f}%" if within else "half the collectives, no larger peak"
    again = "its boxings planned again" if reboxed else "solved again"
    choice.latency_note = (
        f"then {again} with each collective's ring latency, and that plan kept: {alt_bytes} B "
        f"in place of {kept_bytes} B "
        f"({100 * (alt_bytes / max(kept_bytes, 1) - 1):+.1f}%, {why}), "
        f"{alt_count} collectives in place of {kept_count}, "
        f"{(kept_time - alt_time) / 1e6:.2f} MB-equivalent faster by the cost model"
    )
    alt.warnings = kept.warnings
    alt.choice = choice
    return alt


# The share of solve_time_limit the whole-program solve takes where layers
# repeat; the window search then has the rest (it usually stops before: when
# a round over every window improves nothing). Decision: 0.7, not half. The
# tied program of a deep GPT step (benchmarks/compiler.py's 4- to 32-layer
# rows: 7,779 binaries whatever the depth) is proven within 1% in 2.7 s (32
# layers) to 4.5-6.2 s (8 layers), about all of it HiGHS's root node (cuts,
# then a sub-MIP finds the optimum); with 5 s the 8-layer row was proven on
# some runs and not on others, and
# when not, the window search from the bytes-only plan stopped in a local
# optimum: 16,241,720 B in 74 collectives where the proven plan runs 36
# (GSPMD's count). The cost falls on programs whose solve is not proven
# (those solves and the one by bytes alone take 7 s each, the windows 3 s).
WHOLE_SHARE = 0.7
# Where layers repeat, the whole-program solve stops once it is proven within
# 1% of the optimum, and the window search is then skipped: it could win at
# most that 1%, and on a deep stack (32 layers) closing the last 1% takes
# HiGHS longer than the solve itself (5 s against 2.7 s for the same plan).
WINDOWS_GAP = 1e-2
# Programs of up to this many ops are solved whole, in the whole time limit,
# with every op choosing on its own (no layer classes, so no windows): sharing a
# class's choice is a restriction, and there it weakens the relaxation where
# it should shrink it. On a 2-layer GPT step (~700 ops, 10,000 columns) the
# tied program ends its 5 s 7% above the optimum the untied one proves in 9 s;
# a transformer block's 2-D step (400 ops) needs the whole 10 s to find a plan
# 10% below greedy's. Beyond it (4 layers, ~1,400 ops) the untied search ends
# above the tied one's windows, and at 8 (~2,700 ops, 39,000 columns) it is
# lost (a 71% gap after 10 s).
UNTIED_OPS = 1000


def _windows(classes, program) -> list[set]:
    """The parts of the program the window search solves one at a time: the
    ops that share a layer class with others (the repeated layers, all
    together since they share their choices), and the rest (embedding, head,
    the first and last layers' edges, the optimizer's unrepeated ops). Each
    has about one layer's choices, where the integer program's relaxation is
    tight and HiGHS solves it in a second; the whole program of a few layers
    is not (on a 4-layer decoder its bound stays below half the optimum).

    Where scans were written out, each loop (every iteration of it: they
    share their choices, ``loop_classes``) is a window of its own, the rest
    split as above: the forward and the backward loop then change one at a
    time. With the windows of layer classes alone (the loops' ops in one
    window) the search stopped at 99.7 MB on the model zoo's scanned decoder
    on jax 0.12 (GSPMD 99.0 MB); with a window per loop, 86.0 MB."""
    if classes is None:
        return []
    owners = _loop_owners(program)
    loops: dict = {}
    for i, where in enumerate(owners):
        if where is not None:
            loops.setdefault(id(where[0]), set()).add(i)
    count: dict = {}
    for c in classes:
        count[c] = count.get(c, 0) + 1
    outside = [i for i, where in enumerate(owners) if where is None]
    repeated = {i for i in outside if count[classes[i]] > 1}
    rest = set(outside) - repeated
    return [w for w in (*loops.values(), repeated, rest) if w]


# The ops of a window of _stretches, where no layers repeat.
STRETCH_OPS = 100


def _stretches(program) -> list[set]:
    """Windows for a program whose whole solve stopped short of its gap and
    whose layers do not repeat (or which is solved untied, ``UNTIED_OPS``):
    runs of ``STRETCH_OPS`` consecutive ops, so that the forward pass, the
    backward pass and the optimizer change a part at a time. On the 2-D
    transformer step of ``benchmarks/compiler.py`` (400 ops) both 10 s
    solves stopped 26% from their bound, neither below greedy's 75.8 MB;
    from there 5 window solves (0.3 s) reach 68.7 MB, and runs of 200 or 50
    ops reach the same plan."""
    n = len(program.nodes)
    return [set(range(i, min(n, i + STRETCH_OPS))) for i in range(0, n, STRETCH_OPS)]


def _refine(run, starts, deadline, windows, cost_model=None):
    """Large-neighbourhood search from each plan of ``starts`` in turn, while
    time is left: solve the integer program with one window's ops free and
    every other op fixed to the best plan of this search so far, window after
    window, until a round improves nothing or the deadline passes.
    ``run(time_limit=..., fixed=..., start=...)`` solves the program. Plans
    are compared by ``emitted_price`` (buckets counted). Returns (the best
    plan of all searches, solves, seconds).

    A search ends in a local optimum that depends on where it starts: on the
    2-D transformer step of ``benchmarks/compiler.py`` one from greedy's plan
    (75.8 MB) reached 68.7 MB, one from a time-limited whole-program solve's
    better plan (75.4 MB) stopped at 75.0 MB; so where time is left, the
    search starts again from greedy's plan."""
    t0 = time.perf_counter()
    # one window may not take the whole budget: the other needs its turn
    per_solve = (deadline - t0) / 2
    found, rounds = starts[0], 0
    for best in starts:
        stale = 0
        while stale < len(windows) and deadline - time.perf_counter() > 0:
            for window in windows:
                left = min(deadline - time.perf_counter(), per_solve)
                if left <= 0 or stale >= len(windows):
                    break
                fixed = _signatures(best, free=window)
                prop, _ = run(time_limit=left, fixed=fixed, start=best)
                rounds += 1
                if prop is not None and emitted_price(prop, cost_model) < emitted_price(best, cost_model):
                    best, stale = prop, 0
                else:
                    stale += 1
        if emitted_price(best, cost_model) < emitted_price(found, cost_model):
            found = best
    return found, rounds, time.perf_counter() - t0


def _held_bytes(program, prop: Propagation, ties, grid) -> int:
    """Per-device bytes of a plan's arguments and results (a tied result once)."""
    held = sum(block_bytes(v.shape, v.dtype, nd, grid) for v, nd in zip(program.inputs, prop.in_sbp))
    for k, (atom, nd) in enumerate(zip(program.outputs, prop.out_sbp)):
        if isinstance(atom, Var) and k not in ties:
            held += block_bytes(atom.shape, atom.dtype, nd, grid)
    return held


def _over_budget(program, placement, in_sbp, out_sbp, greedy, time_limit, caches, extra, choice):
    """The SBPError for a budget no layout meets, with the least bytes any
    layout in the solver's space holds (a second solve, minimizing memory)."""
    least = None
    if "infeasible" in choice.status.lower():
        _, low = solve(
            program,
            placement,
            in_sbp,
            out_sbp,
            greedy,
            None,
            time_limit,
            caches=caches,
            ties=extra["ties"],
            same_layout=extra["same_layout"],
            classes=extra["classes"],
            objective="memory",
        )
        if low.bound is not None:
            least = int(np.ceil(low.bound))
    why = (
        f"the least any layout holds is {least} B per device"
        if least is not None
        else f"the solver stopped without a layout that fits ({choice.status})"
    )
    return SBPError(
        f"sj.jit: no layout fits memory_budget={extra['memory_budget']} B per device: {why} (arguments and "
        "results, a donated argument and its result once). Raise the budget, use a placement "
        "with more devices, or give the solver more time (solve_time_limit)."
    )


__all__ = [
    "solve",
    "choose",
    "Choice",
    "total_bytes",
    "price",
    "SOLVERS",
    "AUTO",
    "auto_layouts",
]

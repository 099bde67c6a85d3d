"""An estimate of what each device holds while a program runs.

Each value's block in its layout (``local_shape``, padded where uneven) is
counted from the op that makes it (or the boxing that moves it) to its last
use, in program order; results live to the end, boxed to their ``out_sbp``
in a step of their own after the last op; the arguments as passed are left
out (they are held throughout; :func:`estimated_peak_bytes` adds them).
It is not XLA's schedule, which fuses many of these values away (counted
so with ``fused=True``, :func:`_fused`), reorders ops and keeps some values
longer, but it places a train step's peak where the forward pass's saved
activations are all alive, which is what its users need:
:mod:`sbpjax.compiler.regather` (which gathered weights to free across the
peak) and :mod:`sbpjax.compiler.buckets` (how large a bucket of parameter
gathers may grow). ``explain()``'s estimated peak
(:func:`estimated_peak_bytes`) counts these spans as XLA fuses and orders
the program (``fused``, ``scheduled``) and places them as XLA's buffer
assignment does (:mod:`sbpjax.compiler.allocation`), since that is what
``memory_analysis()`` reports: 0.92-1.09 of it on the rows of
``benchmarks/compiler.py``, and 0.89-1.11 on six of the seven models of
``benchmarks/models.py`` (jax 0.10.2). On the unrolled decoder, whose layers
are each under ``jax.checkpoint``, it is 0.60: XLA's temporaries there are
3.2x the scanned decoder's, for GSPMD's program too (the estimate counts
what remat should leave alive). Counted with the recomputation hoisted
(``hoisted=True``, as early as its inputs allow) it is 4.8x: XLA keeps
something in between, and a plan that is not larger either way is not
larger in XLA's schedule (:func:`sbpjax.compiler.second_looks.fewer_collectives`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax.compiler.allocation import Value, allocated_bytes
from sbpjax.compiler.program import Var
from sbpjax.compiler.propagation import Boxing, Propagation
from sbpjax.rules import local_shape
from sbpjax.rules.elementwise import ELEMENTWISE
from sbpjax.sbp import Broadcast


def block_bytes(shape, dtype, nd, grid) -> int:
    """Bytes of one device's block of a value in layout ``nd`` (padded where
    uneven). A PRNG key's dtype (``key<fry>``) is no NumPy dtype but has an
    itemsize of its own. Remembered per shape, dtype, layout and grid: the
    liveness passes and the formulation of one 32-layer plan size some 45,000
    blocks, a few hundred distinct."""
    return _block_bytes(tuple(shape), dtype, tuple(nd), tuple(grid))


@functools.lru_cache(maxsize=1 << 16)  # bounded: a long session plans many programs
def _block_bytes(shape: tuple, dtype, nd: tuple, grid: tuple) -> int:
    size = dtype.itemsize if isinstance(getattr(dtype, "itemsize", None), int) else np.dtype(dtype).itemsize
    # Python's exact integers (no overflow to guard against, unlike np.prod's)
    return math.prod(int(n) for n in local_shape(shape, nd, grid)) * int(size)


def value_bytes(var, nd, grid) -> int:
    """Bytes of one device's block of ``var`` in layout ``nd``."""
    return block_bytes(var.shape, var.dtype, nd, grid)


@dataclasses.dataclass
class Held:
    """A gathered argument: the boxing that makes it, the decisions using it
    (ascending) and where it is gathered (the first use, then each regather)."""

    boxing: Boxing
    uses: list
    starts: list
    size: int


# Ops whose same-layout operand made by an elementwise op XLA computes inside
# their own loop (a loop or input fusion) when that op has no other reader.
FUSING_READERS = ELEMENTWISE | {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "argmax", "argmin"}


def _fused(prop: Propagation, block) -> tuple[set, dict]:
    """The values XLA's fusion never writes, as :func:`live_bytes` counts them
    with ``fused=True``: the result of an elementwise op whose only reader is
    an elementwise op or a reduction (``FUSING_READERS``), in the same layout
    (no boxing between), that is not a result of the program, and whose
    computing at that reader holds none of its operands longer that is as
    large as itself. Returns their blocks and, per decision whose result is
    fused, the decision that computes it (the end of a chain of such ops):
    its operands are read there.

    Why these: XLA fuses an elementwise producer into its one consumer where
    that consumer is a loop (elementwise) or reduction fusion, so the value
    is never written; with two readers it is computed twice or written once.
    Dots, gathers, concatenations and collectives read written operands, and
    nothing is fused across a ``cond``'s branch computation or a scan
    iteration's carries and slices (the loop's state once it is rolled). The
    size condition keeps a backward pass's residuals: an activation saved for
    the backward pass (``x_hat`` of a layer norm, read once, hundreds of ops
    later) cannot be fused away for free, since its operands would be held
    instead; counting them fused put the 2x4 GPT rows of
    ``benchmarks/compiler.py`` at 0.78-0.87x XLA's peak. A scalar operand
    (Adam's ``1 - b1**t``) is held at no cost. What it corrects: optax's
    updates compute each stage for every leaf before the next
    (``m / (1 - b1**t)`` for all leaves, then ``v``'s, then their ratio...),
    which XLA fuses into one loop per leaf (counted as written, the 8x1 GPT
    row's estimate was 1.19x XLA's peak, the data-parallel transformer's
    1.16x; now 1.02x and 1.00x), and a softmax's ``exp(z - max)`` summed at
    once (1.50x, now 1.00x)."""
    decisions, grid = prop.decisions, prop.placement.shape
    outputs = {block(v, nd) for v, nd in zip(prop.program.outputs, prop.out_sbp) if isinstance(v, Var)}
    held = outputs | {block(v, nd) for v, nd in zip(prop.program.inputs, prop.in_sbp)}
    written = outputs | {block(b.var, b.src) for d in decisions for b in d.boxings}
    written |= {block(b.var, b.src) for b in prop.out_boxings}
    # a scan iteration's carries and slices are the loop's state when the lowering rolls it
    carried = {id(v) for loop in prop.program.loops for it in loop.iterations for v in it.outs}
    readers: dict = {}
    for i, d in enumerate(decisions):
        for a, nd in zip(d.node.ins, d.in_sbp):
            if isinstance(a, Var):
                readers.setdefault(block(a, nd), set()).add(i)

    def held_longer(a, nd, at: int, size: int) -> bool:
        key = block(a, nd)
        return key not in held and max(readers[key]) < at and value_bytes(a, nd, grid) >= size

    fused: set = set()
    computed_at: dict = {}
    for i in range(len(decisions) - 1, -1, -1):  # a chain's reader first
        d = decisions[i]
        if d.node.name not in ELEMENTWISE or len(d.node.outs) != 1:
            continue
        key = block(d.node.outs[0], d.out_sbp[0])
        (r, *more) = readers.get(key, (None,))
        if key in written or id(d.node.outs[0]) in carried or r is None or more:
            continue
        if decisions[r].node.name not in FUSING_READERS or decisions[r].node.branch != d.node.branch:
            continue
        at = computed_at.get(r, r)
        size = value_bytes(d.node.outs[0], d.out_sbp[0], grid)
        if any(held_longer(a, nd, at, size) for a, nd in zip(d.node.ins, d.in_sbp) if isinstance(a, Var)):
            continue
        fused.add(key)
        computed_at[i] = at
    return fused, computed_at


def _branch_results(prop: Propagation) -> dict:
    """``{id(value): decision}`` for each value made inside a ``lax.cond``
    branch and read only outside it (the branch's result, read by the
    ``select_n`` that joins the branches): the first decision reading it.
    XLA runs one branch, in a computation of its own whose result exists
    from the end of the conditional on; the flat program runs every branch's
    ops one after another, so a result counted from where it is made would be
    held through the other branches' ops, as XLA never holds it (a Megatron
    block under ``cond`` beside ``x * 2``: the estimated peak was a third
    higher with the reduction made inside the block's branch, and XLA's the
    same either way)."""
    made: dict = {}
    firsts: dict = {}
    for i, d in enumerate(prop.decisions):
        for a in d.node.ins:
            if isinstance(a, Var) and id(a) in made:
                branch = made[id(a)]
                if d.node.branch[: len(branch)] == branch:
                    made.pop(id(a))  # read inside its own branch: held from where it is made
                    firsts.pop(id(a), None)
                else:
                    firsts.setdefault(id(a), i)
        if d.node.branch:
            made.update((id(v), d.node.branch) for v in d.node.outs)
    return firsts


@dataclasses.dataclass
class Spans:
    """When each value is alive (:func:`spans`): ``size``, ``start`` and ``end``
    by value block (``(id(value), layout)``), alive after decisions ``start``
    to ``end``; ``steps`` (the decisions, then the results' boxings);
    ``results``: the blocks the program returns (not its arguments), in
    its order, each once;
    ``gathered``: each regathered copy held, as a :class:`Value`."""

    size: dict
    start: dict
    end: dict
    steps: int
    results: list
    gathered: list


def _write_in_place(writes: list, size: dict, start: dict, end: dict) -> None:
    """An elementwise op writes its result over an operand it reads last
    that is as large (XLA's in-place buffer reuse): that operand is dead
    from the op on, ``end`` cut back to before it. ``writes``: ``(decision,
    result, operands)`` of each elementwise op, by block."""
    for i, out, ins in writes:
        for key in ins:
            if (
                key in size
                and out in size
                and key != out
                and end[key] == i
                and size[key] == size[out]
                and start[key] < i
            ):
                end[key] = i - 1
                break


def live_bytes(
    prop: Propagation,
    held: Sequence = (),
    hoisted: bool = False,
    fused: bool = False,
    scheduled: bool = False,
) -> np.ndarray:
    """The bytes :func:`spans` counts alive after each step."""
    sp = spans(prop, held, hoisted, fused, scheduled)
    delta = np.zeros(sp.steps + 1, np.int64)
    for key, s in sp.size.items():
        delta[sp.start[key]] += s
        delta[sp.end[key] + 1] -= s
    for g in sp.gathered:
        delta[g.first] += g.size
        delta[g.last + 1] -= g.size
    return np.cumsum(delta)[: sp.steps]


def spans(
    prop: Propagation,
    held: Sequence = (),
    hoisted: bool = False,
    fused: bool = False,
    scheduled: bool = False,
) -> Spans:
    """When each value a device holds is alive (:class:`Spans`): after each
    decision, and last while the results are boxed to their ``out_sbp`` (the
    program's arguments left out: they are held throughout):
    ``len(prop.decisions) + 1`` steps.
    ``held``: gathered arguments whose gathered copies live from each start
    to the last use before the next (see :class:`Held`).

    ``hoisted``: each recomputing op (one inside a ``jax.checkpoint`` region)
    runs as early as its inputs allow instead of where the program has it,
    what a scheduler that does not honour the recomputation's place would do.
    Programs without checkpoint regions get the same counts either way.

    ``fused``: the values XLA's fusion never writes are left out, and their
    operands held to where they are read (:func:`_fused`); and an elementwise
    op writes its result over an operand it reads last that is as large (in
    place, as XLA does), which is dead from there. What
    :func:`estimated_peak_bytes` counts. The plan's own comparisons (second
    looks, buckets, regathers) count every value written: the fusion removes
    the same values from plans that differ in layouts only.

    ``scheduled``: a value boxed for a later reader waits in the smaller of
    its two layouts, as a scheduler that minimizes memory (XLA's) runs the
    boxing: right after the value is made when the boxing shrinks it (a
    reduce-scatter, a slice), just before the reader when it grows it or
    keeps its size (an all-gather, an all-reduce). Otherwise a boxing runs
    where its reader is, and the value waits in neither layout: nothing is
    counted for it between its maker and that reader unless something else
    reads it there. What :func:`estimated_peak_bytes` counts. (Without it a
    train step's gradients, which wait for the optimizer unreduced, were
    counted nowhere in between; holding each waiting value in its source
    layout instead overcounted the tensor-parallel transformer steps of
    ``benchmarks/compiler.py``, whose activations' reduce-scatters XLA runs
    at once: 1.11-1.12x XLA's peak.)"""
    grid = prop.placement.shape
    # The results' boxings to out_sbp run after the last op, when only what the
    # program returns is still held: a step of their own. Counted at the last op,
    # a result reduced at the end (u @ v @ w, its partial sum all-reduced) was
    # held three times over beside that op's operands (uvw: estimated 1.31x XLA's peak).
    n = len(prop.decisions) + 1

    # A value's block in layouts that differ only on axes of size 1 (B, S or P
    # over an axis of one device) is one block: a boxing between them (out_sbp
    # (B, S(1)) of a (B, B) result on 8x1) moves nothing and makes none. Counted
    # apart, a data-parallel GPT step's results were held twice at its end (the
    # estimated peak 1.49x XLA's, now 1.19x).
    # (Normalized once per layout: live_bytes runs several times a plan, over
    # some 60,000 reads on a 32-layer step.)
    normal: dict = {}
    rep = Broadcast()

    def block(v, nd) -> tuple:
        nd = tuple(nd)  # (a tuple is itself)
        key = normal.get(nd)
        if key is None:
            key = normal[nd] = tuple(rep if p == 1 else q for p, q in zip(grid, nd))
        return id(v), key

    # the arguments as passed are held throughout; their boxed versions are not
    args = {block(v, nd) for v, nd in zip(prop.program.inputs, prop.in_sbp)}
    start: dict = {}
    end: dict = {}
    size: dict = {}
    ready: dict = {}  # id(value) -> the decision after which it exists (read when hoisted)
    gathered = {block(h.boxing.var, h.boxing.dst) for h in held}

    def use(key, var, nd, s, i):
        first = start.get(key)
        if first is None:
            size[key] = value_bytes(var, nd, grid)
            first = end[key] = start[key] = s
        elif s < first:
            first = start[key] = s
        # at least where it starts: a branch's result read only by a boxing at the join
        last = i if i > first else first
        if last > end[key]:
            end[key] = last

    def box(b: Boxing, s: int, read: int, reads_source: bool = False) -> None:
        """A boxing whose result is read from ``s`` to ``read``. With
        ``scheduled`` the value waits in its smaller layout; otherwise its
        source is held to ``s`` only where ``reads_source`` (a result's
        boxing, in the step after the last op)."""
        src, dst = block(b.var, b.src), block(b.var, b.dst)
        waits = scheduled and src not in skip and src in start
        if waits and value_bytes(b.var, b.dst, grid) < size[src]:
            s = start[src]  # boxed at once: the source is freed by its other readers
        elif (waits or reads_source) and src not in skip:
            use(src, b.var, b.src, s, read)
        if dst not in skip:
            use(dst, b.var, b.dst, s, read)

    unwritten, computed_at = _fused(prop, block) if fused else (set(), {})
    writes: list = []  # (decision, result, operands) of the elementwise ops, where fused
    joined = _branch_results(prop)
    skip = args | gathered | unwritten
    for i, d in enumerate(prop.decisions):
        s = i
        if hoisted and d.node.region:
            s = min(i, max((ready.get(id(a), 0) for a in d.node.ins if isinstance(a, Var)), default=0))
        read = computed_at.get(i, i)
        for b in d.boxings:
            box(b, s, read)
        for a, nd in zip(d.node.ins, d.in_sbp):
            if isinstance(a, Var) and (key := block(a, nd)) not in skip:
                use(key, a, nd, s, read)
        for v, nd in zip(d.node.outs, d.out_sbp):
            ready[id(v)] = s
            if (key := block(v, nd)) not in unwritten:
                use(key, v, nd, max(s, joined.get(id(v), s)), i)
        if fused and d.node.name in ELEMENTWISE and len(d.node.outs) == 1:
            ins = [block(a, nd) for a, nd in zip(d.node.ins, d.in_sbp) if isinstance(a, Var)]
            writes.append((i, block(d.node.outs[0], d.out_sbp[0]), ins))
    for b in prop.out_boxings:
        box(b, n - 1, n - 1, reads_source=True)
    for v, nd in zip(prop.program.outputs, prop.out_sbp):
        if isinstance(v, Var) and (key := block(v, nd)) in size:
            end[key] = n - 1
    _write_in_place(writes, size, start, end)
    copies = []
    for h in held:  # each gathering holds the weight from it to the last use before the next
        cuts = [*h.starts[1:], None]
        for s, nxt in zip(h.starts, cuts):
            last = max(u for u in h.uses if u >= s and (nxt is None or u < nxt))
            copies.append(Value(h.size, s, last))
    # in the program's order, each once: the estimate's allocations are tried in it
    results = {block(v, nd): None for v, nd in zip(prop.program.outputs, prop.out_sbp) if isinstance(v, Var)}
    return Spans(size, start, end, n, [k for k in results if k in size], copies)


def argument_bytes(prop: Propagation) -> int:
    """Bytes of one device's blocks of the program's arguments, as passed
    (each value once, however many times it is passed)."""
    grid = prop.placement.shape
    seen: dict = {}
    for v, nd in zip(prop.program.inputs, prop.in_sbp):
        if isinstance(v, Var):
            seen.setdefault((id(v), nd), value_bytes(v, nd, grid))
    return sum(seen.values())


def decision_uses(prop: Propagation, keys) -> dict:
    """For each ``(id(value), nd-SBP)`` of ``keys``, the ascending indices of
    the decisions that read that value in that layout."""
    uses: dict = {key: [] for key in keys}
    for i, d in enumerate(prop.decisions):
        for a, nd in zip(d.node.ins, d.in_sbp):
            key = (id(a), nd)
            if key in uses and (not uses[key] or uses[key][-1] != i):
                uses[key].append(i)
    return uses


def regathered(prop: Propagation) -> list:
    """The :class:`Held` gathered arguments of a chosen program whose
    decisions already carry their regathers (``sbpjax.compiler.regather``):
    each gathered where its first boxing runs and again at each regather."""
    grid = prop.placement.shape
    again: dict = {}
    for b in (b for d in prop.decisions for b in d.boxings if b.regather):
        again.setdefault((id(b.var), b.dst), []).append(b.node_index)
    if not again:
        return []
    first: dict = {}
    for i, d in enumerate(prop.decisions):
        for b in d.boxings:
            key = (id(b.var), b.dst)
            if key in again and not b.regather:
                first.setdefault(key, (i, b))
    uses = decision_uses(prop, again)
    return [
        Held(b, uses[key], sorted({i, *again[key]}), value_bytes(b.var, b.dst, grid))
        for key, (i, b) in first.items()
        if uses[key]
    ]


def estimated_peak_bytes(prop: Propagation) -> int:
    """The most one device is estimated to hold: its arguments (held
    throughout), and its values (:func:`spans`, ``fused`` and ``scheduled``:
    as XLA fuses and orders the program; regathered arguments held from each
    gathering to its last use before the next) in the allocations XLA's
    buffer assignment makes of them (:mod:`sbpjax.compiler.allocation`):
    each result's own, which other values use before it is made, and one
    packed with the rest. An estimate of XLA's ``memory_analysis()``
    (arguments + outputs + temporaries - aliased), not a bound on it: XLA
    may fuse other values away, keep values longer or reorder ops."""
    sp = spans(prop, regathered(prop), fused=True, scheduled=True)
    returned = set(sp.results)
    temps = [Value(sp.size[k], sp.start[k], sp.end[k]) for k in sp.size if k not in returned]
    temps += sp.gathered
    results = [Value(sp.size[k], sp.start[k], sp.end[k]) for k in sp.results]
    return argument_bytes(prop) + allocated_bytes(temps, results, sp.steps) + result_table_bytes(prop.program)


def result_table_bytes(program) -> int:
    """The bytes of the results' tuple XLA holds besides their buffers: it
    returns two or more results as a tuple, whose table of buffer addresses
    (8 B a result, a donated one's too) its memory_analysis() counts with the
    outputs; one result is returned as it is. Left out of ``held_bytes``, a
    20-result AdamW step planned under an 85,911 B budget held 85,904 B by
    the plan and 86,064 B by XLA's count."""
    n = len(program.outputs)
    return 8 * n if n > 1 else 0


def held_bytes(program, prop: Propagation, pairs, grid) -> int:
    """Per-device bytes of a plan's arguments and results, as XLA's argument
    + output - alias sizes count them. ``pairs``: {result: donated argument}
    (a choice's ties and aliases): a result in its argument's layout (a
    tied one always) is in that argument's buffer. Elsewhere XLA may still
    reuse the buffer; not counting on it keeps the count an upper bound."""
    held = result_table_bytes(program)
    held += sum(block_bytes(v.shape, v.dtype, nd, grid) for v, nd in zip(program.inputs, prop.in_sbp))
    for k, (atom, nd) in enumerate(zip(program.outputs, prop.out_sbp)):
        if isinstance(atom, Var) and not (k in pairs and nd == prop.in_sbp[pairs[k]]):
            held += block_bytes(atom.shape, atom.dtype, nd, grid)
    return held

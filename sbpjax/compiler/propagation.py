"""What signature choice produces and the facts about single ops it reads.

A :class:`Propagation` is a program with an nd-SBP for every value: per op a
:class:`Decision` (its signature and the :class:`Boxing` of each input that
needs one), and the boxings of the outputs. Beside them: each op's own
communication for a signature (:func:`op_comm`), the key its candidate
signatures depend on (:func:`op_key`), the values known to be zero
(:func:`zero_values`), the axes a program leaves idle (:func:`idle_axes`), the
ops that plan programs of their own (:data:`NESTED`), and the small tests
of a layout against a shape and dtype the choice applies.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from sbpjax.boxing.plan import BoxingPlan
from sbpjax.compiler.options import DEFAULT_OPTIONS
from sbpjax.compiler.program import Const, Node, Program, Var
from sbpjax.dtypes import constant_bits, dtype_name, is_key, partial_supported
from sbpjax.placement import Placement
from sbpjax.rules import RULES
from sbpjax.sbp import Broadcast, Partial, Split

CONSTRAIN = "sbp_constrain"
CONTROL_FLOW = ("scan", "while", "cond", "switch")


@dataclasses.dataclass
class Boxing:
    """One boxing the program needs: a value moved from ``src`` to ``dst``."""

    var: Var
    src: tuple
    dst: tuple
    plan: BoxingPlan
    where: str  # the consuming op and its source line
    node_index: int | None
    # a gathered argument gathered again for a later use (sbpjax.compiler.regather)
    regather: bool = False

    @property
    def bytes(self) -> int:
        return self.plan.bytes


@dataclasses.dataclass
class Decision:
    node: Node
    in_sbp: list  # nd-SBP each input is used with
    out_sbp: list
    boxings: list
    comm: list = dataclasses.field(default_factory=list)  # the op's own (sbpjax.rules.Comm)


@dataclasses.dataclass
class Propagation:
    program: Program
    placement: Placement
    in_sbp: list
    decisions: list
    out_boxings: list
    out_sbp: list
    warnings: list
    choice: Any = None  # how the layouts were chosen (sbpjax.compiler.choice.Choice)
    # estimated per-device peak bytes before and after regathers (sbpjax.compiler.regather)
    regathered: tuple | None = None
    # regathers regather="auto" left out: (count, peak before, peak after, their bytes,
    # the plan's bytes with them, the greedy pass's bytes)
    regather_declined: tuple | None = None
    # seconds spent per phase of sj.jit's front end (trace_s, choose_s, build_s;
    # lower_s and xla_compile_s once measured): see Explanation.timings
    timings: dict = dataclasses.field(default_factory=dict)
    # the settings the plan was made with (sbpjax.compiler.options): the
    # lowering, buckets, loops and regathers read theirs from here
    options: Any = DEFAULT_OPTIONS
    # {value key (decode.value_keys): the layout it was boxed to first}: the
    # layout choice's hub versions (sbpjax.compiler.decode)
    first_versions: dict = dataclasses.field(default_factory=dict)
    # its boxings planned and compared by the ring's latency (the second solve)
    ring: bool = False
    # (options, the rolled loops sbpjax.compiler.loops.plan_runs found): kept for the
    # lowering and explain(), forgotten where boxings are added (add_regathers)
    runs: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def boxings(self) -> list:
        return [b for d in self.decisions for b in d.boxings] + self.out_boxings

    @property
    def comm(self) -> list:
        """(op index, Comm) of the communication ops run themselves, each
        exchange once: an op sending what an earlier op sent (the same input
        value and layout, the same ``Comm.detail``) reuses it (the lowering's
        ``LocalCtx.memo``)."""
        seen, out = set(), []
        for i, d in enumerate(self.decisions):
            for c in d.comm:
                atom = d.node.ins[c.operand]
                key = (id(atom), d.in_sbp[c.operand], c.what, c.detail)
                if key not in seen:
                    seen.add(key)
                    out.append((i, c))
        return out

    @property
    def bytes(self) -> int:
        """Everything the program moves: its boxings and the ops' own
        communication (halo exchanges, prefix carries)."""
        return int(sum(b.bytes for b in self.boxings) + sum(c.bytes for _, c in self.comm))


@dataclasses.dataclass(frozen=True)
class Nested:
    """An op whose local evaluation runs programs of its own, each planned
    as a whole (:mod:`sbpjax.compiler.inner_loops`). Not a rule of
    :mod:`sbpjax.rules`: planning the inner programs needs the compiler.

    ``signature(node, layouts in, placement)``: its (ins, outs) nd-signature, the
    only one it takes (None: it runs whole, with a warning, as an op without
    a rule does); ``comm(node, ins, outs, placement)``: what the inner
    programs move (a list of ``Comm``); ``local(eqn, local ins, ctx)``: the
    local evaluation."""

    signature: Any
    comm: Any
    local: Any


NESTED: dict = {}  # primitive name -> Nested; filled by the modules that plan them


def op_comm(node: Node, ins, outs, placement: Placement, cache: dict | None = None):
    """The communication ``node`` runs itself with this nd-signature (a list
    of ``sbpjax.rules.Comm``), or ``None`` when its rule cannot run it."""
    nested = NESTED.get(node.name)
    rule = RULES.get(node.name)
    if nested is None and (rule is None or rule.comm is None):
        return []
    key = (id(node), tuple(ins), tuple(outs))
    if cache is not None and key in cache:
        return cache[key]
    if nested is not None:
        hit = nested.comm(node, ins, outs, placement)
    else:
        assert rule is not None and rule.comm is not None  # checked above
        in_avals = [v.aval for v in node.eqn.invars]
        hit = rule.comm(node.eqn, in_avals, list(ins), list(outs), tuple(placement.shape))
    if cache is not None:
        cache[key] = hit
    return hit


def nbytes(var) -> int:
    return int(math.prod(var.shape)) * var.dtype.itemsize


def dtype_ok(sbp, dtype) -> bool:
    """A partial only where the dtype table allows it (``sbpjax.dtypes``): a
    rule's algebra may hold for the values (a bool select of P(sum) cases) and
    still make a partial no collective can reduce."""
    return not isinstance(sbp, Partial) or partial_supported(dtype, sbp.op)


def valid_for(sbp, shape) -> bool:
    return not (isinstance(sbp, Split) and sbp.dim >= len(shape))


def even_on(nd, shape, grid) -> bool:
    counts = [1] * len(shape)
    for a, s in enumerate(nd):
        if isinstance(s, Split):
            counts[s.dim] *= grid[a]
    return all(n % c == 0 for n, c in zip(shape, counts))


def estimate(src, dst, nbytes, p) -> float:
    """OneFlow Table 2 on one axis, for ranking 1-D candidates."""
    if src == dst or p == 1:
        return 0.0
    if isinstance(dst, Partial) or isinstance(src, Broadcast):
        return 0.0 if not isinstance(src, Partial) else (p - 1) * nbytes
    if isinstance(src, Split):
        return (p - 1) / p * nbytes if isinstance(dst, Split) else (p - 1) * nbytes
    return (p - 1) * nbytes if isinstance(dst, Split) else 2 * (p - 1) * nbytes


def axis_ties(sig, cur, a) -> tuple:
    """How a 1-D candidate on axis ``a`` ranks after its estimate and the
    inputs it changes: fewer partial outputs, then fewer splits invented where
    no input is split. ``_best_signature`` and ``_free_signature`` share it, so
    the shortcut sees the ranking the full path would."""
    partial_outs = sum(isinstance(q, Partial) for q in sig.outs)
    fresh = sum(isinstance(q, Split) for q in sig.outs) * (not any(isinstance(c[a], Split) for c in cur))
    return partial_outs, fresh


def fresh_splits(outs, cur) -> int:
    """Output splits on axes where no input is split (made from nothing)."""
    return sum(
        isinstance(nd[a], Split) and not any(isinstance(c[a], Split) for c in cur)
        for nd in outs
        for a in range(len(nd))
    )


def op_key(node: Node) -> tuple:
    """What an op's candidate signatures depend on: its primitive, parameters,
    operand and result shapes and dtypes, and its constant operands' values
    (a rule may read a literal). Alike ops of different layers share it."""
    key = node.op_key
    if key is None:
        consts = tuple(
            None
            if isinstance(a, Var)
            else (constant_bits(a.value).tobytes() if np.size(a.value) <= 64 else id(a.value))
            for a in node.ins
        )
        key = (
            node.name,
            node.params_text,
            tuple((tuple(a.shape), dtype_name(a.dtype)) for a in node.ins),
            tuple((tuple(o.shape), dtype_name(o.dtype)) for o in node.outs),
            consts,
        )
        node.op_key = key
    return key


# ops whose result is all zeros when their (first) operand is: a zero tensor
# reshaped, cast, sliced or constrained is still one (not neg: -0.0 is not
# the +0.0 a block made afresh holds, and 1/x tells them apart)
ZERO_KEEPING = frozenset(
    {
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "transpose",
        "convert_element_type",
        "copy",
        "copy_p",
        "name",
        "slice",
        "rev",
        "reduce_sum",
        CONSTRAIN,
    }
)


def zero_values(program: Program) -> set:
    """ids of the values known to be all zeros: broadcasts of a zero constant
    (``jnp.zeros``; the zeros a gradient's ``scatter-add`` starts from) and
    what ``ZERO_KEEPING`` ops make of them. Such a value holds zeros in every
    block of every layout, so boxing it is making the target block afresh
    (``plan_zeros``), which moves no byte. Counting it as a collective would
    plan bytes the compiled program never moves: XLA folds a reduction of
    zeros away."""
    out: set = set()

    def zero(atom) -> bool:
        if isinstance(atom, Const):
            return not is_key(atom.value) and not np.any(np.asarray(atom.value))
        return id(atom) in out

    for node in program.nodes:
        if node.name in ZERO_KEEPING and len(node.outs) == 1 and node.ins and zero(node.ins[0]):
            out.add(id(node.outs[0]))
    return out


# LAUNCH PRICED. In a program with an idle axis (``idle_axes``), a boxing whose plan of
# the fewest bytes runs a collective over that axis is planned instead by the
# layout choice's price (``plan_boxing``'s ``launch_priced``: bytes plus one
# launch latency per collective, as ``CompileOptions.latency`` prices
# them). By bytes alone a small gradient, partial over the data axis x of
# 4x2 and whole over the idle y, was reduced by a slice over y, a
# reduce-scatter over x and an all-gather over all 8 devices; the integer
# program, which prices those collectives, then preferred to make the
# gradient partial over y as well and all-reduce it over 8 devices in one
# collective, at more bytes than the all-reduce over x it could not choose:
# a data-parallel 2-layer GPT at d 32 on 4x2 moved 1,414,192 B in 8
# collectives against GSPMD's 1,382,448 B in one. Planned by price, it
# moves GSPMD's bytes.
# Decision: not for every boxing of every program. Priced that way
# throughout, the cheaper launches of other plans (Megatron's reductions
# over the tensor axis, which borrow the data axis the same way) changed no
# GPT row's bytes on benchmarks/compiler.py but weakened the integer
# program's bound: the 4-, 8- and 16-layer rows ended their solves 3-7% from
# it instead of proving it within 0.1-0.6%, and the 4-layer solve took
# 10.9 s instead of 3.5 s.
# Extended to an axis the value is whole on in both layouts (B before and after):
# the boxing has nothing to do there either, and borrowing it buys bytes with
# launches the same way. Muon's Gram matrices on 2x4 (a 32x64 kernel split
# by columns over y, the batch over x) are partial over y and whole over x;
# their reduction to B was planned as a slice over x, a reduce-scatter over y
# and an all-gather over all 8 devices (40,960 B), so the integer program
# zero-filled them into partials over x as well and all-reduced each over
# the 8 devices in one collective (57,344 B), where GSPMD all-reduces over
# the 4 of y (49,152 B): a Megatron MLP step with Muon moved 390,272 B against
# GSPMD's 339,072, in 13 collectives each; planned by price, GSPMD's bytes.
# The decision above measured again with the extension: every row of
# benchmarks/compiler.py still proves its plan (gap 0.00%), two rows move
# fewer bytes (4x2 and 4x4) and none more, and the layout choice's time on
# the 8-layer and 32-layer scanned rows stayed within the machine's noise
# (3.51 against 3.44 s, 3.40 against 3.33 s, on one quiet run each).
# ``CompileOptions.launch_priced`` False: by bytes alone (ties by time), as
# ``plan_boxing`` plans by default.


def idle_axes(in_sbp, grid) -> frozenset:
    """The placement axes (of size > 1) over which no argument is split or
    partial in any layout it may take (an AUTO argument may take any): data
    parallelism annotated on 4x2 leaves y idle. See LAUNCH PRICED above and
    ``sbpjax.compiler.domains.Domains``."""
    if not all(isinstance(nd, tuple) for nd in in_sbp):  # an AUTO argument
        return frozenset()
    return frozenset(
        a for a, p in enumerate(grid) if p > 1 and all(isinstance(nd[a], Broadcast) for nd in in_sbp)
    )

"""Loops planned as programs of their own: while loops whose trip count is
known only at run time, and scans too long to write out.

The layout choice sees a ``scan`` (and a ``fori_loop`` with static bounds)
written out iteration by iteration (``trace.UNROLL_LIMIT``). Two kinds of
loop cannot be written out: a ``lax.while_loop`` that stops on a value it
computes (an iterative solver run to a tolerance, a search until it is
found), whose iterations nobody knows before it runs, and a scan whose
iterations times its body's size pass the limit (an RNN over 1,000 time
steps). Each runs as a loop of its own, inside the ``shard_map`` body, its
body (and a while loop's condition) planned as a program of its own:

- its carries keep the layouts they arrive in, and the body's results are
  boxed back to them at the end of each iteration where the body's own
  choice leaves them in other layouts, so the loop's state has one layout
  (a fixed point by construction). A partial carry is reduced first (no
  nonlinear body keeps a partial); an unevenly split one is gathered (its
  padding would be carried through the body's ops). The loop's constants
  (operands every iteration reads) are taken the same way, and a scan's
  stacked operands too, with the stacked dim whole (each iteration reads
  its slice of the local block);
- the body is traced and its layouts chosen by the same whole-program choice
  as the outer program (:func:`sbpjax.compiler.choose.choose`), with the
  carries' layouts as both its arguments and its results and a scan's
  per-iteration outputs in the layouts it chooses (their stack takes them,
  the stacked dim whole); a while loop's condition likewise, with a
  replicated predicate (every device must take the same branch: a predicate
  computed from split values is reduced inside it);
- the lowering runs ``lax.while_loop`` / ``lax.scan`` on the local blocks,
  its body and condition the inner programs as one device runs them
  (:func:`sbpjax.compiler.lower.local_program`), their collectives inside.

Bytes: the body moves its plan's bytes in every iteration. A scan's plan
counts ``length`` iterations, as :mod:`sbpjax.comm` counts a loop whose trip
count XLA knows. A while loop's counts one iteration (the trip count is
unknown), which is how :mod:`sbpjax.comm` counts such a loop's collectives.
``explain()`` lists them on the loop's line (``scan_body`` for all the
iterations, ``while_iteration`` for one). Where XLA finds a while loop's
trip count itself (a bare counter compared with a constant:
``lax.while_loop(lambda c: c[1] < 3, ...)``), ``sj.collectives`` counts
every iteration and the two differ.

Decision: carries keep the layouts they arrive in, rather than layouts the
whole-program choice picks for the loop. Which layout is cheapest depends on
how often the body runs (unknown for a while loop; for a scan, pricing the
body's choice against the code around it would make the loop part of the
whole-program problem, which is what writing it out does); the layout the
carry has where it is made is the one the code before the loop chose, and a
caller who wants another writes ``sj.constrain`` on the initial value. One
exception: a replicated carry may take the split of a constant or carry of
its shape (B to S is free) where the loop then moves fewer bytes per
iteration: a carry made from a constant (``jnp.ones_like(x)``) arrives
replicated, and kept so the body would gather the split ``x`` every
iteration (``_split_carries``); and so may a replicated carry take the
split the body makes it in, its results left free (a power iteration's
vector, ``w.T @ u`` of a matrix split over both axes, comes out split; kept
whole, every iteration gathered it back: 3,152 B per iteration against
GSPMD's 2,048, 2,000 now; ``_carries_as_made``). The
inner programs are planned with the default ``CostModel`` and the integer
program (their own time limit: ``INNER_TIME_LIMIT``). A side effect in a
body is an op of the inner program like any other: a ``jax.debug.print``
prints once per iteration, from the placement's first device
(``sbpjax.rules.control``); one without a rule (a ``jax.pure_callback``)
runs whole on every device, with an ``SBPWarning`` naming its line, and the
loop around it keeps its layouts.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import jax
import jax.extend.core as jcore
from jax import lax

from sbpjax.compiler import lower
from sbpjax.compiler.choose import choose
from sbpjax.compiler.loop_eqns import scan_operands
from sbpjax.compiler.loop_exits import shift_down, shift_up
from sbpjax.compiler.pricing import count_collectives
from sbpjax.compiler.program import Node
from sbpjax.compiler.propagation import NESTED, Nested, Propagation, even_on
from sbpjax.compiler.trace import trace
from sbpjax.rules import Comm
from sbpjax.sbp import Broadcast, Partial, Split

WHILE, SCAN = "while", "scan"

_CACHE_SIZE = 64  # planned loops kept (a compiled function keeps its own lowering)


@dataclasses.dataclass
class LoopPlan:
    """A loop's inner programs with their layouts."""

    body: Propagation  # constants + carries (+ a scan's slices) -> carries (+ its outputs)
    cond: Propagation | None = None  # a while loop's: constants + carries -> predicate (B)
    length: int = 1  # iterations counted: a scan's length, 1 for a while loop

    @property
    def bytes(self) -> int:
        """Bytes the iterations counted move (summed over devices, as boxings count)."""
        per = self.body.bytes + (self.cond.bytes if self.cond is not None else 0)
        return int(per) * self.length

    @property
    def launches(self) -> int:
        """Collectives the iterations counted run, as the compiled program
        runs them (``pricing.count_collectives``)."""
        per = count_collectives(self.body) + (count_collectives(self.cond) if self.cond is not None else 0)
        return per * self.length


def _nestable(eqn) -> bool:
    """A loop with iterations: an empty scan computes nothing to plan (it
    runs as it is, whole on every device)."""
    return eqn.primitive.name != SCAN or eqn.params["length"] > 0


def _kept(nd, shape, grid) -> tuple:
    """The layout a carry or constant keeps: partial axes reduced; gathered
    whole where its splits are uneven."""
    out = tuple(Broadcast() if isinstance(s, Partial) else s for s in nd)
    return out if even_on(out, shape, grid) else (Broadcast(),) * len(grid)


def _stack_kept(nd, shape, grid) -> tuple:
    """A scan's stacked operand: as ``_kept``, with the stacked dim whole."""
    whole = tuple(Broadcast() if isinstance(s, Split) and s.dim == 0 else s for s in nd)
    return _kept(whole, shape, grid)


def _scan_counts(eqn) -> tuple[int, int]:
    """(constants, carries) among a scan's operands (then its stacked ones)."""
    consts, carry, _ = scan_operands(eqn.params, list(eqn.invars))
    return len(consts), len(carry)


def _split_counts(eqn) -> tuple[int, int]:
    """(constants before the carries, carries) of either kind of loop; a
    while loop's constants are its condition's and then its body's."""
    if eqn.primitive.name == SCAN:
        return _scan_counts(eqn)
    p = eqn.params
    n = p["cond_nconsts"] + p["body_nconsts"]
    return n, len(eqn.invars) - n


def _split_carries(ins, node, n_consts: int, n_carry: int, grid):
    """Other layouts for the replicated carries, to price against keeping them:
    each split layout a constant or carry of the same shape has, given to every
    replicated carry of that shape (B -> S is a local slice, free). A carry
    made before the loop from a constant (``jnp.ones_like(x)``) arrives
    replicated where nothing before the loop chose otherwise; kept so, the body
    gathers a split ``x`` it meets in every iteration (GSPMD keeps it split)."""
    rep = (Broadcast(),) * len(grid)
    fixed = range(n_consts + n_carry)
    carries = [k for k in range(n_consts, n_consts + n_carry) if ins[k] == rep]
    seen = set()
    for j in fixed:
        nd, shape = ins[j], tuple(node.ins[j].shape)
        if nd == rep or (nd, shape) in seen:
            continue
        seen.add((nd, shape))
        alt = list(ins)
        for k in carries:
            if tuple(node.ins[k].shape) == shape and even_on(nd, shape, grid):
                alt[k] = nd
        if alt != list(ins):
            yield alt


def _carries_as_made(eqn, ins, node, n_consts: int, n_carry: int, placement) -> list:
    """The replicated carries in the splits the body makes them in, its
    results left free (B -> S is free at the loop's entry), as one more
    layout to price against keeping them. A power iteration's vector
    (``v = w.T @ u`` of a matrix split over both axes) comes out of the body
    split; kept whole, every iteration gathers it back (GSPMD carries it
    split)."""
    grid = placement.shape
    rep = (Broadcast(),) * len(grid)
    carries = [k for k in range(n_consts, n_consts + n_carry) if ins[k] == rep]
    if not carries:
        return []
    made = plan_loop(eqn, ins, placement, free=True).body.out_sbp
    alt = list(ins)
    for k in carries:
        nd, shape = made[k - n_consts], tuple(node.ins[k].shape)
        if not any(isinstance(q, Partial) for q in nd) and even_on(nd, shape, grid):
            alt[k] = nd
    return [alt] if alt != list(ins) else []


def signature(node: Node, cur, placement):
    """(ins, outs): every operand in the layout it arrives in (see ``_kept``;
    a scan's stacked ones ``_stack_kept``; a replicated carry may take a
    split where the loop then moves fewer bytes per iteration:
    ``_split_carries``), the carries' results in their
    layouts and a scan's stacked results in their slices' as the body
    chose them; None for an empty scan (it runs whole on every device, with
    a warning)."""
    eqn, grid = node.eqn, placement.shape
    if not _nestable(eqn):
        return None
    rep = (Broadcast(),) * len(grid)
    n_consts, n_carry = _split_counts(eqn)
    ins = []
    for k, (nd, a) in enumerate(zip(cur, node.ins)):
        nd = rep if nd is None else nd
        ins.append(_stack_kept(nd, a.shape, grid) if k >= n_consts + n_carry else _kept(nd, a.shape, grid))
    alts = list(_split_carries(ins, node, n_consts, n_carry, grid))
    alts += _carries_as_made(eqn, ins, node, n_consts, n_carry, placement)
    for alt in alts:
        if plan_loop(eqn, alt, placement).bytes < plan_loop(eqn, ins, placement).bytes:
            ins = alt
    carries = ins[n_consts : n_consts + n_carry]
    if eqn.primitive.name == WHILE:
        return ins, carries
    body = plan_loop(eqn, ins, placement).body
    return ins, carries + [shift_up(nd) for nd in body.out_sbp[n_carry:]]


_plans: OrderedDict = OrderedDict()


def plan_loop(eqn, ins, placement, free: bool = False) -> LoopPlan:
    """The inner programs of the loop ``eqn`` with operands in layouts ``ins``
    (cached per loop, layouts and placement). ``free``: the body's carried
    results in the layouts it chooses, not the carries' (``_carries_as_made``)."""
    key = (id(eqn), tuple(ins), id(placement), free)
    hit = _plans.get(key)
    if hit is not None and hit[0] is eqn and hit[1] is placement:
        _plans.move_to_end(key)
        return hit[2]
    p = eqn.params
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    rep = (Broadcast(),) * placement.ndim

    def planned(jaxpr, args, in_sbp, out_sbp):
        closed = jaxpr if hasattr(jaxpr, "consts") else jcore.ClosedJaxpr(jaxpr, ())
        fn = jcore.jaxpr_as_fun(closed)
        program = trace(fn, args, jax.tree_util.tree_structure((tuple(args), {})), devices=placement.size)
        return choose(program, placement, in_sbp, out_sbp)

    if eqn.primitive.name == WHILE:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        carries = list(ins[nc + nb :])
        cond = planned(p["cond_jaxpr"], avals[:nc] + avals[nc + nb :], list(ins[:nc]) + carries, [rep])
        body = planned(
            p["body_jaxpr"], avals[nc:], list(ins[nc:]), [None] * len(carries) if free else carries
        )
        plan = LoopPlan(body, cond)
    else:
        n_consts, n_carry = _scan_counts(eqn)
        n_fixed = n_consts + n_carry
        slices = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in avals[n_fixed:]]
        n_ys = len(eqn.outvars) - n_carry
        body = planned(
            p["jaxpr"],
            avals[:n_fixed] + slices,
            list(ins[:n_fixed]) + [shift_down(nd) for nd in ins[n_fixed:]],
            ([None] * n_carry if free else list(ins[n_consts:n_fixed])) + [None] * n_ys,
        )
        plan = LoopPlan(body, length=int(p["length"]))
    _plans[key] = (eqn, placement, plan)
    while len(_plans) > _CACHE_SIZE:
        _plans.popitem(last=False)
    return plan


def comm(node: Node, ins, outs, placement) -> list:
    """What the loop moves, as one ``Comm`` on its line."""
    if not _nestable(node.eqn) or any(nd is None for nd in ins):
        return []
    plan = plan_loop(node.eqn, ins, placement)
    if not plan.bytes:
        return []
    what = "while_iteration" if node.name == WHILE else "scan_body"
    return [
        Comm(what, tuple(range(placement.ndim)), plan.bytes, detail=(id(node.eqn),), launches=plan.launches)
    ]


def local(eqn, ins, ctx):
    """``lax.while_loop`` / ``lax.scan`` on the local blocks, its condition
    and body the inner programs as one device runs them."""
    if not _nestable(eqn):
        return lower._default_local(eqn, ins, ctx)
    plan = plan_loop(eqn, list(ctx.in_nd), ctx.placement)
    p = eqn.params
    body_fn = lower.local_program(plan.body, physical=False)
    if eqn.primitive.name == WHILE:
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_fn = lower.local_program(plan.cond, physical=False)
        cconsts, bconsts, init = ins[:nc], ins[nc : nc + nb], tuple(ins[nc + nb :])
        return list(
            lax.while_loop(
                lambda carry: cond_fn(*cconsts, *carry)[0],
                lambda carry: tuple(body_fn(*bconsts, *carry)),
                init,
            )
        )
    n_consts, n_carry = _scan_counts(eqn)
    consts, init, xs = (
        ins[:n_consts],
        tuple(ins[n_consts : n_consts + n_carry]),
        tuple(ins[n_consts + n_carry :]),
    )

    def step(carry, x):
        outs = body_fn(*consts, *carry, *x)
        return tuple(outs[:n_carry]), tuple(outs[n_carry:])

    carry, ys = lax.scan(step, init, xs, length=int(p["length"]), reverse=bool(p["reverse"]))
    return list(carry) + list(ys)


NESTED[WHILE] = NESTED[SCAN] = Nested(signature, comm, local)

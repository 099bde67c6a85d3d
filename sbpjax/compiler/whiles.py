"""While loops whose trip count is known only at run time.

A ``lax.while_loop`` that stops on a value it computes (an iterative solver
run to a tolerance, a search until it is found) cannot be written out as a
scan is (``trace.UNROLL_LIMIT``): nobody knows its iterations before it runs.
It runs as a loop of its own, inside the ``shard_map`` body, with its body and
its condition planned as programs of their own:

- its carries keep the layouts they arrive in, and the body's results are
  boxed back to them at the end of each iteration where the body's own
  choice leaves them in other layouts, so the loop's state has one layout
  (a fixed point by construction). A partial carry is reduced first (no
  nonlinear body keeps a partial); an unevenly split one is gathered (its
  padding would be carried through the body's ops). The loop's constants
  (operands every iteration reads) are taken the same way;
- the body is traced and its layouts chosen by the same whole-program choice
  as the outer program (:func:`sbpjax.compiler.solve.choose`), with the
  carries' layouts as both its arguments and its results; the condition
  likewise, with a replicated predicate (every device must take the same
  branch: a predicate computed from split values is reduced inside it);
- the lowering runs ``lax.while_loop`` on the local blocks, its body and
  condition the inner programs as one device runs them
  (:func:`sbpjax.compiler.lower.local_program`), their collectives inside.

Bytes: the body and the condition move their plans' bytes in every
iteration. The plan counts one iteration (the trip count is unknown), which
is how :mod:`sbpjax.comm` counts the compiled loop's collectives, and
``explain()`` lists them on the loop's line as ``while_iteration``. Where
XLA finds the trip count itself (a bare counter compared with a constant:
``lax.while_loop(lambda c: c[1] < 3, ...)``), ``sj.collectives`` counts
every iteration and the two differ; ``fori_loop`` with static bounds is a
scan, written out and counted whole.

Decision: carries keep the layouts they arrive in, rather than layouts the
whole-program choice picks for the loop. Which layout is cheapest depends on
how often the body runs, which is what is unknown; the layout the carry has
where it is made is the one the code before the loop chose, and a caller
who wants another writes ``sj.constrain`` on the initial value. The inner
programs are planned with the default ``CostModel`` and the integer program
(their own time limit: ``INNER_TIME_LIMIT``).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict

import jax
import jax.extend.core as jcore
from jax import lax

from sbpjax.compiler import lower
from sbpjax.compiler.propagate import NESTED, Nested, _even
from sbpjax.compiler.trace import Node, trace
from sbpjax.rules import Comm
from sbpjax.sbp import Broadcast, Partial

WHILE = "while"

INNER_TIME_LIMIT = 10.0
"""Seconds the integer program may take on a loop's body (and on its condition)."""

_CACHE_SIZE = 64  # planned loops kept (a compiled function keeps its own lowering)


@dataclasses.dataclass
class WhilePlan:
    """A while loop's inner programs with their layouts."""

    cond: object  # Propagation: condition constants + carries -> predicate (B)
    body: object  # Propagation: body constants + carries -> carries (same layouts)

    @property
    def bytes(self) -> int:
        """Bytes one iteration moves (summed over devices, as boxings count)."""
        return _moved(self.cond) + _moved(self.body)


def _moved(prop) -> int:
    return int(prop.bytes)


def _nestable(eqn) -> bool:
    """A loop without side effects: one with them (a ``jax.debug.print`` in
    its body) runs whole on every device, with a warning."""
    return not getattr(eqn, "effects", None)


def _kept(nd, shape, grid) -> tuple:
    """The layout a carry or constant keeps: partial axes reduced; gathered
    whole where its splits are uneven."""
    out = tuple(Broadcast() if isinstance(s, Partial) else s for s in nd)
    return out if _even(out, shape, grid) else (Broadcast(),) * len(grid)


def signature(node: Node, cur, grid):
    """(ins, outs): every operand in the layout it arrives in (see ``_kept``),
    the results in their carries'; None for a loop with side effects (it
    runs whole on every device, with a warning)."""
    p = node.eqn.params
    rep = (Broadcast(),) * len(grid)
    if not _nestable(node.eqn):
        return None
    ins = [rep if nd is None else _kept(nd, a.shape, grid) for nd, a in zip(cur, node.ins)]
    return ins, ins[p["cond_nconsts"] + p["body_nconsts"] :]


_plans: OrderedDict = OrderedDict()


def plan_while(eqn, ins, placement) -> WhilePlan:
    """The inner programs of the loop ``eqn`` with operands in layouts ``ins``
    (cached per loop, layouts and placement)."""
    key = (id(eqn), tuple(ins), id(placement))
    hit = _plans.get(key)
    if hit is not None and hit[0] is eqn and hit[1] is placement:
        _plans.move_to_end(key)
        return hit[2]
    from sbpjax.compiler.solve import choose

    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    carries = list(ins[nc + nb :])
    rep = (Broadcast(),) * placement.ndim

    def planned(jaxpr, args, in_sbp, out_sbp):
        closed = jaxpr if hasattr(jaxpr, "consts") else jcore.ClosedJaxpr(jaxpr, ())
        fn = jcore.jaxpr_as_fun(closed)
        program = trace(fn, args, jax.tree_util.tree_structure((tuple(args), {})))
        return choose(program, placement, in_sbp, out_sbp, time_limit=INNER_TIME_LIMIT)

    cond = planned(p["cond_jaxpr"], avals[:nc] + avals[nc + nb :], list(ins[:nc]) + carries, [rep])
    body = planned(p["body_jaxpr"], avals[nc:], list(ins[nc:]), carries)
    plan = WhilePlan(cond, body)
    _plans[key] = (eqn, placement, plan)
    while len(_plans) > _CACHE_SIZE:
        _plans.popitem(last=False)
    return plan


def comm(node: Node, ins, outs, placement) -> list:
    """What one iteration of the loop moves, as one ``Comm`` on its line."""
    if not _nestable(node.eqn) or any(nd is None for nd in ins):
        return []
    moved = plan_while(node.eqn, ins, placement).bytes
    if not moved:
        return []
    return [Comm("while_iteration", tuple(range(placement.ndim)), moved, detail=(id(node.eqn),))]


def local(eqn, ins, ctx):
    """``lax.while_loop`` on the local blocks, its condition and body the
    inner programs as one device runs them."""
    if not _nestable(eqn):
        return lower._default_local(eqn, ins, ctx)
    plan = plan_while(eqn, list(ctx.in_nd), ctx.placement)
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    cond_fn, body_fn = lower.local_program(plan.cond), lower.local_program(plan.body)
    cconsts, bconsts, init = ins[:nc], ins[nc : nc + nb], tuple(ins[nc + nb :])

    def cond(carry):
        return cond_fn(*cconsts, *carry)[0]

    def body(carry):
        return tuple(body_fn(*bconsts, *carry))

    return list(lax.while_loop(cond, body, init))


NESTED[WHILE] = Nested(signature, comm, local)

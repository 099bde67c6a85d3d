"""Loop equations as JAX writes them: a scan's operand groups (which moved
between JAX versions), a ``while`` on a batched predicate (``jax.vmap`` of a
``while_loop``) as a loop on one, and the carries of a loop kept whole
(:mod:`sbpjax.compiler.inner_loops`) that nothing reads after it.

A ``while_loop`` (or a scan run as a loop of its own) whose results are
partly used computes its other carries for nothing, and XLA drops them from
the loop. Planned as they were written, the inner program chose layouts for
them and ``explain()`` counted their exchanges: a ``fori_loop`` printing its
step (``jax.debug.print``, an effect, so the loop is kept) beside a dead
split matmul chain counted 114,688 B where XLA compiled 0.

A carry is live if the code after the loop reads it, the loop's condition
reads it, or the body needs it for a live carry or an effect (a fixed point).
A dead carry's body result becomes its own input, passed through unchanged:
the equation keeps its arity (the loop's outputs and inputs stay where the
program reads them), and the trace of the body then drops the computation
that made it, as dead code. The dead output's value is its initial value;
nothing reads it.

JAX's own dead-code rule for ``while`` does this, but JAX 0.10.2 has none,
and its interface differs between versions: this module reads only the
equations' variables.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def scan_operands(params, ins) -> tuple[list, list, list]:
    """A scan's operands ``ins`` (or its body's inputs) as (constants,
    carries, stacked ones)."""
    if "ft_in" in params:  # jax >= 0.12 groups the operands as flat trees
        consts, carry, xs = (list(g) for g in params["ft_in"].update(ins).unpack())
        return consts, carry, xs
    n_consts, n_carry = params["num_consts"], params["num_carry"]
    return ins[:n_consts], ins[n_consts : n_consts + n_carry], ins[n_consts + n_carry :]


def _live_inputs(jaxpr, used_outs) -> list[bool]:
    """Which of ``jaxpr``'s inputs its used outputs and its effects read
    (a nested equation counts as reading all its inputs)."""
    live = {id(v) for v, used in zip(jaxpr.outvars, used_outs) if used}
    for eqn in reversed(jaxpr.eqns):
        if getattr(eqn, "effects", None) or any(id(o) in live for o in eqn.outvars):
            live |= {id(v) for v in eqn.invars}
    return [id(v) in live for v in jaxpr.invars]


def _fixed_point(body, n_before: int, used: list, cond_reads: list) -> list[bool]:
    """The live carries: ``used`` after the loop or read by the condition,
    and what the body needs to make those (``n_before``: the body's inputs
    before its carries)."""
    live = [u or c for u, c in zip(used, cond_reads)]
    while True:
        reads = _live_inputs(body.jaxpr, live + [True] * (len(body.jaxpr.outvars) - len(live)))
        grown = [lv or r for lv, r in zip(live, reads[n_before : n_before + len(live)])]
        if grown == live:
            return live
        live = grown


def _passed_through(body, n_before: int, live: list):
    """``body`` with each dead carry's result its input, or None where they
    are so already (a second dead-code pass over the same loop)."""
    outvars = list(body.jaxpr.outvars)
    for k, alive in enumerate(live):
        if not alive:
            outvars[k] = body.jaxpr.invars[n_before + k]
    if all(a is b for a, b in zip(outvars, body.jaxpr.outvars)):
        return None
    return body.replace(jaxpr=body.jaxpr.replace(outvars=outvars))


def without_dead_carries(eqn, used_outs: list[bool]):
    """``eqn`` (a ``while`` or ``scan``) with the carries nothing needs passed
    through unchanged, or ``eqn`` itself where every carry is live."""
    name, p = eqn.primitive.name, eqn.params
    if name == "while":
        n_before = p["body_nconsts"]
        cond = p["cond_jaxpr"].jaxpr
        cond_reads = _live_inputs(cond, [True])[p["cond_nconsts"] :]
        live = _fixed_point(p["body_jaxpr"], n_before, list(used_outs), cond_reads)
        body = None if all(live) else _passed_through(p["body_jaxpr"], n_before, live)
        return eqn if body is None else eqn.replace(params={**p, "body_jaxpr": body})
    if name == "scan":
        consts, carry, _ = scan_operands(p, list(eqn.invars))
        n_carry, n_before = len(carry), len(consts)
        live = _fixed_point(p["jaxpr"], n_before, list(used_outs[:n_carry]), [False] * n_carry)
        body = None if all(live) else _passed_through(p["jaxpr"], n_before, live)
        return eqn if body is None else eqn.replace(params={**p, "jaxpr": body})
    return eqn


def batched_while(eqn):
    """The jaxpr (closed) of a ``while`` whose condition returns a batched
    predicate, as a loop on one scalar, or None for any other equation.

    ``jax.vmap`` of a ``while_loop`` whose trip count differs per example
    writes such a ``while``: it runs while any lane's predicate holds, and
    each iteration keeps the body's results only in the lanes whose predicate
    held at its start (JAX's own lowering of it). ``lax.while_loop`` takes a
    scalar predicate only, so the lowering of the local program could not run
    it; spelled with ``jnp.any`` and a select, the layout choice plans it as
    any loop (a split predicate is reduced to one flag in the loop)."""
    if eqn.primitive.name != "while" or not eqn.params["cond_jaxpr"].out_avals[0].shape:
        return None
    p = eqn.params
    cond, body = p["cond_jaxpr"], p["body_jaxpr"]
    nc, nb = p["cond_nconsts"], p["body_nconsts"]

    def unbatched(*args):
        cond_consts, body_consts, carry = args[:nc], args[nc : nc + nb], args[nc + nb :]

        def alive(c):
            return jax.core.eval_jaxpr(cond.jaxpr, cond.consts, *cond_consts, *c)[0]

        def step(c):
            lanes = alive(c)
            new = jax.core.eval_jaxpr(body.jaxpr, body.consts, *body_consts, *c)
            dims = tuple(range(lanes.ndim))
            return tuple(
                lax.select(lax.broadcast_in_dim(lanes, jnp.shape(n), dims), n, o) for n, o in zip(new, c)
            )

        return lax.while_loop(lambda c: jnp.any(alive(c)), step, tuple(carry))

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    return jax.make_jaxpr(unbatched)(*avals)


__all__ = ["batched_while", "scan_operands", "without_dead_carries"]

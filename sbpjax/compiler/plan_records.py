"""A plan cache entry from a plan, and a plan from an entry, checked against the program.

An entry (``plan_cache.Entry``) is data read from disk or sent by process 0:
each op's signature, the arguments' and results' layouts, the layouts
values are boxed to first, and the ``Choice`` that made it. ``restore``
holds it to the call (the layouts asked for, each signature one its op's
rule allows) and derives the boxings again, as for a solved plan, so a
tampered or foreign entry is rejected, never trusted.
"""

from __future__ import annotations

import dataclasses

from sbpjax.boxing.cost import CostModel
from sbpjax.compiler import plan_cache
from sbpjax.compiler.auto import AUTO, auto_layouts
from sbpjax.compiler.choice import choice_of_record
from sbpjax.compiler.decode import propagation_of, value_keys
from sbpjax.compiler.options import DEFAULT_OPTIONS
from sbpjax.compiler.pricing import boxing_cost
from sbpjax.compiler.propagation import Propagation, idle_axes, op_key
from sbpjax.compiler.propagator import Propagator
from sbpjax.compiler.signatures import allowed


def restore(program, placement, in_sbp, out_sbp, ties, entry, cost_model=None, options=DEFAULT_OPTIONS):
    """The plan of a plan cache entry (``plan_cache.Entry``), or None where
    it is not a plan of this call: its layouts must be the ones asked for
    (an ``AUTO`` argument's one it may take) and each op's signature one its
    rule allows (``signatures.allowed``). The boxings are derived again, as for
    a solved plan (:mod:`sbpjax.compiler.decode`)."""
    grid = placement.shape
    pr = Propagator(program, placement, cost_model, launch_priced=options.launch_priced)
    if len(entry.in_sbp) != len(in_sbp) or len(entry.out_sbp) != len(program.outputs):
        return None
    pr.idle = idle_axes(entry.in_sbp if entry.choice.get("as_given") is True else in_sbp, grid)
    pr.ring = entry.ring
    pr.quiet = True
    for v, want, got in zip(program.inputs, in_sbp, entry.in_sbp):
        if got not in (auto_layouts(v.shape, grid) if want is AUTO else [want]):
            return None
    final = list(out_sbp) if out_sbp is not None else [None] * len(program.outputs)
    for k, i in (ties or {}).items():
        final[k] = entry.in_sbp[i]
    for k, want in enumerate(final):
        if want is not None and entry.out_sbp[k] != want:
            return None
    # alike ops (a written-out scan's layers) with alike signatures are checked once
    checked: dict = {}
    for node, (ins, outs) in zip(program.nodes, entry.signatures):
        key = (op_key(node), tuple(ins), tuple(outs))
        ok = checked.get(key)
        if ok is None:
            ok = checked[key] = allowed(pr, node, ins, outs)
        if not ok:
            return None
    keys = set(value_keys(program).values())
    for key, nd in entry.first.items():
        if key not in keys or len(nd) != len(grid):
            return None
    cm = cost_model if cost_model is not None else CostModel()

    def cost(plan):
        return boxing_cost(plan, cm, options, ring=entry.ring)

    prop = propagation_of(
        program, placement, pr, list(entry.in_sbp), final, entry.signatures, entry.first, cost
    )
    prop.ring = entry.ring
    if any(want is None and got != have for want, got, have in zip(final, entry.out_sbp, prop.out_sbp)):
        return None
    prop.choice = choice_of_record(entry.choice)
    if prop.choice is None:
        return None
    prop.choice.source = "plan cache"
    prop.options = options
    return prop


def entry_of(prop: Propagation):
    """The plan cache entry of a plan (``plan_cache.Entry``)."""
    choice = {} if prop.choice is None else dataclasses.asdict(prop.choice)
    choice["source"] = "solved"
    return plan_cache.Entry(
        list(prop.in_sbp),
        [(list(d.in_sbp), list(d.out_sbp)) for d in prop.decisions],
        list(prop.out_sbp),
        choice,
        dict(prop.first_versions),
        prop.ring,
    )

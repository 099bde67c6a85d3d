"""Where the local program runs each boxing, decided before it is traced.

The lowering (:mod:`sbpjax.compiler.lower`) walks the decisions in program
order. Some of them it runs as control flow: written-out scans whose
iterations are alike as one ``lax.scan`` (:mod:`sbpjax.compiler.loops`), and
written-out conds as ``lax.switch`` (:mod:`sbpjax.compiler.switches`). Boxings
that run the same collectives run together in buckets
(:mod:`sbpjax.compiler.buckets`), but a bucket may not cross such an edge: each
boxing gets a *zone* (the loop body, the code before a loop, a switch's branch,
the consumer a regather waits for), and only boxings whose zones agree join.
This module makes those decisions, with no JAX in it; the lowering only
executes them.
"""

from __future__ import annotations

import dataclasses

from sbpjax.compiler.buckets import plan_buckets
from sbpjax.compiler.loops import plan_runs
from sbpjax.compiler.program import Var
from sbpjax.compiler.propagation import Propagation
from sbpjax.compiler.switches import plan_switches


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """What the lowering's walk looks up as it runs the decisions."""

    runs: list  # the rolled loops (loops.Run), program order
    run_at: dict  # first decision index -> the run starting there
    dropped: set  # decision indices a run executes (not walked one by one)
    unread: set  # decision indices of slicing whose results no code traced reads (_unread_slices)
    # decision index -> (var, layout, missing slices, push): a stack a loop filled but for
    # the slices made outside it, completed where the walk reaches that index
    finish: dict
    hoisted: set  # id(boxing) of boxings a run does before its loop
    switches: dict  # the conds run as lax.switch (switches.Switch)
    switch_at: dict  # first decision index -> the switches starting there (nested ones share it)
    before_switch: set  # id(boxing) of boxings a switch runs before it branches
    buckets: dict  # id(boxing) -> its bucket (buckets.Bucket)
    joined: set  # id(boxing) of boxings that ran earlier, with their bucket
    region_inputs: dict  # jax.checkpoint region -> ids of the Vars it reads from outside


def plan_local(prop: Propagation) -> LocalPlan:
    """The runs, switches and buckets of ``prop``'s local program."""
    runs = plan_runs(prop)
    switches, places = plan_switches(prop, runs)
    switch_at: dict = {}
    for sw in switches.values():
        switch_at.setdefault(sw.span[0], []).append(sw)
    hoisted = {id(b) for r in runs for b in r.hoisted}
    buckets, joined = plan_buckets(prop, zones=_zones(prop, runs, places, hoisted))
    return LocalPlan(
        runs=runs,
        run_at={r.first: r for r in runs},
        dropped={i for r in runs for i in r.dropped},
        unread=_unread_slices(prop, runs),
        finish={
            i: (var, nd, missing, r.pushed.get((key, nd)))
            for r in runs
            for var, key, nd, missing, i in r.stacks
            if missing
        },
        hoisted=hoisted,
        switches=switches,
        switch_at=switch_at,
        before_switch={id(b) for sw in switches.values() for b in sw.before},
        buckets=buckets,
        joined=joined,
        region_inputs=_region_inputs(prop),
    )


def _unread_slices(prop: Propagation, runs: list) -> set:
    """The decisions of the tracer's slicing of a run's later iterations
    (``Iteration.slicing``, in ``Run.slices``) whose results only the rolled
    bodies read, and read from the stacks (``Run.xs`` with the stacked
    operand): the loop indexes each slice out of its stack in the body, so
    nothing traced would read them. Left out of the walk, where they were
    traced and left to JAX to drop: 2,688 of the 3,177 ops the lowering of
    the compiler benchmark's 32-layer scanned GPT traced, 0.11 s of its
    0.94 s. Kept where anything else reads them (a boxing, code after the
    loop, another loop's body sharing the slice, a stack of per-iteration
    values)."""
    if not runs:
        return set()
    readers: dict = {}
    for i, d in enumerate(prop.decisions):
        for a in d.node.ins:
            readers.setdefault(id(a), []).append(i)
    held = {id(b.var) for b in prop.boxings} | {id(a) for a in prop.program.outputs}
    unread: set = set()
    for r in runs:
        from_stacks = {k for k, _, x in r.xs if x is not None} - {k for k, _, x in r.xs if x is None}
        its = [r.loop.iterations[q] for q in r.positions]
        entering = {id(it.ins[k]) for it in its for k in from_stacks}
        slicing = {id(n) for it in its for n in it.slicing}
        body = {i for b in r.bodies for i in b}
        for i in reversed(r.slices):
            d = prop.decisions[i]
            if id(d.node) not in slicing or d.boxings or any(id(o) in held for o in d.node.outs):
                continue
            if all(
                j in unread or (id(o) in entering and j in body)
                for o in d.node.outs
                for j in readers.get(id(o), ())
            ):
                unread.add(i)
    return unread


def _zones(prop: Propagation, runs: list, places: dict, hoisted: set) -> dict:
    """id(boxing) -> its zone: a bucket joins only boxings of the same zone."""
    zones: dict = {}
    for n, r in enumerate(runs):
        for m, body in enumerate(r.bodies):
            for i in body:
                for b in prop.decisions[i].boxings:
                    zones[id(b)] = (*zones.get(id(b), ()), (n, "before" if id(b) in hoisted else m))
        # the code between the bodies runs before the loop: its boxings join only each other
        for i in r.slices:
            for b in prop.decisions[i].boxings:
                zones[id(b)] = (*zones.get(id(b), ()), (n, "slices"))
    for r in runs:
        # boxings a loop ran already (Run.pushed, Run.done) run alone, so the walk can skip them
        for b in [b for b, _, _ in r.pushed.values()] + r.done:
            zones[id(b)] = (("done in a loop", id(b)),)
    # a bucket stays inside one branch of a switch, or outside them all
    for b_id, place in places.items():
        zones[b_id] = (*zones.get(b_id, ()), ("branch", place))
    # a regather runs at its consumer, after the value it is anchored to
    # (sbpjax.compiler.regather): it joins only the regathers of that consumer
    for i, dec in enumerate(prop.decisions):
        for b in dec.boxings:
            if b.regather:
                zones[id(b)] = ("regather", i)
    return zones


def _region_inputs(prop: Propagation) -> dict:
    """jax.checkpoint regions (sbpjax.compiler.trace.REMAT): the Vars each
    reads from outside it."""
    produced: dict = {}
    region_inputs: dict = {}
    for dec in prop.decisions:
        r = dec.node.region
        if r:
            made = produced.setdefault(r, set())
            region_inputs.setdefault(r, set()).update(
                id(a) for a in dec.node.ins if isinstance(a, Var) and id(a) not in made
            )
            made.update(id(o) for o in dec.node.outs)
    return region_inputs

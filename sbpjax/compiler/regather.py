"""Gathering a parameter again where it is used again (FSDP's reshard after forward).

A plan that keeps parameters split and all-gathers them where an op needs them
whole (ZeRO-3 / FSDP, which the whole-program choice often finds because it
moves the fewest bytes) uses each gathered weight twice in a train step: in
the forward pass and, much later, in the backward pass. Gathered once, the
whole weight is held from one to the other, across the point where the
forward pass's saved activations are all alive: the step's memory peak. On the
model benchmark's 2-layer ViT on 2x4 that put the peak 6% above GSPMD's (7.62
MB against 7.19 MB), with a third of GSPMD's bytes.

PyTorch's FSDP frees a gathered parameter after the forward pass and gathers
it again for the backward pass (``reshard_after_forward``, its default).
:func:`plan_regathers` plans the same: it estimates each device's live bytes
after every op (each value's block in its layout, from the op that makes it
to its last use, in program order; an upper bound, as XLA fuses many of them
away) and, while a gathered argument is held across the estimated peak
without being used there, gathers it again at its first use after the peak;
it keeps the regathers if the estimate falls by ``MIN_SAVING`` or more. A
regather moves the boxing's bytes again (``explain()`` lists it, and its
bytes count).

When (``sj.jit``'s ``regather``):

* ``"auto"`` (the default): the regathers run if the plan with them still
  moves no more bytes than the greedy pass's plan
  (``explain().choice.greedy_bytes``). The greedy pass takes each op's
  layouts from its operands', starting from the annotations, as a per-op
  partitioner does; where the whole-program choice moves fewer bytes than it
  by gathering annotated-split weights whole, regathering spends part of
  that saving to hold them split again between their uses, never more than
  all of it. The estimate alone cannot decide: the compiler benchmark's
  one-block transformer steps (tensor and 2-D) would regather 7 weights,
  their estimates falling 16-21% as the ViT's does (20%), to lower peaks
  already below GSPMD's (26.4 and 24.1 MB against 36.8 and 28.3 MB); with
  the regathers they would move 97.3 and 93.9 MB, more than the greedy
  plans' 76.2 and 75.8 MB, so "auto" runs none there (``explain()`` says
  what they would have saved and cost). The ViT with its regathers moves
  32.4 MB, under the greedy plan's 36.0 MB: they run, and its peak is 6.31
  MB (7.62 MB held; GSPMD 7.19 MB). A program solved by the greedy pass
  (``solver="greedy"``, or where it was kept) never regathers on "auto".
* ``True``: whenever the estimate falls by ``MIN_SAVING``, whatever the bytes.
* ``False``: never; every gathered copy is held from its first use to its last.

Each regather runs alone, at its consumer: letting one regather's bucket
(:mod:`sbpjax.compiler.buckets`) take the later ones held them all through the
backward pass and raised the ViT's temp memory above not regathering at all
(6.38 MB against 5.86 MB). Not done inside rolled loops, switches or
``jax.checkpoint`` regions (a checkpoint recomputes its own gathers), nor for
gathers of values the program computes (those are activations, which the
backward pass reads anyway).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sbpjax.compiler.liveness import Held, live_bytes, value_bytes
from sbpjax.compiler.loops import plan_runs
from sbpjax.compiler.propagate import Propagation
from sbpjax.compiler.switches import plan_switches

MIN_SAVING = 0.05
"""Regathers are kept only when they lower the estimated peak by at least
this fraction of it. Each moves bytes again; on the GPT sweep of
``benchmarks/compiler.py`` single regathers (of the embedding table) saved
under 1.5% of the estimate for 100-230 kB each."""


def plan_regathers(prop: Propagation, excluded: set) -> tuple[dict, tuple | None]:
    """``({decision index: [Boxing]}, (estimated peak before, after))``: the
    regathers to run before those decisions (see the module docstring), and
    the estimate they lower (None without regathers). ``excluded``: decision
    indices inside rolled loops, switches or checkpoint regions."""
    if not prop.decisions:
        return {}, None
    grid = prop.placement.shape
    inputs = {id(v) for v in prop.program.inputs}
    made: dict = {}
    for i, d in enumerate(prop.decisions):
        for b in d.boxings:
            steps = [s for s in b.plan.steps if s.collective is not None]
            if (
                id(b.var) in inputs
                and steps
                and all(s.op == "all_gather" for s in steps)
                and value_bytes(b.var, b.dst, grid) > value_bytes(b.var, b.src, grid)
            ):
                made.setdefault((id(b.var), b.dst), (i, b))
    if not made:
        return {}, None
    uses: dict = {key: [] for key in made}
    for i, d in enumerate(prop.decisions):
        for a, nd in zip(d.node.ins, d.in_sbp):
            key = (id(a), nd)
            if key in uses and (not uses[key] or uses[key][-1] != i):
                uses[key].append(i)
    held = [
        Held(b, uses[key], [i], value_bytes(b.var, b.dst, prop.placement.shape))
        for key, (i, b) in made.items()
        if not any(u in excluded for u in uses[key])
    ]
    if not held:
        return {}, None
    live = live_bytes(prop, held)
    first = int(live.max())
    while True:
        peak = int(np.argmax(live))
        moved = []
        for h in held:
            seg = max((s for s in h.starts if s <= peak), default=None)
            after = [u for u in h.uses if u > peak]
            if seg is None or seg == peak or peak in h.uses or not after or min(after) in h.starts:
                continue
            h.starts.append(min(after))
            h.starts.sort()
            moved.append((h, min(after)))
        if not moved:
            break
        trial = live_bytes(prop, held)
        if trial.max() >= live.max():
            for h, u in moved:
                h.starts.remove(u)
            break
        live = trial
    if first - int(live.max()) < MIN_SAVING * first:
        return {}, None
    out: dict = {}
    for h in held:
        for s in h.starts[1:]:
            node = prop.decisions[s].node
            where = f"{node.name} at {node.source} (gathered again)"
            out.setdefault(s, []).append(
                dataclasses.replace(h.boxing, where=where, node_index=s, regather=True)
            )
    return out, ((first, int(live.max())) if out else None)


def add_regathers(prop: Propagation, mode: bool | str = True) -> None:
    """Plan the regathers of a chosen program and add them to the decisions
    that run them (before lowering, so ``explain()`` and the bytes count them).
    ``mode=True`` adds every regather :func:`plan_regathers` keeps;
    ``"auto"`` only if the plan with them moves no more bytes than the greedy
    pass's plan (see the module docstring), else it records why in
    ``prop.regather_declined`` for ``explain()``."""
    runs = plan_runs(prop)
    switches, _ = plan_switches(prop, runs)
    excluded = {i for i, d in enumerate(prop.decisions) if d.node.region}
    for r in runs:
        excluded.update(range(r.first, r.last + 1))
    for sw in switches.values():
        excluded.update(range(sw.span[0], sw.span[1] + 1))
    planned, estimate = plan_regathers(prop, excluded)
    if estimate is None:
        return
    if mode == "auto":
        extra = sum(b.bytes for bs in planned.values() for b in bs)
        limit = prop.choice.greedy_bytes if prop.choice is not None else None
        with_them = prop.bytes + extra
        if limit is None or with_them > limit:
            count = sum(len(bs) for bs in planned.values())
            prop.regather_declined = (count, *estimate, extra, with_them, limit)
            return
    prop.regathered = estimate
    for i, bs in planned.items():
        prop.decisions[i].boxings.extend(bs)

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
it keeps the regathers if the estimate falls by
``CompileOptions.regather_min_saving`` (5%) or more. A
regather moves the boxing's bytes again (``explain()`` lists it, and its
bytes count).

When (``sj.jit``'s ``regather``):

* ``"auto"`` (the default): the chosen plan may hold as much as the greedy
  pass's plan, no more. The greedy pass takes each op's layouts from its
  operands', starting from the annotations, as a per-op partitioner (GSPMD)
  does. Where the plan's estimated peak is above ``1 - regather_margin`` of the
  greedy plan's (``explain().choice.greedy_peak``), the largest gathered
  weights are gathered again first, the fewest that bring it there (all of
  them where that is out of reach), and only if the plan with them still
  moves no more bytes than the greedy plan
  (``explain().choice.greedy_bytes``; otherwise ``explain()`` says what
  they would have saved and cost). The margin covers the estimate's slack:
  the ViT below and the 2-D GPT held peaked 4-6% above GSPMD's programs
  while their estimates were within 1% of the greedy plans'.
  Decision: a target rather than "every regather that fits under the greedy
  plan's bytes" (the rule before): that regathered all 18 weights of a
  3-layer GPT at d_model 128 with 2-D weights on 4x2 (batch 40): 35.8 MB,
  above GSPMD's 33.3 MB (held 28.8 MB). With the target it regathered 2:
  30.3 MB, and a 4.49 MB peak against GSPMD's 4.56 MB (held 4.75 MB). (Its
  solve now starts better, ``solve._weights_gathered``: 19.2 MB, a 4.48 MB
  peak, no regather.) A 4-layer MLP at d 64 with 2-D kernels on 4x2
  (batch 128) regathers 4 of 7: 1.44 MB and XLA's peak 213 kB (held 1.25
  MB and 242 kB; all 7: 1.59 MB and 201 kB; GSPMD 1.64 MB and 242 kB). The
  model benchmark's ViT regathers 2 of 12: 26.1 MB and a 7.10 MB peak
  (all 12: 32.4 MB and 6.31 MB; held 23.0 MB and 7.62 MB; GSPMD 66.9 MB
  and 7.19 MB). An FSDP step whose greedy plan gathers the same weights
  holds them (its estimate is half the greedy plan's). The compiler
  benchmark's one-block transformer steps: the tensor-parallel one would
  need 22.0 MB of regathers, past the greedy plan's bytes, so none run; the
  2-D one (estimated 3% under its greedy plan's, held) regathers 6.3 MB
  of weights (+9%) for a real peak of 23.3 MB instead of 24.1 MB, already
  below GSPMD's 28.3 MB: the estimate's slack costs that much there.
  A program solved by the greedy pass (``solver="greedy"``, or where it was
  kept) never regathers on "auto".
* ``True``: whenever the estimate falls by ``regather_min_saving``, whatever the bytes.
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

from sbpjax.compiler.liveness import Held, decision_uses, live_bytes, value_bytes
from sbpjax.compiler.loops import plan_runs
from sbpjax.compiler.propagation import Propagation
from sbpjax.compiler.switches import plan_switches


def plan_regathers(prop: Propagation, excluded: set, target: int | None = None) -> tuple[dict, tuple | None]:
    """``({decision index: [Boxing]}, (estimated peak before, after))``: the
    regathers to run before those decisions (see the module docstring), and
    the estimate they lower (None without regathers). ``excluded``: decision
    indices inside rolled loops, switches or checkpoint regions. ``target``:
    an estimated peak to reach with the fewest regathers (the largest first)
    and then stop; None: regather while the peak falls."""
    held = _gathered_arguments(prop, excluded)
    if not held:
        return {}, None
    live = live_bytes(prop, held)
    first = int(live.max())
    live = _lower_peak(prop, held, live, -1 if target is None else target)
    if first - int(live.max()) < prop.options.regather_min_saving * first:
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


def _gathered_arguments(prop: Propagation, excluded: set) -> list:
    """A :class:`Held` per argument all-gathered to a larger block (first
    where it is gathered), its uses outside ``excluded``."""
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
        return []
    uses = decision_uses(prop, made)
    return [
        Held(b, uses[key], [i], value_bytes(b.var, b.dst, grid))
        for key, (i, b) in made.items()
        # Held's model: gathered where it is first used, so each segment starts at a use.
        # A gathering whose first counted use is elsewhere (a consumer inside a region
        # the uses above do not see) is left as it is.
        if uses[key] and uses[key][0] == i and not any(u in excluded for u in uses[key])
    ]


def _lower_peak(prop: Propagation, held: list, live, goal: int):
    """Gather again, at the peak, each weight held across it and next used
    after it, while the estimated peak falls and stays above ``goal`` (where
    a round reaches ``goal``: only the fewest of its regathers, the largest
    first). Changes ``held``' starts; returns the live bytes it ends with."""
    while live.max() > goal:
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
        if trial.max() <= goal:
            # the fewest of them, the largest first, that reach the target
            for h, u in moved:
                h.starts.remove(u)
            for h, u in sorted(moved, key=lambda m: -m[0].size):
                h.starts.append(u)
                h.starts.sort()
                trial = live_bytes(prop, held)
                if trial.max() <= goal:
                    break
        live = trial
    return live


def add_regathers(prop: Propagation, mode: bool | str = True) -> None:
    """Plan the regathers of a chosen program and add them to the decisions
    that run them (before lowering, so ``explain()`` and the bytes count them).
    ``mode=True`` adds every regather :func:`plan_regathers` keeps;
    ``"auto"`` the fewest that bring the estimated peak ``regather_margin`` under
    the greedy plan's, and only if the plan with them moves no more bytes
    than the greedy pass's plan (see the module docstring), else it records
    why in ``prop.regather_declined`` for ``explain()``."""
    runs = plan_runs(prop)
    switches, _ = plan_switches(prop, runs)
    excluded = {i for i, d in enumerate(prop.decisions) if d.node.region}
    for r in runs:
        excluded.update(range(r.first, r.last + 1))
    for sw in switches.values():
        excluded.update(range(sw.span[0], sw.span[1] + 1))
    target = None
    if mode == "auto":
        target = prop.choice.greedy_peak if prop.choice is not None else None
        if target is None:
            return
        target = int((1 - prop.options.regather_margin) * target)
    planned, estimate = plan_regathers(prop, excluded, target)
    if estimate is None:
        return
    if mode == "auto":
        extra = sum(b.bytes for bs in planned.values() for b in bs)
        limit = _bytes_limit(prop.choice)
        with_them = prop.bytes + extra
        if limit is None or with_them > limit:
            count = sum(len(bs) for bs in planned.values())
            prop.regather_declined = (count, *estimate, extra, with_them, limit)
            return
    prop.regathered = estimate
    prop.runs = None  # reads outside the loops change what their stacks must hold
    for i, bs in planned.items():
        prop.decisions[i].boxings.extend(bs)


def _bytes_limit(choice) -> int | None:
    """The most bytes a plan with its "auto" regathers may move: the greedy
    pass's plan's, and under a memory budget no more than any hand-written
    layout that fits it (``Choice.candidates``, ``hand_layouts``): the
    budget promises those bytes, and a regather adds to them. A 4-layer MLP
    with SGD on 4x2 under a budget kept Megatron's splits with ZeRO-3 over
    x, 741,120 B, and regathered a weight to 851,712 B, past ZeRO-3 over x's
    833,664 B; it now keeps the weight gathered."""
    if choice is None or choice.greedy_bytes is None:
        return None
    limit = choice.greedy_bytes
    if choice.memory_budget is not None:
        fitting = [moved for _, moved, held in choice.candidates if held <= choice.memory_budget]
        limit = min([limit, *fitting])
    return limit

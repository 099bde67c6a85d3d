"""The hand-written layouts a memory budget is held to: ZeRO-1/2 and ZeRO-3/FSDP.

Under ``sj.jit(memory_budget=...)`` the whole-program solve picks the
``AUTO`` arguments' layouts with the budget as a constraint. A user who did
not have sbpjax would write one of the sharded data-parallel layouts by hand
instead; the plan must never move more bytes than the cheapest of those that
fits (``choose`` keeps that layout where it does, and ``explain()`` lists them
all):

* ``zero-1/2``: parameters whole on every device, optimizer state split as
  far as it goes. ZeRO-1 and ZeRO-2 differ only inside the step (ZeRO-2
  reduce-scatters the gradients): in one fused train step the gradient is a
  temporary, so at the step's boundary, where layouts are written, they are
  the same layouts, and which collective reduces the gradient is the plan's
  choice either way.
* ``zero-3/fsdp``: parameters and optimizer state split as far as they go,
  parameters gathered where they are used (ZeRO-3; PyTorch FSDP is the same
  layouts).

Which ``AUTO`` arguments are optimizer state comes from the mirror pairs
``sj.jit`` finds (``auto_arguments.mirrored_state``: optax's ``mu`` / ``nu`` of a
parameter): without any, there is no ZeRO-1 candidate.

A user who splits the model by hand (Megatron's column and row splits over
one axis) adds ZeRO over the batch's axis on top of it (torchtitan's "2-D",
MaxText's fsdp + tensor axes). :func:`on_chosen` writes those layouts from
the ones the ``AUTO`` solve chose, the split the user would have written.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
from collections.abc import Callable

from sbpjax.compiler.auto import AUTO, auto_layouts
from sbpjax.compiler.liveness import block_bytes, held_bytes
from sbpjax.layout import zero_split
from sbpjax.sbp import Broadcast, Split

# How ``on_chosen``'s layouts are named: after the splits the AUTO solve chose.
ON_CHOSEN = "AUTO's splits + "


def most_split(var, grid) -> tuple:
    """ZeRO's split of ``var``: its lowest dim that the device count divides,
    split over every axis of size > 1 (as ZeRO flattens a tensor and splits it from its
    start); where no dim divides, the ``AUTO`` layout with the smallest block
    per device (the first such in ``auto_layouts``' order)."""
    n = math.prod(grid)
    for d, size in enumerate(var.shape):
        if size % n == 0 and size >= n:
            # B on an axis of size 1: the form AUTO's layouts take (auto_layouts), by which
            # the plan cache reads a plan back
            return tuple(Split(d) if p > 1 else Broadcast() for p in grid)
    options = auto_layouts(var.shape, grid)
    return min(options, key=lambda nd: block_bytes(var.shape, var.dtype, nd, grid))


def split_over(var, grid, axis: int) -> tuple:
    """ZeRO's split of ``var`` over one placement ``axis`` (the data axis on
    a grid that also has a tensor axis), whole on the other axes: what
    ``sbpjax.flax.zero_layout`` stores (``layout.zero_split``)."""
    return zero_split((Broadcast(),) * len(grid), var.shape, grid, axis)


def data_axes(in_sbp, grid) -> list[int]:
    """The axes of size > 1 over which an annotated argument is split (the
    batch's)."""
    split = {a for nd in in_sbp if nd is not AUTO for a, q in enumerate(nd) if isinstance(q, Split)}
    return sorted(a for a in split if grid[a] > 1)


def candidates(program, in_sbp, grid, mirrors: dict, axis_names=None) -> list[tuple[str, list]]:
    """``[(name, in_sbp)]``: each hand-written layout of the ``AUTO``
    arguments (the annotated ones as given), each once: ZeRO-1/2 and
    ZeRO-3/FSDP split over every axis (``most_split``), and split over the
    batch's axis alone, a tensor no dim of which divides kept whole
    (``split_over``: what ``sbpjax.flax.zero_layout`` writes). ``mirrors``:
    {optimizer state leaf: its parameter's leaf}.

    Decision: the single-axis pair is offered over the batch's axes only.
    Without it, a 6-layer MLP on 4x2 (SGD with momentum, batch over x) moved
    1.46-1.61x the bytes of ZeRO over x under budgets that layout met, and
    an embedding model on 8 devices split its (100,) head bias unevenly and
    moved 1.20x the bytes of ZeRO with that bias whole. Over the other axes
    the pair would add solves for layouts no guide writes."""
    if not any(nd is AUTO for nd in in_sbp):
        return []
    rep = (Broadcast(),) * len(grid)
    state = set(mirrors)
    names = axis_names or tuple(str(a) for a in range(len(grid)))
    splits: list[tuple[str, Callable]] = [("", functools.partial(most_split, grid=grid))]
    splits += [
        (f" over {names[a]}", functools.partial(split_over, grid=grid, axis=a))
        for a in data_axes(in_sbp, grid)
    ]
    out: list = []
    for suffix, split in splits:
        if state:
            zero12 = [
                (split(v) if i in state else rep) if nd is AUTO else nd
                for i, (v, nd) in enumerate(zip(program.inputs, in_sbp))
            ]
            out.append((f"zero-1/2{suffix}", zero12))
        zero3 = [split(v) if nd is AUTO else nd for v, nd in zip(program.inputs, in_sbp)]
        out.append((f"zero-3/fsdp{suffix}", zero3))
    unique: list = []
    for name, ins in out:
        if all(ins != other for _, other in unique):
            unique.append((name, ins))
    return unique


def split_whole_dim(nd: tuple, shape, grid, axis: int) -> tuple:
    """``nd`` with ZeRO's split over ``axis`` added where ``nd`` is whole
    (B) over it: the lowest dim no other axis splits and ``grid[axis]``
    divides, as FSDP with tensor parallelism stores a weight (its input dim
    under a column split, its output dim under a row split: gathered over
    ``axis`` it is the tensor-parallel block again). Where no such dim is
    left (a bias the tensor axis splits) ``nd`` stays: its piece is small
    already, and splitting that dim further would gather it at every use
    (on the MLP of ``on_chosen``, 224,256 B priced 1,824,384 with such biases
    split further, 222,000 B priced 1,622,000 without)."""
    if not isinstance(nd[axis], Broadcast) or grid[axis] == 1:
        return nd
    taken = {q.dim for q in nd if isinstance(q, Split)}
    for dim, size in enumerate(shape):
        if dim not in taken and size % grid[axis] == 0 and size >= grid[axis]:
            return nd[:axis] + (Split(dim),) + nd[axis + 1 :]
    return nd


def on_chosen(program, in_sbp, chosen, grid, mirrors: dict, axis_names=None) -> list[tuple[str, list]]:
    """``[(name, in_sbp)]``: the layouts an ``AUTO`` solve ``chose`` with
    ZeRO over each of the batch's axes added (``split_whole_dim``), to the
    optimizer state alone (zero-1/2) and to every ``AUTO`` argument
    (zero-3/fsdp); none where the chosen layouts are split over that axis
    already. ``mirrors`` as for ``candidates``.

    Why: the solve proves its plan optimal over the candidates ``Domains``
    keeps for each op, which are narrowed around its greedy pass, and a
    tensor-parallel plan with ZeRO on top lies outside them. A 4-layer MLP
    step with AdamW on 4x2 (batch over x) chose Megatron's splits over y,
    569,088 B priced 1,669,088, where the same splits with ZeRO-3 over x,
    written by hand, move 222,000 B priced 1,622,000."""
    if not any(nd is AUTO for nd in in_sbp):
        return []
    names = axis_names or tuple(str(a) for a in range(len(grid)))
    state = set(mirrors)
    out: list = []
    for a in data_axes(in_sbp, grid):

        def added(i, v, nd, a=a):
            return split_whole_dim(chosen[i], v.shape, grid, a) if nd is AUTO else nd

        zero3 = [added(i, v, nd) for i, (v, nd) in enumerate(zip(program.inputs, in_sbp))]
        if zero3 == list(chosen):
            continue
        if state:
            zero12 = [
                added(i, v, nd) if i in state else (chosen[i] if nd is AUTO else nd)
                for i, (v, nd) in enumerate(zip(program.inputs, in_sbp))
            ]
            if zero12 != list(chosen):
                out.append((f"{ON_CHOSEN}zero-1/2 over {names[a]}", zero12))
        out.append((f"{ON_CHOSEN}zero-3/fsdp over {names[a]}", zero3))
    return out


def to_try(program, in_sbp, chosen, grid, mirrors: dict, axis_names=None) -> list[tuple[str, list]]:
    """``[(name, in_sbp)]``: every hand-written layout a plan that chose
    ``AUTO``'s layouts (``chosen``) is held to, each once: ``candidates``,
    then ``on_chosen``."""
    written = candidates(program, in_sbp, grid, mirrors, axis_names)
    extra = on_chosen(program, in_sbp, chosen, grid, mirrors, axis_names)
    return written + [(name, ins) for name, ins in extra if all(ins != other for _, other in written)]


def described(name: str) -> str:
    """A hand-written layout's ``name`` in a sentence: "the hand-written
    zero-1/2 layouts", "AUTO's splits + zero-3/fsdp over x written by hand"."""
    return f"{name} written by hand" if name.startswith(ON_CHOSEN) else f"the hand-written {name} layouts"


def own(prop):
    """A shallow copy of the plan ``prop`` with a ``Choice`` of its own to
    write this call's budget and candidates in: plans are shared through the
    process's plan memo (``sub_plans``), and a budget written into the shared
    one listed every earlier call's candidates again."""
    prop = copy.copy(prop)
    if prop.choice is not None:
        prop.choice = dataclasses.replace(prop.choice, candidates=list(prop.choice.candidates))
    return prop


def no_worse_than_by_hand(program, kept, fits, in_sbp, mirrors, pairs, memory_budget, plan_of):
    """``kept`` (``fits``: within the budget), or the hand-written layout
    (``candidates``, and ``on_chosen`` of ``kept``'s layouts) that fits the
    budget and moves the fewest bytes, where it moves fewer than ``kept``.
    ``plan_of(in_sbp)``: the whole-program plan given those layouts, as
    ``sj.jit`` given them by hand would make it. None where nothing fits. Every candidate's bytes and memory go in
    ``Choice.candidates``. ``pairs``: the donated buffers results may
    share (``liveness.held_bytes``).

    Decisions: by bytes, as the budget is promised (never more bytes than the
    layouts one would write by hand), even where a hand layout runs more
    collectives (a small MLP's ZeRO-3 moved 16% fewer bytes than the solved
    plan in twice its collectives); ``explain()`` shows both. Each candidate
    is solved, not taken from the greedy pass: on a 1-layer GPT under jax
    0.12 the greedy pass's ZeRO plans moved more than the budgeted solve's
    1.59 MB, where sj.jit given ZeRO-1's layouts moved 0.94 MB. That costs a
    solve per candidate, under a budget only."""
    grid = kept.placement.shape
    kept = own(kept)
    choice = kept.choice
    choice.candidates = []
    best, best_bytes = (kept, kept.bytes) if fits else (None, float("inf"))
    names = kept.placement.axis_names
    for name, ins in to_try(program, in_sbp, list(kept.in_sbp), grid, mirrors, names):
        prop = plan_of(ins)
        held = held_bytes(program, prop, pairs, grid)
        choice.candidates.append([name, prop.bytes, held])
        if held <= memory_budget and prop.bytes < best_bytes:
            best, best_bytes, best_name, best_held = prop, prop.bytes, name, held
    if best is None or best is kept:
        return best
    solved = f"the solved plan {kept.bytes} B" if fits else "no solved plan fits"
    choice.reason = f"{described(best_name)} fit and move {best.bytes} B, {solved}"
    choice.method, choice.memory_bytes, choice.latency_note = "hand", best_held, ""
    best = own(best)
    best.choice, best.warnings = choice, kept.warnings
    return best

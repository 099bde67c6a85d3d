"""The hand-written layouts a memory budget is held to: ZeRO-1/2 and ZeRO-3/FSDP.

Under ``sj.jit(memory_budget=...)`` the whole-program solve picks the
``AUTO`` arguments' layouts with the budget as a constraint. A user who did
not have sbpjax would write one of the sharded data-parallel layouts by hand
instead; the plan must never cost more than the cheapest of those that fits,
by the solver's own price (bytes plus each collective's latency): ``choose``
keeps that layout where it does, and ``explain()`` lists them all:

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
``sj.jit`` finds (``CompiledFunction._mirrors``: optax's ``mu`` / ``nu`` of a
parameter): without any, there is no ZeRO-1 candidate.
"""

from __future__ import annotations

from sbpjax.compiler.domains import AUTO, auto_layouts
from sbpjax.compiler.liveness import block_bytes, held_bytes
from sbpjax.sbp import Broadcast


def most_split(var, grid) -> tuple:
    """The ``AUTO`` layout of ``var`` with the smallest block per device (the
    first such in ``auto_layouts``' order, which splits the lowest dims
    first, as ZeRO flattens and splits a tensor from its start)."""
    options = auto_layouts(var.shape, grid)
    return min(options, key=lambda nd: block_bytes(var.shape, var.dtype, nd, grid))


def candidates(program, in_sbp, grid, mirrors: dict) -> list[tuple[str, list]]:
    """``[(name, in_sbp)]``: each hand-written layout of the ``AUTO``
    arguments (the annotated ones as given). ``mirrors``: {optimizer state
    leaf: its parameter's leaf}."""
    if not any(nd is AUTO for nd in in_sbp):
        return []
    rep = (Broadcast(),) * len(grid)
    state = set(mirrors)
    out = []
    if state:
        out.append(
            (
                "zero-1/2",
                [
                    (most_split(v, grid) if i in state else rep) if nd is AUTO else nd
                    for i, (v, nd) in enumerate(zip(program.inputs, in_sbp))
                ],
            )
        )
    out.append(
        ("zero-3/fsdp", [most_split(v, grid) if nd is AUTO else nd for v, nd in zip(program.inputs, in_sbp)])
    )
    return out


def no_worse_than_by_hand(program, kept, fits, in_sbp, mirrors, ties, memory_budget, greedy_of, price_of):
    """``kept`` (``fits``: within the budget), or the cheapest hand-written
    layout (``candidates``, each planned by ``greedy_of``) that fits the
    budget where ``price_of`` (``pricing.price``: bytes plus each
    collective's latency, the solver's own objective) prices it lower: where
    the solve's gap is not closed it may not have found them. None where
    nothing fits. Every candidate's bytes and memory go in
    ``Choice.candidates``.

    Decision: by price, not bytes alone. A hand layout that moves fewer bytes
    in more collectives does not dominate the plan (the trade ``explain()``
    shows); on a small MLP under a budget ZeRO-1 moved 16% fewer bytes than
    the solved plan in twice its collectives, slower by the cost model."""
    grid = kept.placement.shape
    choice = kept.choice
    best, best_price = (kept, price_of(kept)) if fits else (None, float("inf"))
    for name, ins in candidates(program, in_sbp, grid, mirrors):
        prop = greedy_of(ins)
        held = held_bytes(program, prop, ties, grid)
        choice.candidates.append([name, prop.bytes, held])
        if held <= memory_budget and price_of(prop) < best_price:
            best, best_price, best_name, best_held = prop, price_of(prop), name, held
    if best is None or best is kept:
        return best
    solved = f"the solved plan {kept.bytes} B" if fits else "no solved plan fits"
    choice.reason = f"the hand-written {best_name} layouts fit and move {best.bytes} B, {solved}"
    choice.method, choice.memory_bytes, choice.latency_note = "hand", best_held, ""
    best.choice, best.warnings = choice, kept.warnings
    return best

"""A pipeline's memory budget, checked before a step runs.

``Pipeline(memory_budget=...)``: the bytes each device may hold between
actions, in residuals (a forward's, for its backward) and kept values (a B's,
for its W). Bytes per microbatch come from the stages' shapes (logical bytes,
:meth:`~sbpjax.pipeline.programs.StageVJP.slot_bytes`): one device holds at
most a value's logical bytes (a split value holds less), so the check bounds
what the timeline measures per device. It reads shapes only, not the
layouts the stages' programs choose, so it does not divide by a split. An action list is then
played through the validator with them, and register-count schedules (GPipe,
1F1B) are bounded by their slot counts.
"""

from __future__ import annotations

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.pipeline.schedule import ActionList
from sbpjax.tensor import is_global


def check_budget(pipe, load_inputs, load_targets) -> None:
    """Refuse, naming the action or the register counts, a step of ``pipe`` that
    would hold more than ``pipe.memory_budget`` bytes on a device. A
    function feed is called once more, for microbatch 0's shape; each shape is
    checked once."""
    x, t = load_inputs(0), load_targets(0)
    x_shape = _shape_of(x)
    t_shape = jax.tree.map(_shape_of, t, is_leaf=is_global)
    key = (x_shape, jax.tree.structure(t_shape), tuple(jax.tree.leaves(t_shape)))
    if key in pipe._budget_checked:
        return
    slot_bytes = _slot_bytes(pipe, x_shape, t_shape)
    counts = {r.name: r.count for r in pipe.graph.registers}
    n, p = len(pipe.stages), len(pipe.groups)
    stash = [counts[f"stash{s}"] for s in range(n)]
    if isinstance(pipe.schedule, ActionList):
        kept = [counts[f"kept{s}"] for s in range(n)] if pipe.schedule.split_backward else None
        pipe.schedule.validate(
            p,
            pipe.microbatches,
            stash_counts=stash,
            kept_counts=kept,
            slot_bytes=slot_bytes,
            memory_budget=pipe.memory_budget,
        )
    else:
        for d in range(p):
            mine = [s for s in range(n) if pipe.schedule.device_of(s, p) == d]
            held = sum(stash[s] * slot_bytes[s][0] for s in mine)
            if held > pipe.memory_budget:
                parts = " + ".join(f"stage {s}: {stash[s]} x {slot_bytes[s][0]}" for s in mine)
                raise SBPError(
                    f"Pipeline: {pipe.schedule!r} keeps up to {held} bytes of residuals on device group {d} "
                    f"({parts} bytes per microbatch), over memory_budget={pipe.memory_budget}; "
                    + (
                        "use 1f1b (at most p microbatches per stage), fewer microbatches, or a larger budget."
                        if pipe.schedule.flush
                        else "give fewer stash_counts, or a larger budget."
                    )
                )
    pipe._budget_checked.add(key)


def _shape_of(a) -> jax.ShapeDtypeStruct:
    """A microbatch leaf's shape and dtype: an array, a global tensor (its
    logical ones) or what numpy makes of a Python number or list."""
    if hasattr(a, "shape") and hasattr(a, "dtype"):
        return jax.ShapeDtypeStruct(tuple(a.shape), a.dtype)
    return jax.ShapeDtypeStruct(np.shape(a), np.result_type(a))


def _slot_bytes(pipe, h, target) -> dict:
    """Per stage, ``(residual bytes, kept bytes)`` of one microbatch (0 for a
    stage another process runs)."""
    slot_bytes, last = {}, len(pipe.stages) - 1
    for s, (stage, prog) in enumerate(zip(pipe.stages, pipe.programs)):
        params = jax.tree_util.tree_map(
            lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
            stage.params,
            is_leaf=lambda v: hasattr(v, "sbp"),
        )
        rest = (target,) if s == last else ()
        slot_bytes[s] = prog.vjp.slot_bytes(params, h, rest) if prog is not None else (0, 0)
        if s < last:
            h = jax.eval_shape(stage.fn, params, h)
    return slot_bytes

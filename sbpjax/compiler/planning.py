"""A program's plan: from the plan cache, from process 0, or chosen here.

``sj.jit`` asks :func:`plan` for the layouts of a traced program. With a
plan cache directory (:mod:`sbpjax.compiler.plan_cache`) a plan made before
for the same program, placement shape, layouts, cost model, options and
sbpjax version is read back and checked; otherwise it is chosen
(:func:`sbpjax.compiler.choose.choose`) and written. With several processes
(``jax.distributed``) and a placement over all of them, process 0 plans
(or reads its cache) and sends its plan to the others, which check it as
they would a cache entry: every process compiles the same program, whatever
its cache holds.
"""

from __future__ import annotations

import json
import warnings

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler import plan_cache
from sbpjax.compiler.choose import choose
from sbpjax.compiler.options import DEFAULT_OPTIONS
from sbpjax.compiler.plan_records import entry_of, restore


def plan(
    program,
    placement,
    in_sbp,
    out_sbp,
    cost_model=None,
    solver="ilp",
    options=DEFAULT_OPTIONS,
    ties=None,
    memory_budget=None,
    same_layout=None,
    arg_names=None,
    cache=None,
    aliases=None,
):
    """The Propagation of ``program`` (``choose``'s arguments, and ``cache``:
    ``sj.jit``'s ``plan_cache``, see ``plan_cache.cache_dir``)."""
    ties, same_layout, aliases = dict(ties or {}), dict(same_layout or {}), dict(aliases or {})

    def chosen():
        return choose(
            program,
            placement,
            in_sbp,
            out_sbp,
            cost_model,
            solver=solver,
            options=options,
            ties=ties,
            memory_budget=memory_budget,
            same_layout=same_layout,
            arg_names=arg_names,
            aliases=aliases,
        )

    directory = plan_cache.cache_dir(cache)
    shared = jax.process_count() > 1 and len(placement.processes) == jax.process_count()
    if directory is None and not shared:
        return chosen()
    key = plan_cache.plan_key(
        program,
        placement,
        in_sbp,
        out_sbp,
        solver=solver,
        cost_model=cost_model,
        options=options,
        ties=ties,
        same_layout=same_layout,
        memory_budget=memory_budget,
        arg_names=arg_names,
        aliases=aliases,
    )
    n_ops = len(program.nodes)

    def restored(entry):
        return restore(program, placement, in_sbp, out_sbp, ties, entry, cost_model, options)

    prop = None
    if not shared or jax.process_index() == 0:
        entry = plan_cache.load(directory, key, n_ops)
        if entry is not None:
            prop = restored(entry)
            if prop is None:
                warnings.warn(
                    plan_cache.PlanCacheWarning(
                        f"sj.jit: plan cache entry {key} is not a plan of this program; planning anew"
                    ),
                    stacklevel=3,
                )
        if prop is None:
            prop = chosen()
            plan_cache.store(directory, key, entry_of(prop), n_ops)
    if not shared:
        return prop
    text = _from_process_0(entry_of(prop).to_json(key, n_ops) if prop is not None else None)
    if jax.process_index() == 0:
        return prop
    prop = restored(plan_cache.parse_entry(json.loads(text), key, n_ops))
    if prop is None:
        raise SBPError(
            "sj.jit: the plan process 0 sent is not a plan of this process's program; every process must "
            "trace the same function on the same shapes and layouts."
        )
    if prop.choice is not None:
        prop.choice.source = "process 0"
    return prop


def _from_process_0(text: str | None) -> str:
    """Process 0's ``text`` in every process (all processes call this)."""
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8) if text is not None else np.zeros(0, np.uint8)
    n = int(np.asarray(multihost_utils.broadcast_one_to_all(np.asarray(len(data), np.int64))))
    buf = np.zeros(n, np.uint8)
    if jax.process_index() == 0:
        buf[:] = data
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf), np.uint8)).decode()


__all__ = ["plan"]

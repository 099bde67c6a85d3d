"""The jaxprs of the small functions the tracer writes out, made once per shape.

Writing out a scan (``sbpjax.compiler.trace``) slices each stacked operand once
per iteration and stacks each result: a 32-layer scanned decoder's train step
asked ``jax.make_jaxpr`` for 1,347 of them, most of the trace's time, though
they repeat a few shapes (each weight of a layer, per iteration index): 363
distinct ones.
A jaxpr depends only on what it computes, named by the caller (``what``: the
function and its static arguments, as the slice's index), and on the operands'
shapes and dtypes; it is immutable, and inlining reads its equations without
changing them, so one is shared by every use (the unrolled iterations of a
scan already share their body's equations).
"""

from __future__ import annotations

import jax
import numpy as np

# Entries are small (a handful of equations); the bound keeps a long session's
# table from growing with every shape it ever traced.
KEPT = 4096
_JAXPRS: dict = {}


def jaxpr_of(what, fn, atoms):
    """``jax.make_jaxpr(fn)`` on ``atoms``' shapes and dtypes, kept under
    ``what`` (hashable; None: made afresh and not kept)."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in atoms]
    if what is None:
        return jax.make_jaxpr(fn)(*avals)
    key = (
        what,
        bool(jax.config.jax_enable_x64),
        tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in atoms),
    )
    closed = _JAXPRS.get(key)
    if closed is None:
        if len(_JAXPRS) >= KEPT:
            _JAXPRS.clear()
        closed = _JAXPRS[key] = jax.make_jaxpr(fn)(*avals)
    return closed


def clear() -> None:
    _JAXPRS.clear()

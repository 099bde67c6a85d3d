"""An ``sj.jit`` function called inside another one.

The outer ``sj.jit`` plans the whole program, so the inner function's body is
inlined into the trace, its ``in_sbp`` / ``out_sbp`` kept as ``sj.constrain``
points, as ``jax.jit`` inlines a nested ``jax.jit``.
"""

from __future__ import annotations

import jax
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.compiler.arguments import broadcast_spec, leaf_layout
from sbpjax.compiler.auto import AUTO
from sbpjax.compiler.constrain import constrain
from sbpjax.compiler.static_args import bind
from sbpjax.placement import Placement


def inline_call(cf, outer: Placement, args, kwargs):
    """Called inside a function another ``sj.jit`` traces: that one plans
    the whole program, so this function's body is inlined there, its
    ``in_sbp`` / ``out_sbp`` kept as ``sj.constrain`` points (None and
    AUTO leave a value free), and it returns plain values as the code
    around it gets (GlobalTensors are what a call from outside returns)."""
    if outer != cf.placement:
        raise SBPError(
            f"sj.jit: {cf!r} is called inside a function sj.jit compiles on {outer!r}; one program "
            "runs on one placement. Give both the same placement, or call this one outside (its "
            "results are GlobalTensors to pass in)."
        )
    ndim = cf.placement.ndim

    def constrained(values, spec, what):
        leaves, tree = jax.tree_util.tree_flatten(values)
        specs = broadcast_spec(spec, tree, what, ndim)
        out = []
        for k, (x, s) in enumerate(zip(leaves, specs)):
            if s is not None and s is not AUTO:
                x = constrain(x, leaf_layout(s, ndim, tuple(np.shape(x)), k, tree))
            out.append(x)
        return jax.tree_util.tree_unflatten(tree, out)

    args, kwargs, static = cf.static.split(args, kwargs)
    if cf.in_sbp is not None:
        args = constrained(args, cf.in_sbp, "in_sbp")
    outs = bind(cf.fn, static)(*args, **kwargs)
    return outs if cf.out_sbp is None else constrained(outs, cf.out_sbp, "out_sbp")


__all__ = ["inline_call"]

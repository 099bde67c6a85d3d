"""Reductions: a reduced split dim becomes the matching partial.

Per device: ``y_i = reduce(x_i, axes)``. If ``x`` is split on a reduced dim,
``y = op_i y_i``: ``reduce_sum`` -> P(sum), ``reduce_max`` -> P(max),
``reduce_min`` -> P(min) (how a model-parallel softmax gets its max and sum
without gathering the logits). A split on a kept dim stays a split (renumbered).
A partial input of the same op stays partial: ``sum(sum_i x_i) = sum_i sum(x_i)``.
``argmax``/``argmin`` need the reduced dim whole. ``cumsum`` and friends keep
splits off their axis; ``cumsum`` is linear (keeps P(sum)), ``cummax`` monotone.
Split along their axis, each piece's scan is completed with the totals of the
pieces before it (an all-gather of one row per piece).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.lower import axis_arg, fill_value, group_index
from sbpjax.rules import B, Comm, P, Sig, local_shape, rank, register, set_comm, set_local, split_axes
from sbpjax.sbp import Split

_OP = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min"}


@register("reduce_sum", "reduce_max", "reduce_min")
def reduction(eqn, in_avals):
    """``y_i = reduce(x_i)``; a reduced split dim gives ``y = op_i y_i``."""
    axes = tuple(eqn.params["axes"])
    op = _OP[eqn.primitive.name]
    sigs = []
    for d in range(rank(in_avals[0])):
        if d in axes:
            sigs.append(Sig((Split(d),), (P(op),)))
        else:
            sigs.append(Sig((Split(d),), (Split(d - sum(a < d for a in axes)),)))
    sigs += [Sig((P(op),), (P(op),)), Sig((B,), (B,))]
    return sigs


@register("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def kept_dim_reduction(eqn, in_avals):
    """``y_i = reduce(x_i)`` for splits of kept dims; over a split dim only a
    boolean ``and`` / ``or`` has a partial kind: they are ``min`` / ``max`` on
    booleans (``jnp.all(jnp.isfinite(grads))`` of a loss scaler reduces each
    piece and all-reduces one flag, not the gathered gradients). An argmax, a
    product, an integer (bitwise) and / or, or a xor over a split dim is
    reduced whole."""
    axes = tuple(eqn.params["axes"])
    sigs = [
        Sig((Split(d),), (Split(d - sum(a < d for a in axes)),))
        for d in range(rank(in_avals[0]))
        if d not in axes
    ]
    op = _LOGICAL.get(eqn.primitive.name) if in_avals[0].dtype == bool else None
    if op:
        sigs += [Sig((Split(d),), (P(op),)) for d in axes] + [Sig((P(op),), (P(op),))]
    return sigs + [Sig((B,), (B,))]


_LOGICAL = {"reduce_and": "min", "reduce_or": "max"}


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(eqn, in_avals):
    """``y_i = cumop(x_i, axis)`` for splits off the axis; along it, ``y_i =
    cumop(x_i)`` combined with the totals of the pieces before it (after it,
    for ``reverse``); cumsum keeps P(sum), cummax/cummin keep P(max)/P(min)."""
    axis = eqn.params["axis"]
    sigs = [Sig((Split(d),), (Split(d),)) for d in range(rank(in_avals[0])) if d != axis]
    keep = {"cumsum": "sum", "cummax": "max", "cummin": "min"}.get(eqn.primitive.name)
    if keep:
        sigs.append(Sig((P(keep),), (P(keep),)))
    return sigs + [Sig((B,), (B,)), Sig((Split(axis),), (Split(axis),))]


@set_comm("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative_comm(eqn, in_avals, ins, outs, grid):
    """Split along the axis: every device gathers each piece's total (one
    row: the local shape without the axis)."""
    axes = split_axes(ins[0], eqn.params["axis"])
    if not axes:
        return []
    pieces = math.prod(grid[a] for a in axes)
    shape = local_shape(in_avals[0].shape, ins[0], grid)
    row = math.prod(shape) // shape[eqn.params["axis"]] * in_avals[0].dtype.itemsize
    return [Comm("all_gather", axes, math.prod(grid) * (pieces - 1) * row)]


def _identity(name, dtype):
    """The carry of a piece with no pieces before it."""
    if name == "cumprod":
        return jnp.ones((), dtype)
    return fill_value({"cumsum": "sum", "cummin": "min"}.get(name, "max"), dtype)


_COMBINE = {
    "cumsum": jnp.add,
    "cumprod": jnp.multiply,
    "cummax": jnp.maximum,
    "cummin": jnp.minimum,
    "cumlogsumexp": jnp.logaddexp,
}
_REDUCE = {
    "cumsum": jnp.sum,
    "cumprod": jnp.prod,
    "cummax": jnp.max,
    "cummin": jnp.min,
    "cumlogsumexp": lambda v, axis: lax.reduce(v, -jnp.inf, jnp.logaddexp, (axis,)),
}


@set_local("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative_local(eqn, ins, ctx):
    name, axis, reverse = eqn.primitive.name, eqn.params["axis"], eqn.params.get("reverse", False)
    y = eqn.primitive.bind(ins[0], **eqn.params)
    axes = split_axes(ctx.in_nd[0], axis)
    if not axes:
        return [y]
    names = ctx.placement.axis_names
    pieces = math.prod(ctx.grid[a] for a in axes)
    # this piece's total is the last element of its scan (the first, reversed)
    end = 0 if reverse else y.shape[axis] - 1
    total = lax.slice_in_dim(y, end, end + 1, axis=axis)
    totals = lax.all_gather(total, axis_arg([names[a] for a in axes]), axis=0, tiled=False)
    me = group_index(axes, names, ctx.grid)
    before = jnp.arange(pieces) > me if reverse else jnp.arange(pieces) < me
    before = before.reshape((pieces,) + (1,) * total.ndim)
    carry = _REDUCE[name](jnp.where(before, totals, _identity(name, y.dtype)), axis=0)
    return [_COMBINE[name](carry, y).astype(y.dtype)]

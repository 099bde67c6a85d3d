"""Reductions: a reduced split dim becomes the matching partial.

Per device: ``y_i = reduce(x_i, axes)``. If ``x`` is split on a reduced dim,
``y = op_i y_i``: ``reduce_sum`` -> P(sum), ``reduce_max`` -> P(max),
``reduce_min`` -> P(min) (how a model-parallel softmax gets its max and sum
without gathering the logits). A split on a kept dim stays a split (renumbered).
A partial input of the same op stays partial: ``sum(sum_i x_i) = sum_i sum(x_i)``.
``argmax``/``argmin``, products, bitwise reductions and ``lax.reduce`` with a
function of its own over a split dim gather each piece's result and reduce
those. ``cumsum`` and friends keep splits off their axis; ``cumsum`` is linear
(keeps P(sum)), ``cummax`` monotone. Split along their axis, each piece's scan
is completed with the totals of the pieces before it (an all-gather of one row
per piece).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

try:  # the public home moved across JAX versions
    from jax.extend.core import ClosedJaxpr, Literal, jaxpr_as_fun
except ImportError:  # pragma: no cover
    from jax.core import ClosedJaxpr, Literal, jaxpr_as_fun  # type: ignore[attr-defined,no-redef]

from sbpjax.boxing.device_index import axis_arg, group_index
from sbpjax.boxing.extremes import fill_value
from sbpjax.rules import B, Comm, P, Sig, local_shape, rank, register, set_comm, set_local, split_axes
from sbpjax.sbp import Partial, Split

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
    """``y_i = reduce(x_i)`` for splits of kept dims. Over a split dim a
    boolean ``and`` / ``or`` is partial: ``min`` / ``max`` on booleans
    (``jnp.all(jnp.isfinite(grads))`` of a loss scaler reduces each piece and
    all-reduces one flag, not the gathered gradients). The others have no
    partial kind, so each piece is reduced and the pieces' results are
    gathered and reduced again, ``y = reduce_i y_i`` (B): a product or a
    bitwise op over the gathered results; an argmax takes each piece's winner
    (its value and its index plus the piece's offset) and the first piece
    holding the largest value (greedy decoding from logits split by
    vocabulary gathers one value and one index per row, not the logits)."""
    axes = tuple(eqn.params["axes"])
    sigs = [
        Sig((Split(d),), (Split(d - sum(a < d for a in axes)),))
        for d in range(rank(in_avals[0]))
        if d not in axes
    ]
    op = _LOGICAL.get(eqn.primitive.name) if in_avals[0].dtype == bool else None
    if op:
        sigs += [Sig((Split(d),), (P(op),)) for d in axes] + [Sig((P(op),), (P(op),))]
    else:
        sigs += [Sig((Split(d),), (B,)) for d in axes]
    return sigs + [Sig((B,), (B,))]


_LOGICAL = {"reduce_and": "min", "reduce_or": "max"}


def _reduced_split_axes(eqn, nd) -> tuple[int, ...]:
    """The placement axes splitting a dim the reduction removes (``axes`` of
    a named reduction, ``dimensions`` of ``lax.reduce``)."""
    dims = eqn.params["axes"] if "axes" in eqn.params else eqn.params["dimensions"]
    return tuple(a for a, s in enumerate(nd) if isinstance(s, Split) and s.dim in dims)


def _gathered_bytes(shape, nd, grid, pieces: int, itemsize: int) -> int:
    """Bytes all devices receive gathering the other ``pieces - 1`` pieces'
    results (of ``shape``, in layout ``nd``)."""
    return math.prod(grid) * (pieces - 1) * math.prod(local_shape(shape, nd, grid)) * itemsize


@set_comm("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def kept_dim_reduction_comm(eqn, in_avals, ins, outs, grid):
    """Over a split dim (and not a boolean partial): every device gathers each
    piece's result (an argmax: its value and its index)."""
    axes = _reduced_split_axes(eqn, ins[0])
    if not axes or isinstance(outs[0][axes[0]], Partial):
        return []
    pieces = math.prod(grid[a] for a in axes)
    out = eqn.outvars[0].aval
    itemsize = out.dtype.itemsize + (in_avals[0].dtype.itemsize if eqn.primitive.name in _ARG else 0)
    # each reduction gathers its own results: two reductions of one operand
    # (an argmax and an argmin, or two argmaxes of other index dtypes) share
    # no exchange, unlike two reads of one halo
    return [
        Comm(
            "all_gather",
            axes,
            _gathered_bytes(out.shape, outs[0], grid, pieces, itemsize),
            detail=_op_detail(eqn),
        )
    ]


def _op_detail(eqn) -> tuple:
    """A ``Comm.detail`` naming the op and its params: what it gathers is its own."""
    return (eqn.primitive.name, tuple(sorted((k, str(v)) for k, v in eqn.params.items())))


_ARG = {"argmax": jnp.argmax, "argmin": jnp.argmin}
_REDUCE_PIECES = {"reduce_prod": jnp.multiply, "reduce_and": jnp.bitwise_and, "reduce_or": jnp.bitwise_or}


@set_local("argmax", "argmin", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def kept_dim_reduction_local(eqn, ins, ctx):
    x = ins[0]
    y = eqn.primitive.bind(x, **eqn.params)
    axes = _reduced_split_axes(eqn, ctx.in_nd[0])
    if not axes or isinstance(ctx.out_nd[0][axes[0]], Partial):
        return [y]
    group = axis_arg([ctx.placement.axis_names[a] for a in axes])
    name = eqn.primitive.name
    if name in _ARG:
        (dim,) = eqn.params["axes"]
        # even pieces (an op with communication of its own never takes an uneven split)
        offset = group_index(axes, ctx.placement.axis_names, ctx.grid) * x.shape[dim]
        # argmax's indices are in range: gathered without wrapping or masking them
        value = jnp.take_along_axis(
            x, jnp.expand_dims(y, dim), axis=dim, mode="clip", wrap_negative_indices=False
        ).squeeze(dim)
        values = lax.all_gather(value, group, axis=0, tiled=False)
        indices = lax.all_gather(y + offset.astype(y.dtype), group, axis=0, tiled=False)
        # the first piece holding the winning value holds the first index of it (NaN included)
        winner = _ARG[name](values, axis=0)
        return [
            jnp.take_along_axis(indices, winner[None], axis=0, mode="clip", wrap_negative_indices=False)[0]
        ]
    pieces = lax.all_gather(y, group, axis=0, tiled=False)
    combine = (
        jnp.not_equal
        if name == "reduce_xor" and y.dtype == bool
        else _REDUCE_PIECES.get(name, jnp.bitwise_xor)
    )
    out = pieces[0]
    for k in range(1, pieces.shape[0]):  # a handful of pieces; lax.reduce has no xor on booleans
        out = combine(out, pieces[k])
    return [out.astype(y.dtype)]


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
    detail = _totals_detail(eqn, shape[eqn.params["axis"]])
    return [Comm("all_gather", axes, math.prod(grid) * (pieces - 1) * row, detail=detail)]


def _totals_detail(eqn, extent: int) -> tuple:
    """What a cumulative op's gather sends: its pieces' totals, which depend on
    the op and its params. A cummax and a cummin of one operand (or a cumsum and
    a reverse cumsum) send different rows and share no exchange; the same op
    twice sends the same rows, gathered once (``LocalCtx.memo``). Pieces of one
    row along the axis (``extent``, the local length) are their own totals,
    whatever the op and direction: every cumulative op of the operand sends
    the operand's pieces, once (XLA merged such gathers before the lowering did)."""
    return ("pieces", eqn.params["axis"]) if extent == 1 else _op_detail(eqn)


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
    totals = ctx.memo(
        0,
        _totals_detail(eqn, y.shape[axis]),
        lambda: lax.all_gather(total, axis_arg([names[a] for a in axes]), axis=0, tiled=False),
    )
    me = group_index(axes, names, ctx.grid)
    before = jnp.arange(pieces) > me if reverse else jnp.arange(pieces) < me
    before = before.reshape((pieces,) + (1,) * total.ndim)
    carry = _REDUCE[name](jnp.where(before, totals, _identity(name, y.dtype)), axis=0)
    return [_COMBINE[name](carry, y).astype(y.dtype)]


@register("reduce")
def generic_reduction(eqn, in_avals):
    """``lax.reduce`` with a function of its own (``(value, index)`` pairs
    reduced to an argmax by hand, a monoid of the user's): ``y_i =
    reduce(x_i)`` on every operand alike, inits broadcast. A split of a kept
    dim stays a split. Over a split dim each piece is reduced and the
    pieces' results are gathered and reduced again with the same function,
    ``y = reduce_i y_i`` (B). That is the reduction of the whole where the
    function is associative and commutative, as XLA's reduce assumes (it
    reduces in an order of its own: a "first non-zero" function over two
    dims does not return the first in row-major order even on one CPU
    device), and where each init ``e`` is a constant the function keeps
    (``f(e, e) == e``, checked: an identity such as 0 for a sum or ``-inf``
    for a max), since every piece applies it once more. A reduce whose
    inits are computed, or not kept (``lax.add`` from 1), is gathered whole
    first."""
    n = len(eqn.outvars)
    axes = tuple(eqn.params["dimensions"])
    inits = (B,) * n
    reducible = _inits_kept(eqn)
    sigs = []
    for d in range(rank(in_avals[0])):
        if d not in axes:
            sigs.append(Sig((Split(d),) * n + inits, (Split(d - sum(a < d for a in axes)),) * n))
        elif reducible:
            sigs.append(Sig((Split(d),) * n + inits, (B,) * n))
    return sigs + [Sig((B,) * (2 * n), (B,) * n)]


def _inits_kept(eqn) -> bool:
    """Whether every init of a generic reduce is a literal ``e`` with
    ``f(e, e) == e`` (NaN equal to NaN), evaluated now, outside any trace."""
    n = len(eqn.outvars)
    inits = eqn.invars[n:]
    if not all(isinstance(v, Literal) for v in inits):
        return False
    values = [np.asarray(v.val) for v in inits]
    jaxpr = eqn.params["jaxpr"]
    closed = jaxpr if isinstance(jaxpr, ClosedJaxpr) else ClosedJaxpr(jaxpr, [])
    with jax.ensure_compile_time_eval():
        got = jaxpr_as_fun(closed)(*values, *values)
    return all(np.array_equal(np.asarray(g), v, equal_nan=v.dtype.kind in "fc") for g, v in zip(got, values))


@set_comm("reduce")
def generic_reduction_comm(eqn, in_avals, ins, outs, grid):
    """Over a split dim: every device gathers each piece's result of each
    operand (one all-gather per result)."""
    axes = _reduced_split_axes(eqn, ins[0])
    if not axes:
        return []
    pieces = math.prod(grid[a] for a in axes)
    return [
        Comm(
            "all_gather",
            axes,
            _gathered_bytes(v.aval.shape, nd, grid, pieces, v.aval.dtype.itemsize),
            detail=(*_op_detail(eqn), k),
        )
        for k, (v, nd) in enumerate(zip(eqn.outvars, outs))
    ]


@set_local("reduce")
def generic_reduction_local(eqn, ins, ctx):
    ys = eqn.primitive.bind(*ins, **eqn.params)
    axes = _reduced_split_axes(eqn, ctx.in_nd[0])
    if not axes:
        return list(ys)
    group = axis_arg([ctx.placement.axis_names[a] for a in axes])
    pieces = [lax.all_gather(y, group, axis=0, tiled=False) for y in ys]
    inits = ins[len(ys) :]
    return list(eqn.primitive.bind(*pieces, *inits, **{**eqn.params, "dimensions": (0,)}))

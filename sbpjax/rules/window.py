"""Windowed reductions: pooling (``reduce_window_*``) and its derivatives.

Per device: ``y_i = reduce_window(x_i)`` where ``x`` is split only on dims the
window does not slide over (window size 1, stride 1, no padding, no dilation):
the batch and channel dims of a CNN's pooling, so a data-parallel or
channel-split model pools without moving anything. A split of a dim the
window slides over (image height) runs with a halo exchange
(``sbpjax.rules.halo``): the pieces' border rows are sent to their
neighbours, and the pieces at either end get the reduction's init value
(``-inf`` for a max), as the whole op pads. Non-overlapping windows (a 2x2
max pool with stride 2) need no halo and move nothing. The derivatives are
split on a sliding dim only where windows do not cross pieces (no halo).

Partial algebra: a window sum is linear (``sum_w sum_i x_i = sum_i sum_w x_i``:
P(sum) passes), a window max/min commutes with a max/min over devices
(P(max)/P(min) pass); the derivatives ``select_and_scatter_add`` (max pooling)
and ``select_and_gather_add`` are linear in the cotangent for a broadcast
operand.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from sbpjax.rules import B, P, Sig, rank, register, set_comm, set_local
from sbpjax.rules.halo import Slide, exchange, halo, halo_comm, local_shape, mesh_axes, split_axes
from sbpjax.sbp import Split


def _slides(eqn, in_avals, out_aval) -> list[Slide]:
    p = eqn.params
    r = len(in_avals[0].shape)
    ones = (1,) * r
    pad = p.get("padding", ((0, 0),) * r)
    return [
        Slide(
            n=in_avals[0].shape[d],
            k=p["window_dimensions"][d],
            m=out_aval.shape[d],
            stride=p.get("window_strides", ones)[d],
            lo=pad[d][0],
            hi=pad[d][1],
            lhs_dil=p.get("base_dilation", ones)[d],
            rhs_dil=p.get("window_dilation", ones)[d],
        )
        for d in range(r)
    ]


def _halos(eqn, in_avals, ins, outs, grid):
    """Per split dim of the pooled operand: (dim, Halo, axes); ``None`` when
    one cannot be run. Untouched dims have an empty halo."""
    found = []
    for d, sl in enumerate(_slides(eqn, in_avals, eqn.outvars[0].aval)):
        axes = split_axes(ins[0], d)
        if not axes:
            continue
        if split_axes(outs[0], d) != axes:
            return None
        h = halo(sl, math.prod(grid[a] for a in axes), split_window=False)
        if h is None:
            return None
        found.append((d, h, axes))
    return found


def _window_comm(eqn, in_avals, ins, outs, grid):
    found = _halos(eqn, in_avals, ins, outs, grid)
    if found is None:
        return None
    n = len(eqn.outvars)
    comms = []
    for j in range(n):  # each pooled operand is exchanged (a generic reduce_window may have several)
        shape, done = local_shape(in_avals[j].shape, ins[j], grid), ()
        for d, h, axes in found:
            done += ((d, h.left, h.right, axes, eqn.primitive.name),)
            comms.append(halo_comm(shape, in_avals[j].dtype.itemsize, d, h, axes, grid, j, done))
            shape[d] += h.left + h.right
    return [c for c in comms if c.bytes]


def _fill(name, dtype):
    """The value a window reduction pads with: its identity."""
    if name == "reduce_window_sum":
        return None  # zeros
    info = np.finfo(dtype) if jnp.issubdtype(dtype, jnp.floating) else np.iinfo(dtype)
    big = np.inf if jnp.issubdtype(dtype, jnp.floating) else info.max
    small = -np.inf if jnp.issubdtype(dtype, jnp.floating) else info.min
    return small if name == "reduce_window_max" else big


def _window_local(eqn, ins, ctx):
    in_avals = [v.aval for v in eqn.invars]
    found = _halos(eqn, in_avals, ctx.in_nd, ctx.out_nd, ctx.grid)
    n = len(eqn.outvars)
    name = eqn.primitive.name
    padding = [tuple(c) for c in eqn.params["padding"]]
    xs = list(ins[:n])
    for j in range(n):
        # a generic reduce_window pads with its init operand (broadcast: the same on every device)
        fill = ins[n + j] if name == "reduce_window" else _fill(name, xs[j].dtype)
        done: tuple = ()
        for d, h, axes in found:
            done += ((d, h.left, h.right, axes, name),)
            if h.received or h.left < 0 or h.right < 0:
                xs[j] = ctx.memo(
                    j,
                    ("halo_exchange", done),
                    lambda x=xs[j], d=d, h=h, axes=axes, fill=fill: exchange(
                        x, d, h, *mesh_axes(ctx, axes), fill=fill
                    ),
                )
            padding[d] = h.pad
    outs = eqn.primitive.bind(*xs, *ins[n:], **{**eqn.params, "padding": tuple(padding)})
    return list(outs) if eqn.primitive.multiple_results else [outs]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def pooling(eqn, in_avals):
    """``y_i = pool(x_i)`` for splits of any dim (a halo exchange where the
    window slides over it); the matching partial passes."""
    op = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}[
        eqn.primitive.name
    ]
    splits = [Sig((Split(d),), (Split(d),)) for d in range(rank(in_avals[0]))]
    return splits + [Sig((P(op),), (P(op),)), Sig((B,), (B,))]


@register("reduce_window")
def reduce_window(eqn, in_avals):
    """A general window reduction (operands, then one scalar init value each):
    splits of any dim (a halo exchange where the window slides over it, the
    ends padded with the init value), init values broadcast."""
    n = len(eqn.outvars)
    splits = [Sig((Split(d),) * n + (B,) * n, (Split(d),) * n) for d in range(rank(in_avals[0]))]
    return splits + [Sig((B,) * (2 * n), (B,) * n)]


set_comm("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")(_window_comm)
set_local("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")(_window_local)


def _no_halo_split(eqn, in_avals, ins, outs, grid):
    """Pooling derivatives on a dim the window slides over: only where each
    window lies inside one piece (windows no longer than their stride, no
    low padding, aligned pieces), so no halo is needed; then the local op runs
    unpadded on that dim."""
    operand = in_avals[1]
    out = eqn.outvars[0].aval
    pooled = in_avals[0] if eqn.primitive.name == "select_and_scatter_add" else out
    for d in range(len(operand.shape)):
        axes = split_axes(ins[1], d)
        if not axes:
            continue
        pieces = math.prod(grid[a] for a in axes)
        p = eqn.params
        k, s = p["window_dimensions"][d], p["window_strides"][d]
        dils = [p.get(n, (1,) * len(operand.shape))[d] for n in ("base_dilation", "window_dilation")]
        n, m = operand.shape[d], pooled.shape[d]
        if not (k <= s and p["padding"][d][0] == 0 and n == m * s and m % pieces == 0 and dils == [1, 1]):
            return None
    return []


def _pooling_derivative_local(eqn, ins, ctx):
    padding = [tuple(c) for c in eqn.params["padding"]]
    for d in range(len(padding)):
        if split_axes(ctx.in_nd[1], d):
            padding[d] = (0, 0)
    return [eqn.primitive.bind(*ins, **{**eqn.params, "padding": tuple(padding)})]


@register("select_and_scatter_add", "select_and_gather_add")
def pooling_derivative(eqn, in_avals):
    """``select_and_scatter_add(ct, x)`` (max pooling's transpose) and
    ``select_and_gather_add(t, x)`` (its tangent): both operands split alike
    on dims where no window crosses a piece; linear in the first operand, so
    (P, B) -> P."""
    splits = [Sig((Split(d), Split(d)), (Split(d),)) for d in range(rank(in_avals[1]))]
    return splits + [Sig((P(), B), (P(),)), Sig((B, B), (B,))]


_no_halo_split.moves_data = False  # type: ignore[attr-defined]  # it only refuses (see sbpjax.rules.coverage)
set_comm("select_and_scatter_add", "select_and_gather_add")(_no_halo_split)
set_local("select_and_scatter_add", "select_and_gather_add")(_pooling_derivative_local)

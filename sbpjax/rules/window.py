"""Windowed reductions: pooling (``reduce_window_*``) and its derivatives.

Per device: ``y_i = reduce_window(x_i)`` where ``x`` is split only on dims the
window does not slide over (window size 1, stride 1, no padding, no dilation):
the batch and channel dims of a CNN's pooling, so a data-parallel or
channel-split model pools without moving anything. A split of a dim the
window slides over (image height) runs with a halo exchange
(``sbpjax.rules.halo``): the pieces' border rows are sent to their
neighbours, and the pieces at either end get the reduction's init value
(``-inf`` for a max), as the whole op pads. Non-overlapping windows (a 2x2
max pool with stride 2) need no halo and move nothing. The derivatives take
halos too: ``select_and_gather_add`` (a max pool's tangent) like the pool,
``select_and_scatter_add`` (its gradient) with the windows of its
neighbours that reach into its piece and every row they cover.

Partial algebra: a window sum is linear (``sum_w sum_i x_i = sum_i sum_w x_i``:
P(sum) passes), a window max/min commutes with a max/min over devices
(P(max)/P(min) pass); the derivatives ``select_and_scatter_add`` (max pooling)
and ``select_and_gather_add`` are linear in the cotangent for a broadcast
operand.
"""

from __future__ import annotations

import math

from jax import lax

from sbpjax.boxing.extremes import fill_value
from sbpjax.rules import B, P, Sig, local_shape, rank, register, set_comm, set_local, split_axes
from sbpjax.rules.halo import Halo, Slide, halo, halo_comms, run_halos
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


def _halos(eqn, in_avals, ins, outs, grid, pooled=(0,)):
    """Per split dim of the pooled operand(s) ``pooled`` (split alike, the
    first one's shape read): (dim, Halo, axes); ``None`` when one cannot be
    run. Dims the window leaves as they are (``Slide.untouched``) need none
    and are left out."""
    found = []
    for d, sl in enumerate(_slides(eqn, [in_avals[pooled[0]]], eqn.outvars[0].aval)):
        axes = split_axes(ins[pooled[0]], d)
        if not axes:
            continue
        if any(split_axes(ins[j], d) != axes for j in pooled) or split_axes(outs[0], d) != axes:
            return None
        if sl.untouched:
            continue
        h = halo(sl, math.prod(grid[a] for a in axes), split_window=False)
        if h is None:
            return None
        found.append((d, h, axes))
    return found


_POOL_OP = {"reduce_window_sum": "sum", "reduce_window_max": "max", "reduce_window_min": "min"}


def _fill(name, dtype):
    """The value a window reduction pads with: its identity (None: zeros)."""
    return None if name == "reduce_window_sum" else fill_value(_POOL_OP[name], dtype)


def _fill_key(eqn, j):
    """Names the edge value of operand ``j``'s halo: the reduction, or for a
    generic reduce_window (whose init value is an operand) this equation's."""
    if eqn.primitive.name == "reduce_window":
        return ("init", id(eqn), j)
    return None if eqn.primitive.name == "reduce_window_sum" else _POOL_OP[eqn.primitive.name]


def _operands_comm(in_avals, ins, grid, per_operand) -> list:
    """The exchanges of every operand's halo steps (``run_halos``' form)."""
    comms = []
    for j, steps in enumerate(per_operand):
        shape = local_shape(in_avals[j].shape, ins[j], grid)
        comms += halo_comms(shape, in_avals[j].dtype.itemsize, steps, grid, j)
    return comms


def _window_comm(eqn, in_avals, ins, outs, grid):
    found = _halos(eqn, in_avals, ins, outs, grid)
    if found is None:
        return None
    # each pooled operand (a generic reduce_window may have several); the fill value is not sent
    per_operand = [
        [(d, h, axes, None, _fill_key(eqn, j)) for d, h, axes in found] for j in range(len(eqn.outvars))
    ]
    return _operands_comm(in_avals, ins, grid, per_operand)


def _window_local(eqn, ins, ctx):
    in_avals = [v.aval for v in eqn.invars]
    found = _halos(eqn, in_avals, ctx.in_nd, ctx.out_nd, ctx.grid)
    n = len(eqn.outvars)
    name = eqn.primitive.name
    padding = [tuple(c) for c in eqn.params["padding"]]
    for d, h, _ in found:
        padding[d] = h.pad
    xs = list(ins[:n])
    for j in range(n):
        # a generic reduce_window pads with its init operand (broadcast: the same on every device)
        fill = ins[n + j] if name == "reduce_window" else _fill(name, xs[j].dtype)
        key = _fill_key(eqn, j)
        xs[j] = run_halos(xs[j], [(d, h, axes, fill, key) for d, h, axes in found], ctx, j)
    outs = eqn.primitive.bind(*xs, *ins[n:], **{**eqn.params, "padding": tuple(padding)})
    return list(outs) if eqn.primitive.multiple_results else [outs]


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min")
def pooling(eqn, in_avals):
    """``y_i = pool(x_i)`` for splits of any dim (a halo exchange where the
    window slides over it); the matching partial passes."""
    op = _POOL_OP[eqn.primitive.name]
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


def _select_op(eqn) -> str:
    """The selection as a reduction: ``ge`` / ``gt`` pick the max. Positions
    outside the operand hold its identity, never chosen over a real element."""
    return "max" if eqn.params["select_prim"].name in ("ge", "gt") else "min"


def _scatter_halos(eqn, in_avals, ins, outs, grid):
    """``select_and_scatter_add(source, operand)`` split along a dim the window
    slides over: per split dim (dim, axes, source halo, operand halo). Each
    device takes the windows that touch its piece (its own and up to
    ``s_left`` / ``s_right`` of its neighbours') with every operand element
    they cover, selects and scatters locally, and keeps its piece. Only where
    ``n == m * stride`` (each piece starts the same number of windows)."""
    p = eqn.params
    source, operand = in_avals
    found = []
    for d in range(len(operand.shape)):
        axes = split_axes(ins[1], d)
        if not axes:
            continue
        if split_axes(ins[0], d) != axes or split_axes(outs[0], d) != axes:
            return None
        pieces = math.prod(grid[a] for a in axes)
        k, st, (lo, hi) = p["window_dimensions"][d], p["window_strides"][d], p["padding"][d]
        n, m = operand.shape[d], source.shape[d]
        if Slide(n, k, m, st, lo, hi).untouched:
            continue  # no window crosses its pieces, even or not
        if n % pieces or m % pieces or n != m * st:
            return None
        n_l, m_l = n // pieces, m // pieces
        # windows o cover operand [o * st - lo, o * st - lo + k): those reaching
        # this piece run from s_left before its own first to s_right past its last
        s_left = max(0, (k - 1 - lo) // st)
        s_right = max(0, (lo - 1) // st + 1)
        left = s_left * st + lo
        right = (s_right - 1) * st - lo + k  # < 0: the piece's last rows are in no window
        if lo < 0 or max(s_left, s_right) > m_l or max(left, right) > n_l:
            return None
        # (a negative right is not trimmed: the output keeps every row of the
        # piece, and the extension of at most st - k rows leaves the count of
        # windows unchanged)
        found.append((d, axes, Halo(s_left, s_right, (0, 0)), Halo(left, max(right, 0), (0, 0))))
    return found


def _scatter_steps(eqn, found, operand_dtype):
    op = _select_op(eqn)
    source = [(d, hs, axes, None, None) for d, axes, hs, _ in found]
    operand = [(d, ho, axes, fill_value(op, operand_dtype), op) for d, axes, _, ho in found]
    return source, operand


def _scatter_comm(eqn, in_avals, ins, outs, grid):
    found = _scatter_halos(eqn, in_avals, ins, outs, grid)
    if found is None:
        return None
    return _operands_comm(in_avals, ins, grid, _scatter_steps(eqn, found, in_avals[1].dtype))


def _scatter_local(eqn, ins, ctx):
    in_avals = [v.aval for v in eqn.invars]
    found = _scatter_halos(eqn, in_avals, ctx.in_nd, ctx.out_nd, ctx.grid)
    source_steps, operand_steps = _scatter_steps(eqn, found, ins[1].dtype)
    # windows that do not exist (past either end) receive zeros: they add nothing
    src = run_halos(ins[0], source_steps, ctx, 0)
    operand = run_halos(ins[1], operand_steps, ctx, 1)
    padding = [tuple(c) for c in eqn.params["padding"]]
    for d, *_ in found:
        padding[d] = (0, 0)
    out = eqn.primitive.bind(src, operand, **{**eqn.params, "padding": tuple(padding)})
    for d, _, _, ho in found:
        out = lax.slice_in_dim(out, ho.left, ho.left + ctx.local_out_shapes[0][d], axis=d)
    return [out]


def _gather_halos(eqn, in_avals, ins, outs, grid):
    """``select_and_gather_add(tangents, operand)``: a pooling of two operands
    (the output is split like a pool's); both get the pool's halo."""
    return _halos(eqn, in_avals, ins, outs, grid, pooled=(1, 0))


def _gather_steps(eqn, found, operand_dtype):
    op = _select_op(eqn)
    tangents = [(d, h, axes, None, None) for d, h, axes in found]
    operand = [(d, h, axes, fill_value(op, operand_dtype), op) for d, h, axes in found]
    return tangents, operand


def _gather_comm(eqn, in_avals, ins, outs, grid):
    found = _gather_halos(eqn, in_avals, ins, outs, grid)
    if found is None:
        return None
    return _operands_comm(in_avals, ins, grid, _gather_steps(eqn, found, in_avals[1].dtype))


def _gather_local(eqn, ins, ctx):
    in_avals = [v.aval for v in eqn.invars]
    found = _gather_halos(eqn, in_avals, ctx.in_nd, ctx.out_nd, ctx.grid)
    padding = [tuple(c) for c in eqn.params["padding"]]
    for d, h, _ in found:
        padding[d] = h.pad
    xs = [
        run_halos(x, steps, ctx, j)
        for j, (x, steps) in enumerate(zip(ins, _gather_steps(eqn, found, ins[1].dtype)))
    ]
    return [eqn.primitive.bind(*xs, **{**eqn.params, "padding": tuple(padding)})]


@register("select_and_scatter_add", "select_and_gather_add")
def pooling_derivative(eqn, in_avals):
    """``select_and_scatter_add(ct, x)`` (max pooling's transpose) and
    ``select_and_gather_add(t, x)`` (its tangent): both operands split alike
    on any dim (with halos where windows cross pieces); linear in the first
    operand, so (P, B) -> P."""
    splits = [Sig((Split(d), Split(d)), (Split(d),)) for d in range(rank(in_avals[1]))]
    return splits + [Sig((P(), B), (P(),)), Sig((B, B), (B,))]


set_comm("select_and_scatter_add")(_scatter_comm)
set_local("select_and_scatter_add")(_scatter_local)
set_comm("select_and_gather_add")(_gather_comm)
set_local("select_and_gather_add")(_gather_local)

"""Shape primitives: splits follow the dims they move to.

Per device the op runs on its piece with shape parameters made local
(``broadcast_in_dim``'s shape, ``reshape``'s sizes, ``slice`` limits...). A split
survives when its dim maps to one output dim: ``transpose`` permutes it,
``broadcast_in_dim`` carries it to its target dim, ``reshape`` keeps it when the
split dim is the major part of a merged dim or the major dim of a split one,
``squeeze`` renumbers it, ``concatenate``/``pad``/``slice``/``rev`` keep splits
off the dims they touch. All of these are linear, so partials pass through
(``concatenate`` needs every operand partial the same way).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from sbpjax.rules import (
    B,
    P,
    Sig,
    rank,
    register,
    set_comm,
    set_comm_if,
    set_comm_sig_if,
    set_local,
    shape_of,
)
from sbpjax.rules.shift_run import run_shifts
from sbpjax.rules.shifts import (
    may_shift,
    placements,
    shift_comms,
    shifts,
    splits_moved_dim,
    step_comms,
)
from sbpjax.sbp import Split

ALL_P = ("sum", "max", "min")


def _partials(n_in, n_out=1):
    return [Sig((P(op),) * n_in, (P(op),) * n_out) for op in ALL_P]


def moved_in_place(aval) -> list[Sig]:
    """The signatures of an op that moves each element to another place of the
    same shape (a reversal, a rotation): any split dim kept (the rule moves
    pieces between devices where that dim is the one moved), every partial
    passes, B."""
    return [Sig((Split(d),), (Split(d),)) for d in range(rank(aval))] + _partials(1) + [Sig((B,), (B,))]


@register("transpose")
def transpose(eqn, in_avals):
    """``y_i = transpose(x_i)``: S(d) -> S(perm.index(d))."""
    perm = tuple(eqn.params["permutation"])
    return (
        [Sig((Split(d),), (Split(perm.index(d)),)) for d in range(len(perm))]
        + _partials(1)
        + [Sig((B,), (B,))]
    )


@register("broadcast_in_dim")
def broadcast_in_dim(eqn, in_avals):
    """``y_i = broadcast(x_i)``: S(d) -> S(bdims[d]) where the dim keeps its size;
    B -> S(j) for a new or size-1 dim j (each device builds its own piece)."""
    bd = tuple(eqn.params["broadcast_dimensions"])
    out_shape = tuple(eqn.params["shape"])
    in_shape = shape_of(in_avals[0])
    sigs = [
        Sig((Split(d),), (Split(bd[d]),))
        for d in range(len(in_shape))
        if in_shape[d] == out_shape[bd[d]] and in_shape[d] > 1
    ]
    for j in range(len(out_shape)):
        if j not in bd or in_shape[bd.index(j)] == 1:
            sigs.append(Sig((B,), (Split(j),)))
    return sigs + _partials(1) + [Sig((B,), (B,))]


def reshape_map(in_shape, out_shape) -> dict:
    """Input dim -> output dim for splits that survive a row-major reshape: the
    dims start at the same flat offset. With ``pre`` elements' worth of outer
    index before both, the j-th of p even pieces of either is, for each outer
    index, the flat run ``[j, j + 1) * total / (pre * p)``: the same elements,
    whatever the sizes of the two dims (a (16, 96) -> (384, 4) reshape keeps a
    split of the rows, though 384 merges the rows with part of the columns).
    Uneven pieces of dims of different sizes are not the same runs; the
    uneven-split check (``sbpjax.compiler.uneven.fits``) refuses those."""
    out = {}
    pre_out = [math.prod(out_shape[:k]) for k in range(len(out_shape) + 1)]
    for d, n in enumerate(in_shape):
        if n <= 1:
            continue
        pre = math.prod(in_shape[:d])
        for k in range(len(out_shape)):
            if pre_out[k] == pre and out_shape[k] > 1:
                out[d] = k
                break
    return out


@register("reshape")
def reshape(eqn, in_avals):
    """``y_i = reshape(transpose(x_i, dimensions), local sizes)``: a split
    survives as in ``reshape_map`` of the transposed shape. ``dimensions`` is
    the transpose JAX's own rules still emit (a grouped convolution's input
    gradient reorders its kernel's groups with one)."""
    order = _reshape_order(eqn, in_avals[0])
    shape = shape_of(in_avals[0])
    mapping = reshape_map(tuple(shape[d] for d in order), tuple(eqn.params["new_sizes"]))
    return (
        [Sig((Split(order[t]),), (Split(k),)) for t, k in mapping.items()] + _partials(1) + [Sig((B,), (B,))]
    )


def _reshape_order(eqn, aval) -> tuple:
    """The order ``reshape`` reads its operand's dims in: ``dimensions``, or as they are."""
    return tuple(eqn.params.get("dimensions") or range(rank(aval)))


@register("squeeze")
def squeeze(eqn, in_avals):
    """``y_i = squeeze(x_i)``: S(d) -> S(d - removed dims before d)."""
    dims = tuple(eqn.params["dimensions"])
    return (
        [
            Sig((Split(d),), (Split(d - sum(x < d for x in dims)),))
            for d in range(rank(in_avals[0]))
            if d not in dims
        ]
        + _partials(1)
        + [Sig((B,), (B,))]
    )


@register("expand_dims")
def expand_dims(eqn, in_avals):
    dims = tuple(eqn.params["dimensions"])
    out_rank = rank(in_avals[0]) + len(dims)
    kept = [j for j in range(out_rank) if j not in dims]
    return (
        [Sig((Split(d),), (Split(kept[d]),)) for d in range(rank(in_avals[0]))]
        + _partials(1)
        + [Sig((B,), (B,))]
    )


@register("concatenate")
def concatenate(eqn, in_avals):
    """``y_i = concat(a_i, b_i)`` along a dim none of them is split on; partials
    of one op concatenate to that partial. Along the split dim of the first
    operand, the others whole, where that operand's pieces are the result's
    cut short (``shifts.prefix_aligned``): the others fill the holes at the
    end (``jnp.roll(tokens, -1, axis=1)``: ``x[:, 1:]`` then ``x[:, :1]``).
    And along a dim all of them are split on: each operand's rows move to
    the result's pieces they fall in (``shifts.placements``: the gradient of
    ``q, k, v = jnp.split(qkv, 3, -1)`` with ``qkv``'s columns split, whose
    thirds do not line up with the pieces)."""
    dim = eqn.params["dimension"]
    n = len(in_avals)
    tail = (
        [Sig((Split(dim),) + (B,) * (n - 1), (Split(dim),)), Sig((Split(dim),) * n, (Split(dim),))]
        if n > 1
        else []
    )
    return (
        [Sig((Split(d),) * n, (Split(d),)) for d in range(rank(in_avals[0])) if d != dim]
        + tail
        + _partials(n)
        + [Sig((B,) * n, (B,))]
    )


def concatenate_comms(eqn, in_avals, ins, outs, grid):
    """The rows each operand sends to the result's pieces they fall in
    (``shifts.placements``), along a dim all of them are split on; nothing
    otherwise."""
    steps = placements(eqn, ins, outs, grid)
    if steps is None:
        return []
    return [c for k, st in enumerate(steps) for c in step_comms([st], in_avals[k], ins[k], grid, operand=k)]


def local_concatenate(eqn, ins, ctx):
    """Along a split dim: each operand's rows moved to the result's pieces
    (all split there, ``shifts.placements``), or the first operand's block
    with the positions past its rows taken from the other operands (whole),
    as the result's piece there reads them."""
    dim = eqn.params["dimension"]
    if not ctx.is_split(ctx.out_nd[0], dim):
        return [lax.concatenate(ins, dim)]
    if len(ins) > 1 and all(ctx.is_split(nd, dim) for nd in ctx.in_nd):
        return [_placed(eqn, ins, ctx, dim)]
    head, tail = ins[0], lax.concatenate(ins[1:], dim)
    if not tail.shape[dim]:  # only empty operands after it
        return [head]
    at = ctx.offset(ctx.out_nd[0], shape_of(eqn.outvars[0].aval), dim)
    rows, here = _rows_at(tail, eqn.invars[0].aval.shape[dim], at, head, dim)
    return [jnp.where(here, rows, head)]


def _placed(eqn, ins, ctx, dim):
    """The concatenation of operands split along ``dim``: each one's rows
    moved to this device's piece of the result (a pad of it by the rows
    before and after), taken where they fall."""
    steps = placements(eqn, ctx.in_nd, ctx.out_nd, ctx.grid)
    assert steps is not None, "a concatenation signature the planner could not run"
    at = ctx.offset(ctx.out_nd[0], shape_of(eqn.outvars[0].aval), dim)
    y, start = None, 0
    for k, (x, st) in enumerate(zip(ins, steps)):
        moved = run_shifts(x, [st], ctx, fill=jnp.zeros((), x.dtype), operand=k)
        if y is None:
            y = moved
        else:  # the rows from this operand's first on are its
            rows = jnp.asarray(at, jnp.int32) + jnp.arange(moved.shape[dim], dtype=jnp.int32)
            y = jnp.where((rows >= start).reshape([-1 if e == dim else 1 for e in range(y.ndim)]), moved, y)
        start += shape_of(eqn.invars[k].aval)[dim]
    return y


def _rows_at(u, start, at, block, dim):
    """``u`` (whole along ``dim``) placed at global row ``start`` of a value
    whose piece here begins at global row ``at`` and is held in ``block``:
    ``u``'s row for each of the block's rows, and where one falls in ``u``."""
    rows = jnp.asarray(at, jnp.int32) + jnp.arange(block.shape[dim], dtype=jnp.int32) - start
    here = ((rows >= 0) & (rows < u.shape[dim])).reshape([-1 if e == dim else 1 for e in range(block.ndim)])
    return jnp.take(u, rows, axis=dim, mode="clip"), here  # rows outside u: ``here`` masks them


@register("pad")
def pad(eqn, in_avals):
    """``y_i = pad(x_i, v)``: the pieces move as ``sbpjax.rules.shifts``
    says (in place where they line up, as the gradient of ``logits[:, :-1]``;
    one exchange per side for a shift, as the gradient of ``tokens[:, 1:]``;
    a dim with interior padding, as the gradient of ``x[:, ::2]``, only
    where every piece of the result is a multiple of the stride); v broadcast."""
    return [Sig((Split(d), B), (Split(d),)) for d in range(rank(in_avals[0]))] + [Sig((B, B), (B,))]


@register("slice")
def slice_(eqn, in_avals):
    """``y_i = slice(x_i)``: split dims taken whole, or moved as
    ``sbpjax.rules.shifts`` says (in place where the pieces line up, as
    ``logits[:, :-1]``; one exchange per side for a shift, as
    ``tokens[:, 1:]``; a strided dim, as ``x[:, ::2]``, only where every
    piece is a multiple of the stride: each device keeps its own rows)."""
    return (
        [Sig((Split(d),), (Split(d),)) for d in range(rank(in_avals[0]))] + _partials(1) + [Sig((B,), (B,))]
    )


# a slice or pad that moves rows along a split dim exchanges them (sbpjax.rules.shifts)
set_comm("slice", "pad")(shift_comms)
# a concatenation along a dim its operands are split on moves their rows (shifts.placements)
set_comm("concatenate")(concatenate_comms)
set_comm_if("slice", "pad")(may_shift)
set_comm_sig_if("slice", "pad")(splits_moved_dim)


@register("dynamic_slice")
def dynamic_slice(eqn, in_avals):
    """``y_i = dynamic_slice(x_i, starts)`` for splits of dims taken whole; the
    start indices are broadcast, and clamped as XLA clamps them (a negative
    start the program leaves unwrapped reads from 0)."""
    sizes = eqn.params["slice_sizes"]
    n = shape_of(in_avals[0])
    k = len(in_avals) - 1
    full = [d for d in range(len(n)) if sizes[d] == n[d]]
    return (
        [Sig((Split(d),) + (B,) * k, (Split(d),)) for d in full]
        + [Sig((P(op),) + (B,) * k, (P(op),)) for op in ALL_P]
        + [Sig((B,) * (k + 1), (B,))]
    )


@register("dynamic_update_slice")
def dynamic_update_slice(eqn, in_avals):
    """``y_i = dynamic_update_slice(x_i, u_i, starts)`` for splits of dims the
    update covers whole; and an operand split along a dim the update does not
    cover, the update whole: each device writes the part of the update that
    falls in its piece (a KV cache split along the sequence, a token written
    at a traced position: nothing moves)."""
    n, u = shape_of(in_avals[0]), shape_of(in_avals[1])
    k = len(in_avals) - 2
    full = [d for d in range(len(n)) if n[d] == u[d]]
    return (
        [Sig((Split(d), Split(d)) + (B,) * k, (Split(d),)) for d in full]
        + [Sig((Split(d),) + (B,) * (k + 1), (Split(d),)) for d in range(len(n)) if d not in full]
        + [Sig((P(), P()) + (B,) * k, (P(),)), Sig((B,) * (k + 2), (B,))]
    )


@register("iota")
def iota(eqn, in_avals):
    """Each device makes its own piece (offset along the iota dim)."""
    return [Sig((), (Split(d),)) for d in range(len(eqn.params["shape"]))] + [Sig((), (B,))]


@register("empty2")
def empty2(eqn, in_avals):
    """An uninitialized scalar (what a branch of ``cond`` returns for a zero
    cotangent before broadcasting it): the same on every device."""
    return [Sig((), (B,))]


def local_iota(eqn, ins, ctx):
    p = eqn.params
    out_shape = ctx.local_out_shapes[0]
    dim = p["dimension"]
    y = lax.broadcasted_iota(p["dtype"], out_shape, dim)
    off = ctx.offset(ctx.out_nd[0], shape_of(eqn.outvars[0].aval), dim)
    return [y + jnp.asarray(off, p["dtype"])]


def local_reshape(eqn, ins, ctx):
    return [ins[0].transpose(_reshape_order(eqn, eqn.invars[0].aval)).reshape(ctx.local_out_shapes[0])]


def local_broadcast(eqn, ins, ctx):
    return [lax.broadcast_in_dim(ins[0], ctx.local_out_shapes[0], tuple(eqn.params["broadcast_dimensions"]))]


def local_slice(eqn, ins, ctx):
    """Split dims are taken whole or shifted (``sbpjax.rules.shifts``); a
    strided split dim keeps the rows at the start's offset of each piece."""
    p = eqn.params
    x = run_shifts(ins[0], _shift_steps(eqn, ctx), ctx)
    split = [ctx.is_split(ctx.in_nd[0], d) for d in range(x.ndim)]
    strides = p["strides"] or (1,) * x.ndim
    start = [0 if split[d] and strides[d] == 1 else p["start_indices"][d] for d in range(x.ndim)]
    limit = [x.shape[d] if split[d] else p["limit_indices"][d] for d in range(x.ndim)]
    return [lax.slice(x, start, limit, p["strides"])]


def local_pad(eqn, ins, ctx):
    """Split dims are shifted (``sbpjax.rules.shifts``: padded at their end,
    the block stays and its positions past the operand's piece take the
    padding value)."""
    x, value = ins
    x = run_shifts(x, _shift_steps(eqn, ctx), ctx, fill=value)
    cfg = [
        ((lo, inner - lo, inner) if inner else (0, 0, 0))
        if ctx.is_split(ctx.in_nd[0], d)
        else (lo, hi, inner)
        for d, (lo, hi, inner) in enumerate(eqn.params["padding_config"])
    ]
    return [lax.pad(x, value, cfg)]


def _shift_steps(eqn, ctx):
    steps = shifts(eqn, ctx.in_nd, ctx.out_nd, ctx.grid)
    assert steps is not None, "a slice or pad signature the planner could not run"
    return steps


def local_dynamic_slice(eqn, ins, ctx):
    x = ins[0]
    n = shape_of(eqn.invars[0].aval)
    sizes = [
        x.shape[d] if eqn.params["slice_sizes"][d] == n[d] else eqn.params["slice_sizes"][d]
        for d in range(len(n))
    ]
    # the jaxpr's starts come as the primitive takes them (any wrapping of negative
    # starts is already in the jaxpr): clamped, never wrapped again
    return [lax.dynamic_slice(x, ins[1:], sizes, allow_negative_indices=False)]


def local_dynamic_update_slice(eqn, ins, ctx):
    """Along each dim the operand is split on and the update is not, the
    update's rows at (piece offset + local index - start) are written where
    that index falls in the update; the start is clamped first, as XLA clamps
    it to fit the whole operand. Padded positions of an uneven piece may
    receive rows too: nothing reads them."""
    x, u, starts = ins[0], ins[1], list(ins[2:])
    n, un = shape_of(eqn.invars[0].aval), shape_of(eqn.invars[1].aval)
    op_nd, up_nd = ctx.in_nd[0], ctx.in_nd[1]
    inside = None
    for d in range(len(n)):
        if not ctx.is_split(op_nd, d) or ctx.is_split(up_nd, d):
            continue
        start = jnp.clip(starts[d].astype(jnp.int32), 0, n[d] - un[d])
        u, here = _rows_at(u, start, ctx.offset(op_nd, n, d), x, d)
        inside = here if inside is None else inside & here
        starts[d] = jnp.zeros_like(starts[d])
    if inside is not None:
        u = jnp.where(inside, u, lax.dynamic_slice(x, starts, u.shape, allow_negative_indices=False))
    return [lax.dynamic_update_slice(x, u, starts, allow_negative_indices=False)]


set_local("iota")(local_iota)
set_local("reshape")(local_reshape)
set_local("broadcast_in_dim")(local_broadcast)
set_local("slice")(local_slice)
set_local("concatenate")(local_concatenate)
set_local("pad")(local_pad)
set_local("dynamic_slice")(local_dynamic_slice)
set_local("dynamic_update_slice")(local_dynamic_update_slice)


@register("split")
def split(eqn, in_avals):
    """``y_i = split(x_i)`` into pieces along a dim the input is not split on
    (``q, k, v = jnp.split(qkv, 3, axis=-1)``): every piece keeps the input's
    split; splitting only selects elements, so every partial kind survives."""
    axis = eqn.params["axis"]
    n_out = len(eqn.outvars)
    return (
        [Sig((Split(d),), (Split(d),) * n_out) for d in range(rank(in_avals[0])) if d != axis]
        + _partials(1, n_out)
        + [Sig((B,), (B,) * n_out)]
    )


@register("device_put")
def device_put(eqn, in_avals):
    """``jax.device_put`` inside a traced function is the identity on values:
    every layout passes through (operands of one shape share a split)."""
    n = len(in_avals)
    shapes = {tuple(shape_of(a)) for a in in_avals}
    sigs = (
        [Sig((Split(d),) * n, (Split(d),) * n) for d in range(rank(in_avals[0]))] if len(shapes) == 1 else []
    )
    return sigs + _partials(n, n) + [Sig((B,) * n, (B,) * n)]


@register("stack")
def stack(eqn, in_avals):
    """``y_i = stack(a_i, b_i, ..., axis)``: inputs split alike on dim d give
    the stack split on d (d + 1 from ``axis`` on); partials of one kind stack
    to that kind."""
    axis = eqn.params["axis"]
    n = len(in_avals)
    return (
        [Sig((Split(d),) * n, (Split(d + (d >= axis)),)) for d in range(rank(in_avals[0]))]
        + _partials(n)
        + [Sig((B,) * n, (B,))]
    )


@register("unstack")
def unstack(eqn, in_avals):
    """``a_i, b_i, ... = unstack(x_i, axis)`` (jax 0.12 iterates an array this
    way: ``q, k, v = qkv``) for splits off ``axis``; every partial passes."""
    axis = eqn.params["axis"]
    n_out = len(eqn.outvars)
    return (
        [Sig((Split(d),), (Split(d - (d > axis)),) * n_out) for d in range(rank(in_avals[0])) if d != axis]
        + (_partials(1, n_out))
        + [Sig((B,), (B,) * n_out)]
    )

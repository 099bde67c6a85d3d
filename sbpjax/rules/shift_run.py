"""A plan's shifts and cuts run on a device's block (:func:`run_shifts`).

:mod:`sbpjax.rules.shifts` works out which rows each device needs and the
exchanges that bring them (planning, priced by the layout choice); this
module emits them inside the ``shard_map`` body: one ``ppermute`` per side of
a shift, one per distance of a cut, each made once per value
(``ctx.memo``), and the device's rows read from its block extended by them.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.device_index import axis_arg, group_index, table_entry
from sbpjax.rules.shifts import Cut, Shift, exchange_of, step_key


def run_shifts(x, steps, ctx, fill=None, operand: int = 0):
    """``x`` (a device's block) with each :class:`Shift` of ``steps`` run
    along its dim, one after the other (a later dim's exchange carries the
    corners); ``fill``: the padding value (a pad's), or None (a slice's).
    Exchanges of the same rows of the same value (operand ``operand`` of
    the op) are made once (``ctx.memo``)."""
    chain: tuple = ()
    for st in steps:
        if isinstance(st, Cut):
            x = _run_cut(x, st, ctx, fill, chain, operand)
        elif not st.in_place:
            x = _run(x, st, ctx, fill, chain, operand)
        elif fill is not None:  # the block stays: positions past the operand's piece are padding
            sizes = [z for _, z in st.pieces_in]
            size = sizes[0] if len(set(sizes)) == 1 else jnp.asarray(sizes, jnp.int32)[_index(st, ctx)]
            x = jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, st.dim) < size, x, fill.astype(x.dtype))
        chain += (step_key(st),)
    return x


def _index(st: Shift | Cut, ctx):
    return group_index(st.axes, ctx.placement.axis_names, ctx.grid)


def _run(x, st: Shift, ctx, fill, chain, operand):
    d, pieces = st.dim, len(st.pieces_in)
    axis = axis_arg([ctx.placement.axis_names[a] for a in st.axes])
    idx = _index(st, ctx)
    table = lambda values: table_entry(jnp.asarray(values, jnp.int32), idx)  # noqa: E731
    size_in = table([z for _, z in st.pieces_in])
    parts = []
    if st.left:
        # the piece before's last `left` rows: at the end of its valid rows
        def send_left():
            tail = (
                lax.slice_in_dim(x, st.block_in - st.left, st.block_in, axis=d)
                if st.n_in % pieces == 0
                else lax.dynamic_slice_in_dim(
                    x, size_in - st.left, st.left, axis=d, allow_negative_indices=False
                )
            )
            return lax.ppermute(tail, axis, perm=[(i, i + 1) for i in range(pieces - 1)])

        parts.append(ctx.memo(operand, exchange_of(st, chain, "left", st.left), send_left))
    parts.append(x)
    if st.right:

        def send_right():
            head = lax.slice_in_dim(x, 0, st.right, axis=d)
            return lax.ppermute(head, axis, perm=[(i + 1, i) for i in range(pieces - 1)])

        parts.append(ctx.memo(operand, exchange_of(st, chain, "right", st.right), send_right))
    ext = lax.concatenate(parts, d) if len(parts) > 1 else x
    rows = table([so for so, _ in st.pieces_out]) + st.shift + jnp.arange(st.block_out, dtype=jnp.int32)
    if st.static:
        at = min(st.offsets)
        y = lax.slice_in_dim(ext, at, at + st.block_out, axis=d)
    else:
        start_in = table([si for si, _ in st.pieces_in])
        own = rows - start_in  # the row's place in this device's piece
        local = jnp.where(own < size_in, st.left + own, st.left + st.block_in + own - size_in)
        y = jnp.take(ext, local, axis=d, mode="clip")  # clamped: padded rows, never read
    if fill is not None:
        outside = ((rows < 0) | (rows >= st.n_in)).reshape([-1 if e == d else 1 for e in range(y.ndim)])
        y = jnp.where(outside, fill.astype(y.dtype), y)
    return y


def _run_cut(x, st: Cut, ctx, fill, chain, operand):
    d, pieces = st.dim, len(st.pieces_in)
    axis = axis_arg([ctx.placement.axis_names[a] for a in st.axes])
    idx = _index(st, ctx)
    parts = [x]
    for k, rows, starts in st.sends:

        def send(k=k, rows=rows, starts=starts):
            start = table_entry(jnp.asarray([max(s, 0) for s in starts], jnp.int32), idx)
            chunk = lax.dynamic_slice_in_dim(x, start, rows, axis=d, allow_negative_indices=False)
            return lax.ppermute(chunk, axis, perm=[(j, j - k) for j in range(pieces) if starts[j] >= 0])

        parts.append(ctx.memo(operand, ("cut", chain, d, k, rows, starts, st.axes), send))
    ext = lax.concatenate(parts, d) if len(parts) > 1 else x
    runs = st.runs
    reads = table_entry(jnp.asarray(st.reads, jnp.int32), idx)  # this device's rows of ext (< 0: outside)
    if runs is not None:
        y = lax.dynamic_slice_in_dim(
            ext,
            table_entry(jnp.asarray(runs, jnp.int32), idx),
            st.block_out,
            axis=d,
            allow_negative_indices=False,
        )
    else:
        y = jnp.take(ext, reads, axis=d, mode="clip")
    if fill is not None:
        outside = reads < 0
        y = jnp.where(outside.reshape([-1 if e == d else 1 for e in range(y.ndim)]), fill.astype(y.dtype), y)
    return y

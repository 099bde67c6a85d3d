"""Indexing: ``gather`` (embeddings, ``take_along_axis``) and ``scatter-add``.

``gather`` per device, for the operand split on a dim it takes whole (a window
dim) or the indices split on a batch dim: ``y_i = gather(x_i, idx_i)``. For the
operand split on the *indexed* dim (an embedding table split by vocabulary,
logits split by class), each device looks up only the rows it owns and writes
zeros elsewhere, so ``y = sum_i y_i``: P(sum) (OneFlow's Wide & Deep, and the
label term of a model-parallel cross-entropy). ``scatter-add`` is the transpose:
updates split on a batch dim add into a partial result; an operand split on
the indexed dim drops updates for rows it does not own. ``scatter-max`` and
``-min`` (``segment_max``) combine split updates into partial maxima (minima).

Out-of-range indices keep the meaning JAX gives them on one device: an
index clamped (``x[ids]``, ``mode="clip"``) is clamped against the whole
operand before each device looks for it in its own rows, so exactly one
device owns it; a ``mode="fill"`` gather's fill value is written by that one
device (the others add zeros); a clipped scatter is clamped before its
indices are shifted to the local block.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.device_index import group_index
from sbpjax.rules import B, P, Sig, rank, register, set_local, shape_of
from sbpjax.sbp import Partial, Split


def _gather_dims(eqn):
    dn = eqn.params["dimension_numbers"]
    return (
        tuple(dn.offset_dims),
        tuple(dn.collapsed_slice_dims),
        tuple(dn.start_index_map),
        tuple(getattr(dn, "operand_batching_dims", ())),
        tuple(getattr(dn, "start_indices_batching_dims", ())),
    )


@register("gather")
def gather(eqn, in_avals):
    """Window splits, batch splits, indexed-dim split -> P(sum), P -> P.
    Out-of-range ids read what they read on one device (clamped, or the fill
    value of ``mode="fill"``)."""
    offset_dims, collapsed, start_map, op_batch, idx_batch = _gather_dims(eqn)
    xs, ishape = shape_of(in_avals[0]), shape_of(in_avals[1])
    sizes = eqn.params["slice_sizes"]
    out_rank = rank(eqn.outvars[0].aval)
    batch_out = [j for j in range(out_rank) if j not in offset_dims]
    idx_batch_dims = list(range(len(ishape) - 1))  # the last indices dim is the index vector
    window = [d for d in range(len(xs)) if d not in collapsed and d not in op_batch]
    sigs = []
    for k, d in enumerate(window):
        if sizes[d] == xs[d] and d not in start_map:
            sigs.append(Sig((Split(d), B), (Split(offset_dims[k]),)))
    for pos, k in enumerate(idx_batch_dims):
        if k in idx_batch:
            od = op_batch[idx_batch.index(k)]
            sigs.append(Sig((Split(od), Split(k)), (Split(batch_out[pos]),)))
        else:
            sigs.append(Sig((B, Split(k)), (Split(batch_out[pos]),)))
    for d in start_map:
        if d in collapsed:
            sigs.append(Sig((Split(d), B), (P(),)))
    return sigs + [Sig((P(), B), (P(),)), Sig((B, B), (B,))]


def _local_offsets(ctx, operand_nd, operand_shape, dims):
    return {d: ctx.offset(operand_nd, operand_shape, d) for d in dims}


def _in_bounds(idx, xs, slice_sizes, start_map):
    """Per index vector, whether its slice lies inside an operand of global
    shape ``xs`` (a FILL_OR_DROP gather's test)."""
    ok = jnp.ones(idx.shape[:-1], bool)
    for j, d in enumerate(start_map):
        ok = ok & (idx[..., j] >= 0) & (idx[..., j] <= xs[d] - slice_sizes[d])
    return ok


def _clamped(idx, xs, slice_sizes, start_map):
    """Start indices clamped so that each slice lies inside the operand, as
    XLA clamps them (CLIP, PROMISE_IN_BOUNDS)."""
    upper = jnp.asarray([xs[d] - slice_sizes[d] for d in start_map], idx.dtype)
    return jnp.clip(idx, 0, upper)


def _first_of_partial(ctx, nd):
    """True on one device of each group the partial axes of ``nd`` span."""
    axes = [a for a, q in enumerate(nd) if isinstance(q, Partial) and ctx.grid[a] > 1]
    return group_index(axes, ctx.placement.axis_names, ctx.grid) == 0


def local_gather(eqn, ins, ctx):
    """The gather on local pieces. Out-of-range ids keep their meaning: an
    index is clamped (CLIP, PROMISE_IN_BOUNDS: as XLA clamps) or reads the
    fill value (FILL_OR_DROP) exactly as on one device, and where the result
    is a partial sum the fill value is held by one device of each group."""
    x, idx = ins
    xs = shape_of(eqn.invars[0].aval)
    _, collapsed, start_map, _, _ = _gather_dims(eqn)
    params = dict(eqn.params)
    sizes = params["slice_sizes"]  # global: an indexed dim split here has size 1 (collapsed)
    fill = params["mode"] == lax.GatherScatterMode.FILL_OR_DROP
    # window dims taken whole: the slice size is the local size
    params["slice_sizes"] = tuple(x.shape[d] if sizes[d] == xs[d] else sizes[d] for d in range(len(xs)))
    out_rank = rank(eqn.outvars[0].aval)
    offset_dims = tuple(eqn.params["dimension_numbers"].offset_dims)
    batch_out = tuple(j for j in range(out_rank) if j not in offset_dims)
    split_indexed = [d for d in start_map if ctx.is_split(ctx.in_nd[0], d)]
    if not split_indexed:
        y = lax.gather_p.bind(x, idx, **params)
        if fill and any(isinstance(q, Partial) for q in ctx.in_nd[0]):
            # a partial operand: every device would fill, and the sum hold the fill n times
            held = _first_of_partial(ctx, ctx.in_nd[0]) | _in_bounds(idx, xs, sizes, start_map)
            y = jnp.where(lax.broadcast_in_dim(held, y.shape, batch_out), y, jnp.zeros((), y.dtype))
        return [y]
    # indexed dim split: each device looks up the rows it owns, zeros elsewhere (a
    # partial sum). The global index is clamped first, so exactly one device owns
    # every index vector (for FILL_OR_DROP that device then writes the fill value).
    inside = _in_bounds(idx, xs, sizes, start_map)
    idx = _clamped(idx, xs, sizes, start_map)
    # (an uneven split's padded rows are owned by no device: the next piece owns them)
    pieces = {d: ctx.extent(ctx.in_nd[0], xs, d) for d in split_indexed}
    local_idx = idx - jnp.asarray([pieces[d][0] if d in pieces else 0 for d in start_map], idx.dtype)
    owned = jnp.ones(idx.shape[:-1], bool)
    for j, d in enumerate(start_map):
        if d in pieces:
            owned = owned & (local_idx[..., j] >= 0) & (local_idx[..., j] < pieces[d][1])
    params["mode"] = lax.GatherScatterMode.CLIP
    y = lax.gather_p.bind(x, local_idx, **params)
    y = jnp.where(lax.broadcast_in_dim(owned, y.shape, batch_out), y, jnp.zeros((), y.dtype))
    if fill:
        value = jnp.asarray(eqn.params["fill_value"], y.dtype)
        y = jnp.where(lax.broadcast_in_dim(owned & ~inside, y.shape, batch_out), value, y)
    return [y]


set_local("gather")(local_gather)


def _scatter_dims(eqn):
    dn = eqn.params["dimension_numbers"]
    return (
        tuple(dn.update_window_dims),
        tuple(dn.inserted_window_dims),
        tuple(dn.scatter_dims_to_operand_dims),
        tuple(getattr(dn, "operand_batching_dims", ())),
        tuple(getattr(dn, "scatter_indices_batching_dims", ())),
    )


@register("scatter-add", "scatter_add", "scatter-sub", "scatter_sub")
def scatter_add(eqn, in_avals):
    """Updates split on a batch dim -> P(sum); window splits; indexed-dim split.
    ``x.at[idx].subtract(u)`` is as linear: the same signatures."""
    uw, inserted, to_operand, op_batch, idx_batch = _scatter_dims(eqn)
    xs, us = shape_of(in_avals[0]), shape_of(in_avals[2])
    window = [d for d in range(len(xs)) if d not in inserted and d not in op_batch]
    sigs = []
    for k, u in _index_update_dims(in_avals, uw):
        if k in idx_batch:
            od = op_batch[idx_batch.index(k)]
            sigs.append(Sig((Split(od), Split(k), Split(u)), (Split(od),)))
        else:
            sigs.append(Sig((P(), Split(k), Split(u)), (P(),)))
    for k, d in enumerate(window):
        if us[uw[k]] == xs[d] and d not in to_operand:
            sigs.append(Sig((Split(d), B, Split(uw[k])), (Split(d),)))
    for d in to_operand:
        if d in inserted:
            sigs.append(Sig((Split(d), B, B), (Split(d),)))
    return sigs + [Sig((P(), B, P()), (P(),)), Sig((B, B, B), (B,))]


def _index_update_dims(in_avals, update_window_dims) -> list:
    """Each dim of a scatter's indices (less the index vector) with the dim
    of the updates it runs along: split alike, each device scatters its rows."""
    updates = range(rank(in_avals[2]))
    return list(zip(range(rank(in_avals[1]) - 1), [j for j in updates if j not in update_window_dims]))


def _scatter_slice_sizes(eqn) -> list:
    """Per operand dim, the global size of the window each update writes."""
    dn = eqn.params["dimension_numbers"]
    us = shape_of(eqn.invars[2].aval)
    window = iter(dn.update_window_dims)
    skipped = set(dn.inserted_window_dims) | set(getattr(dn, "operand_batching_dims", ()))
    return [1 if d in skipped else us[next(window)] for d in range(rank(eqn.invars[0].aval))]


def local_scatter(eqn, ins, ctx):
    """A scatter of any combining kind on local pieces: indices into an operand
    split on the indexed dim are shifted to its block, and rows owned
    elsewhere are dropped."""
    x, idx, upd = ins
    xs = shape_of(eqn.invars[0].aval)
    _, _, to_operand, _, _ = _scatter_dims(eqn)
    params = dict(eqn.params)
    split_indexed = [d for d in to_operand if ctx.is_split(ctx.in_nd[0], d)]
    if split_indexed:
        if params["mode"] == lax.GatherScatterMode.CLIP:
            # clamped as on one device, before the shift: a clamped row has one owner
            idx = _clamped(idx, xs, _scatter_slice_sizes(eqn), to_operand)
        offs = _local_offsets(ctx, ctx.in_nd[0], xs, split_indexed)
        idx = idx - jnp.asarray([offs.get(d, 0) for d in to_operand], idx.dtype)
        params["mode"] = lax.GatherScatterMode.FILL_OR_DROP  # rows owned elsewhere are dropped
    return [eqn.primitive.bind(x, idx, upd, **params)]


set_local("scatter-add", "scatter_add", "scatter-sub", "scatter_sub")(local_scatter)


@register("scatter")
def scatter(eqn, in_avals):
    """``x.at[idx].set(u)``: ``y_i = scatter(x_i, idx, u_i)`` for an operand split
    on a window dim the updates cover whole, or on a batching dim shared with
    the indices and updates; or split on the indexed dim, each device writing
    the rows it owns (others dropped, as for scatter-add: a KV cache's or a
    memory bank's row update moves nothing). A set replaces values, so no
    partial passes."""
    uw, inserted, to_operand, op_batch, idx_batch = _scatter_dims(eqn)
    xs, ishape, us = shape_of(in_avals[0]), shape_of(in_avals[1]), shape_of(in_avals[2])
    update_scatter = [j for j in range(len(us)) if j not in uw]
    sigs = []
    for pos, k in enumerate(range(len(ishape) - 1)):
        if k in idx_batch:
            od = op_batch[idx_batch.index(k)]
            sigs.append(Sig((Split(od), Split(k), Split(update_scatter[pos])), (Split(od),)))
    window = [d for d in range(len(xs)) if d not in inserted and d not in op_batch]
    for k, d in enumerate(window):
        if us[uw[k]] == xs[d] and d not in to_operand:
            sigs.append(Sig((Split(d), B, Split(uw[k])), (Split(d),)))
    sigs += [Sig((Split(d), B, B), (Split(d),)) for d in to_operand if d in inserted]
    return sigs + [Sig((B, B, B), (B,))]


set_local("scatter")(local_scatter)


# x.at[idx].max / .min / .multiply (segment_max, _min, _prod)
COMBINING = ("scatter-max", "scatter_max", "scatter-min", "scatter_min", "scatter-mul", "scatter_mul")


@register(*COMBINING)
def scatter_combine(eqn, in_avals):
    """``x.at[idx].max(u)`` (``segment_max``), ``.min`` and ``.multiply``: the
    set's signatures, and an operand split on the indexed dim (rows owned
    elsewhere dropped, as for scatter-add). Max and min are idempotent, so
    updates split on a scatter dim combine into a whole operand on each
    device and the results are partial maxima (minima): ``P(max)``, as are
    partial operands and updates. A product is not idempotent: no partials."""
    uw, inserted, to_operand, _, idx_batch = _scatter_dims(eqn)
    sigs = scatter(eqn, in_avals)[:-1]  # the set's, without its (B, B, B)
    op = eqn.primitive.name[len("scatter") + 1 :]
    if op in ("max", "min"):
        for k, u in _index_update_dims(in_avals, uw):
            if k not in idx_batch:
                sigs.append(Sig((B, Split(k), Split(u)), (P(op),)))
                sigs.append(Sig((P(op), Split(k), Split(u)), (P(op),)))
        sigs.append(Sig((P(op), B, P(op)), (P(op),)))
    return sigs + [Sig((B, B, B), (B,))]


set_local(*COMBINING)(local_scatter)

"""``dot_general``: matrix products with batch and contracting dims.

Per device: ``Y_i = dot(X_i, W_i)``. With ``X`` and ``W`` split on a shared
batch dim, or one operand split on a free dim and the other broadcast, each
device computes its piece of ``Y``. Split on the contracting dims of both,
``Y = sum_i dot(X_i, W_i)``: a partial sum. A partial operand times a broadcast
one stays partial. OneFlow Table 1 (``Y = X W``): (S(0),B)->S(0), (B,S(1))->S(1),
(S(1),S(0))->P, (P,B)->P, (B,P)->P, (B,B)->B; nd signatures (Tables 3 and
AutoDDL's 3-D matmul) combine these per placement axis.
"""

from __future__ import annotations

import math

from sbpjax.rules import B, P, Sig, local_shape, rank, register, set_comm, set_local, split_axes
from sbpjax.rules.halo import Slide, halo, halo_comms, run_halos
from sbpjax.sbp import Split


@register("dot_general")
def dot_general(eqn, in_avals):
    """Batch splits, free-dim splits, contracting splits -> P(sum), P x B -> P."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lr, rr = rank(in_avals[0]), rank(in_avals[1])
    l_free = [d for d in range(lr) if d not in lc and d not in lb]
    r_free = [d for d in range(rr) if d not in rc and d not in rb]
    sigs = []
    for k, (a, b) in enumerate(zip(lb, rb)):
        sigs.append(Sig((Split(a), Split(b)), (Split(k),)))
    for k, d in enumerate(l_free):
        sigs.append(Sig((Split(d), B), (Split(len(lb) + k),)))
    for k, d in enumerate(r_free):
        sigs.append(Sig((B, Split(d)), (Split(len(lb) + len(l_free) + k),)))
    for a, b in zip(lc, rc):
        sigs.append(Sig((Split(a), Split(b)), (P(),)))
    sigs += [Sig((P(), B), (P(),)), Sig((B, P()), (P(),)), Sig((B, B), (B,))]
    return sigs


@register("conv_general_dilated")
def conv(eqn, in_avals):
    """Per device ``y_i = conv(x_i, k_i)``: a batch split of ``x`` gives a batch
    split of ``y``; a split of the kernel's output channels gives a channel split
    of ``y``; splitting the input channels of both gives ``y = sum_i y_i``
    (P(sum)) when there are no feature groups. A spatial split of ``x`` (image
    height) runs with a halo exchange: with ``y`` split alike and ``k``
    broadcast (forward, input gradient), or with ``k``'s taps split alike and
    ``y = sum_i y_i`` (a kernel gradient) (``sbpjax.rules.halo``). Feature
    groups (``G = feature_group_count``: a depthwise or grouped
    convolution): ``x``'s channels and ``k``'s output channels split alike
    give each device whole groups, ``y_i = conv(x_i, k_i)`` with ``G / p``
    groups, a split of ``y``'s channels; batch groups (such a convolution's
    kernel gradient, and a per-example kernel gradient under ``vmap``) pair
    ``x``'s batch with ``k``'s output channels the same way. Only where the
    ``p`` pieces divide the groups (``_local_groups``)."""
    dn = eqn.params["dimension_numbers"]
    lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    sigs = []
    if eqn.params.get("feature_group_count", 1) > 1:
        sigs.append(Sig((Split(lhs[1]), Split(rhs[0])), (Split(out[1]),)))
    if eqn.params.get("batch_group_count", 1) > 1:
        sigs.append(Sig((Split(lhs[0]), Split(rhs[0])), (Split(out[1]),)))
    if eqn.params.get("batch_group_count", 1) == 1:
        sigs.append(Sig((Split(lhs[0]), B), (Split(out[0]),)))
    if eqn.params.get("feature_group_count", 1) == 1:
        if eqn.params.get("batch_group_count", 1) == 1:
            sigs.append(Sig((B, Split(rhs[0])), (Split(out[1]),)))
        # batch groups pair x's batch with the kernel's output channels; the
        # input channels are summed whole either way (a grouped convolution's
        # kernel gradient: its batch is the contracted feature dim here)
        sigs.append(Sig((Split(lhs[1]), Split(rhs[1])), (P(),)))
    sigs += [Sig((P(), B), (P(),)), Sig((B, P()), (P(),)), Sig((B, B), (B,))]
    for t in range(len(lhs) - 2):
        sigs.append(Sig((Split(lhs[2 + t]), B), (Split(out[2 + t]),)))
        sigs.append(Sig((Split(lhs[2 + t]), Split(rhs[2 + t])), (P(),)))
    return sigs


def _conv_halos(eqn, in_avals, ins, outs, grid):
    """Per split spatial dim: (spatial index, lhs dim, Halo, axes), in order;
    ``None`` when the nd-signature mixes the two spatial splits on one dim or
    a halo cannot be run."""
    p = eqn.params
    dn = p["dimension_numbers"]
    lhs, rhs, out = dn.lhs_spec, dn.rhs_spec, dn.out_spec
    nsp = len(lhs) - 2
    ones = (1,) * nsp
    found = []
    for t in range(nsp):
        axes = split_axes(ins[0], lhs[2 + t])
        if not axes:
            continue
        window = split_axes(ins[1], rhs[2 + t])
        if window == axes:
            split_window = True
        elif not window and split_axes(outs[0], out[2 + t]) == axes:
            split_window = False
        else:
            return None
        lo, hi = p["padding"][t]
        sl = Slide(
            n=in_avals[0].shape[lhs[2 + t]],
            k=in_avals[1].shape[rhs[2 + t]],
            m=eqn.outvars[0].aval.shape[out[2 + t]],
            stride=p["window_strides"][t],
            lo=lo,
            hi=hi,
            lhs_dil=(p.get("lhs_dilation") or ones)[t],
            rhs_dil=(p.get("rhs_dilation") or ones)[t],
        )
        h = halo(sl, math.prod(grid[a] for a in axes), split_window)
        if h is None:
            return None
        found.append((t, lhs[2 + t], h, axes))
    return found


def _local_groups(eqn, ins, grid) -> dict | None:
    """The group count each device's convolution runs with, as the params to
    override (``{}`` where the nd-signature splits no grouped dim of ``x``:
    feature groups split its channels, batch groups its batch), or None where
    the pieces do not divide the groups (a device would hold part of one)."""
    p = eqn.params
    lhs = p["dimension_numbers"].lhs_spec
    for param, dim in (("feature_group_count", lhs[1]), ("batch_group_count", lhs[0])):
        groups = p.get(param, 1)
        pieces = math.prod(grid[a] for a in split_axes(ins[0], dim))
        if groups > 1 and pieces > 1:
            return {param: groups // pieces} if groups % pieces == 0 else None
    return {}


@set_comm("conv_general_dilated")
def conv_comm(eqn, in_avals, ins, outs, grid):
    """One halo exchange per split spatial dim, on ``x``'s piece as extended
    by the exchanges before it (so the corners come with the second); not
    runnable where a device would hold part of a feature or batch group."""
    if _local_groups(eqn, ins, grid) is None:
        return None
    found = _conv_halos(eqn, in_avals, ins, outs, grid)
    if found is None:
        return None
    steps = [(dim, h, axes, None, None) for _, dim, h, axes in found]
    return halo_comms(local_shape(in_avals[0].shape, ins[0], grid), in_avals[0].dtype.itemsize, steps, grid)


@set_local("conv_general_dilated")
def conv_local(eqn, ins, ctx):
    in_avals = [v.aval for v in eqn.invars]
    found = _conv_halos(eqn, in_avals, ctx.in_nd, ctx.out_nd, ctx.grid)
    padding = list(eqn.params["padding"])
    for t, _, h, _ in found:
        padding[t] = h.pad
    x = run_halos(ins[0], [(dim, h, axes, None, None) for _, dim, h, axes in found], ctx)
    # each device holds whole groups: a convolution of its own groups
    params = {**eqn.params, "padding": tuple(padding), **_local_groups(eqn, ctx.in_nd, ctx.grid)}
    return [eqn.primitive.bind(x, ins[1], **params)]

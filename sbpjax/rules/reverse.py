"""``rev`` (``jnp.flip``, ``x[::-1]``) along a split dim: a permute of the pieces.

The reversal of a dim split evenly into ``p`` pieces is, at piece ``j``, the
operand's piece ``p - 1 - j`` reversed. So each device sends its block to
the device holding the mirrored piece and reverses what it receives: the
result keeps the operand's split, one block moved per device, as GSPMD's
collective permute moves it. Over several axes the group index is
mixed-radix, and ``p - 1 - g`` mirrors each axis's coordinate; so one
``ppermute`` over every axis that splits a reversed dim mirrors them all
(reversing two split dims moves each block once, not twice). The device
whose coordinates are the middle ones of odd axes keeps its block. An uneven
split is not run this way (piece ``p - 1 - j`` of the operand is not the
size of piece ``j``): the operand is boxed instead.
"""

from __future__ import annotations

import itertools
import math

from jax import lax

from sbpjax.boxing.device_index import axis_arg
from sbpjax.rules import (
    Comm,
    local_shape,
    register,
    set_comm,
    set_local,
    shape_of,
    split_axes,
)
from sbpjax.rules.shape import moved_in_place


@register("rev")
def rev(eqn, in_avals):
    """``y_j = rev(x_{p-1-j})``: any split dim, a reversed one's blocks sent to
    the devices of the mirrored pieces (one permute; even splits only);
    every partial passes."""
    return moved_in_place(in_avals[0])


def _mirrored(eqn, nd, shape, grid) -> tuple | None:
    """The placement axes that split a reversed dim, in order (their
    coordinates are mirrored); None where such a dim is split unevenly."""
    axes: list = []
    for d in eqn.params["dimensions"]:
        by = split_axes(nd, d)
        if shape[d] % math.prod(grid[a] for a in by):
            return None
        axes.extend(by)
    return tuple(sorted(axes))


def _mirror_perm(axes, grid) -> list:
    """``ppermute``'s pairs over ``axes`` (devices numbered row-major over
    them): each coordinate to its mirror."""
    sizes = [grid[a] for a in axes]
    pairs = []
    for coords in itertools.product(*(range(n) for n in sizes)):
        src = dst = 0
        for c, n in zip(coords, sizes):
            src, dst = src * n + c, dst * n + (n - 1 - c)
        pairs.append((src, dst))
    return pairs


@set_comm("rev")
def rev_comms(eqn, in_avals, ins, outs, grid) -> list[Comm] | None:
    """One permute over the axes splitting the reversed dims: every device
    receives a block, but the middle one where each of those axes is odd."""
    aval = in_avals[0]
    axes = _mirrored(eqn, ins[0], shape_of(aval), grid)
    if not axes:
        return None if axes is None else []
    block = math.prod(local_shape(shape_of(aval), ins[0], grid)) * aval.dtype.itemsize
    moving = sum(1 for src, dst in _mirror_perm(axes, grid) if src != dst)
    lines = math.prod(grid) // math.prod(grid[a] for a in axes)
    return [Comm("permute", axes, lines * moving * block, 0, ("rev", axes))]


@set_local("rev")
def local_rev(eqn, ins, ctx):
    """The blocks permuted to the mirrored pieces' devices, then each reversed.
    Ops permuting the same operand over the same axes share the exchange (``ctx.memo``)."""
    x = ins[0]
    axes = _mirrored(eqn, ctx.in_nd[0], shape_of(eqn.invars[0].aval), ctx.grid)
    if axes:
        axis = axis_arg([ctx.placement.axis_names[a] for a in axes])
        perm = _mirror_perm(axes, ctx.grid)
        x = ctx.memo(0, ("rev", axes), lambda: lax.ppermute(x, axis, perm=perm))
    return [lax.rev(x, tuple(eqn.params["dimensions"]))]

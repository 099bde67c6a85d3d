"""``jnp.roll`` along one dim as one op: pieces of a split dim rotate by permutes.

JAX spells a static roll as ``concatenate([x[n - s:], x[:n - s]])``; the
layout choice sees it as this op (``sbpjax.compiler.rewrites.rolls``), whose
result row ``r`` is the operand's row ``(r - s) mod n``. Along a dim split
evenly into ``p`` pieces of ``b`` rows, with ``s = q b + t`` (``0 <= t <
b``), piece ``j`` of the result is the last ``t`` rows of the operand's piece
``j - q - 1`` followed by the first ``b - t`` rows of its piece ``j - q``
(indices mod ``p``): at most two ``ppermute``s, each a cyclic shift of the
pieces, and one where ``t`` is 0 or a part stays on its device (a roll by
fewer rows than a piece holds sends each device's last ``t`` rows to the
next device, as GSPMD's one collective permute does). Spelled as two shifted
pads (before 2026-12), the rows that wrap around moved in a permute of their
own: two collectives for one. Over several axes the pieces are in the group
index's order (mixed radix, outer axis first), as for every split. An
uneven split is not run this way: the operand is boxed instead.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.interpreters import mlir

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

try:
    from jax.extend.core import Primitive
except ImportError:  # pragma: no cover
    from jax.core import Primitive  # type: ignore[attr-defined,no-redef]

ROLL = "roll"


def _roll(x, *, dim: int, shift: int):
    return jnp.roll(x, shift, axis=dim)


roll_p = Primitive(ROLL)
roll_p.def_impl(_roll)
roll_p.def_abstract_eval(lambda x, *, dim, shift: x)
mlir.register_lowering(roll_p, mlir.lower_fun(_roll, multiple_results=False))


def roll(x, shift: int, dim: int):
    """``jnp.roll(x, shift, axis=dim)`` as one op (any shift, taken mod the dim's size)."""
    return roll_p.bind(x, dim=dim, shift=shift)


@register(ROLL)
def rolled(eqn, in_avals):
    """``y = roll(x)``: any split dim, a rolled one's pieces rotated by at most two
    cyclic permutes of their rows (even splits only); every partial passes."""
    return moved_in_place(in_avals[0])


def _parts(eqn, nd, shape, grid) -> tuple | None:
    """(axes splitting the rolled dim, pieces, rows per piece, the parts):
    each part ``(rows, first, hops)``: ``rows`` rows from row ``first`` of
    each piece, sent ``hops`` pieces on (mod the pieces; 0: kept). None
    where the dim is split unevenly."""
    dim, s = eqn.params["dim"], eqn.params["shift"]
    axes = split_axes(nd, dim)
    p = math.prod(grid[a] for a in axes)
    if shape[dim] % p:
        return None
    b = shape[dim] // p
    q, t = divmod(s, b)
    parts = [(t, b - t, (q + 1) % p), (b - t, 0, q % p)]
    return axes, p, b, [part for part in parts if part[0] > 0]


@set_comm(ROLL)
def roll_comms(eqn, in_avals, ins, outs, grid) -> list[Comm] | None:
    """One permute per part that changes devices: every device receives that
    part's rows."""
    aval = in_avals[0]
    found = _parts(eqn, ins[0], shape_of(aval), grid)
    if found is None:
        return None
    axes, _, _, parts = found
    if not axes:
        return []
    block = local_shape(shape_of(aval), ins[0], grid)
    row = math.prod(block) // block[eqn.params["dim"]] * aval.dtype.itemsize
    devices = math.prod(grid)
    return [
        Comm("permute", axes, devices * rows * row, 0, ("roll", eqn.params["dim"], axes, rows, first, hops))
        for rows, first, hops in parts
        if hops
    ]


@set_local(ROLL)
def local_roll(eqn, ins, ctx):
    """Each part's rows cut from the block and sent its hops on (shared with
    any op sending the same rows of the same operand, ``ctx.memo``), then
    joined in order; a roll of a dim the block holds whole runs as it is."""
    x = ins[0]
    dim = eqn.params["dim"]
    found = _parts(eqn, ctx.in_nd[0], shape_of(eqn.invars[0].aval), ctx.grid)
    if found is None or not found[0]:
        return [_roll(x, dim=dim, shift=eqn.params["shift"])]
    axes, p, _, parts = found
    axis = axis_arg([ctx.placement.axis_names[a] for a in axes])
    pieces = []
    for rows, first, hops in parts:
        part = lax.slice_in_dim(x, first, first + rows, axis=dim)
        if hops:
            perm = [(i, (i + hops) % p) for i in range(p)]
            detail = ("roll", dim, axes, rows, first, hops)
            part = ctx.memo(0, detail, lambda part=part, perm=perm: lax.ppermute(part, axis, perm=perm))
        pieces.append(part)
    return [lax.concatenate(pieces, dim) if len(pieces) > 1 else pieces[0]]

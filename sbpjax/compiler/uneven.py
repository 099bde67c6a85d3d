"""Uneven splits inside ``sj.jit``: a dim whose size the pieces do not divide.

Inside the compiled program such a value lives as it does outside
(:mod:`sbpjax.layout`): pieces are balanced (the first ``n % p`` get one more
element) and each device's block is padded at the end of the split dim to the
largest piece. What an op computes in the padded positions (the *holes*) is
never read as a value, because of three rules:

* **Holes stay in place.** An op takes an uneven layout only when every operand
  and result split on that placement axis is split on a dim of the same size
  by the same axes (same pieces, same holes), and the op needs no
  communication of its own there. Elementwise ops, the batch and free dims of
  a contraction, the kept dims of a reduction, transposes, slices of other
  dims pass; a reshape that merges the dim, a halo exchange or a prefix scan
  along it keep to even layouts (the value is boxed first). A slice or pad
  of the dim itself moves its rows as ``sbpjax.rules.shifts`` says, which
  reads each piece's size (its holes are never read).
* **Every device has work.** A signature where some device's piece would be
  empty (5 rows on 8 devices) is not chosen inside a program: it moves few
  bytes only because idle devices receive nothing, and the bytes-first cost
  cannot see the compute it piles on the others. Such a value (an argument
  that arrives that way) is boxed to a layout that gives every device work.
* **Reductions see identities.** Where a result is partial on an axis that
  splits an operand unevenly (a contraction or a reduction over the dim, a
  gather or scatter-add over it), the operand's holes are first set to the
  identity of that partial (0 for a sum, -inf for a max).
* **Boxing and results see zeros.** A value is boxed and returned with its
  holes set to zero (the identity of its partial, if it has one), the
  physical form the boxing lowering and :class:`~sbpjax.GlobalTensor` use.

Boxing between uneven layouts uses the core's uneven plans, so the bytes the
plan counts are the bytes the compiled program moves. Why not pad the value to
an even size instead: a padded batch changes what a mean divides by and what
a softmax sums over, so every reduction would still need the masks above, and
the padding would cross devices in every collective.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.device_index import IndexTables
from sbpjax.boxing.extremes import fill_value
from sbpjax.layout import Geometry
from sbpjax.rules import split_axes
from sbpjax.rules.shifts import placements, shifts
from sbpjax.sbp import Partial, Split


def uneven_dims(nd, shape, grid) -> tuple[int, ...]:
    """The dims of ``shape`` that ``nd`` splits into pieces of unequal size."""
    return tuple(d for d in range(len(shape)) if shape[d] % math.prod(grid[a] for a in split_axes(nd, d)))


def fits(nds, shapes, grid) -> bool:
    """Whether an op's nd-signature keeps holes in place (see the module
    docstring); ``nds``/``shapes``: its operands' then its results' layouts and
    shapes. A signature with no uneven split fits."""
    for a, p in enumerate(grid):
        if p == 1:
            continue
        members = set()
        uneven = False
        for nd, shape in zip(nds, shapes):
            s = nd[a]
            if not isinstance(s, Split):
                continue
            axes = split_axes(nd, s.dim)
            n = shape[s.dim]
            pieces = math.prod(grid[b] for b in axes)
            if n % pieces:
                uneven = True
                if n < pieces:
                    return False  # some device would hold nothing (see the module docstring)
            members.add((n, axes))
        if uneven and len(members) > 1:
            return False
    return True


def moved_shapes(eqn, ins, outs, shapes, grid) -> list | None:
    """For a slice or pad, or a concatenation along a dim its operands are
    split on, whose split dims move as ``sbpjax.rules.shifts`` says (holes
    and exchanges included): the shapes to test the layouts' evenness at,
    each moved dim at an even size (the steps read each piece's own size;
    the other split dims keep their holes in place), or ``[]`` where the
    signature cannot run. None for other ops and signatures."""
    if eqn.primitive.name in ("slice", "pad"):
        steps = shifts(eqn, ins, outs, grid)
    elif eqn.primitive.name == "concatenate" and len(ins) > 1:
        dim = eqn.params["dimension"]
        if not all(split_axes(nd, dim) for nd in ins):
            return None
        steps = placements(eqn, ins, outs, grid)
    else:
        return None
    if steps is None:
        return []
    even = {st.dim: len(st.pieces_in) for st in steps}
    return [tuple(even.get(d, n) for d, n in enumerate(shape)) for shape in shapes]


def reduced_operands(ins, outs, in_shapes, grid) -> list[tuple[int, str]]:
    """``(operand, partial op)`` for each operand whose holes a reduction would
    read: split unevenly on an axis where a result is partial."""
    out = []
    for j, (nd, shape) in enumerate(zip(ins, in_shapes)):
        bad = uneven_dims(nd, shape, grid)
        if not bad:
            continue
        for a, s in enumerate(nd):
            if isinstance(s, Split) and s.dim in bad:
                ops = [o[a].op for o in outs if isinstance(o[a], Partial)]
                if ops:
                    out.append((j, ops[0]))
                    break
    return out


def piece(n: int, axes, names, grid):
    """(start, size) along a dim of size ``n`` of this device's piece when
    ``axes`` split it (balanced, outer axis first), as traced int32 scalars."""
    if not axes:
        return jnp.int32(0), jnp.int32(n)
    geom = Geometry((n,), grid)
    tables = IndexTables(geom, names)
    row = tables.lookup(axes, tables.table(axes, lambda coord: geom.dim_range(axes, 0, coord)))
    return row[0], row[1]


def fill_holes(x, shape, nd, names, grid, op: str = "sum"):
    """``x`` (a device's block of a value of logical ``shape`` in layout ``nd``)
    with every padded position set to the identity of ``op``."""
    bad = uneven_dims(nd, shape, grid)
    if not bad:
        return x
    keep = jnp.ones(x.shape, bool)
    for d in bad:
        _, size = piece(shape[d], split_axes(nd, d), names, grid)
        keep = keep & (lax.broadcasted_iota(jnp.int32, x.shape, d) < size)
    return jnp.where(keep, x, fill_value(op, x.dtype))


def holes_op(nd) -> str:
    """What a value's holes hold when it is boxed or returned: the identity of
    its partial (the first, when there are several), else zero."""
    ops = [s.op for s in nd if isinstance(s, Partial)]
    return ops[0] if ops else "sum"

"""Rows moved along a split dim by ``slice`` and ``pad``: a shift.

``x[k:N-e]`` and ``pad(x, (lo, hi))`` along a dim split into pieces both
read, for each row ``r`` of the result, row ``r + shift`` of the operand
(``shift = k`` for the slice, ``-lo`` for the pad, rows outside the operand
taking the padding value). With the balanced pieces of the operand (``N``
rows) and of the result (``N - k - e`` or ``N + lo + hi``), device ``i``
needs the operand rows ``[out_start_i + shift, ... + out_size_i)``: its own
piece's, and a few past either end of it. Where those few fit in the piece
before and the piece after, one ``ppermute`` per side brings them (the
last ``left`` valid rows of the piece before, the first ``right`` of the
piece after, the same counts for every device, as a halo exchange sends
them), and each device reads its result rows from its own block extended by
them, at an offset of its own (a static slice where every device reads at
the same offset of an even block, a gather otherwise).

Where every piece of the result is the operand's piece at the same place
in a block of the same size (:func:`prefix_aligned`: ``logits[:, :-1]``
on 8 pieces of 32, and the pad that is its gradient), nothing moves.
Otherwise only *shifts* communicate: slices and pads that change a dim by
less than half of its longer size (``tokens[:, 2:]``, a causal convolution
written as padded shifted slices, ``pad`` then ``slice``). A larger cut
(``x[N - 3:]``, a third of ``qkv``) reads rows of far pieces, which one
exchange with a neighbour cannot bring; its value is boxed first, as the
greedy pass assumes for ops that do not communicate (``may_shift``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.lower import axis_arg, group_index
from sbpjax.layout import balanced_piece
from sbpjax.rules import Comm, local_shape, shape_of, split_axes


@dataclasses.dataclass(frozen=True)
class Shift:
    """How one split dim of a slice or pad is run: result row ``r`` reads
    operand row ``r + shift`` (rows outside ``[0, n_in)`` are padding).
    ``pieces_in`` / ``pieces_out``: every piece's (start, size), in the
    order of the group index of ``axes``; ``left`` / ``right``: rows each
    device receives from the piece before / after it (0: no exchange)."""

    dim: int
    axes: tuple
    shift: int
    n_in: int
    n_out: int
    pieces_in: tuple
    pieces_out: tuple
    left: int
    right: int

    @property
    def block_in(self) -> int:
        return max(z for _, z in self.pieces_in)

    @property
    def block_out(self) -> int:
        return max(z for _, z in self.pieces_out)

    @property
    def offsets(self) -> set:
        """Where each device's result rows start in its own extended block."""
        return {so + self.shift - si + self.left for (si, _), (so, _) in zip(self.pieces_in, self.pieces_out)}

    @property
    def in_place(self) -> bool:
        """Every result piece is the operand's piece at the same place, in a
        block of the same size: the block stays (holes filled by a pad)."""
        return not (self.left or self.right) and self.offsets == {0} and self.block_in == self.block_out

    @property
    def static(self) -> bool:
        """Every device reads its result rows at one offset of an even block."""
        offsets = self.offsets
        return (
            self.n_in % len(self.pieces_in) == 0
            and len(offsets) == 1
            and 0 <= min(offsets)
            and min(offsets) + self.block_out <= self.left + self.block_in + self.right
        )


def _resized(eqn) -> dict:
    """{dim: (shift, operand size, result size)} for each dim a slice or pad
    moves or resizes (strided slices and interior padding are not shifts:
    their dims are never offered split)."""
    n, m = shape_of(eqn.invars[0].aval), shape_of(eqn.outvars[0].aval)
    if eqn.primitive.name == "slice":
        starts = eqn.params["start_indices"]
        return {d: (starts[d], n[d], m[d]) for d in range(len(n)) if starts[d] or n[d] != m[d]}
    return padded_dims(eqn.params["padding_config"], n, m)


def padded_dims(cfg, n, m) -> dict:
    """{dim: (shift, operand size, result size)} of the dims a padding config
    (``(lo, hi, interior)`` per dim) moves or resizes, from shape ``n`` to ``m``."""
    return {d: (-lo, n[d], m[d]) for d, (lo, _, _) in enumerate(cfg) if lo or n[d] != m[d]}


def may_shift(eqn) -> bool:
    """Whether a slice or pad is a shift along some dim (``is_shift``): the
    ops whose split dims may exchange rows, which the greedy pass costs exactly."""
    return any(is_shift(*change) for change in _resized(eqn).values())


def is_shift(shift: int, n: int, m: int) -> bool:
    """Whether reading row ``r + shift`` of ``n`` rows into ``m`` changes the
    dim by less than half of its longer size (rows cut or padded at its start
    plus at its end)."""
    return 0 < 2 * (abs(shift) + abs(n - m - shift)) < max(n, m)


def _pieces(n: int, axes, grid) -> tuple:
    """Every piece's (start, size) of a dim of ``n`` split by ``axes``, in group order."""
    out = [(0, n)]
    for a in axes:
        out = [
            (s + t, z)
            for s, size in out
            for t, z in (balanced_piece(size, grid[a], c) for c in range(grid[a]))
        ]
    return tuple(out)


def shifts(eqn, ins, outs, grid) -> list[Shift] | None:
    """The :class:`Shift` of each split dim a slice or pad moves or resizes,
    or ``None`` where that signature cannot run with one exchange per side
    (or, for an op that is not a shift, ``may_shift``, with none at all)."""
    out = []
    shifting = may_shift(eqn)
    for d, (shift, n, m) in _resized(eqn).items():
        axes = split_axes(ins[0], d)
        if not axes and not split_axes(outs[0], d):
            continue
        if split_axes(outs[0], d) != axes:
            return None
        step = _shift(d, tuple(axes), shift, n, m, tuple(grid))
        if step is None or not (shifting or step.in_place):
            return None
        out.append(step)
    return out


def prefix_aligned(short: int, long: int, axes: tuple, grid: tuple) -> bool:
    """Whether every device's piece of a dim of size ``short`` split by
    ``axes`` is its piece of the same dim at size ``long`` cut at ``short``,
    in a block of the same size, and not empty (``logits[:, :-1]`` on 8
    pieces of 32: seven of 32 and one of 31): the shift between the two
    sizes is in place. Whole rows concatenated after such a cut fill its
    hole in place (``sbpjax.rules.shape``)."""
    step = _shift(0, tuple(axes), 0, long, short, tuple(grid))
    return step is not None and step.in_place


@functools.cache  # the propagator asks again for each candidate signature
def _shift(d, axes, shift, n, m, grid) -> Shift | None:
    """The :class:`Shift` of dim ``d`` (``n`` rows split by ``axes`` into ``m``,
    row ``r`` reading ``r + shift``), or None where some device would hold
    nothing or needs rows past its neighbours' pieces."""
    pin, pout = _pieces(n, axes, grid), _pieces(m, axes, grid)
    if min(z for _, z in pin) < 1 or min(z for _, z in pout) < 1:
        return None  # a device would hold nothing (sbpjax.compiler.uneven)
    left = right = 0
    for i, ((si, zi), (so, zo)) in enumerate(zip(pin, pout)):
        g0, g1 = max(so + shift, 0), min(so + shift + zo, n)
        if g0 >= g1:
            continue  # padding only
        need_l, need_r = max(0, si - g0), max(0, g1 - si - zi)
        if (
            need_l
            and (i == 0 or need_l > pin[i - 1][1])
            or need_r
            and (i + 1 == len(pin) or need_r > pin[i + 1][1])
        ):
            return None
        left, right = max(left, need_l), max(right, need_r)
    if len(pin) > 1 and left > min(z for _, z in pin[:-1]):
        # every piece sends its last `left` valid rows on: a shorter one has
        # fewer (a receiver that needs fewer would read past its sender's rows)
        return None
    return Shift(d, axes, shift, n, m, pin, pout, left, right)


def shift_comms(eqn, in_avals, ins, outs, grid) -> list[Comm] | None:
    """One exchange per side that receives rows, per shifted dim, on the
    block as the dims before it left it (``run_shifts``)."""
    steps = shifts(eqn, ins, outs, grid)
    if steps is None:
        return None
    shape, out = list(local_shape(shape_of(in_avals[0]), ins[0], grid)), []
    chain: tuple = ()
    itemsize = in_avals[0].dtype.itemsize
    for st in steps:
        pieces = len(st.pieces_in)
        slab = math.prod(shape) // shape[st.dim] * itemsize
        lines = math.prod(grid) // pieces
        for side, rows in (("left", st.left), ("right", st.right)):
            if rows:
                detail = ("shift", chain, st.dim, side, rows, st.axes)
                out.append(Comm("halo_exchange", st.axes, lines * (pieces - 1) * rows * slab, 0, detail))
        shape[st.dim] = st.block_out
        chain += (_key(st),)
    return out


def _key(st: Shift) -> tuple:
    return (st.dim, st.shift, st.n_in, st.n_out, st.axes)


def run_shifts(x, steps, ctx, fill=None):
    """``x`` (a device's block) with each :class:`Shift` of ``steps`` run
    along its dim, one after the other (a later dim's exchange carries the
    corners); ``fill``: the padding value (a pad's), or None (a slice's).
    Exchanges of the same rows of the same value are made once (``ctx.memo``)."""
    chain: tuple = ()
    for st in steps:
        if not st.in_place:
            x = _run(x, st, ctx, fill, chain)
        elif fill is not None:  # the block stays: positions past the operand's piece are padding
            sizes = [z for _, z in st.pieces_in]
            size = sizes[0] if len(set(sizes)) == 1 else jnp.asarray(sizes, jnp.int32)[_index(st, ctx)]
            x = jnp.where(lax.broadcasted_iota(jnp.int32, x.shape, st.dim) < size, x, fill.astype(x.dtype))
        chain += (_key(st),)
    return x


def _index(st: Shift, ctx):
    return group_index(st.axes, ctx.placement.axis_names, ctx.grid)


def _run(x, st: Shift, ctx, fill, chain):
    d, pieces = st.dim, len(st.pieces_in)
    axis = axis_arg([ctx.placement.axis_names[a] for a in st.axes])
    idx = _index(st, ctx)
    table = lambda values: jnp.asarray(values, jnp.int32)[idx]  # noqa: E731
    size_in = table([z for _, z in st.pieces_in])
    parts = []
    if st.left:
        # the piece before's last `left` rows: at the end of its valid rows
        def send_left():
            tail = (
                lax.slice_in_dim(x, st.block_in - st.left, st.block_in, axis=d)
                if st.n_in % pieces == 0
                else lax.dynamic_slice_in_dim(x, size_in - st.left, st.left, axis=d)
            )
            return lax.ppermute(tail, axis, perm=[(i, i + 1) for i in range(pieces - 1)])

        parts.append(ctx.memo(0, ("shift", chain, d, "left", st.left, st.axes), send_left))
    parts.append(x)
    if st.right:

        def send_right():
            head = lax.slice_in_dim(x, 0, st.right, axis=d)
            return lax.ppermute(head, axis, perm=[(i + 1, i) for i in range(pieces - 1)])

        parts.append(ctx.memo(0, ("shift", chain, d, "right", st.right, st.axes), send_right))
    ext = lax.concatenate(parts, d) if len(parts) > 1 else x
    rows = table([so for so, _ in st.pieces_out]) + st.shift + jnp.arange(st.block_out, dtype=jnp.int32)
    if st.static:
        at = min(st.offsets)
        y = lax.slice_in_dim(ext, at, at + st.block_out, axis=d)
    else:
        start_in = table([si for si, _ in st.pieces_in])
        own = rows - start_in  # the row's place in this device's piece
        local = jnp.where(own < size_in, st.left + own, st.left + st.block_in + own - size_in)
        y = jnp.take(ext, jnp.clip(local, 0, ext.shape[d] - 1), axis=d)
    if fill is not None:
        outside = ((rows < 0) | (rows >= st.n_in)).reshape([-1 if e == d else 1 for e in range(y.ndim)])
        y = jnp.where(outside, fill.astype(y.dtype), y)
    return y

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
A *shift*, a slice or pad that changes a dim by less than half of its
longer size (``tokens[:, 2:]``, a causal convolution written as padded
shifted slices, ``pad`` then ``slice``), exchanges rows with the
neighbours. A larger change (a third of a column-split ``qkv``, the
halves of a value swapped), or a shift whose rows lie past a neighbour's
piece, is a *cut* (:class:`Cut`): the rows each device needs come from
whichever pieces hold them, one ``ppermute`` per distance between the
sending and the receiving piece, each row once. A concatenation along a
dim its operands are split on places each operand as a pad by the rows
around it (:func:`placements`). Where some device would hold nothing
(``x[N - 3:]`` on 8 pieces), the value is boxed first.

A strided slice (``x[:, ::2]``, ``x[:, 1::2]``) and its gradient, a pad
with interior padding, move nothing where each piece is a multiple of the
stride and the start is below it (:func:`strided_in_place`): every device
keeps the rows at that offset of its own piece. Other strides are boxed.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from sbpjax.layout import balanced_piece
from sbpjax.rules import Comm, exchange_detail, local_shape, shape_of, split_axes
from sbpjax.sbp import Split


@dataclasses.dataclass(frozen=True)
class _Moved:
    """Dim ``dim`` of ``n_in`` rows split by ``axes``, moved to ``n_out``
    rows, result row ``r`` reading operand row ``r + shift``; every piece's
    (start, size), and a device's block: the largest piece."""

    dim: int
    axes: tuple
    shift: int
    n_in: int
    n_out: int
    pieces_in: tuple
    pieces_out: tuple

    @property
    def block_in(self) -> int:
        return max(z for _, z in self.pieces_in)

    @property
    def block_out(self) -> int:
        return max(z for _, z in self.pieces_out)


@dataclasses.dataclass(frozen=True)
class Shift(_Moved):
    """How one split dim of a slice or pad is run: result row ``r`` reads
    operand row ``r + shift`` (rows outside ``[0, n_in)`` are padding).
    ``pieces_in`` / ``pieces_out``: every piece's (start, size), in the
    order of the group index of ``axes``; ``left`` / ``right``: rows each
    device receives from the piece before / after it (0: no exchange)."""

    left: int
    right: int

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


def _geometry(eqn) -> tuple:
    """``(strided, resized)`` of a slice or pad, as ``(dim, value)`` items.

    ``strided``: ``(stride, rows of the wide side)`` for each dim a slice
    takes with a stride > 1 (the operand's size) or a pad pads with interior
    padding (interior + 1, the result's size), where every stride-aligned
    run of ``stride`` rows of the wide side keeps one row, at the same
    offset below the stride (the slice's start, the pad's low padding):
    ``x[:, ::2]``, ``x[:, 1::2]`` and their gradients. Each device's piece
    then keeps its own rows where the pieces are multiples of the stride
    (:func:`strided_in_place`). A dim strided otherwise maps to None.

    ``resized``: ``(shift, operand size, result size)`` for each other dim
    the op moves or resizes.

    Read from what they depend on (the op, its operand's and result's shapes,
    its slice indices or padding config) and worked out once per geometry:
    the layout choice asks again for every candidate signature of every
    slice and pad, in each greedy pass and in the formulation (some 300,000
    times for a 32-layer scanned GPT step, whose 544 written-out slices of
    stacked weights each have a start of their own)."""
    name, params = eqn.primitive.name, eqn.params
    config: tuple
    if name == "slice":
        config = (tuple(params["start_indices"]), tuple(params["strides"] or ()))
    else:
        config = tuple(tuple(c) for c in params["padding_config"])
    return _geometry_of(name, shape_of(eqn.invars[0].aval), shape_of(eqn.outvars[0].aval), config)


@functools.lru_cache(maxsize=4096)
def _geometry_of(name: str, n: tuple, m: tuple, config: tuple) -> tuple:
    strided: dict = {}
    if name == "slice":
        starts, strides = config
        for d, s in enumerate(strides or (1,) * len(n)):
            if s > 1:
                a = starts[d]
                strided[d] = (s, n[d]) if a < s and n[d] % s == 0 and m[d] == n[d] // s else None
        resized = {
            d: (starts[d], n[d], m[d])
            for d in range(len(n))
            if d not in strided and (starts[d] or n[d] != m[d])
        }
    else:
        for d, (lo, _, inner) in enumerate(config):
            if inner:
                s = inner + 1
                strided[d] = (s, m[d]) if 0 <= lo < s and m[d] == n[d] * s else None
        moved = padded_dims(config, n, m)
        resized = {d: change for d, change in moved.items() if d not in strided}
    return tuple(strided.items()), tuple(resized.items())


def strided_in_place(wide: int, stride: int, axes, grid) -> bool:
    """Whether a dim of ``wide`` rows split by ``axes`` into even pieces,
    each a multiple of ``stride`` rows, so that the rows a stride keeps
    (and the narrow side's even pieces) stay on their devices."""
    pieces = math.prod(grid[a] for a in axes)
    return wide % (pieces * stride) == 0


def padded_dims(cfg, n, m) -> dict:
    """{dim: (shift, operand size, result size)} of the dims a padding config
    (``(lo, hi, interior)`` per dim) moves or resizes, from shape ``n`` to ``m``."""
    return {d: (-lo, n[d], m[d]) for d, (lo, _, _) in enumerate(cfg) if lo or n[d] != m[d]}


def may_shift(eqn) -> bool:
    """Whether a slice or pad moves, resizes or strides some dim: the ops
    whose split dims may exchange rows (a shift with its neighbours, a cut
    with farther pieces) or run only where the pieces line up (a stride),
    which the greedy pass costs exactly."""
    strided, resized = _geometry(eqn)
    return bool(strided) or bool(resized)


def splits_moved_dim(eqn, sig) -> bool:
    """Whether 1-D candidate ``sig`` of a slice or pad splits a dim the op
    moves, resizes or strides: only such a candidate can exchange rows."""
    strided, resized = _geometry(eqn)
    moved = {d for d, _ in strided} | {d for d, _ in resized}
    return any(isinstance(q, Split) and q.dim in moved for q in (sig.ins[0], sig.outs[0]))


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


def shifts(eqn, ins, outs, grid) -> list[Shift | Cut] | None:
    """The :class:`Shift` or :class:`Cut` of each split dim a slice or pad
    moves or resizes, or ``None`` where that signature cannot run (some
    device would hold no rows, or a strided dim's pieces do not line up
    with its stride). A strided dim that lines up moves nothing."""
    steps = _shifts(_geometry(eqn), tuple(ins[0]), tuple(outs[0]), tuple(grid))
    return None if steps is None else list(steps)


@functools.lru_cache(maxsize=16384)  # per geometry and signature: see _geometry
def _shifts(geometry: tuple, nd_in: tuple, nd_out: tuple, grid: tuple) -> tuple | None:
    strided, resized = geometry
    for d, stride in strided:
        axes = split_axes(nd_in, d)
        if not axes and not split_axes(nd_out, d):
            continue
        if split_axes(nd_out, d) != axes or stride is None:
            return None
        if not strided_in_place(stride[1], stride[0], tuple(axes), grid):
            return None
    out = []
    shifting = any(is_shift(*change) for _, change in resized)
    for d, (shift, n, m) in resized:
        axes = split_axes(nd_in, d)
        if not axes and not split_axes(nd_out, d):
            continue
        if split_axes(nd_out, d) != axes:
            return None
        step = _moved(d, tuple(axes), shift, n, m, grid, shifting)
        if step is None:
            return None
        out.append(step)
    return tuple(out)


def placements(eqn, ins, outs, grid) -> list | None:
    """For ``concatenate`` along a dim every operand and the result are split
    on by the same axes: per operand, the :class:`Shift` or :class:`Cut` that
    places it at its rows of the result (as a pad by the rows before and
    after it), or None where that signature is not this one or cannot run."""
    d = eqn.params["dimension"]
    axes = tuple(split_axes(outs[0], d))
    if not axes or any(tuple(split_axes(nd, d)) != axes for nd in ins):
        return None
    total, at, out = shape_of(eqn.outvars[0].aval)[d], 0, []
    for a in eqn.invars:
        n = shape_of(a.aval)[d]
        step = _moved(d, axes, -at, n, total, tuple(grid), is_shift(-at, n, total))
        if step is None:
            return None
        out.append(step)
        at += n
    return out


def _moved(d, axes, shift, n, m, grid, shifting: bool) -> Shift | Cut | None:
    """Dim ``d`` moved as a :class:`Shift` where the op is one (``shifting``)
    or the pieces stay in place, else as a :class:`Cut`; None where neither runs."""
    step = _shift(d, axes, shift, n, m, grid)
    if step is not None and (shifting or step.in_place):
        return step
    return _cut(d, axes, shift, n, m, grid)


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


@dataclasses.dataclass(frozen=True)
class Cut(_Moved):
    """A slice or pad of a split dim whose result pieces read rows of pieces
    beyond their neighbours (a third of a column-split ``qkv``, a cut by half
    or more): each distance ``k`` (the sending piece's index minus the
    receiving piece's) is one ``ppermute`` of ``rows`` rows, each sender's
    from its own first row (``starts``, per piece; -1: it sends nothing at
    that distance), and each device takes its result rows from its block
    extended by what it received, in the order of ``sends`` (``reads``: per
    piece, each result row's place there; -1: padding, or past the piece).
    Every row a device needs crosses once, as GSPMD's collective permutes
    move a misaligned slice."""

    sends: tuple  # ((k, rows, starts per piece), ...)
    reads: tuple  # per piece: the place of each of its block's result rows
    left: int = 0  # no neighbour exchange (``Shift``'s)
    right: int = 0

    @property
    def runs(self) -> tuple | None:
        """Each device's first place, where every device reads its valid
        result rows as one run of its extended block that fits it (a dynamic
        slice), else None (a gather)."""
        ext = self.block_in + sum(rows for _, rows, _ in self.sends)
        firsts = []
        for places, (_, size) in zip(self.reads, self.pieces_out):
            valid = places[:size]
            first = valid[0]
            if first < 0 or first + self.block_out > ext or list(valid) != list(range(first, first + size)):
                return None
            firsts.append(first)
        return tuple(firsts)


@functools.cache
def _cut(d, axes, shift, n, m, grid) -> Cut | None:
    """The :class:`Cut` of dim ``d`` (``n`` rows split by ``axes`` into ``m``,
    row ``r`` reading ``r + shift``), or None where some device would hold
    nothing."""
    pin, pout = _pieces(n, axes, grid), _pieces(m, axes, grid)
    if min(z for _, z in pin) < 1 or min(z for _, z in pout) < 1:
        return None  # a device would hold nothing (sbpjax.compiler.uneven)
    block_in = max(z for _, z in pin)

    def piece_of(row):
        return next(j for j, (s, z) in enumerate(pin) if s <= row < s + z)

    need: dict = {}  # k -> {sender: (its first row needed, count)}
    for i, (so, zo) in enumerate(pout):
        g0, g1 = max(so + shift, 0), min(so + shift + zo, n)
        for j, (si, zi) in enumerate(pin):
            a, b = max(g0, si), min(g1, si + zi)
            if a < b and j != i:
                need.setdefault(j - i, {})[j] = (a - si, b - a)
    sends, base, at = [], {}, block_in
    for k in sorted(need):
        rows = max(c for _, c in need[k].values())
        starts = tuple(min(need[k][j][0], block_in - rows) if j in need[k] else -1 for j in range(len(pin)))
        sends.append((k, rows, starts))
        base[k], at = (at, starts), at + rows
    reads = []
    for i, (so, zo) in enumerate(pout):
        places = []
        for r in range(max(z for _, z in pout)):
            row = so + shift + r
            if r >= zo or not 0 <= row < n:
                places.append(-1)
                continue
            j = piece_of(row)
            if j == i:
                places.append(row - pin[i][0])
            else:
                first, starts = base[j - i]
                places.append(first + row - pin[j][0] - starts[j])
        reads.append(tuple(places))
    return Cut(d, axes, shift, n, m, pin, pout, tuple(sends), tuple(reads))


def clear_caches() -> None:
    """Forget the geometries, shifts and cuts worked out so far (kept for the
    life of the process; benchmarks clear them to time a cold planner)."""
    for cached in (_geometry_of, _shifts, _shift, _cut):
        cached.cache_clear()


def shift_comms(eqn, in_avals, ins, outs, grid) -> list[Comm] | None:
    """One exchange per side that receives rows (per distance, for a
    :class:`Cut`), per moved dim, on the block as the dims before it left it
    (:func:`sbpjax.rules.shift_run.run_shifts`)."""
    steps = shifts(eqn, ins, outs, grid)
    return None if steps is None else step_comms(steps, in_avals[0], ins[0], grid)


def step_comms(steps, aval, nd, grid, operand: int = 0) -> list[Comm]:
    """The exchanges of ``steps`` run on operand ``operand`` (``aval``, in
    layout ``nd``)."""
    shape, out = list(local_shape(shape_of(aval), nd, grid)), []
    chain: tuple = ()
    itemsize = aval.dtype.itemsize
    for st in steps:
        pieces = len(st.pieces_in)
        slab = math.prod(shape) // shape[st.dim] * itemsize
        lines = math.prod(grid) // pieces
        if isinstance(st, Cut):
            for k, rows, starts in st.sends:
                pairs = sum(1 for s in starts if s >= 0)
                sent: tuple = ("cut", chain, st.dim, k, rows, starts, st.axes)
                out.append(Comm("permute", st.axes, lines * pairs * rows * slab, operand, sent))
        for side, rows in (("left", st.left), ("right", st.right)):
            if rows:
                detail = exchange_of(st, chain, side, rows)
                out.append(
                    Comm("halo_exchange", st.axes, lines * (pieces - 1) * rows * slab, operand, detail)
                )
        shape[st.dim] = st.block_out
        chain += (step_key(st),)
    return out


def exchange_of(st: Shift, chain: tuple, side: str, rows: int) -> tuple:
    """An exchange's detail (see ``exchange_detail``), the same where it is
    priced (here) and where it runs (:mod:`sbpjax.rules.shift_run`), so that
    the run makes each priced exchange once: an uneven split's left side
    sends the rows at the end of each piece's valid rows, not the block's
    edge."""
    edge = side == "right" or st.n_in % len(st.pieces_in) == 0
    return exchange_detail(chain, st.dim, side, rows, st.axes, "shift", edge)


def step_key(st: Shift | Cut) -> tuple:
    """A step as the chain of an exchange's detail names it."""
    return (st.dim, st.shift, st.n_in, st.n_out, st.axes)

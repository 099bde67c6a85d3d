"""Halo exchange: sliding windows over a split dim.

A convolution or a pooling window split along a dim it slides over (image
height) needs, on each device, a few elements past either end of its piece:
the *halo*. Each device sends its border rows to its neighbours with one
``ppermute`` per side, appends what it receives, and runs the op on the
extended piece with the padding changed to what is left at that position
(GSPMD and Mesh-TensorFlow's spatial partitioning do the same). Devices at
the ends of the dim receive the padding value instead, as the whole op would
have read it.

One dim of a window op is a :class:`Slide`: ``out[o]`` reduces
``xd[o * stride - lo + j * rhs_dil]`` over the window taps ``j``, where ``xd``
is the input with ``lhs_dil - 1`` holes between elements (a transposed
convolution, the input gradient of a strided one). Two splits are run:

* **output split**: the input and the output are split alike, every device
  has every tap (a forward convolution, pooling, an input gradient);
* **window split**: the input and the taps are split alike and every device
  makes a partial sum of the whole output (a kernel gradient, whose "window"
  is the output gradient).

Where every device's needed range sits at the same place relative to its
own piece (``shift == n_l * lhs_dil`` below: "SAME" padding with a stride
that divides the size, non-overlapping pooling, their gradients), each runs
the op on its extended piece. Where the output split's ranges drift from the
pieces (a "VALID" convolution, whose output is shorter than its input; its
input gradient, longer), each device receives the most rows any device
needs from either neighbour and reads its own window from the extended
piece at an offset of its own (:func:`_drifting`); so does a window split
that drifts (such a convolution's kernel gradient). A dilated input's
drifting halo is not offered and the operand is gathered first; neither is
a halo wider than a neighbour's piece.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

from sbpjax.boxing.device_index import axis_arg, group_index
from sbpjax.rules import Comm, exchange_detail


@dataclasses.dataclass(frozen=True)
class Slide:
    """One dim of a window op (global sizes): input ``n``, taps ``k``, output
    ``m``, ``stride``, padding ``lo``/``hi``, input and tap dilations."""

    n: int
    k: int
    m: int
    stride: int = 1
    lo: int = 0
    hi: int = 0
    lhs_dil: int = 1
    rhs_dil: int = 1

    @property
    def untouched(self) -> bool:
        """Whether the window leaves this dim as it is (one tap, stride 1, no
        padding or dilation: a pool's batch and channel dims). Its pieces need
        no halo, whatever their sizes (an uneven batch's too)."""
        return (
            self.k == 1
            and self.stride == 1
            and self.lo == self.hi == 0
            and self.lhs_dil == 1
            and self.m == self.n
        )


@dataclasses.dataclass(frozen=True)
class Halo:
    """What each device needs beyond its piece (``left`` elements from the
    piece before it, ``right`` from the piece after; negative: that many of
    its own are not used), and the padding the op then runs with.

    ``drift`` (not 0 where the output's pieces advance by another number of
    input rows than the input's pieces, as a "VALID" convolution's 16 rows
    of output over the 18 rows of its input): the device of group index
    ``i`` reads ``span`` rows of its extended block from row ``start + i *
    drift``, the padding already among them (``pad`` is then (0, 0))."""

    left: int
    right: int
    pad: tuple[int, int]
    drift: int = 0
    start: int = 0
    span: int = 0

    @property
    def key(self) -> tuple:
        """What the block after this exchange holds, for the exchanges of the
        dims after it (``halo_comms``' chain)."""
        return (self.left, self.right) + ((self.drift, self.start, self.span) if self.drift else ())

    @property
    def received(self) -> int:
        return max(self.left, 0) + max(self.right, 0)


def halo(sl: Slide, pieces: int, split_window: bool) -> Halo | None:
    """The halo of ``sl`` split into ``pieces`` (output split, or window split
    when ``split_window``); ``None`` where that split cannot be run locally."""
    if sl.n % pieces or (sl.k if split_window else sl.m) % pieces:
        return None
    n_l = sl.n // pieces
    if split_window:
        m_l, k_l = sl.m, sl.k // pieces
        shift = k_l * sl.rhs_dil
    else:
        m_l, k_l = sl.m // pieces, sl.k
        shift = m_l * sl.stride
    span = (m_l - 1) * sl.stride + (k_l - 1) * sl.rhs_dil + 1
    # device i needs dilated positions [i * shift - lo, ... + span): the same
    # place relative to its piece [i * n_l * lhs_dil, ...) on every device only
    # when the two advance together; else each reads at its own offset
    if shift != n_l * sl.lhs_dil:
        return None if sl.lhs_dil != 1 else _drifting(sl, n_l, shift, span, pieces)
    left = sl.lo // sl.lhs_dil
    right = (span - 1 - sl.lo) // sl.lhs_dil + 1 - n_l
    if left > n_l or right > n_l or n_l + min(left, 0) + min(right, 0) < 1:
        return None
    width = n_l + left + right
    lo_l = sl.lo - left * sl.lhs_dil
    return Halo(left, right, (lo_l, span - lo_l - ((width - 1) * sl.lhs_dil + 1)))


def _drifting(sl: Slide, n_l: int, shift: int, span: int, pieces: int) -> Halo | None:
    """The halo where device ``i``'s window, input rows ``[i * shift - lo,
    ... + span)`` (its outputs' under an output split, its taps' under a
    window split), moves against its piece ``[i * n_l, ...)`` by ``drift =
    shift - n_l`` rows per device: it needs ``lo - i * drift``
    rows of the piece before and ``span - lo - n_l + i * drift`` of the piece
    after. Every device receives the most any needs (the ends receive the
    padding value: the op's padding, which the window then holds) and reads
    its window at its own offset, as GSPMD does. None where a neighbour's
    piece is too short."""
    drift = shift - n_l
    needs_left = [sl.lo - i * drift for i in range(pieces)]
    needs_right = [span - sl.lo - n_l + i * drift for i in range(pieces)]
    left, right = max(0, *needs_left), max(0, *needs_right)
    if left > n_l or right > n_l:
        return None
    return Halo(left, right, (0, 0), drift, left - sl.lo, span)


def halo_comms(shape, itemsize, steps, grid, operand=0) -> list[Comm]:
    """The exchanges of ``run_halos(x, steps, ...)`` on a local piece of
    ``shape``, one ``Comm`` per side that receives rows: every device but the
    first of its line receives ``left`` rows, every device but the last
    ``right`` rows. ``steps``: as ``run_halos`` takes them, (dim, Halo, axes,
    fill, fill key) per split dim, in order (the fill key names the edge
    value; ops sending the same rows of the same value share the exchange,
    see ``Comm``)."""
    shape, out = list(shape), []
    chain: tuple = ()
    for dim, h, axes, _, fill_key in steps:
        pieces = math.prod(grid[a] for a in axes)
        slab = math.prod(shape) // shape[dim] * itemsize
        lines = math.prod(grid) // pieces
        for side, rows in (("left", h.left), ("right", h.right)):
            if rows > 0:
                nbytes = lines * (pieces - 1) * rows * slab
                detail = exchange_detail(chain, dim, side, rows, axes, "halo")
                out.append(Comm("halo_exchange", tuple(axes), nbytes, operand, detail))
        shape[dim] = h.span if h.drift else shape[dim] + h.left + h.right
        chain += ((dim, *h.key, axes, fill_key),)
    return out


def run_halos(x, steps, ctx, operand=0):
    """``x`` extended by the halos of ``steps``: (dim, Halo, axes, fill, fill
    key) per split dim, the fill being the edge value (None: zeros) and the
    key its name (see ``halo_comms``), one dim after the other, so
    a second dim's exchange carries the corners. Each side's ``ppermute`` is
    made once per program for the same rows of the same value (``ctx.memo``)."""
    chain: tuple = ()
    for dim, h, axes, fill, fill_key in steps:

        def send(side, rows, make, chain=chain, dim=dim, axes=axes):
            return ctx.memo(operand, exchange_detail(chain, dim, side, rows, axes, "halo"), make)

        x = exchange(x, dim, h, axes, ctx.placement.axis_names, ctx.grid, fill, send)
        if h.drift:
            at = h.start + group_index(axes, ctx.placement.axis_names, ctx.grid) * h.drift
            x = lax.dynamic_slice_in_dim(x, at, h.span, axis=dim)
        chain += ((dim, *h.key, axes, fill_key),)
    return x


def exchange(x, dim: int, h: Halo, axes, names, grid, fill=None, send=None):
    """``x`` (this device's piece along ``dim``, split over placement
    ``axes``; ``names`` / ``grid``: every axis's name and size) with its halo:
    ``h.left`` rows of the piece before it in front, ``h.right`` rows of the
    piece after it behind; the first and last pieces get ``fill`` there
    (``None``: zeros, which ``ppermute`` leaves where nothing is sent).
    ``ppermute`` over several axes numbers devices row-major in the order
    given, as nd-SBP orders pieces. ``send(side, rows, make)`` may reuse an
    earlier ``make()`` (``run_halos``)."""
    n_l = x.shape[dim]
    pieces = math.prod(grid[a] for a in axes)
    axis = axis_arg([names[a] for a in axes])
    idx = group_index(axes, names, grid) if fill is not None else None
    send = send or (lambda side, rows, make: make())
    parts = []
    if h.left > 0:
        got = send(
            "left",
            h.left,
            lambda: lax.ppermute(
                lax.slice_in_dim(x, n_l - h.left, n_l, axis=dim),
                axis,
                perm=[(i, i + 1) for i in range(pieces - 1)],
            ),
        )
        if idx is not None:
            got = jnp.where(idx == 0, jnp.asarray(fill, x.dtype), got)
        parts.append(got)
    parts.append(lax.slice_in_dim(x, max(0, -h.left), n_l - max(0, -h.right), axis=dim))
    if h.right > 0:
        got = send(
            "right",
            h.right,
            lambda: lax.ppermute(
                lax.slice_in_dim(x, 0, h.right, axis=dim), axis, perm=[(i + 1, i) for i in range(pieces - 1)]
            ),
        )
        if idx is not None:
            got = jnp.where(idx == pieces - 1, jnp.asarray(fill, x.dtype), got)
        parts.append(got)
    return lax.concatenate(parts, dim) if len(parts) > 1 else parts[0]

"""Layouts: which part of a logical tensor each device holds.

An nd-SBP names one SBP per placement axis and always applies the axes in order
(axis 0 first). The boxing planner also needs layouts where a dim is split by
several axes in another order, e.g. dim 0 split first by ``y`` then by ``x``:
a reduce-scatter over ``x`` of a tensor already split by ``y`` produces one.
:class:`Layout` is that general form: for each tensor dim, the placement axes
that split it, outermost first; the partial axes with their op; every other
axis broadcasts. An nd-SBP is the layout whose per-dim axis lists are sorted.

Physical form (how a global tensor lives in one ``jax.Array``): each device's
block is its local tensor padded at the end of every split dim to the largest
local size (balanced splits are uneven when the size does not divide), and one
leading dim of size ``p`` per partial axis, sharded over that axis, so every
device keeps its own partial term.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence

import numpy as np
from jax.sharding import PartitionSpec

from sbpjax.sbp import Broadcast, Partial, Split, format_sbp


@functools.total_ordering
class Layout:
    """``dims[d]``: placement axes splitting tensor dim ``d``, outer first.
    ``partial``: ``(axis, op)`` pairs sorted by axis.

    Immutable and interned: equal layouts are one object, so equality is
    identity. The boxing search keys its states by layout and looks them up
    millions of times on a 3-D placement; with every move building its
    target layout afresh, each lookup compared nested tuples in Python
    (``__eq__`` was 8% of a 2-D GPT's plan on 2x2x2, 14M calls). The table
    of layouts made holds one entry per distinct layout a process met: a few
    thousand, bounded by its placements' axes and its tensors' ranks."""

    __slots__ = ("dims", "partial", "_hash")
    _interned: dict = {}

    dims: tuple
    partial: tuple
    _hash: int

    def __new__(cls, dims: tuple, partial: tuple = ()) -> Layout:
        key = (dims, partial)
        self = cls._interned.get(key)
        if self is None:
            self = object.__new__(cls)
            object.__setattr__(self, "dims", dims)
            object.__setattr__(self, "partial", partial)
            # hashed once, by contents (the search hashes a layout millions of times)
            object.__setattr__(self, "_hash", hash(key))
            cls._interned[key] = self
        return self

    def __setattr__(self, name, value):
        raise AttributeError(f"Layout is immutable: cannot set {name!r}")

    def __hash__(self) -> int:
        return self._hash

    # __eq__ is object's: identity, since equal layouts are one object
    def __lt__(self, other) -> bool:
        if other.__class__ is not Layout:
            return NotImplemented
        return (self.dims, self.partial) < (other.dims, other.partial)

    def __repr__(self) -> str:
        return f"Layout(dims={self.dims!r}, partial={self.partial!r})"

    def __reduce__(self):
        # rebuilt (and interned) in the receiving process
        return (Layout, (self.dims, self.partial))

    @staticmethod
    def from_nd_sbp(sbp: Sequence, ndim: int) -> Layout:
        dims: list[list[int]] = [[] for _ in range(ndim)]
        partial = []
        for axis, s in enumerate(sbp):
            if isinstance(s, Split):
                dims[s.dim].append(axis)
            elif isinstance(s, Partial):
                partial.append((axis, s.op))
        return Layout(tuple(tuple(d) for d in dims), tuple(partial))

    @property
    def canonical(self) -> bool:
        return all(list(d) == sorted(d) for d in self.dims)

    def canonicalized(self) -> Layout:
        return Layout(tuple(tuple(sorted(d)) for d in self.dims), self.partial)

    def to_nd_sbp(self, n_axes: int) -> tuple:
        out: list = [Broadcast()] * n_axes
        for d, axes in enumerate(self.dims):
            for a in axes:
                out[a] = Split(d)
        for a, op in self.partial:
            out[a] = Partial(op)
        return tuple(out)

    def split_axes(self) -> set:
        return {a for d in self.dims for a in d}

    def describe(self, n_axes: int, axis_names: Sequence[str] | None = None) -> str:
        """The nd-SBP text, plus the split order where it is not the axis order."""
        text = format_sbp(self.to_nd_sbp(n_axes))
        if self.canonical:
            return text
        names = axis_names or [str(a) for a in range(n_axes)]
        orders = [
            f"dim {d} split {','.join(names[a] for a in axes)}"
            for d, axes in enumerate(self.dims)
            if list(axes) != sorted(axes)
        ]
        return f"{text}[{'; '.join(orders)}]"


@functools.lru_cache(maxsize=4096)
def geometry(shape: tuple, grid: tuple) -> Geometry:
    """A shared :class:`Geometry` for ``shape`` on ``grid`` (its box cache with it)."""
    return Geometry(shape, grid)


def zero_split(nd: tuple, shape, grid: tuple, axis: int) -> tuple:
    """ZeRO's stored layout of a tensor laid out ``nd``: whole (B) over
    ``axis`` becomes a split of its first dim that stays even with the splits
    already on it (dim 0 first, as OneFlow's Fig. 14); a tensor no dim of which
    divides (a small odd bias), or ``nd`` not whole over ``axis``, stays as it is."""
    if not isinstance(nd[axis], Broadcast) or grid[axis] == 1:
        return nd
    for dim in range(len(shape)):
        splits = grid[axis] * math.prod(
            grid[a] for a, s in enumerate(nd) if isinstance(s, Split) and s.dim == dim
        )
        if shape[dim] % splits == 0:
            return nd[:axis] + (Split(dim),) + nd[axis + 1 :]
    return nd


def balanced_piece(n: int, p: int, i: int) -> tuple[int, int]:
    """(start, size) of piece ``i`` when ``n`` is split in ``p`` balanced pieces:
    the first ``n % p`` pieces get one extra element."""
    base, rem = divmod(n, p)
    return i * base + min(i, rem), base + (1 if i < rem else 0)


class Geometry:
    """Local ranges and padded sizes of a tensor shape over a device grid."""

    def __init__(self, shape: Sequence[int], grid: Sequence[int]):
        self.shape = tuple(int(s) for s in shape)
        self.grid = tuple(int(g) for g in grid)
        self.ndim = len(self.shape)
        self.n_devices = int(np.prod(self.grid))
        self.coords = list(itertools.product(*[range(g) for g in self.grid]))
        self._coord_array: np.ndarray | None = None  # coords as [n_devices, n_axes] (box_arrays)
        self._box_arrays: dict = {}  # layout -> box_arrays(layout)
        self._overlaps: dict = {}  # (src, dst) -> overlap(src, dst)

    def dim_range(self, axes: Sequence[int], d: int, coord) -> tuple[int, int]:
        start, size = 0, self.shape[d]
        for a in axes:
            s, size = balanced_piece(size, self.grid[a], coord[a])
            start += s
        return start, size

    def local_box(self, layout: Layout, coord) -> tuple:
        """Per dim (start, size) of the device's local piece."""
        return tuple(self.dim_range(layout.dims[d], d, coord) for d in range(self.ndim))

    def box_arrays(self, layout: Layout) -> tuple[np.ndarray, np.ndarray]:
        """Every device's ``local_box`` as two int64 arrays ``[n_devices, ndim]``
        in ``coords`` order, the starts and the sizes (kept: the planner's bounds
        and point-to-point steps compare every device's boxes under two layouts
        at once, 256 devices on a 16x16 placement, where a loop over them was a
        third of a plan's front end). ``balanced_piece`` over all devices at once."""
        hit = self._box_arrays.get(layout)
        if hit is None:
            if self._coord_array is None:
                self._coord_array = np.asarray(self.coords, np.int64).reshape(self.n_devices, len(self.grid))
            starts = np.zeros((self.n_devices, self.ndim), np.int64)
            sizes = np.empty((self.n_devices, self.ndim), np.int64)
            for d in range(self.ndim):
                size = np.full(self.n_devices, self.shape[d], np.int64)
                for a in layout.dims[d]:
                    i = self._coord_array[:, a]
                    base, rem = np.divmod(size, self.grid[a])
                    starts[:, d] += i * base + np.minimum(i, rem)
                    size = base + (i < rem)
                sizes[:, d] = size
            hit = self._box_arrays[layout] = (starts, sizes)
        return hit

    def padded_dim(self, axes: Sequence[int], d: int) -> int:
        size = self.shape[d]
        for a in axes:
            size = -(-size // self.grid[a])
        return size

    def padded(self, layout: Layout) -> tuple:
        """The block shape every device stores (its local tensor padded at the end)."""
        return tuple(self.padded_dim(layout.dims[d], d) for d in range(self.ndim))

    def splits(self, axes: Sequence[int]) -> int:
        return math.prod(self.grid[a] for a in axes)

    def even(self, layout: Layout) -> bool:
        """True when every split divides exactly (no padding anywhere)."""
        return all(self.shape[d] % self.splits(layout.dims[d]) == 0 for d in range(self.ndim))

    def physical_shape(self, layout: Layout) -> tuple:
        lead = tuple(self.grid[a] for a, _ in layout.partial)
        body = tuple(
            self.padded_dim(layout.dims[d], d) * self.splits(layout.dims[d]) for d in range(self.ndim)
        )
        return lead + body

    def block_shape(self, layout: Layout) -> tuple:
        return (1,) * len(layout.partial) + self.padded(layout)

    def partition_spec(self, layout: Layout, axis_names: Sequence[str]) -> PartitionSpec:
        lead = [axis_names[a] for a, _ in layout.partial]
        body: list[str | tuple[str, ...] | None] = []
        for axes in layout.dims:
            if not axes:
                body.append(None)
            elif len(axes) == 1:
                body.append(axis_names[axes[0]])
            else:
                body.append(tuple(axis_names[a] for a in axes))
        return PartitionSpec(*lead, *body)

    def overlap(self, src: Layout, dst: Layout) -> tuple[int, int]:
        """(elements all devices hold under ``dst``, of those the ones the same
        device already holds under ``src``), summed over devices (kept: the
        planner's bounds ask for one pair of layouts under many nd-SBP pairs,
        its partial sources read as B)."""
        hit = self._overlaps.get((src, dst))
        if hit is None:
            hit = self._overlaps[src, dst] = self._overlap(src, dst)
        return hit

    def _overlap(self, src: Layout, dst: Layout) -> tuple[int, int]:
        held, kept = self.held_per_device(src, dst)
        return int(held.sum()), int(kept.sum())

    def held_per_device(self, src: Layout, dst: Layout) -> tuple[np.ndarray, np.ndarray]:
        """Per device (``coords`` order), the elements it holds under ``dst`` and, of
        those, the ones it already holds under ``src`` (int64 arrays)."""
        s0, sn = self.box_arrays(src)
        d0, dn = self.box_arrays(dst)
        common = np.clip(np.minimum(s0 + sn, d0 + dn) - np.maximum(s0, d0), 0, None)
        # (a product over no dims, a scalar's, is 1: each device holds its one element)
        return np.prod(dn, axis=1), np.prod(common, axis=1)

    def floor_bytes(self, src: Layout, dst: Layout, itemsize: int) -> int:
        """Bytes every device must receive that it does not already hold (summed)."""
        held, kept = self.overlap(src, dst)
        return (held - kept) * itemsize

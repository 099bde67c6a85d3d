"""A global tensor from each device's local tensor (:func:`from_local_tensors`).

The inverse of :meth:`~sbpjax.tensor.GlobalTensor.local_tensors`, and the one
way in for pieces that cannot come from one array: uneven splits given piece
by piece, partial terms, a process's own devices' pieces. Every piece is
checked against the logical shape and the layout before anything is built.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.plan import normalized_layout
from sbpjax.dtypes import canonical_dtype, check_partial_dtype
from sbpjax.layout import Geometry
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Split, format_sbp, normalize_nd_sbp
from sbpjax.tensor import GlobalTensor, _assemble, _local_coords


def _checked_shape(shape, where: str) -> tuple:
    try:
        return tuple(int(s) for s in shape)
    except TypeError:
        raise SBPError(
            f"{where}: shape must be the logical shape as a tuple of ints (e.g. (8, 4)), got {shape!r}."
        ) from None


def _check_grid(locals_, placement: Placement) -> None:
    """That ``locals_`` has one entry per device of ``placement``'s grid: no
    fewer and, where a piece would otherwise be dropped silently, no more."""
    grid = placement.shape
    if isinstance(locals_, np.ndarray) and locals_.dtype == object:
        if locals_.shape != grid:
            raise SBPError(
                f"from_local_tensors: got a grid of shape {locals_.shape} of local tensors, the "
                f"placement has shape {grid}."
            )
        return

    def walk(item, depth, where):
        if depth == len(grid):
            return
        try:
            n = len(item)
        except TypeError:
            return  # read below, where it fails with its position
        if n != grid[depth]:
            raise SBPError(
                f"from_local_tensors: {where} has {n} local tensors where the placement's axis "
                f"{placement.axis_names[depth]!r} has {grid[depth]} devices; pass one local tensor per device, "
                f"in a grid of shape {grid}."
            )
        for i, sub in enumerate(item):
            walk(sub, depth + 1, f"{where}[{i}]")

    walk(locals_, 0, "the list")


def from_local_tensors(locals_, placement: Placement, sbp, shape) -> GlobalTensor:
    """Build a global tensor from each device's local tensor.

    ``locals_``: an array-like of the placement's shape (numpy object array or
    nested lists) whose entries are the local tensors; ``shape`` is the logical
    shape, required because it cannot be recovered from uneven pieces.
    """
    checked_placement(placement, "from_local_tensors")
    shape = _checked_shape(shape, "from_local_tensors")
    _check_grid(locals_, placement)
    sbp = normalize_nd_sbp(sbp, placement.ndim, len(shape), "from_local_tensors")
    layout = normalized_layout(sbp, len(shape), placement.shape)
    geom = Geometry(shape, placement.shape)
    grid = np.empty(placement.shape, dtype=object)
    try:
        if isinstance(locals_, np.ndarray) and locals_.dtype == object:
            src = locals_
        else:
            src = np.empty(placement.shape, dtype=object)
            for c in geom.coords:
                item = locals_
                for i in c:
                    item = item[i]
                src[c] = item
        mine = set(_local_coords(geom, placement))
        for c in geom.coords:
            # other processes' devices: their processes pass those pieces
            grid[c] = None if (c not in mine and src[c] is None) else np.asarray(src[c])
    except (IndexError, TypeError, ValueError) as e:
        raise SBPError(
            f"from_local_tensors: expected one local tensor per device in a grid of shape "
            f"{placement.shape}; could not read it ({e})."
        ) from None
    if grid.shape != placement.shape:
        raise SBPError(
            f"from_local_tensors: got a grid of shape {grid.shape} of local tensors, the "
            f"placement has shape {placement.shape}."
        )
    present = [c for c in geom.coords if grid[c] is not None]
    if missing := [c for c in _local_coords(geom, placement) if grid[c] is None]:
        raise SBPError(
            f"from_local_tensors: no local tensor for device {placement.devices[missing[0]].id} at grid "
            f"position {missing[0]}, which this process drives; pass one for each of its devices "
            "(None is allowed only for devices of other processes)."
        )
    dtype = canonical_dtype(np.result_type(*[grid[c].dtype for c in present]))
    check_partial_dtype(dtype, sbp, "from_local_tensors")
    blocks = {}
    for c in present:
        box = geom.local_box(layout, c)
        want = tuple(n for _, n in box)
        got = grid[c].shape
        if got != want:
            raise SBPError(
                f"from_local_tensors: device {placement.devices[c].id} at grid position {c} holds a "
                f"local tensor of shape {got}, but logical shape {shape} with sbp {format_sbp(sbp)} "
                f"gives it shape {want} "
                + _explain_local(shape, sbp, placement, c)
                + ". Check the logical shape or the sbp."
            )
        block = np.zeros(geom.block_shape(layout), dtype)
        block[(0,) * len(layout.partial) + tuple(slice(0, n) for n in want)] = grid[c]
        blocks[c] = block
    _check_broadcast_copies(grid, geom, layout, placement, sbp)
    return GlobalTensor(_assemble(blocks, geom, layout, placement, dtype), shape, dtype, placement, sbp)


def _explain_local(shape, sbp, placement, coord) -> str:
    parts = []
    for a, s in enumerate(sbp):
        if isinstance(s, Split) and placement.shape[a] > 1:
            parts.append(
                f"dim {s.dim} split {placement.shape[a]} ways on axis "
                f"'{placement.axis_names[a]}' (piece {coord[a]})"
            )
    return "(" + "; ".join(parts) + ")" if parts else "(no splits: the whole shape)"


def _check_broadcast_copies(grid, geom, layout, placement, sbp):
    """B means every device along the axis holds the same tensor: refuse copies
    that differ rather than silently keep one of them."""
    varying = layout.split_axes() | {a for a, _ in layout.partial}
    groups: dict = {}
    for c in geom.coords:
        if grid[c] is None:  # another process's device: that process checks it
            continue
        key = tuple(c[a] for a in sorted(varying))
        if key in groups:
            ref_c = groups[key]
            if not np.array_equal(grid[c], grid[ref_c], equal_nan=jnp.issubdtype(grid[c].dtype, jnp.inexact)):
                raise SBPError(
                    f"from_local_tensors: devices at grid positions {ref_c} and {c} differ only along "
                    f"broadcast axes of sbp {format_sbp(sbp)}, so they must hold equal local tensors, "
                    "but they do not. Use P (partial) if they are terms of a sum, or fix the data."
                )
        else:
            groups[key] = c


__all__ = ["from_local_tensors"]

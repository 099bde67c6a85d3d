"""Placements: an ordered grid of devices with axis names.

A placement wraps a ``jax.sharding.Mesh``. The device order the user gives is
kept exactly (OneFlow sorts devices; we do not), so ``S(0)`` over an axis puts
piece ``i`` on the ``i``-th device along that axis.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from sbpjax._errors import SBPError


class Placement:
    """A grid of distinct devices with one name per axis.

    ``Placement(devices, axis_names)``: ``devices`` is an array (any rank) of
    ``jax.Device``; its shape is the grid shape. Sub-placements come from
    indexing (``pl[0]`` is the first row of a 2-D grid, ``pl[:, 1:]`` a block)
    or from :meth:`subset`.
    """

    def __init__(self, devices, axis_names: Sequence[str]):
        devs = np.asarray(devices, dtype=object)
        if isinstance(axis_names, str):
            axis_names = (axis_names,)
        axis_names = tuple(axis_names)
        if devs.ndim == 0:
            devs = devs.reshape(1)
        if devs.ndim != len(axis_names):
            raise SBPError(
                f"Placement: a device grid of shape {devs.shape} needs {devs.ndim} axis names, "
                f"got {len(axis_names)}: {axis_names}."
            )
        if len(set(axis_names)) != len(axis_names) or not all(isinstance(n, str) and n for n in axis_names):
            raise SBPError(f"Placement: axis names must be distinct non-empty strings, got {axis_names}.")
        if devs.size == 0:
            raise SBPError(f"Placement: the device grid {devs.shape} is empty.")
        ids: list = [getattr(d, "id", None) for d in devs.flat]
        if any(i is None for i in ids):
            bad = next(d for d in devs.flat if getattr(d, "id", None) is None)
            raise SBPError(f"Placement: {bad!r} is not a jax.Device; use jax.devices().")
        seen: dict[int, int] = {}
        for pos, i in enumerate(ids):
            if i in seen:
                where_a = np.unravel_index(seen[i], devs.shape)
                where_b = np.unravel_index(pos, devs.shape)
                raise SBPError(
                    f"Placement: device {i} appears twice (grid positions {tuple(map(int, where_a))} "
                    f"and {tuple(map(int, where_b))}); every position needs its own device."
                )
            seen[i] = pos
        self._devices = devs
        self._axis_names = axis_names
        self._mesh = Mesh(devs, axis_names)
        self._ids = tuple(int(i) for i in ids)
        self._hash = hash((tuple(devs.shape), self._ids, axis_names))  # plans are cached by placement

    # -- the public surface -------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._devices.shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._axis_names

    @property
    def ndim(self) -> int:
        return self._devices.ndim

    @property
    def size(self) -> int:
        return int(self._devices.size)

    @property
    def devices(self) -> np.ndarray:
        return self._devices

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def device_ids(self) -> tuple[int, ...]:
        """Device ids in grid order (row-major)."""
        return self._ids

    def axis_size(self, axis: int | str) -> int:
        return self.shape[self.axis_index(axis)]

    def axis_index(self, axis: int | str) -> int:
        if isinstance(axis, str):
            if axis not in self._axis_names:
                raise SBPError(f"placement has no axis {axis!r}; its axes are {self._axis_names}.")
            return self._axis_names.index(axis)
        if not 0 <= axis < self.ndim:
            raise SBPError(f"placement axis {axis} out of range for {self.ndim} axes.")
        return axis

    def __getitem__(self, index) -> Placement:
        """A sub-placement: numpy indexing of the grid; integer indices drop axes."""
        if not isinstance(index, tuple):
            index = (index,)
        names = []
        for axis, name in enumerate(self._axis_names):
            ix = index[axis] if axis < len(index) else slice(None)
            if not isinstance(ix, (int, np.integer)):
                names.append(name)
        try:
            sub = self._devices[index]
        except (IndexError, TypeError) as e:
            raise SBPError(
                f"placement[{index if len(index) > 1 else index[0]!r}]: {e}; the grid has shape {self.shape} "
                f"(axes {self._axis_names}): index it with integers and slices, one per axis."
            ) from None
        if np.ndim(sub) == 0:
            return Placement(np.asarray([sub], dtype=object), (self._axis_names[-1],))
        return Placement(sub, names)

    def subset(
        self, devices: Sequence, axis_names: Sequence[str] | None = None, shape: Sequence[int] | None = None
    ) -> Placement:
        """A placement over ``devices`` (all from this one; jax devices or their
        ids), reshaped to ``shape``."""
        by_id = {d.id: d for d in self._devices.flat}
        chosen = []
        for d in devices:
            key = int(d) if isinstance(d, (int, np.integer)) else getattr(d, "id", None)
            if key not in by_id:
                raise SBPError(
                    f"subset: device {d!r} is not in this placement (its device ids: {self.device_ids}); "
                    "pass its jax devices or their ids."
                )
            chosen.append(by_id[key])
        devs = np.asarray(chosen, dtype=object)
        if shape is not None:
            if int(np.prod(tuple(shape))) != devs.size:
                raise SBPError(
                    f"subset: shape {tuple(shape)} holds {int(np.prod(tuple(shape)))} devices, and "
                    f"{devs.size} were given; give a shape whose sizes multiply to {devs.size}."
                )
            devs = devs.reshape(tuple(shape))
        names = (
            axis_names
            if axis_names is not None
            else tuple(
                f"{self._axis_names[0]}{i}" if devs.ndim > 1 else self._axis_names[0]
                for i in range(devs.ndim)
            )
        )
        return Placement(devs, names)

    @property
    def processes(self) -> frozenset:
        """The ``jax.process_index()`` of every process with a device here (one
        process unless ``jax.distributed`` runs several)."""
        return frozenset(d.process_index for d in self.devices.flat)

    @property
    def in_this_process(self) -> bool:
        """Whether this process drives a device of the placement."""
        return jax.process_index() in self.processes

    def is_disjoint(self, other: Placement) -> bool:
        return not set(self.device_ids) & set(other.device_ids)

    def same_devices(self, other: Placement) -> bool:
        return self.shape == other.shape and self.device_ids == other.device_ids

    # -- identity -------------------------------------------------------------
    def _key(self):
        return (self.shape, self.device_ids, self._axis_names)

    def __eq__(self, other):
        return isinstance(other, Placement) and self._key() == other._key()

    def __hash__(self):
        return self._hash

    def __repr__(self):
        axes = ", ".join(f"{n}={s}" for n, s in zip(self._axis_names, self.shape))
        ids = np.asarray(self.device_ids).reshape(self.shape).tolist()
        return f"Placement({axes}; devices {ids})"


def checked_placement(value, where: str) -> Placement:
    """``value`` if it is a Placement, else an SBPError naming ``where``."""
    if not isinstance(value, Placement):
        raise SBPError(
            f"{where}: placement must be an sj.Placement, got {type(value).__name__} ({value!r:.60}); "
            "make one with sj.placement(shape, axis_names)."
        )
    return value


def placement(
    shape: int | Sequence[int], axis_names: Sequence[str] | str | None = None, devices: Sequence | None = None
) -> Placement:
    """A placement of ``prod(shape)`` devices, the first ones of ``jax.devices()``
    (or of ``devices``), in order.

    ``sj.placement((2, 4), ("x", "y"))``; a 1-D placement may be written
    ``sj.placement(8, "x")``.
    """
    if isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(s) for s in shape)
    if any(s < 1 for s in shape):
        raise SBPError(f"placement: every axis size must be >= 1, got {shape}.")
    if axis_names is None:
        axis_names = tuple("xyzwuv"[i] if i < 6 else f"a{i}" for i in range(len(shape)))
    elif isinstance(axis_names, str):
        axis_names = (axis_names,)
    pool = list(devices) if devices is not None else jax.devices()
    need = int(np.prod(shape))
    if need > len(pool):
        raise SBPError(
            f"placement{shape} needs {need} devices but only {len(pool)} are available. "
            "On CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N before importing jax."
        )
    devs = np.empty(need, dtype=object)
    for i in range(need):
        devs[i] = pool[i]
    return Placement(devs.reshape(shape), axis_names)

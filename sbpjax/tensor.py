"""Global tensors: a logical tensor with its placement and nd-SBP.

A :class:`GlobalTensor` keeps every device's local tensor in one ``jax.Array``
(the physical form in :mod:`sbpjax.layout`): for even S/B layouts that array
*is* the logical array with the equivalent ``NamedSharding``, so
:meth:`GlobalTensor.to_jax` and :func:`to_global` convert without copying.
Partials keep one term per device and are never handed out as a plain array
that looks reduced.

Global tensors are JAX pytrees (the physical array is the leaf), so they pass
through ``jax.jit`` and ``jax.tree.map``; boxing inside a traced function is
differentiable. A function mapped over one sees the physical array, each
device's piece: an elementwise function gives the logical result for S and B
layouts, but on a partial (P) it acts on each term of the sum (``t + 1`` adds
1 once per term): reduce it first (``t.to_global(sbp=B)``) or map over
``t.to_jax()``. A function that changes the shape is an ``SBPError``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from sbpjax._errors import SBPError
from sbpjax.boxing.lower import boxing_fn, boxings_fn
from sbpjax.boxing.plan import normalized_layout, plan_boxing
from sbpjax.boxing.transfer import (
    TransferPlan,
    across_processes,
    execute_transfer,
    transfer_across_processes,
)
from sbpjax.dtypes import canonical_dtype, check_partial_dtype
from sbpjax.layout import Geometry, Layout
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, Partial, format_sbp, normalize_nd_sbp


def _check_physical_shape(got: tuple, shape, dtype, placement: Placement, sbp) -> None:
    """A function mapped over a global tensor's pytree leaf (``jax.tree.map``)
    sees its physical array, each device's piece: one that changes its shape
    (a sum, a reshape) would make a tensor its layout cannot describe."""
    want = Geometry(shape, placement.shape).physical_shape(
        normalized_layout(sbp, len(shape), placement.shape)
    )
    if tuple(got) != tuple(want):
        raise SBPError(
            f"GlobalTensor {tuple(shape)} {format_sbp(sbp)}: a function mapped over its pytree leaf (jax.tree.map "
            f"and the like) returned shape {tuple(got)} where its physical array has shape {tuple(want)}. "
            "The leaf is the physical array, each device's piece (a partial's terms stacked): map over "
            "t.to_jax() (a jax.Array) instead, or compute inside sj.jit."
        )


def _is_traced(x) -> bool:
    return isinstance(x, jax.core.Tracer)


@jax.tree_util.register_pytree_node_class
class GlobalTensor:
    """A logical tensor laid out over a placement by an nd-SBP.

    Build one with :func:`to_global` or
    :func:`~sbpjax.local_tensors.from_local_tensors`. As a pytree its leaf is
    the physical array (see the module's docstring for ``jax.tree.map``).
    """

    __slots__ = ("_data", "_shape", "_dtype", "_placement", "_sbp")

    def __init__(self, data, shape, dtype, placement: Placement, sbp: tuple):
        self._data = data
        self._shape = tuple(shape)
        self._dtype = np.dtype(dtype)
        self._placement = placement
        self._sbp = tuple(sbp)

    # -- pytree --------------------------------------------------------------
    def tree_flatten(self):
        return (self._data,), (self._shape, self._dtype, self._placement, self._sbp)

    @classmethod
    def tree_unflatten(cls, aux, children):
        data = children[0]
        shape = getattr(data, "shape", None)
        if isinstance(shape, tuple):  # an array or its trace (JAX unflattens placeholders too)
            _check_physical_shape(shape, *aux)
        return cls(data, *aux)

    # -- description ---------------------------------------------------------
    @property
    def sbp(self) -> tuple:
        return self._sbp

    @property
    def placement(self) -> Placement:
        return self._placement

    @property
    def shape(self) -> tuple:
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def layout(self) -> Layout:
        return normalized_layout(self._sbp, self.ndim, self._placement.shape)

    @property
    def physical(self) -> jax.Array:
        """The underlying array: each device's local tensor, padded to the largest
        local size, with one leading dim per partial axis (see ``sbpjax.layout``)."""
        return self._data

    def __repr__(self):
        return (
            f"GlobalTensor(shape={self._shape}, dtype={self._dtype.name}, "
            f"sbp={format_sbp(self._sbp)}, placement={self._placement!r})"
        )

    # -- values --------------------------------------------------------------
    def _check_alive(self, what: str) -> None:
        if not _is_traced(self._data) and getattr(self._data, "is_deleted", lambda: False)():
            raise SBPError(
                f"{what}: this global tensor {self!r} has been deleted: it was donated to a call "
                "(sj.jit donate_argnums, a TrainStep/Trainer step), whose result holds its buffer now, "
                "or deleted. Use that call's result."
            )

    def _blocks(self) -> dict:
        """Device coordinate -> that device's padded block, as numpy."""
        if _is_traced(self._data):
            raise SBPError(
                "numpy()/local_tensors() need concrete values; they cannot run "
                "inside jax.jit or jax.grad. Use to_jax() there (S/B layouts)."
            )
        self._check_alive("numpy()/local_tensors()")
        by_id = {s.device.id: s for s in self._data.addressable_shards}
        geom = Geometry(self._shape, self._placement.shape)
        out = {}
        for c in geom.coords:
            dev = self._placement.devices[c]
            if dev.id in by_id:
                out[c] = np.asarray(by_id[dev.id].data)
        return out

    def _gathered_blocks(self, geom: Geometry) -> dict:
        """Every device's padded block, in every process: the placement spans
        several processes (``jax.distributed``), so the blocks of the others
        are gathered (``process_allgather``, a collective: every process must
        call ``numpy()`` on this tensor, as with any multi-controller JAX
        program)."""
        from jax.experimental import multihost_utils

        whole = np.asarray(multihost_utils.process_allgather(self._data, tiled=True))
        index = self._data.sharding.devices_indices_map(self._data.shape)
        return {c: whole[index[self._placement.devices[c]]] for c in geom.coords}

    def local_tensors(self) -> np.ndarray:
        """A numpy object array of the placement's shape: each device's local
        tensor. With several processes (``jax.distributed``), the entries of
        other processes' devices are ``None``: each process reads its own."""
        layout = self.layout
        geom = Geometry(self._shape, self._placement.shape)
        out = np.empty(self._placement.shape, dtype=object)
        lead = (0,) * len(layout.partial)
        for c, block in self._blocks().items():
            box = geom.local_box(layout, c)
            out[c] = block[lead + tuple(slice(0, n) for _, n in box)].copy()
        return out

    def numpy(self) -> np.ndarray:
        """The logical value (partials reduced) as numpy.

        A partial is reduced on the devices, by the same boxing as
        ``to_global(sbp=...)`` to the layout without partials, so the host reads
        exactly what the devices compute (integer sums wrap around in the dtype;
        low-precision float sums round as the device collective does; max/min
        propagate NaN like ``jnp.max``)."""
        layout = self.layout
        if layout.partial and not _is_traced(self._data):
            return self.to_global(sbp=_reduced(self._sbp)).numpy()
        geom = Geometry(self._shape, self._placement.shape)
        blocks = self._blocks()
        if len(blocks) != geom.n_devices:
            held_by = {d.process_index for d in self._placement.devices.flat}
            if held_by != set(range(jax.process_count())):
                raise SBPError(
                    f"numpy(): this tensor lives on the devices of process(es) {sorted(held_by)}; process "
                    f"{jax.process_index()} cannot gather it alone. Read it in those processes, or box it to "
                    "a placement with devices in every process first."
                )
            blocks = self._gathered_blocks(geom)
        out = np.zeros(self._shape, self._dtype)
        for c, block in blocks.items():
            box = geom.local_box(layout, c)
            out[tuple(slice(s, s + n) for s, n in box)] = block[tuple(slice(0, n) for _, n in box)]
        return out

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def to_jax(self) -> jax.Array:
        """The logical value as a ``jax.Array`` with the equivalent ``NamedSharding``.

        Even S/B layouts: the same buffers, no copy. Uneven splits: a copy with the
        padding removed, without that ``NamedSharding`` (JAX cannot express a split
        that does not divide the dim).
        Partials: an error (reduce first with ``to_global(sbp=...)``).
        """
        self._check_alive("to_jax()")
        layout = self.layout
        if layout.partial:
            bad = [f"{self._placement.axis_names[a]}: P({op})" for a, op in layout.partial]
            raise SBPError(
                f"to_jax(): this tensor is partial over {', '.join(bad)}; a plain array would "
                "look reduced but hold one term per device. Box it first, e.g. "
                f"t.to_global(sbp={format_sbp(_reduced(self._sbp))}).to_jax()."
            )
        geom = Geometry(self._shape, self._placement.shape)
        if geom.even(layout):
            return self._data
        x = self._data
        for d, axes in enumerate(layout.dims):
            if not axes:
                continue
            M = geom.padded_dim(axes, d)
            idx: list[int] = []
            for k in range(geom.splits(axes)):
                coord = [0] * len(geom.grid)
                rem = k
                for a in reversed(axes):
                    coord[a] = rem % geom.grid[a]
                    rem //= geom.grid[a]
                _, n = geom.dim_range(axes, d, coord)
                idx.extend(k * M + t for t in range(n))
            x = jnp.take(x, jnp.asarray(idx, jnp.int32), axis=d)
        # JAX (0.10) refuses a NamedSharding whose split does not divide the dim,
        # so the compacted array keeps whatever sharding XLA gave it.
        return x

    # -- boxing --------------------------------------------------------------
    def to_global(self, sbp=None, placement: Placement | None = None) -> GlobalTensor:
        """Box to another nd-SBP (and/or another placement). Same layout: ``self``."""
        placement = self._placement if placement is None else checked_placement(placement, "to_global")
        sbp = (
            self._sbp
            if sbp is None
            else normalize_nd_sbp(sbp, placement.ndim, self.ndim, "to_global(sbp=...)")
        )
        if placement == self._placement and sbp == self._sbp:
            return self
        self._check_alive("to_global()")
        check_partial_dtype(self._dtype, sbp, "to_global(sbp=...)")
        plan = plan_boxing(
            self._shape,
            self._dtype,
            self._placement,
            self._sbp,
            sbp,
            dst_placement=None if placement == self._placement else placement,
        )
        if plan.dst_placement is not None:
            assert isinstance(plan, TransferPlan)  # what plan_boxing makes for another placement
            if across_processes(self._placement, placement):
                data, _ = transfer_across_processes(
                    self._data, self._shape, self._dtype, self._placement, self._sbp, placement, sbp
                )
            else:
                data, _ = execute_transfer(plan, self._data)
        elif plan.steps:
            data = boxing_fn(plan)(self._data)
        else:
            data = self._data  # e.g. S over an axis of size 1 -> B: same physical layout
        return GlobalTensor(data, self._shape, self._dtype, placement, sbp)

    def __jax_array__(self):
        return self.to_jax()


def relayout_together(tensors: list, sbps: list) -> list:
    """``[t.to_global(sbp=nd) for t, nd in zip(tensors, sbps)]`` for global
    tensors on one placement, with every boxing that moves data in one
    program (``boxing.lower.boxings_fn``): one dispatch rather than one per
    tensor, and no pile of independent collective programs in flight."""
    out = list(tensors)
    moving = []
    for i, (t, nd) in enumerate(zip(tensors, sbps)):
        nd = normalize_nd_sbp(nd, t.placement.ndim, t.ndim, "to_global(sbp=...)")
        if nd == t.sbp:
            continue
        t._check_alive("to_global()")
        check_partial_dtype(t.dtype, nd, "to_global(sbp=...)")
        plan = plan_boxing(t.shape, t.dtype, t.placement, t.sbp, nd)
        if plan.steps:
            moving.append((i, plan, nd))
        else:  # e.g. S over an axis of size 1 -> B: same physical layout
            out[i] = GlobalTensor(t.physical, t.shape, t.dtype, t.placement, nd)
    if len(moving) == 1:
        datas = [boxing_fn(moving[0][1])(tensors[moving[0][0]].physical)]
    elif moving:
        datas = boxings_fn(tuple(p for _, p, _ in moving))(*[tensors[i].physical for i, _, _ in moving])
    for (i, _, nd), data in zip(moving, datas if moving else []):
        t = tensors[i]
        out[i] = GlobalTensor(data, t.shape, t.dtype, t.placement, nd)
    return out


def _reduced(sbp):
    return tuple(Broadcast() if isinstance(s, Partial) else s for s in sbp)


def _host_block(x: np.ndarray, geom: Geometry, layout: Layout, coord, dtype) -> np.ndarray:
    """The padded block device ``coord`` holds when ``x`` is laid out as ``layout``
    (B -> P(sum): the value on the first device of each group, zeros elsewhere;
    B -> P(max|min): the value everywhere)."""
    box = geom.local_box(layout, coord)
    block = np.zeros(geom.padded(layout), dtype)
    local = x[tuple(slice(s, s + n) for s, n in box)]
    if not any(op == "sum" and coord[a] != 0 for a, op in layout.partial):
        block[tuple(slice(0, n) for _, n in box)] = local
    return block.reshape(geom.block_shape(layout))


def _local_coords(geom: Geometry, placement: Placement) -> list:
    """Grid coordinates of the devices this process drives (all of them in a
    single-process run; with ``jax.distributed``, this process's own)."""
    me = jax.process_index()
    return [c for c in geom.coords if placement.devices[c].process_index == me]


def _assemble(blocks: dict, geom: Geometry, layout: Layout, placement: Placement, dtype) -> jax.Array:
    """The physical array from the padded blocks of this process's devices
    (``make_array_from_single_device_arrays`` takes each process's own; the
    others are made by their processes)."""
    sharding = NamedSharding(placement.mesh, geom.partition_spec(layout, placement.axis_names))
    local = _local_coords(geom, placement)
    arrays = [jax.device_put(blocks[c], placement.devices[c]) for c in local]
    # dtype: a placement without devices here gives an array with no shards here
    return jax.make_array_from_single_device_arrays(
        geom.physical_shape(layout), sharding, arrays, dtype=dtype
    )


def placeholder(shape, dtype, placement: Placement, sbp) -> GlobalTensor:
    """A handle of a tensor whose devices all belong to other processes (its
    array has no shards here): what a process passes to a collective it
    joins without holding the data, e.g. a transfer between pipeline stages."""
    if placement.in_this_process:
        raise SBPError(f"placeholder: {placement!r} has devices in this process; place real data there.")
    shape, dtype = tuple(shape), canonical_dtype(dtype)
    geom = Geometry(shape, placement.shape)
    layout = normalized_layout(sbp, len(shape), placement.shape)
    return GlobalTensor(_assemble({}, geom, layout, placement, dtype), shape, dtype, placement, tuple(sbp))


def is_global(v) -> bool:
    """Whether ``v`` is a :class:`GlobalTensor` (the ``is_leaf`` of pytree
    walks that stop at global tensors)."""
    return isinstance(v, GlobalTensor)


def host_values(tree):
    """``tree`` with each global tensor as its value on the host (``numpy()``),
    other leaves as they are: what code that places the values itself (a
    pipeline stage, a microbatch feed) starts from."""
    return jax.tree.map(lambda v: v.numpy() if is_global(v) else v, tree, is_leaf=is_global)


def checked_layout(shape: tuple, dtype, placement: Placement, sbp) -> tuple:
    """``to_global``'s checks of laying out a ``shape``/``dtype`` array as
    ``sbp``: ``(the nd-SBP, the dtype the devices hold, its layout, its
    geometry)``; an ``SBPError`` for a bad one."""
    checked_placement(placement, "to_global")
    sbp = normalize_nd_sbp(sbp, placement.ndim, len(shape), "to_global")
    dtype = canonical_dtype(dtype)  # what the devices will hold (no float64 without x64)
    check_partial_dtype(dtype, sbp, "to_global")
    return sbp, dtype, normalized_layout(sbp, len(shape), placement.shape), Geometry(shape, placement.shape)


def to_global(x, placement: Placement, sbp, *, process_local: bool = False) -> GlobalTensor:
    """Lay out the logical array ``x`` over ``placement`` as ``sbp``.

    ``x``: a numpy or JAX array (traced values too: the layout is then produced by
    free local steps from B, so ``jax.grad`` flows through), or a
    :class:`GlobalTensor`, which is boxed. A 1-D placement also takes a bare SBP.

    With several processes (``jax.distributed``), every process passes the same
    whole ``x`` and keeps its own devices' pieces; or, with
    ``process_local=True``, each process passes only its part (its rows of a
    batch split over processes), as ``jax.make_array_from_process_local_data``
    takes it: even S/B layouts only.
    """
    if process_local:
        return _from_process_local(x, placement, sbp)
    if isinstance(x, GlobalTensor):
        return x.to_global(sbp=sbp, placement=placement)
    checked_placement(placement, "to_global")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        x = np.asarray(x)
    shape = tuple(x.shape)
    sbp, dtype, layout, geom = checked_layout(shape, x.dtype, placement, sbp)
    if not layout.partial and geom.even(layout):
        sharding = NamedSharding(placement.mesh, geom.partition_spec(layout, placement.axis_names))
        if _is_traced(x):
            data = jax.lax.with_sharding_constraint(jnp.asarray(x), sharding)
        else:
            data = jax.device_put(x, sharding)
        return GlobalTensor(data, shape, dtype, placement, sbp)
    if _is_traced(x):
        rep = (Broadcast(),) * placement.ndim
        plan = plan_boxing(shape, dtype, placement, rep, sbp)
        data = boxing_fn(plan)(x)
        return GlobalTensor(data, shape, dtype, placement, sbp)
    host = np.asarray(x)
    blocks = {c: _host_block(host, geom, layout, c, dtype) for c in _local_coords(geom, placement)}
    return GlobalTensor(_assemble(blocks, geom, layout, placement, dtype), shape, dtype, placement, sbp)


def _from_process_local(x, placement: Placement, sbp) -> GlobalTensor:
    checked_placement(placement, "to_global")
    x = np.asarray(x)
    sbp = normalize_nd_sbp(sbp, placement.ndim, x.ndim, "to_global(process_local=True)")
    layout = normalized_layout(sbp, x.ndim, placement.shape)
    if layout.partial:
        raise SBPError(
            f"to_global(process_local=True): {format_sbp(sbp)} has a partial; pass the whole array "
            "in every process (process_local=False) or from_local_tensors for partial pieces."
        )
    sharding = NamedSharding(
        placement.mesh, Geometry(x.shape, placement.shape).partition_spec(layout, placement.axis_names)
    )
    try:
        data = jax.make_array_from_process_local_data(sharding, x)
    except (ValueError, TypeError) as e:
        raise SBPError(
            f"to_global(process_local=True): this process's part of shape {x.shape} does not fit "
            f"{format_sbp(sbp)} on {placement!r} ({e}). Each process passes the rows its devices hold."
        ) from None
    shape = tuple(data.shape)
    if not Geometry(shape, placement.shape).even(layout):
        raise SBPError(
            f"to_global(process_local=True): the global shape {shape} does not divide evenly as "
            f"{format_sbp(sbp)} on {placement!r}; pad it, or pass the whole array in every process."
        )
    return GlobalTensor(data, shape, canonical_dtype(x.dtype), placement, sbp)


def bytes_per_device(tree) -> int:
    """The most bytes any one device holds for the arrays in ``tree``: the
    local pieces of its global tensors and JAX arrays (padding included)
    summed per device, plus any NumPy value's bytes (it is on the host and
    goes to every device that reads it)."""
    per: dict = {}
    host = 0
    for t in jax.tree_util.tree_leaves(tree, is_leaf=is_global):
        array = t.physical if isinstance(t, GlobalTensor) else t
        if isinstance(array, jax.Array):
            for shard in array.addressable_shards:
                per[shard.device] = per.get(shard.device, 0) + shard.data.nbytes
        elif isinstance(array, (np.ndarray, np.generic)):
            host += array.nbytes
    return max(per.values(), default=0) + host


__all__ = ["GlobalTensor", "bytes_per_device", "checked_layout", "host_values", "is_global", "to_global"]

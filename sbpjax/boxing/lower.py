"""Lowering a boxing plan to one jitted ``shard_map``.

The body sees each device's block (its local tensor padded at the end of every
split dim, see :mod:`sbpjax.layout`) and applies the plan's steps as explicit
collectives. Even splits use the collectives directly. Uneven splits run the
same collectives on padded pieces, with local index maps (``jnp.take`` over
small per-device tables) that arrange pieces before a scatter and compact them
after a gather, so results are exact and bytes match the plan.

Every index this module computes is in range (a device's own offset, a table
entry), so slices and takes say so (``allow_negative_indices=False``,
``mode="clip"``): JAX's defaults wrap negative indices and mask out-of-range
ones, a compare and a select per index that XLA compiles into every program
and cannot fold away, since it does not know a device's index is non-negative.

``check_vma=False``: several steps (point-to-point rounds, table lookups)
produce values that are equal across an axis without JAX being able to prove
it. Gradients are still the transposes of the collectives (all_gather <->
psum_scatter, psum <-> psum, ppermute <-> inverse ppermute); the tests check
every one against NumPy.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from sbpjax._errors import SBPError
from sbpjax.boxing.device_index import IndexTables, axis_arg, group_index
from sbpjax.boxing.extremes import fill_value, preduce_extreme
from sbpjax.boxing.p2p import p2p_schedule
from sbpjax.boxing.steps import BoxingPlan, Step
from sbpjax.dtypes import is_key
from sbpjax.layout import Geometry, Layout

# whether XLA keeps an optimization barrier until fusion (see _On.computed_once)
_BARRIER_KEPT = jax.__version_info__[:2] >= (0, 11)

# ---------------------------------------------------------------------------
# Steps
# ---------------------------------------------------------------------------


def _to_tiles(x, counts, tile):
    n = len(counts)
    x = x.reshape(tuple(v for pair in zip(counts, tile) for v in pair))
    x = x.transpose(tuple(range(0, 2 * n, 2)) + tuple(range(1, 2 * n, 2)))
    return x.reshape((math.prod(counts),) + tuple(tile))


def _from_tiles(t, counts, tile):
    n = len(counts)
    x = t.reshape(tuple(counts) + tuple(tile))
    order = [v for i in range(n) for v in (i, n + i)]
    x = x.transpose(order)
    return x.reshape(tuple(c * s for c, s in zip(counts, tile)))


def _scatter_sum(x, axis, d, g):
    """psum_scatter over dim ``d``. XLA's CPU reduce-scatter is ~10x slower on
    a non-leading dim (measured at 1024x1024 f32 on 8 devices), so the ``g``
    chunks are first moved to the front (one local transpose; the same bytes
    cross devices)."""
    if d == 0 or math.prod(x.shape[:d]) == 1:
        return lax.psum_scatter(x, axis, scatter_dimension=d, tiled=True)
    pre, post = x.shape[:d], x.shape[d + 1 :]
    chunk = x.shape[d] // g
    y = jnp.moveaxis(x.reshape(pre + (g, chunk) + post), d, 0)
    y = y.reshape((g * pre[0],) + pre[1:] + (chunk,) + post)
    return lax.psum_scatter(y, axis, scatter_dimension=0, tiled=True)


def _gather(x, axis, d):
    """all_gather (tiled) over dim ``d``. XLA's CPU all-gather is ~4x slower on
    a non-leading dim (measured at 1024x256 f32 on 8 devices: 3.3 ms against
    0.8 ms on dim 0), so the pieces are gathered on a new leading dim and moved
    into place locally (the same bytes cross devices)."""
    if d == 0 or math.prod(x.shape[:d]) == 1:
        return lax.all_gather(x, axis, axis=d, tiled=True)
    y = jnp.moveaxis(lax.all_gather(x, axis, axis=0), 0, d)  # [..., piece, row in piece, ...]
    return y.reshape(x.shape[:d] + (y.shape[d] * x.shape[d],) + x.shape[d + 1 :])


def exchange_rows(x, axis, e, d, g, computed_once=lambda v: v):
    """``lax.all_to_all(x, axis, split_axis=e, concat_axis=d, tiled=True)``
    over a group of ``g`` devices, spelled as an all-to-all of a 2-D
    ``[g, rest]`` array: the chunks of dim ``e`` are moved to the front
    before, and the received pieces into dim ``d`` after (local transposes;
    the same bytes cross devices). ``computed_once`` wraps the array sent
    (see ``_On.computed_once``).

    Why, on XLA:CPU: it splits an all-to-all into one slice per peer along
    the split dim and concatenates what arrives, and LLVM compiles every
    slice as a kernel of its own. Strided slices of a 4-D block took ~50 ms
    each (jax 0.12: one (4, 8, 32, 64) exchange over 4 devices compiled in
    153 ms, 52 ms as rows; the benchmark's 2-D transformer step's kernels
    took LLVM 686 ms instead of 1,088). The price is a copy on each side:
    the exchange alone ran up to ~20% slower on 8 CPU devices (median over
    interleaved calls, (4..64, 64..256, 256..1024) f32 blocks), a small
    part of a step."""
    pre, post = x.shape[:e], x.shape[e + 1 :]
    chunks = jnp.moveaxis(x.reshape(pre + (g, x.shape[e] // g) + post), e, 0)
    got = lax.all_to_all(computed_once(chunks.reshape(g, -1)), axis, 0, 0, tiled=True).reshape(chunks.shape)
    got = jnp.moveaxis(got, 0, d)  # [..., source, rows from it, ...]
    return got.reshape(got.shape[:d] + (g * got.shape[d + 1],) + got.shape[d + 2 :])


@dataclasses.dataclass(frozen=True)
class _On:
    """What a step's lowering reads besides the step and the block: the
    value's geometry, its index tables, the mesh's axis names, its dtype."""

    geom: Geometry
    tables: IndexTables
    names: tuple
    dtype: Any
    cpu: bool

    def axes(self, step: Step):
        return axis_arg(tuple(self.names[a] for a in step.group))

    def even(self, step: Step) -> bool:
        return self.geom.even(step.src) and self.geom.even(step.dst)

    def index(self, step: Step):
        """This device's index in the step's group."""
        return group_index(step.group, self.names, self.geom.grid)

    def computed_once(self, x):
        """``x``, an all-to-all's operand, kept from being fused into the
        collective's pieces on XLA:CPU. XLA's all-to-all decomposer turns the
        array all-to-all into one slice per peer, and fusion then copies the
        whole producer into every slice: in a tensor-parallel GPT step a layer
        norm's backward before an 8-way all-to-all became 8 fusions of 96 ops.
        An optimization barrier keeps one producer: that step's optimized HLO
        went from 2,494 ops to 1,824 (GSPMD's: 1,567). On a 24-op elementwise
        chain before an 8-way all-to-all (jax 0.12), 1,586 ops compiled in
        288 ms became 237 ops in 193 ms, and the step ran no slower (62 ms).
        The bytes sent are the same.

        jax 0.10's XLA drops barriers before fusion, so there nothing is
        done. Compiling with its barrier expander off (``compiler_options=
        {"xla_disable_hlo_passes": "cse_barrier_expander"}``) kept the
        barrier, but saved only 3% of the benchmark's tensor-parallel step's
        compile on jax 0.10 once ``exchange_rows`` sends rows, and JAX takes
        options on a top-level jit only (an ``sj.jit`` function under
        ``jax.grad`` is nested) and it would keep remat's barriers too. A
        conditional on the device index held the value, but its own compile
        cost outweighed the saving on small producers. CPU only: measured
        there."""
        return lax.optimization_barrier(x) if self.cpu and _BARRIER_KEPT else x

    def exchange(self, x, step: Step, e: int, d: int):
        """The step's all-to-all: dim ``e``'s chunks sent, received into dim
        ``d``. On CPU as rows (``exchange_rows``); elsewhere JAX's own tiled
        all-to-all, which the backend lays out itself (not measured there)."""
        axes = self.axes(step)
        if not self.cpu:
            return lax.all_to_all(x, axes, split_axis=e, concat_axis=d, tiled=True)
        return exchange_rows(x, axes, e, d, self.geom.splits(step.group), self.computed_once)

    def compact(self, y, step: Step, d: int):
        """A gathered dim with an uneven split's padding taken out."""
        dep, tab = self.tables.compact(step.dst.dims[d], step.group, d)
        return jnp.take(y, self.tables.lookup(dep, tab), axis=d, mode="clip")

    def arrange(self, x, step: Step, d: int):
        """A dim laid out as even chunks, one per peer, before an uneven split's
        pieces are sent."""
        dep, tab = self.tables.arrange(step.src.dims[d], step.group, d)
        return jnp.take(x, self.tables.lookup(dep, tab), axis=d, mode="clip")


def _all_gather(step: Step, x, on: _On):
    d = step.dim
    assert d is not None  # plan.py gives every gather, all-to-all, scatter and slice its dim
    y = _gather(x, on.axes(step), d)
    return y if on.even(step) else on.compact(y, step, d)


def _all_to_all(step: Step, x, on: _On):
    d, e = step.dim, step.dim2
    assert d is not None and e is not None
    even = on.even(step)
    if not even:
        x = on.arrange(x, step, e)
    y = on.exchange(x, step, e, d)
    return y if even else on.compact(y, step, d)


def _reduce_scatter(step: Step, x, on: _On):
    d = step.dim
    assert d is not None
    if not on.even(step):
        x = on.arrange(x, step, d)
    g = on.geom.splits(step.group)
    if step.reduce == "sum":
        return _scatter_sum(x, on.axes(step), d, g)
    # max/min: send each peer its chunk (all-to-all), reduce the g received chunks.
    shape = x.shape
    chunks = x.reshape(shape[:d] + (g, shape[d] // g) + shape[d + 1 :])
    got = on.exchange(chunks, step, d, d)
    return jnp.max(got, axis=d) if step.reduce == "max" else jnp.min(got, axis=d)


def _all_reduce(step: Step, x, on: _On):
    if step.reduce == "sum":
        return lax.psum(x, on.axes(step))
    return preduce_extreme(x, on.axes(step), step.reduce)


def _local_slice(step: Step, x, on: _On):
    d = step.dim
    assert d is not None
    parent, child = step.src.dims[d], step.dst.dims[d]
    if on.even(step):
        size = on.geom.padded_dim(child, d)
        return lax.dynamic_slice_in_dim(x, on.index(step) * size, size, axis=d, allow_negative_indices=False)
    dep, tab = on.tables.slice(parent, child, d)
    return jnp.take(x, on.tables.lookup(dep, tab), axis=d, mode="clip")


def _zeros(step: Step, x, on: _On):  # the tensor is all zeros in every layout (plan_zeros)
    return jnp.zeros(on.geom.padded(step.dst), on.dtype)


def _zero_fill(step: Step, x, on: _On):
    assert step.reduce is not None  # a fill names the op of the partial it makes
    d = step.dim
    fill = fill_value(step.reduce, on.dtype)
    if d is None:  # B -> P
        if step.reduce == "sum":
            return jnp.where(on.index(step) == 0, x, jnp.zeros_like(x))
        return x  # B -> P(max|min): every device keeps the value
    parent, child = step.dst.dims[d], step.src.dims[d]
    if on.even(step):
        shape = list(x.shape)
        shape[d] = on.geom.padded_dim(parent, d)
        base = jnp.full(shape, fill, x.dtype)
        start = [0] * x.ndim
        start[d] = on.index(step) * x.shape[d]
        return lax.dynamic_update_slice(base, x, start, allow_negative_indices=False)
    slot_shape = list(x.shape)
    slot_shape[d] = 1
    ext = jnp.concatenate([x, jnp.full(slot_shape, fill, x.dtype)], axis=d)
    dep, tab = on.tables.fill(parent, child, d)
    return jnp.take(ext, on.tables.lookup(dep, tab), axis=d, mode="clip")


def _permute(step: Step, x, on: _On):
    sched = p2p_schedule(on.geom, step.src, step.dst)
    assert sched is not None  # permute steps are only made where p2p_tiles finds even tiles
    everyone = tuple(range(len(on.names)))
    tiles = _to_tiles(x, sched.src_tiles_local, sched.tile_shape)
    pieces = [tiles]
    for (pairs, _), send in zip(sched.rounds, sched.send):
        buf = jnp.take(tiles, on.tables.lookup(everyone, send), axis=0, mode="clip")
        pieces.append(lax.ppermute(buf, axis_arg(tuple(on.names)), perm=list(pairs)))
    pool = jnp.concatenate(pieces, axis=0)
    out = jnp.take(pool, on.tables.lookup(everyone, sched.gather), axis=0, mode="clip")
    return _from_tiles(out, sched.dst_tiles_local, sched.tile_shape)


# each boxing step's lowering on a device's local block
LOWERINGS = {
    "all_gather": _all_gather,
    "all_to_all": _all_to_all,
    "reduce_scatter": _reduce_scatter,
    "all_reduce": _all_reduce,
    "local_slice": _local_slice,
    "zeros": _zeros,
    "zero_fill": _zero_fill,
    "permute": _permute,
}


def apply_step(step: Step, x, plan: BoxingPlan):
    """One step of ``plan`` on a device's local block (a bucket runs its
    members' local steps one by one, their collectives together)."""
    return _apply(step, x, _on(plan, Geometry(plan.shape, plan.placement.shape)))


def _on(plan: BoxingPlan, geom: Geometry) -> _On:
    names = plan.placement.axis_names
    cpu = plan.placement.devices.flat[0].platform == "cpu"
    return _On(geom, IndexTables(geom, names), names, plan.dtype, cpu)


def _apply(step: Step, x, on: _On):
    lowering = LOWERINGS.get(step.op)
    if lowering is None:
        raise SBPError(f"internal error: boxing step {step.op!r} has no lowering; please report it.")
    return lowering(step, x, on)


# ---------------------------------------------------------------------------
# The compiled boxing function
# ---------------------------------------------------------------------------


_FN_CACHE: dict = {}


def boxing_fn(plan: BoxingPlan):
    """The jitted function mapping the source physical array to the target one.

    Cached per (shape, dtype, placement, source layout, target layout, steps).
    """
    key = _plan_key(plan)
    fn = _FN_CACHE.get(key)
    if fn is None:
        fn = _build(plan)
        _FN_CACHE[key] = fn
    return fn


def run_plan(plan: BoxingPlan, x):
    """Apply a plan's steps to a device's local block inside a ``shard_map`` body
    over the plan's placement (``x``: the padded local tensor, partial dims
    squeezed). Returns the target's local block, partial dims squeezed. A
    typed PRNG key array moves as its key data (``plan_boxing`` plans that)."""
    if is_key(x):
        impl = jax.random.key_impl(x)
        return jax.random.wrap_key_data(run_plan(plan, jax.random.key_data(x)), impl=impl)
    geom = Geometry(plan.shape, plan.placement.shape)
    if 0 in plan.shape:
        assert plan.dst_layout is not None  # plan_boxing sets both layouts
        return jnp.zeros(geom.padded(plan.dst_layout), x.dtype)
    on = _on(plan, geom)
    for step in plan.steps:
        x = _apply(step, x, on)
    return x


def boxings_fn(plans: tuple):
    """One jitted function mapping several source physical arrays (one per
    plan, all plans on one placement) to their targets: several tensors
    re-laid out in one program rather than one program each. Besides being
    one dispatch, that keeps XLA:CPU in jax 0.10 out of a deadlock: with
    about 40 or more independent programs with collectives in flight at once,
    one device's part of a collective never joins (measured with plain
    ``jax.jit`` all-gathers too; jax 0.12 does not hang). Cached per tuple of
    plans, like ``boxing_fn``."""
    key = ("together", *(_plan_key(p) for p in plans))
    fn = _FN_CACHE.get(key)
    if fn is None:
        fn = _build(*plans)
        _FN_CACHE[key] = fn
    return fn


def _plan_key(plan: BoxingPlan) -> tuple:
    return (
        plan.shape,
        np.dtype(plan.dtype).str,
        plan.placement,
        plan.src_layout,
        plan.dst_layout,
        tuple(str(s) for s in plan.steps),
    )


def _build(*plans: BoxingPlan):
    """The jitted shard_map applying each plan to its own argument: one
    array in and out for a single plan (``boxing_fn``), tuples for several
    (``boxings_fn``)."""
    pl = plans[0].placement
    assert all(p.placement == pl for p in plans)  # one shard_map: one mesh
    names = pl.axis_names
    geoms = [Geometry(p.shape, pl.shape) for p in plans]
    layouts = []
    for p in plans:
        assert p.src_layout is not None and p.dst_layout is not None  # plan_boxing sets both layouts
        layouts.append((p.src_layout, p.dst_layout))

    def body(*xs):
        return tuple(
            run_plan(p, x.reshape(g.padded(src))).reshape(g.block_shape(dst))
            for p, g, (src, dst), x in zip(plans, geoms, layouts, xs)
        )

    in_specs = tuple(g.partition_spec(src, names) for g, (src, _) in zip(geoms, layouts))
    out_specs = tuple(g.partition_spec(dst, names) for g, (_, dst) in zip(geoms, layouts))
    if len(plans) == 1:
        one = jax.shard_map(
            lambda x: body(x)[0], mesh=pl.mesh, in_specs=in_specs[0], out_specs=out_specs[0], check_vma=False
        )
        return jax.jit(one)
    return jax.jit(jax.shard_map(body, mesh=pl.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))


def layout_sharding(geom: Geometry, layout: Layout, placement):
    from jax.sharding import NamedSharding

    return NamedSharding(placement.mesh, geom.partition_spec(layout, placement.axis_names))

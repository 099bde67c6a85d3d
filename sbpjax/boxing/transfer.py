"""Boxing between different placements (e.g. pipeline stages): a transfer.

The plan boxes on the source placement to a layout ``X`` without partials (so
partial terms are reduced where they are, on the fast links), moves each target
device exactly the elements of its piece of ``Y`` (a layout without partials on
the target placement), then boxes ``Y`` to the target layout. The choice of
``X`` and ``Y`` minimises bytes, then time; it meets OneFlow Table 2's
"disjoint" column: S->S |T|, S->B p2|T|, B->P |T|, P->S p1|T|, P->B (p1+p2-1)|T|.

The move itself runs eagerly, one ``device_put`` per piece, so it cannot be
traced under ``jit``/``grad``; the pipeline runtime calls it between stages.
When both placements have the same grid shape and the tensor keeps one even
S/B layout, each device's block goes whole to the device at the same grid
position: the move is then a single ``device_put`` of the physical array (the
plan and its bytes are the same; only the per-piece loop is skipped).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sbpjax._errors import SBPError
from sbpjax.boxing.lower import boxing_fn, layout_sharding
from sbpjax.boxing.plan import TransferPlan, normalized_layout, plan_boxing, transfer_bytes
from sbpjax.layout import Geometry
from sbpjax.sbp import Broadcast, Split


def execute_transfer(plan: TransferPlan, data: jax.Array) -> tuple[jax.Array, int]:
    """Run a transfer plan on a source physical array; returns the target
    physical array and the bytes actually moved between devices."""

    if isinstance(data, jax.core.Tracer):
        raise SBPError(
            "to_global(placement=...) between different placements runs eagerly and cannot be "
            "traced under jax.jit/jax.grad; move the tensor outside the traced function "
            "(the pipeline runtime does this between stages)."
        )
    src_side, dst_side = plan.src_side, plan.dst_side
    # plan_transfer sets both sides and the target placement
    assert src_side is not None and dst_side is not None and plan.dst_placement is not None
    if src_side.steps:
        data = boxing_fn(src_side)(data)
    src_pl, dst_pl = plan.placement, plan.dst_placement
    X = src_side.dst_layout
    Y = dst_side.src_layout
    assert X is not None and Y is not None  # plan_boxing sets both layouts
    gs, gd = Geometry(plan.shape, src_pl.shape), Geometry(plan.shape, dst_pl.shape)
    if _block_for_block(plan, gs):
        # An even S/B physical array is the logical array itself, so resharding it
        # onto the same spec over the target mesh sends each block whole to the
        # device at the same grid position: what the loop below would move.
        spec = gd.partition_spec(Y, dst_pl.axis_names)
        out = jax.device_put(data, NamedSharding(dst_pl.mesh, spec))
        return out, transfer_bytes(plan.shape, plan.dtype.itemsize, dst_pl, plan.dst_sbp)[0]
    shards = {s.device.id: s.data for s in data.addressable_shards}
    # Source blocks that hold distinct pieces, by their split coordinates; replicas
    # along broadcast axes are used in turn so no single device sends everything.
    split_axes = sorted(X.split_axes())
    holders: dict = {}
    for c in gs.coords:
        holders.setdefault(tuple(c[a] for a in split_axes), []).append(c)
    moved = 0
    blocks = []
    for v_lin, cv in enumerate(gd.coords):
        dev = dst_pl.devices[cv]
        box_v = gd.local_box(Y, cv)
        block = jnp.zeros(gd.padded(Y), plan.dtype, device=dev)
        for cands in holders.values():
            cu = cands[v_lin % len(cands)]
            box_u = gs.local_box(X, cu)
            inter = [(max(a, b), min(a + n, b + m)) for (a, n), (b, m) in zip(box_u, box_v)]
            if any(lo >= hi for lo, hi in inter) and plan.shape and 0 not in plan.shape:
                continue
            src_idx = tuple(slice(lo - a, hi - a) for (lo, hi), (a, _) in zip(inter, box_u))
            dst_idx = tuple(slice(lo - b, hi - b) for (lo, hi), (b, _) in zip(inter, box_v))
            lead = (0,) * len(X.partial)
            piece = shards[src_pl.devices[cu].id][lead + src_idx]
            piece = jax.device_put(piece, dev)
            moved += piece.size * piece.dtype.itemsize
            block = block.at[dst_idx].set(piece)
            if not plan.shape:
                break
        blocks.append(block)
    out = jax.make_array_from_single_device_arrays(
        gd.physical_shape(Y), layout_sharding(gd, Y, dst_pl), blocks
    )
    if dst_side.steps:
        out = boxing_fn(dst_side)(out)
    return out, int(moved)


def _block_for_block(plan: TransferPlan, src_geometry: Geometry) -> bool:
    """Whether the move keeps one even S/B layout on grids of the same shape."""
    # plan_transfer sets both sides, the target placement and both layouts
    assert plan.dst_placement is not None and plan.src_side is not None and plan.dst_side is not None
    assert plan.src_layout is not None
    return (
        plan.placement.shape == plan.dst_placement.shape
        and not plan.src_side.steps
        and not plan.dst_side.steps
        and not plan.src_layout.partial
        and plan.src_layout == plan.dst_layout
        and src_geometry.even(plan.src_layout)
    )


# ---------------------------------------------------------------------------
# Between placements of different processes (jax.distributed)
# ---------------------------------------------------------------------------


def across_processes(src_pl, dst_pl) -> bool:
    """Whether a transfer between the placements needs other processes (a
    device-to-device copy cannot reach their devices)."""
    return src_pl.processes != dst_pl.processes or len(src_pl.processes) > 1


def transfer_across_processes(data, shape, dtype, src_pl, src_sbp, dst_pl, dst_sbp) -> tuple[jax.Array, int]:
    """A transfer between placements whose devices belong to different
    processes, run as collectives every process of either placement calls
    with the same arguments (SPMD): a process without source devices passes
    the tensor's handle (its array has no shards here), one without target
    devices gets a handle back.

    The source boxes to ``X`` (the target layout with partials made B), then
    one ``ppermute`` over a mesh of both placements (rows: source, target)
    sends each block to the device at the same grid position, and the
    target boxes ``X`` to its layout (a partial is a local zero fill). The
    move's bytes are the target's blocks of ``X``. Needs grids of one shape
    and disjoint placements (pipeline stages); returns the target physical
    array and the bytes moved."""

    if src_pl.shape != dst_pl.shape or not src_pl.is_disjoint(dst_pl):
        raise SBPError(
            f"to_global(placement=...): {src_pl!r} and {dst_pl!r} are on different processes, where a "
            f"transfer needs two disjoint placements of one grid shape (here {src_pl.shape} and "
            f"{dst_pl.shape}). Give the target the source's grid shape (and box on it afterwards), or "
            "box within one placement that spans both."
        )
    shape, dtype = tuple(shape), np.dtype(dtype)
    x_sbp = tuple(Broadcast() if not isinstance(q, (Split, Broadcast)) else q for q in dst_sbp)
    me = jax.process_index()
    here_src, here_dst = src_pl.in_this_process, dst_pl.in_this_process
    src_side = plan_boxing(shape, dtype, src_pl, src_sbp, x_sbp)
    dst_side = plan_boxing(shape, dtype, dst_pl, x_sbp, dst_sbp)
    geom = Geometry(shape, dst_pl.shape)
    X = normalized_layout(x_sbp, len(shape), dst_pl.shape)
    block = geom.padded(X)
    if here_src and src_side.steps:
        data = boxing_fn(src_side)(data)
    shards = {s.device.id: s.data for s in data.addressable_shards} if here_src else {}
    # rows: source devices, then target devices, in grid order
    rows = np.stack([src_pl.devices.reshape(-1), dst_pl.devices.reshape(-1)])
    mesh = Mesh(rows, ("_side", "_device"))
    parts = []
    for d in rows.reshape(-1):
        if d.process_index != me:
            continue
        local = shards[d.id].reshape((1, 1) + block) if d.id in shards else np.zeros((1, 1) + block, dtype)
        parts.append(jax.device_put(local, d))
    both = jax.make_array_from_single_device_arrays(
        (2, rows.shape[1]) + block, NamedSharding(mesh, _ROWS), parts, dtype=dtype
    )
    moved = _ppermute_rows(mesh)(both)
    blocks = [
        s.data.reshape(block)
        for s in sorted(moved.addressable_shards, key=lambda s: s.device.id)
        if s.index[0] == slice(1, 2, None)
    ]
    out = jax.make_array_from_single_device_arrays(
        geom.physical_shape(X), layout_sharding(geom, X, dst_pl), blocks, dtype=dtype
    )
    if here_dst and dst_side.steps:
        out = boxing_fn(dst_side)(out)
    elif dst_side.steps:  # a handle of the target's physical shape
        y = dst_side.dst_layout
        assert y is not None  # plan_boxing sets it
        out = jax.make_array_from_single_device_arrays(
            geom.physical_shape(y), layout_sharding(geom, y, dst_pl), [], dtype=dtype
        )
    return out, int(math.prod(block) * dtype.itemsize * rows.shape[1] * (0 not in shape))


_ROWS = PartitionSpec("_side", "_device")  # a block per device of the two-row mesh
_PPERMUTE: dict = {}


def _ppermute_rows(mesh):
    """The jitted program sending row 0's block of every column to row 1."""
    fn = _PPERMUTE.get(mesh)
    if fn is None:
        fn = _PPERMUTE[mesh] = jax.jit(
            jax.shard_map(
                lambda x: lax.ppermute(x, "_side", [(0, 1)]),
                mesh=mesh,
                in_specs=_ROWS,
                out_specs=_ROWS,
                check_vma=False,
            )
        )
    return fn

"""Boxing plans: the cheapest sequence of steps from one layout to another.

A plan is a shortest path over layouts (:class:`~sbpjax.layout.Layout`), with
cost ``(bytes, time, steps)`` compared in that order: the fewest bytes moved
(OneFlow Table 2 convention: bytes received, summed over all devices), ties
broken by the alpha-beta time model counting one alpha per collective (its
launch, as the layout choice prices it: ``Step.tie_time``), then by the
number of steps. A plan reports the cost model's ring time. The moves:

* a collective over one placement axis or over several axes as one group
  (``all_gather``, ``all_to_all``, ``reduce_scatter``, ``all_reduce``), valid
  when the axes are the innermost splits of the dim they touch and, for a
  reduction, when no later partial axis has a different op (the logical value of
  ``(P(max), P(sum))`` is a max of sums: the sums must be reduced first);
* free local steps: ``local_slice`` (B -> S), ``zero_fill`` (B or S -> P);
* ``permute``: rounds of point-to-point sends giving each device exactly the
  tiles it lacks; it reaches the floor for layouts without partials and is
  offered when the tensor tiles evenly.

Intermediate layouts may split a dim in another axis order than nd-SBP's
(e.g. dim 0 split by y, then x); that is how conflicting nested splits such as
(S(0), S(0)) -> (B, S(0)) are handled without gathering the tensor.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax.boxing.cost import DEFAULT_COST_MODEL, CostModel
from sbpjax.boxing.p2p import P2PSchedule, clear_schedules, p2p_schedule, p2p_tiles
from sbpjax.boxing.search import _priced_search, _shared_search, clear_search_caches, shape_unit
from sbpjax.boxing.steps import (
    COLLECTIVE_OF,
    BoxingPlan,
    Step,
    _Ctx,
    human_bytes,
    launch_bytes,
    ring_latency_bytes,
    step_launch_bytes,
)
from sbpjax.dtypes import is_key_dtype, key_data_shape
from sbpjax.layout import Geometry, Layout, geometry
from sbpjax.placement import Placement, checked_placement
from sbpjax.sbp import Broadcast, Partial, Split, normalize_nd_sbp


def normalized_layout(sbp: Sequence, ndim: int, grid: Sequence[int]) -> Layout:
    """The layout of an nd-SBP; S or P over an axis of size 1 is the same as B."""
    key = (tuple(sbp), ndim, tuple(grid))
    hit = _NORMALIZED.get(key)
    if hit is None:
        hit = _NORMALIZED[key] = _normalized_layout(key[0], ndim, key[2])
    return hit


def _normalized_layout(sbp: tuple, ndim: int, grid: tuple) -> Layout:
    L = Layout.from_nd_sbp(sbp, ndim)
    keep = lambda a: grid[a] > 1  # noqa: E731
    return Layout(
        tuple(tuple(a for a in axes if keep(a)) for axes in L.dims),
        tuple((a, op) for a, op in L.partial if keep(a)),
    )


def bytes_lower_bound(shape, itemsize: int, placement: Placement, src_sbp, dst_sbp) -> int:
    """A cheap bound that no boxing plan from ``src_sbp`` to ``dst_sbp`` beats.

    Without partials it is the floor: the bytes each device must receive that it
    does not hold. A partial target needs nothing (S or B -> P is free), so its
    bound is 0. A partial source is bounded two ways, and the larger counts:

    * the floor of the source with its partial axes read as B: B -> P is a free
      fill, and the steps of any plan cost the same on any values of one
      layout, so starting from B can only be cheaper;
    * counting messages per element. Element ``e`` has G contributions (G: the
      product of the partial axes' sizes), held by the devices ``H`` that hold
      ``e`` in the source; the devices ``D`` that hold ``e`` in the target need
      all of them. Every move carries values and merges what two devices know
      (a message), so information from each contribution must reach each
      device of ``D``. Put all moves in one order. Before the first device of
      ``D`` knows the sum, the messages join G holders (or G holders and a
      device with none) into one: at least G - 1 messages, or G when no device
      of ``D`` holds a contribution. Afterwards every other device of ``D``
      still needs a message: |D| - 1 more. For a reduce-scatter that is
      (G - 1)|T|, for an all-reduce 2(G - 1)|T|, as for the ring algorithms.
      |D| is the product of the target's unsplit axes; a device in both D and H
      stays there when any axis free in both layouts changes, so the number of
      elements with D and H meeting is the devices' summed overlap divided by
      the product of those axes' sizes.

    The compiler uses it to skip candidate signatures without a search, for
    tens of thousands of (shape, layouts) pairs on a 2-D model. A dim that
    divides by the device count splits evenly under every layout, so both
    bounds are its size times a factor of the layouts alone
    (``search.shape_unit``): the bound is computed once for the shape with
    each such dim at the device count, and scaled."""
    unit, scale = shape_unit(tuple(int(d) for d in shape), placement.size)
    return unit_bytes_lower_bound(unit, placement.shape, tuple(src_sbp), tuple(dst_sbp)) * itemsize * scale


def unit_bytes_lower_bound(unit: tuple, grid: tuple, src_sbp: tuple, dst_sbp: tuple) -> int:
    """:func:`bytes_lower_bound` of one byte per element of shape class ``unit``
    (``search.shape_unit``) on a placement of shape ``grid``; any shape of the
    class has it times its itemsize and scale."""
    key = (unit, grid, src_sbp, dst_sbp)
    hit = _BOUNDS.get(key)
    if hit is None:
        hit = _BOUNDS[key] = _bytes_lower_bound(unit, 1, grid, src_sbp, dst_sbp)
    return hit


def _bytes_lower_bound(shape: tuple, itemsize: int, grid: tuple, src_sbp: tuple, dst_sbp: tuple) -> int:
    ndim = len(shape)
    if any(isinstance(s, Partial) for s in dst_sbp):
        return 0
    contributions = math.prod(grid[a] for a, s in enumerate(src_sbp) if isinstance(s, Partial))
    src_sbp = tuple(Broadcast() if isinstance(s, Partial) else s for s in src_sbp)
    src = normalized_layout(src_sbp, ndim, grid)
    dst = normalized_layout(dst_sbp, ndim, grid)
    if contributions == 1 and (src == dst or not src.split_axes()):
        return 0  # every device already holds what it needs
    held, kept = geometry(shape, grid).overlap(src, dst)
    floor = held - kept
    if contributions == 1:
        return floor * itemsize
    dst_split, src_split = dst.split_axes(), src.split_axes()
    receivers = math.prod(g for a, g in enumerate(grid) if a not in dst_split)
    free_in_both = math.prod(g for a, g in enumerate(grid) if a not in dst_split and a not in src_split)
    elements = math.prod(shape)
    messages = elements * (contributions + receivers - 1) - kept // free_in_both
    return max(floor, messages) * itemsize


_CACHE: dict = {}
_BOUNDS: dict = {}
_NORMALIZED: dict = {}  # (nd-SBP, ndim, grid) -> normalized_layout: asked for by every bound


def clear_caches() -> None:
    """Forget every plan, bound and move computed so far (they are kept for
    the life of the process; benchmarks clear them to time a cold planner)."""
    for cache in (_CACHE, _BOUNDS, _NORMALIZED):
        cache.clear()
    clear_search_caches()
    clear_schedules()
    geometry.cache_clear()


def plan_zeros(
    shape,
    dtype,
    placement: Placement,
    src_sbp,
    dst_sbp,
    cost_model: CostModel | None = None,
    launch_priced: bool | str = False,
) -> BoxingPlan:
    """The boxing of a tensor known to be all zeros (``jnp.zeros``, the zero
    start of a gradient's ``scatter-add``): each of its layouts holds zeros in
    every block, a partial sum included, so each device makes its target block
    afresh and no byte moves: one ``zeros`` step. Where the ordinary plan
    moves no byte either (a slice, a zero-fill) it is kept, as it is for a
    partial max or min target (whose padding would want the op's identity).
    Where the bytes bound is above 0 the ordinary plan moves bytes, so its
    search is skipped (a 2-layer GPT's choice on 2x2x2 asks for 2,700 such
    plans)."""
    checked_placement(placement, "plan_zeros")
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    src = normalize_nd_sbp(src_sbp, placement.ndim, len(shape), "src_sbp")
    dst = normalize_nd_sbp(dst_sbp, placement.ndim, len(shape), "dst_sbp")
    L_dst = normalized_layout(dst, len(shape), placement.shape)
    if all(op == "sum" for _, op in L_dst.partial) and bytes_lower_bound(
        shape, dtype.itemsize, placement, src, dst
    ):
        L_src = normalized_layout(src, len(shape), placement.shape)
        return _zeros_plan(shape, dtype, placement, src, dst, L_src, L_dst)
    ordinary = plan_boxing(
        shape, dtype, placement, src_sbp, dst_sbp, cost_model=cost_model, launch_priced=launch_priced
    )
    made_src, made_dst = ordinary.src_layout, ordinary.dst_layout
    assert made_src is not None and made_dst is not None  # plan_boxing sets both layouts
    if ordinary.bytes == 0 or any(op != "sum" for _, op in made_dst.partial):
        return ordinary
    return _zeros_plan(shape, dtype, placement, ordinary.src_sbp, ordinary.dst_sbp, made_src, made_dst)


def _zeros_plan(shape, dtype, placement: Placement, src, dst, L_src: Layout, L_dst: Layout) -> BoxingPlan:
    """One ``zeros`` step from ``src`` to ``dst`` (normalized nd-SBPs)."""
    step = Step("zeros", (), 0, L_src, L_dst, n_axes=placement.ndim, axis_names=tuple(placement.axis_names))
    return BoxingPlan(shape, dtype, placement, src, dst, (step,), None, None, L_src, L_dst)


def plan_boxing(
    shape,
    dtype,
    placement: Placement,
    src_sbp,
    dst_sbp,
    dst_placement: Placement | None = None,
    cost_model: CostModel | None = None,
    launch_priced: bool | str = False,
) -> BoxingPlan:
    """The cheapest boxing of a ``shape``/``dtype`` tensor from ``src_sbp`` on
    ``placement`` to ``dst_sbp`` (on ``dst_placement`` when given): the
    fewest bytes received, ties broken by time. A typed PRNG key array is
    planned as its key data: the layouts split the keys' own dims, and the
    plan's shape and dtype are the data's (uint32, with the implementation's
    trailing dims).

    ``launch_priced``: the fewest bytes plus, for each collective, its launch
    latency in bytes (``alpha / beta`` of its group: 100 kB on the default
    ``CostModel``), the price by which ``sj.jit`` chooses layouts. It differs
    only for small tensors whose fewest-bytes plan runs several collectives:
    on 4x2 a gradient partial over x and whole over y is reduced in the fewest
    bytes by slicing it over y, reduce-scattering over x and all-gathering
    over all 8 devices (10 |T| against an all-reduce's 12 |T|), which for a
    tensor under 50 kB costs more than the one all-reduce GSPMD runs.
    The plan of fewer collectives is taken only where the cost model does not
    time it slower. ``launch_priced="ring"``: each collective priced at its
    latency as the cost model times it (``ring_latency_bytes``: the ring's
    hops too), the price of ``sj.jit``'s second solve, which looks for a plan
    of fewer collectives (``sj.CompileOptions.fewer_collectives``); there
    the 4x2 gradient above is all-reduced up to 1.6 MB, where the cost model
    times the one all-reduce faster."""
    checked_placement(placement, "plan_boxing")
    if dst_placement is not None:
        checked_placement(dst_placement, "plan_boxing(dst_placement=...)")
    shape = tuple(int(s) for s in shape)
    cm = cost_model or DEFAULT_COST_MODEL
    src = normalize_nd_sbp(src_sbp, placement.ndim, len(shape), "src_sbp")
    if dst_placement is not None and dst_placement == placement:
        dst_placement = None
    dpl = dst_placement or placement
    dst = normalize_nd_sbp(dst_sbp, dpl.ndim, len(shape), "dst_sbp")
    if is_key_dtype(dtype):
        # typed PRNG keys move as their key data (run_plan unwraps them): the layouts, read
        # against the keys' own dims above, never split the data's trailing dims
        shape, dtype = key_data_shape(shape, dtype), np.uint32
    dtype = np.dtype(dtype)
    launch_priced = launch_priced if dst_placement is None else False
    key = (shape, dtype.str, placement, src, dst, dst_placement, repr(cm), launch_priced)
    if key in _CACHE:
        return _CACHE[key]
    if dst_placement is not None:
        plan = plan_transfer(shape, dtype, placement, src, dpl, dst, cm)
    else:
        L_src = normalized_layout(src, len(shape), placement.shape)
        L_dst = normalized_layout(dst, len(shape), placement.shape)
        fill_ops = tuple(sorted({op for _, op in L_dst.partial}))
        ctx = _Ctx(shape, dtype.itemsize, placement, cm, fill_ops)
        steps = _shared_search(ctx, L_src, L_dst, placement, cm)
        if launch_priced and sum(1 for st in steps if st.bytes > 0) > 1:
            # only a plan of fewer collectives can cost less: a plan of one is final
            priced = _priced_search(ctx, L_src, L_dst, placement, cm, steps, ring=launch_priced == "ring")
            # and never slower by the cost model's own time (the ring's hops):
            # across slow links a hierarchical reduction (reduce-scatter inside
            # a node, all-reduce between nodes, all-gather inside) runs three
            # collectives and is still the faster (tests/compiler/test_buckets.py)
            if priced is not None and sum(st.time for st in priced) <= sum(st.time for st in steps):
                steps = priced
        floor = None
        if not L_src.partial and not L_dst.partial:
            floor = ctx.geom.floor_bytes(L_src, L_dst, dtype.itemsize)
        plan = BoxingPlan(shape, dtype, placement, src, dst, tuple(steps), None, floor, L_src, L_dst)
    _CACHE[key] = plan
    return plan


# ---------------------------------------------------------------------------
# Between placements (a transfer; executed by sbpjax.boxing.transfer)
# ---------------------------------------------------------------------------


def _no_partial_sbps(n_axes: int, ndim: int):
    options = [Broadcast()] + [Split(d) for d in range(ndim)]
    return [tuple(c) for c in itertools.product(options, repeat=n_axes)]


def transfer_bytes(shape, itemsize: int, placement, sbp) -> tuple[int, int]:
    """(total, largest per device) bytes the target devices receive for ``sbp``."""
    geom = Geometry(shape, placement.shape)
    layout = normalized_layout(sbp, len(shape), placement.shape)
    sizes = np.prod(geom.box_arrays(layout)[1], axis=1) * itemsize
    return int(sizes.sum()), int(sizes.max())


def plan_transfer(shape, dtype, src_pl, src_sbp, dst_pl, dst_sbp, cm) -> BoxingPlan:
    itemsize = np.dtype(dtype).itemsize
    src_layout = normalized_layout(src_sbp, len(shape), src_pl.shape)
    if not src_layout.partial:
        src_side = plan_boxing(shape, dtype, src_pl, src_sbp, src_sbp, cost_model=cm)
    else:
        cands = [
            plan_boxing(shape, dtype, src_pl, src_sbp, x, cost_model=cm)
            for x in _no_partial_sbps(src_pl.ndim, len(shape))
        ]
        src_side = min(cands, key=lambda p: (p.bytes, p.time(), len(p.steps)))
    best = None
    ys = _no_partial_sbps(dst_pl.ndim, len(shape))
    for y in ys:
        total, per_device = transfer_bytes(shape, itemsize, dst_pl, y)
        dst_side = plan_boxing(shape, dtype, dst_pl, y, dst_sbp, cost_model=cm)
        t_time = cm.transfer_time(per_device, dst_pl.axis_names)
        key = (total + dst_side.bytes, t_time + dst_side.time(), len(dst_side.steps))
        if best is None or key < best[0]:
            best = (key, y, total, t_time, dst_side)
    assert best is not None  # ys is never empty: B over every axis is a candidate
    _, y, total, t_time, dst_side = best
    assert src_side.dst_layout is not None and dst_side.src_layout is not None  # plan_boxing sets both
    move = _TransferStep(
        op="transfer",
        axes=(),
        bytes=total,
        src=src_side.dst_layout,
        dst=dst_side.src_layout,
        time=t_time,
        n_axes=dst_pl.ndim,
        axis_names=dst_pl.axis_names,
        src_nd=src_side.dst_sbp,
        dst_nd=y,
    )
    steps = tuple(src_side.steps) + (move,) + tuple(dst_side.steps)
    return TransferPlan(
        tuple(shape),
        np.dtype(dtype),
        src_pl,
        src_sbp,
        dst_sbp,
        steps,
        dst_pl,
        None,
        src_layout,
        normalized_layout(dst_sbp, len(shape), dst_pl.shape),
        src_side=src_side,
        dst_side=dst_side,
    )


@dataclasses.dataclass(frozen=True)
class _TransferStep(Step):
    """The move between placements; its two ends live on different placements,
    so it names their nd-SBPs itself."""

    src_nd: tuple = ()
    dst_nd: tuple = ()

    @property
    def src_sbp(self):
        return self.src_nd

    @property
    def dst_sbp(self):
        return self.dst_nd

    def label(self):
        return "transfer"


@dataclasses.dataclass(frozen=True, repr=False)
class TransferPlan(BoxingPlan):
    src_side: BoxingPlan | None = None
    dst_side: BoxingPlan | None = None


__all__ = [
    "plan_boxing",
    "plan_zeros",
    "bytes_lower_bound",
    "unit_bytes_lower_bound",
    "normalized_layout",
    "clear_caches",
    "BoxingPlan",
    "Step",
    "COLLECTIVE_OF",
    "human_bytes",
    "launch_bytes",
    "step_launch_bytes",
    "ring_latency_bytes",
    "P2PSchedule",
    "p2p_schedule",
    "p2p_tiles",
    "_Ctx",
    "plan_transfer",
    "transfer_bytes",
    "TransferPlan",
]

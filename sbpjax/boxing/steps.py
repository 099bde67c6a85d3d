"""Boxing steps and plans, and what a step costs.

A :class:`Step` is one collective over a group of placement axes, a
point-to-point exchange, or a local step; a :class:`BoxingPlan` is a
sequence of them with their cost. ``_Ctx`` costs a step on one shape and
cost model (the planner's searches, :mod:`sbpjax.boxing.search`, walk such
steps); ``launch_bytes`` and ``ring_latency_bytes`` price a collective's
latency in bytes, as the layout choice does.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import CostModel
from sbpjax.boxing.p2p import p2p_schedule, p2p_tiles
from sbpjax.layout import Layout, geometry
from sbpjax.placement import Placement
from sbpjax.sbp import format_sbp

# What each step op compiles to (the HLO collective), used to check plans
# against compiled programs. P(max|min) reduce-scatter has no XLA primitive: it
# is an all-to-all followed by a local max/min, at the same bytes.
COLLECTIVE_OF = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "permute": "collective-permute",
    "local_slice": None,
    "zero_fill": None,
    "zeros": None,
    "transfer": None,
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One boxing step.

    ``op``: all_reduce, all_gather, reduce_scatter, all_to_all, permute,
    local_slice, zero_fill, zeros (the target block made afresh, for a tensor
    known to be all zeros: ``plan_zeros``) or transfer; ``axes``: the placement axis names of
    its group; ``bytes``: bytes received, summed over all devices.
    """

    op: str
    axes: tuple
    bytes: int
    src: Layout
    dst: Layout
    time: float = 0.0
    reduce: str | None = None  # the partial op reduced or filled in
    dim: int | None = None  # the dim gathered / sliced / scattered (all_to_all: gathered)
    dim2: int | None = None  # all_to_all: the dim that becomes split
    group: tuple = ()  # axis indices of the group, in group order
    rounds: int = 0  # permute: number of point-to-point rounds
    n_axes: int = 0
    axis_names: tuple = ()
    # the time with one alpha per collective in place of the ring's hops (None:
    # ``time``, as for a permute, which pays one alpha per round): see tie_time
    launch_time: float | None = None

    @property
    def tie_time(self) -> float:
        """The step's time for breaking ties between plans of equal bytes: the cost
        model's, with one alpha per collective (its launch) in place of the
        ring's hops; a permute already pays one alpha per round.

        Decision: the layout choice (sbpjax.compiler.tables) prices each
        collective's latency once, and the plans it prices are these. With the
        ring's hops a reduction of a (P, P) value to (B, B) was a reduce-scatter,
        an all-reduce and an all-gather (8 alphas against the one all-reduce's
        14), which the solver priced as three collectives: on the model zoo's
        height-split ResNet (BatchNorm statistics reduced at every layer) its
        solve ended 11% from its bound after 10 s at 394 kB and 55 collectives,
        GSPMD moving 295 kB in 42; planned with one alpha per collective it is
        proven optimal in 3 s at 198 kB in 24. The bandwidth terms are the cost
        model's, per axis: where one axis is slower (the network between nodes)
        a hierarchical reduction still wins on a large tensor."""
        return self.time if self.launch_time is None else self.launch_time

    @property
    def collective(self) -> str | None:
        """The HLO collective this step compiles to (None for local steps)."""
        if self.op == "reduce_scatter" and self.reduce in ("max", "min"):
            return "all-to-all"
        return COLLECTIVE_OF[self.op]

    @property
    def src_sbp(self) -> tuple:
        return self.src.to_nd_sbp(self.n_axes)

    @property
    def dst_sbp(self) -> tuple:
        return self.dst.to_nd_sbp(self.n_axes)

    def label(self) -> str:
        op = self.op
        if self.op in ("reduce_scatter", "all_reduce", "zero_fill") and self.reduce not in (None, "sum"):
            op += f"({self.reduce})"
        if self.op == "all_to_all":
            op += f" {self.dim}->{self.dim2}"
        elif self.dim is not None:
            op += f" dim {self.dim}"
        if self.op == "permute":
            op += f" x{self.rounds}"
        return op

    def __str__(self):
        return (
            f"{self.label()} over {','.join(self.axes) or '-'}: "
            f"{self.src.describe(self.n_axes, self.axis_names)} -> "
            f"{self.dst.describe(self.n_axes, self.axis_names)}, {self.bytes} B"
        )


@dataclasses.dataclass(frozen=True)
class BoxingPlan:
    """The steps of one boxing and their cost.

    ``bytes``: total bytes received over all devices (OneFlow Table 2 convention);
    ``floor``: for layouts without partials, the bytes devices must receive that
    they do not already hold (None otherwise); ``time(cost_model)``: seconds.
    """

    shape: tuple
    dtype: np.dtype
    placement: Placement
    src_sbp: tuple
    dst_sbp: tuple
    steps: tuple
    dst_placement: Placement | None = None
    floor: int | None = None
    src_layout: Layout | None = None
    dst_layout: Layout | None = None

    @property
    def bytes(self) -> int:
        return int(sum(s.bytes for s in self.steps))

    @property
    def tensor_bytes(self) -> int:
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize

    def tie_time(self) -> float:
        """Seconds with one alpha per collective (``Step.tie_time``): how plans
        and layout choices of equal bytes are ranked."""
        return float(sum(s.tie_time for s in self.steps))

    def time(self, cost_model: CostModel | None = None) -> float:
        """Seconds under ``cost_model`` (default: the model the plan was made with)."""
        if cost_model is None:
            return float(sum(s.time for s in self.steps))
        return float(sum(_retime(s, self, cost_model) for s in self.steps))

    def __str__(self):
        t = self.tensor_bytes
        where = f"{self.placement!r}"
        if self.dst_placement is not None:
            where += f" -> {self.dst_placement!r}"
        head = (
            f"boxing {self.shape} {np.dtype(self.dtype).name} on {where}: "
            f"{format_sbp(self.src_sbp)} -> {format_sbp(self.dst_sbp)}"
        )
        rows = [("#", "step", "axes", "from", "to", "bytes", "|T|")]
        for i, s in enumerate(self.steps, 1):
            rows.append(
                (
                    str(i),
                    s.label(),
                    ",".join(s.axes) or "-",
                    s.src.describe(s.n_axes, s.axis_names) if s.op != "transfer" else format_sbp(s.src_sbp),
                    s.dst.describe(s.n_axes, s.axis_names) if s.op != "transfer" else format_sbp(s.dst_sbp),
                    human_bytes(s.bytes),
                    _ratio(s.bytes, t),
                )
            )
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        lines = [head]
        if len(rows) == 1:
            lines.append("  (same layout: nothing to do)")
        else:
            for r in rows:
                lines.append("  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
        tail = f"  total {human_bytes(self.bytes)} ({_ratio(self.bytes, t)}|T|)"
        if self.floor is not None:
            tail += f", floor {human_bytes(self.floor)} ({_ratio(self.floor, t)}|T|)"
        tail += f", est. {self.time() * 1e3:.3f} ms"
        lines.append(tail)
        return "\n".join(lines)

    __repr__ = __str__


def human_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def _ratio(n: int, t: int) -> str:
    return f"{n / t:.4g}" if t else "0"


# ---------------------------------------------------------------------------
# Step costs
# ---------------------------------------------------------------------------


class _Ctx:
    """What the move generator needs: geometry, item size, names, cost model."""

    def __init__(self, shape, itemsize, placement: Placement, cm: CostModel, fill_ops):
        self.geom = geometry(tuple(shape), placement.shape)
        self.itemsize = itemsize
        self.names = placement.axis_names
        self.n_axes = placement.ndim
        self.cm = cm
        self.fill_ops = fill_ops
        self._p2p_cache: dict = {}
        self._move_cache: dict = {}
        self._edge_cache: dict = {}  # sbpjax.boxing.search._free_edges

    def g(self, group) -> int:
        return self.geom.splits(group)

    def step(self, op, src, dst, group=(), **kw) -> Step:
        geom, D, isz = self.geom, self.geom.n_devices, self.itemsize
        g = self.g(group)
        names = tuple(self.names[a] for a in group)
        nbytes, timed = 0, None  # timed: the bytes per device of the cost model's formula
        if op == "all_gather":
            child = math.prod(geom.padded(src)) * isz
            nbytes, timed = D * (g - 1) * child, g * child
        elif op == "all_to_all":
            part = list(geom.padded(src))
            e = kw["dim2"]
            part[e] = geom.padded_dim(dst.dims[e], e)
            chunk = math.prod(part) * isz  # what one device sends to one peer
            nbytes, timed = D * (g - 1) * chunk, g * chunk
        elif op == "reduce_scatter":
            out = math.prod(geom.padded(dst)) * isz
            nbytes, timed = D * (g - 1) * out, g * out
        elif op == "all_reduce":
            block = math.prod(geom.padded(src)) * isz
            nbytes, timed = (D // g) * 2 * (g - 1) * block, block
        t, launch = 0.0, None
        if timed is not None:
            t = self.cm.collective_time(op, names, g, timed)
            launch = self.cm.collective_time(op, names, g, timed, launches=True)
        return Step(
            op=op,
            axes=names,
            bytes=int(nbytes),
            src=src,
            dst=dst,
            time=t,
            launch_time=launch,
            group=tuple(group),
            n_axes=self.n_axes,
            axis_names=tuple(self.names),
            **kw,
        )

    def permute(self, src, dst) -> Step | None:
        """A point-to-point exchange as a search edge: exact bytes (every device
        receives exactly what it lacks), rounds estimated by a lower bound;
        :meth:`exact` builds the real schedule for the steps of the chosen path."""
        key = (src, dst)
        if key in self._p2p_cache:
            return self._p2p_cache[key]
        geom = self.geom
        step = None
        if p2p_tiles(geom, src, dst) is not None:
            d0, dn = geom.box_arrays(dst)
            held, own = geom.held_per_device(src, dst)
            missing = held - own
            # rounds: at least the number of other source pieces a device needs;
            # tiles are even, so the source pieces of dim d are equal intervals
            # of width w: count those the target box overlaps, multiply over the
            # dims (minus the device's own piece)
            need = np.ones(geom.n_devices, np.int64)
            for d in range(geom.ndim):
                w = geom.shape[d] // geom.splits(src.dims[d])
                need *= -(-(d0[:, d] + dn[:, d]) // w) - d0[:, d] // w
            rounds = int((need - (own > 0)).max())
            nbytes = int(missing.sum()) * self.itemsize
            # an exchange that moves no byte is no step (search._search_from relies on it)
            if rounds and nbytes:
                moved = tuple(
                    a
                    for a in range(len(geom.grid))
                    if any(a in d for d in src.dims) or any(a in d for d in dst.dims)
                )
                names = tuple(self.names[a] for a in moved)
                per_round = [float(missing.max()) * self.itemsize / rounds] * rounds
                step = Step(
                    op="permute",
                    axes=names,
                    bytes=nbytes,
                    src=src,
                    dst=dst,
                    time=self.cm.p2p_time(names, per_round),
                    group=moved,
                    rounds=rounds,
                    n_axes=self.n_axes,
                    axis_names=tuple(self.names),
                )
        self._p2p_cache[key] = step
        return step

    def restep(self, step: Step) -> Step:
        """The same move (op, layouts, group) costed for this context's shape and model."""
        if step.op == "permute":
            # the step was found for these layouts on this shape or another of its class
            # (dims that differ divide by the device count): same tiles, same rounds
            permute = self.permute(step.src, step.dst)
            assert permute is not None
            return self.exact(permute)
        return self.step(
            step.op, step.src, step.dst, step.group, reduce=step.reduce, dim=step.dim, dim2=step.dim2
        )

    def exact(self, step: Step) -> Step:
        """The permute step with its real schedule (rounds and time)."""
        if step.op != "permute":
            return step
        sched = p2p_schedule(self.geom, step.src, step.dst)
        assert sched is not None  # permute steps are only made where p2p_tiles finds even tiles
        tile_bytes = sched.tile_elems * self.itemsize
        nbytes = sum(len(pairs) * k * tile_bytes for pairs, k in sched.rounds)
        if nbytes != step.bytes:
            raise SBPError(f"internal error: permute schedule moves {nbytes} B, expected {step.bytes} B.")
        names = tuple(self.names[a] for a in sched.axes_used)
        t = self.cm.p2p_time(names, [k * tile_bytes for _, k in sched.rounds])
        return dataclasses.replace(step, axes=names, group=sched.axes_used, rounds=len(sched.rounds), time=t)


def _retime(step: Step, plan: BoxingPlan, cm: CostModel) -> float:
    """The time of one step of ``plan`` under another cost model."""
    if step.op == "transfer":
        return step.time
    return _Ctx(plan.shape, np.dtype(plan.dtype).itemsize, plan.placement, cm, ()).restep(step).time


def launch_bytes(cost_model: CostModel, axes) -> float:
    """One collective's launch over ``axes``, in bytes: ``alpha / beta`` of
    the group (the bytes its links would carry in that time; 100 kB on the
    default ``CostModel``); 0 where beta is 0 (``calibrate`` clamps a
    negative fit to 0). The layout choice prices latency by it
    (``sj.CompileOptions.latency``), and ``launch_priced`` plans too."""
    alpha, beta = cost_model.group(axes)
    return alpha / beta if beta > 0 else 0.0


def step_launch_bytes(step: Step, cost_model: CostModel) -> float:
    """The launches of ``step`` in bytes (``launch_bytes``): one for a
    collective, one per round for a permute, none for a local step."""
    if step.bytes <= 0:
        return 0.0
    launches = max(1, step.rounds) if step.op == "permute" else 1
    return launches * launch_bytes(cost_model, step.axes)


def ring_latency_bytes(cost_model: CostModel, placement: Placement, op: str, axes, rounds: int = 0) -> float:
    """One collective's latency as the cost model times it (the ring's hops:
    ``CostModel.collective_time`` of zero bytes; a permute: one alpha per
    round), in the bytes that every device's links would carry in that time,
    summed over the placement's devices as a plan's bytes are (5.6 MB for an
    all-gather over 8 devices on the default model; over 4 of 8, each group
    of 4 running at once, 2.4 MB), plus its launches (``launch_bytes``; a
    permute one per round): by the hops alone an all-reduce costs what a
    reduce-scatter and an all-gather cost, and the pair is two collectives.
    ``plan_boxing``'s ``launch_priced="ring"`` and the layout choice's second
    solve (``sj.CompileOptions.fewer_collectives``) price collectives by
    it.

    Decision: summed over the placement, not over the group (as it was
    until 2026-11): the bytes it is added to count every device's, so over
    the group it priced a collective over 4 of 8 devices at half its time,
    and a 4x2 data-parallel step's three collectives per gradient (slice
    over y, reduce-scatter over x, all-gather over all 8: 17% fewer bytes)
    then looked faster than the one all-reduce over x that the cost model's
    own time says is faster for a gradient under 1.6 MB per device."""
    launches = max(1, rounds) if op == "permute" else 1
    total = launches * launch_bytes(cost_model, axes)
    p = int(np.prod([placement.axis_size(a) for a in axes], dtype=np.int64))
    alpha, beta = cost_model.group(axes)
    if beta <= 0 or p <= 1:
        return total
    if op == "permute":
        seconds = cost_model.p2p_time(axes, [0.0] * launches)
    else:
        seconds = cost_model.collective_time(op, axes, p, 0.0)
    return total + placement.size * seconds / beta

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
import heapq
import itertools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.boxing.cost import DEFAULT_COST_MODEL, CostModel
from sbpjax.layout import Geometry, Layout, geometry
from sbpjax.placement import Placement
from sbpjax.sbp import Broadcast, Partial, format_sbp, normalize_nd_sbp

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

        Decision: the layout choice (sbpjax.compiler.solve) prices each
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
        self._box_cache: dict = {}
        self._move_cache: dict = {}

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

    def boxes(self, layout: Layout):
        """(starts, sizes) arrays [n_devices, ndim] of every device's local box."""
        if layout not in self._box_cache:
            b = np.asarray(self.geom.boxes(layout), np.int64)
            b = b.reshape(self.geom.n_devices, self.geom.ndim, 2)
            self._box_cache[layout] = (b[..., 0], b[..., 1])
        return self._box_cache[layout]

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
            s0, sn = self.boxes(src)
            d0, dn = self.boxes(dst)
            own = np.prod(np.clip(np.minimum(s0 + sn, d0 + dn) - np.maximum(s0, d0), 0, None), axis=1)
            missing = np.prod(dn, axis=1) - own
            # rounds: at least the number of other source pieces a device needs;
            # tiles are even, so the source pieces of dim d are equal intervals
            # of width w: count those the target box overlaps, multiply over the
            # dims (minus the device's own piece)
            need = np.ones(geom.n_devices, np.int64)
            for d in range(geom.ndim):
                w = geom.shape[d] // geom.splits(src.dims[d])
                need *= -(-(d0[:, d] + dn[:, d]) // w) - d0[:, d] // w
            rounds = int((need - (own > 0)).max())
            if rounds:
                nbytes = int(missing.sum()) * self.itemsize
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


# ---------------------------------------------------------------------------
# Moves
# ---------------------------------------------------------------------------


def _with_dims(layout: Layout, changes: dict) -> tuple:
    return tuple(changes.get(d, axes) for d, axes in enumerate(layout.dims))


def _reducible(layout: Layout, axis: int) -> bool:
    """A partial over ``axis`` may be reduced now: later partial axes share its op."""
    ops = dict(layout.partial)
    return all(op == ops[axis] for b, op in layout.partial if b > axis)


def _free_moves(ctx: _Ctx, L: Layout) -> list[Step]:
    """The moves from ``L`` that do not depend on the target, cached on the
    context (a class context serves many searches, which meet the same
    layouts)."""
    local = ctx._move_cache.get(L)
    if local is None:
        local = ctx._move_cache[L] = list(_local_moves(ctx, L))
    return local


def _moves(ctx: _Ctx, L: Layout, target: Layout) -> list[Step]:
    """Every move from ``L``: ``_free_moves`` and, last, the point-to-point
    exchange straight to ``target`` (where one is offered)."""
    local = _free_moves(ctx, L)
    if L.partial == target.partial and L != target:
        s = ctx.permute(L, target)
        if s is not None:
            return local + [s]
    return local


def _local_moves(ctx: _Ctx, L: Layout):
    grid = ctx.geom.grid
    ndim = ctx.geom.ndim
    partial = dict(L.partial)
    split_axes = L.split_axes()
    # Gathers, all-to-alls and fills of the innermost splits of each dim.
    for d, axes in enumerate(L.dims):
        for k in range(1, len(axes) + 1):
            group, rest = axes[-k:], axes[:-k]
            yield ctx.step("all_gather", L, Layout(_with_dims(L, {d: rest}), L.partial), group, dim=d)
            for e in range(ndim):
                if e == d:
                    continue
                new = Layout(_with_dims(L, {d: rest, e: L.dims[e] + group}), L.partial)
                yield ctx.step("all_to_all", L, new, group, dim=d, dim2=e)
        if axes:
            a = axes[-1]
            for op in ctx.fill_ops:
                others = {o for _, o in L.partial}
                if op != "sum" and others - {op}:
                    continue  # the identity fill of max/min does not commute with a sum
                new = Layout(_with_dims(L, {d: axes[:-1]}), tuple(sorted(L.partial + ((a, op),))))
                yield ctx.step("zero_fill", L, new, (a,), reduce=op, dim=d)
    # Reductions of partials, over one axis or several with the same op.
    reducible = [a for a, _ in L.partial if _reducible(L, a)]
    by_op: dict = {}
    for a in reducible:
        by_op.setdefault(partial[a], []).append(a)
    for op, cand in by_op.items():
        for r in range(1, len(cand) + 1):
            for group in itertools.combinations(cand, r):
                rest = tuple((a, o) for a, o in L.partial if a not in group)
                yield ctx.step("all_reduce", L, Layout(L.dims, rest), group, reduce=op)
                for d in range(ndim):
                    new = Layout(_with_dims(L, {d: L.dims[d] + group}), rest)
                    yield ctx.step("reduce_scatter", L, new, group, reduce=op, dim=d)
    # Free local steps from B.
    for a in range(len(grid)):
        if a in split_axes or a in partial or grid[a] == 1:
            continue
        for d in range(ndim):
            yield ctx.step(
                "local_slice", L, Layout(_with_dims(L, {d: L.dims[d] + (a,)}), L.partial), (a,), dim=d
            )
        for op in ctx.fill_ops:
            yield ctx.step(
                "zero_fill", L, Layout(L.dims, tuple(sorted(L.partial + ((a, op),)))), (a,), reduce=op
            )
    # Point-to-point exchange to the nd-SBP order (the one straight to the
    # target is added by _moves).
    if not L.canonical:
        s = ctx.permute(L, L.canonicalized())
        if s is not None:
            yield s


def launch_bytes(cost_model: CostModel, axes) -> float:
    """One collective's launch over ``axes``, in bytes: ``alpha / beta`` of
    the group (the bytes its links would carry in that time; 100 kB on the
    default ``CostModel``); 0 where beta is 0 (``calibrate`` clamps a
    negative fit to 0). The layout choice prices latency by it
    (``sbpjax.compiler.solve.LATENCY``), and ``launch_priced`` plans too."""
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
    solve (``sbpjax.compiler.solve.FEWER_COLLECTIVES``) price collectives by
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


def _search(ctx: _Ctx, src: Layout, dst: Layout, collectives: int | None = None):
    """The cheapest path of steps from ``src`` to ``dst``: fewest bytes, then
    the least ``tie_time``, then the fewest steps. ``collectives``: among the
    paths of at most that many collectives only (None where there is none)."""
    if src == dst:
        return []
    # A direct exchange (same partials, even tiles) bounds every useful path:
    # costs only grow, so states above its bytes are never pushed.
    direct = ctx.permute(src, dst) if src.partial == dst.partial else None
    bound = direct.bytes if direct is not None else None
    counter = itertools.count()
    # a state: a layout and, under a cap on collectives, how many it took (else 0)
    start: tuple = (src, 0)
    best = {start: (0, 0.0, 0)}
    prev: dict = {start: None}
    heap = [((0, 0.0, 0), next(counter), start)]
    end = None
    while heap:
        cost, _, state = heapq.heappop(heap)
        if cost > best[state]:
            continue
        L, used = state
        if L == dst:
            end = state
            break
        for step in _moves(ctx, L, dst):
            n = used
            if collectives is not None:
                n += step.bytes > 0
                if n > collectives:
                    continue
            nxt = (step.dst, n)
            nc = (cost[0] + step.bytes, cost[1] + step.tie_time, cost[2] + 1)
            if bound is not None and nc[0] > bound:
                continue
            if nxt not in best or _less(nc, best[nxt]):
                best[nxt] = nc
                prev[nxt] = (state, step)
                heapq.heappush(heap, (nc, next(counter), nxt))
    if end is None:
        if collectives is not None:
            return None
        raise SBPError(f"no boxing path from {src} to {dst} (please report this as a bug).")
    return _path(ctx, prev, end)


def _path(ctx: _Ctx, prev: dict, end) -> list:
    """The exact steps a search's ``prev`` links lead back from ``end``."""
    steps = []
    node = end
    while prev[node] is not None:
        node, step = prev[node]
        steps.append(ctx.exact(step))
    return steps[::-1]


@dataclasses.dataclass
class _Tree:
    """Every layout's cheapest path from one source by the target-free moves
    (``_free_moves``): ``best`` its cost, ``prev`` (layout, step) it was
    reached by, ``order`` the layouts in the order the search expanded them."""

    best: dict
    prev: dict
    order: dict


def _tree(ctx: _Ctx, src: Layout) -> _Tree:
    """``_search`` from ``src`` run to the end, without a target
    (``_search_from``)."""
    counter = itertools.count()
    best = {src: (0, 0.0, 0)}
    prev: dict = {src: None}
    order: dict = {}
    heap = [((0, 0.0, 0), next(counter), src)]
    while heap:
        cost, _, L = heapq.heappop(heap)
        if cost > best[L]:
            continue
        order.setdefault(L, len(order))
        for step in _free_moves(ctx, L):
            nxt = step.dst
            nc = (cost[0] + step.bytes, cost[1] + step.tie_time, cost[2] + 1)
            if nxt not in best or _less(nc, best[nxt]):
                best[nxt] = nc
                prev[nxt] = (L, step)
                heapq.heappush(heap, (nc, next(counter), nxt))
    return _Tree(best, prev, order)


def _search_from(ctx: _Ctx, tree: _Tree, src: Layout, dst: Layout) -> list:
    """``_search(ctx, src, dst)``'s path, read from ``src``'s ``tree``.

    The targeted search's moves are the target-free ones plus, last from
    each layout, an exchange straight to the target, which ends a path. Its
    states are expanded in the tree's order (the extra pushes of the target
    do not reorder the others), so its path is the cheaper of the tree's own
    path to ``dst`` and each expanded layout's path followed by the
    exchange, on equal cost (``_less``) the one found first: by the
    expansion of the layout it leaves from, the exchange after that
    layout's other moves. Every pair of layouts in a class is asked for
    (thousands for a 2-D GPT on 2x2x2), and one tree per source answers
    them all."""
    if src == dst:
        return []
    # (time, cost, (layout, step)): the time of a relaxation is the expansion
    # index of the layout it leaves from, and 1 for the exchange (moved last)
    events = []
    if dst in tree.best:
        came = tree.prev[dst]
        events.append(((tree.order[came[0]], 0), tree.best[dst], came))
    # no path of more bytes than the direct exchange or the tree's own path can
    # win, and the tree expanded its layouts in order of cost
    direct = ctx.permute(src, dst) if src.partial == dst.partial else None
    bound = min(
        [e[1][0] for e in events] + ([direct.bytes] if direct is not None else []),
        default=math.inf,
    )
    for L, index in tree.order.items():
        if tree.best[L][0] > bound:
            break
        if L.partial != dst.partial or L == dst:
            continue
        s = ctx.permute(L, dst)
        if s is not None:
            c = tree.best[L]
            events.append(((index, 1), (c[0] + s.bytes, c[1] + s.tie_time, c[2] + 1), (L, s)))
    events.sort(key=lambda e: e[0])
    won = None
    for _, cost, came in events:
        if won is None or _less(cost, won[0]):
            won = (cost, came)
    if won is None:
        raise SBPError(f"no boxing path from {src} to {dst} (please report this as a bug).")
    left, last = won[1]
    return _path(ctx, tree.prev, left) + [ctx.exact(last)]


def _less(a, b) -> bool:
    # Times are float sums: compare with a relative tolerance so equal-cost paths
    # fall back to the step count deterministically.
    if a[0] != b[0]:
        return a[0] < b[0]
    if not math.isclose(a[1], b[1], rel_tol=1e-9, abs_tol=1e-15):
        return a[1] < b[1]
    return a[2] < b[2]


# ---------------------------------------------------------------------------
# Point-to-point schedules
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class P2PSchedule:
    """Tiles and rounds of a point-to-point exchange between two layouts.

    The logical tensor is cut into a grid of equal tiles (per dim, the lcm of the
    split counts of both layouts). Round ``r`` is one ``ppermute``: ``pairs``
    (sender, receiver) by linear device index, every pair sending ``k`` tiles.
    """

    tiles: tuple  # tile count per dim
    tile_shape: tuple
    tile_elems: int
    rounds: tuple  # ((pairs, k), ...)
    send: tuple  # per round: array [n_devices, k] of local src tile indices
    gather: np.ndarray  # [n_devices, n_dst_tiles] indices into the pool
    src_tiles_local: tuple  # per dim tiles in one device's src block
    dst_tiles_local: tuple
    axes_used: tuple


def p2p_tiles(geom: Geometry, src: Layout, dst: Layout):
    """Tile counts per dim (lcm of both layouts' split counts), or None when a
    point-to-point exchange is not offered: different partials, a 0-d or empty
    tensor, or a dim the tiles do not divide (uneven: collectives handle it)."""
    if src.partial != dst.partial or geom.ndim == 0 or 0 in geom.shape:
        return None
    tiles = [math.lcm(geom.splits(src.dims[d]), geom.splits(dst.dims[d])) for d in range(geom.ndim)]
    if any(geom.shape[d] % t for d, t in enumerate(tiles)):
        return None
    return tiles


_SCHEDULES: dict = {}


def p2p_schedule(geom: Geometry, src: Layout, dst: Layout) -> P2PSchedule | None:
    key = (geom.shape, geom.grid, src, dst)
    if key not in _SCHEDULES:
        _SCHEDULES[key] = _p2p_schedule(geom, src, dst)
    return _SCHEDULES[key]


def _p2p_schedule(geom: Geometry, src: Layout, dst: Layout) -> P2PSchedule | None:
    tiles = p2p_tiles(geom, src, dst)
    if tiles is None:
        return None
    tile_shape = [geom.shape[d] // t for d, t in enumerate(tiles)]
    src_local = tuple(tiles[d] // geom.splits(src.dims[d]) for d in range(geom.ndim))
    dst_local = tuple(tiles[d] // geom.splits(dst.dims[d]) for d in range(geom.ndim))
    pax = [a for a, _ in src.partial]

    def tile_ids(layout, coord, local):
        starts = [geom.dim_range(layout.dims[d], d, coord)[0] // tile_shape[d] for d in range(geom.ndim)]
        grid = np.indices(local).reshape(geom.ndim, -1) + np.asarray(starts)[:, None]
        return np.ravel_multi_index(tuple(grid), tiles).tolist()

    src_ids = [tile_ids(src, c, src_local) for c in geom.coords]
    dst_ids = [tile_ids(dst, c, dst_local) for c in geom.coords]
    src_pos = [{t: i for i, t in enumerate(ids)} for ids in src_ids]
    holders: dict = {}
    for v, c in enumerate(geom.coords):
        key = tuple(c[a] for a in pax)
        for t in src_ids[v]:
            holders.setdefault((key, t), []).append(v)
    D = geom.n_devices
    load = [0] * D
    pair_tiles: dict = {}
    for v, c in enumerate(geom.coords):
        key = tuple(c[a] for a in pax)
        for t in dst_ids[v]:
            if t in src_pos[v]:
                continue
            u = min(holders[(key, t)], key=lambda u: (load[u], (v - u) % D))
            load[u] += 1
            pair_tiles.setdefault((u, v), []).append(t)
    rounds, sends, recv_slot = [], [], {}
    offset = math.prod(src_local)  # received tiles follow the own tiles in the pool
    for pairs, k in _rounds(pair_tiles, D):
        send = np.zeros((D, k), np.int32)
        for u, v in pairs:
            for j, t in enumerate(pair_tiles[(u, v)]):
                send[u, j] = src_pos[u][t]
                recv_slot[(v, t)] = offset + j
        rounds.append((pairs, k))
        sends.append(send)
        offset += k
    gather = np.zeros((D, math.prod(dst_local)), np.int32)
    for v in range(D):
        for j, t in enumerate(dst_ids[v]):
            gather[v, j] = src_pos[v][t] if t in src_pos[v] else recv_slot[(v, t)]
    used = set()
    for pairs, _ in rounds:
        for u, v in pairs:
            cu, cv = geom.coords[u], geom.coords[v]
            used |= {a for a in range(len(geom.grid)) if cu[a] != cv[a]}
    return P2PSchedule(
        tuple(tiles),
        tuple(tile_shape),
        int(math.prod(tile_shape)),
        tuple(rounds),
        tuple(sends),
        gather,
        src_local,
        dst_local,
        tuple(sorted(used)),
    )


def _rounds(pair_tiles: dict, D: int) -> list:
    """Group sender->receiver pairs into ``ppermute`` rounds that waste nothing.

    Every pair in a round sends the same number of tiles ``k`` and each device
    sends to and receives from at most one peer. Pairs are placed first fit,
    by ``k`` (largest first) and ring offset ``(v - u) mod D``, so pairs at one
    offset (a permutation) tend to share a round and exchanges take few rounds."""
    order = sorted(pair_tiles, key=lambda p: (-len(pair_tiles[p]), (p[1] - p[0]) % D, p))
    rounds: list = []  # [k, pairs, senders, receivers]
    for u, v in order:
        k = len(pair_tiles[(u, v)])
        for r in rounds:
            if r[0] == k and u not in r[2] and v not in r[3]:
                r[1].append((u, v))
                r[2].add(u)
                r[3].add(v)
                break
        else:
            rounds.append([k, [(u, v)], {u}, {v}])
    return [(tuple(sorted(pairs)), k) for k, pairs, _, _ in rounds]


# ---------------------------------------------------------------------------
# Public entry points
# ---------------------------------------------------------------------------


def normalized_layout(sbp: Sequence, ndim: int, grid: Sequence[int]) -> Layout:
    """The layout of an nd-SBP; S or P over an axis of size 1 is the same as B."""
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

    The compiler uses it to skip candidate signatures without a search."""
    key = (tuple(shape), itemsize, placement.shape, tuple(src_sbp), tuple(dst_sbp))
    hit = _BOUNDS.get(key)
    if hit is None:
        hit = _BOUNDS[key] = _bytes_lower_bound(key[0], itemsize, placement.shape, key[3], key[4])
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


def clear_caches() -> None:
    """Forget every plan, bound and move computed so far (they are kept for
    the life of the process; benchmarks clear them to time a cold planner)."""
    for cache in (_CACHE, _BOUNDS, _STRUCTURES, _CLASS_CTX, _FEWER, _TREES):
        cache.clear()
    geometry.cache_clear()


_STRUCTURES: dict = {}
_CLASS_CTX: dict = {}
_FEWER: dict = {}  # (class, src, dst, k) -> fewest-bytes paths of 1..k collectives (None: none)
_TREES: dict = {}  # (class, src) -> _Tree: every target's search from src


def _shape_class(ctx: _Ctx, placement: Placement, cm: CostModel):
    """The class of ``ctx``'s shape (``_search_by_class``): the dims that do
    not divide by the device count, with the placement, fill ops and cost
    model; None for a scalar or an empty tensor (searched on their own)."""
    shape = ctx.geom.shape
    if not shape or 0 in shape:
        return None
    fixed_dims = tuple(None if d % placement.size == 0 else d for d in shape)
    return (placement, fixed_dims, ctx.fill_ops, repr(cm))


def _search_by_class(ctx: _Ctx, src: Layout, dst: Layout, placement: Placement, cm: CostModel) -> list:
    """The search, shared by all shapes of one class.

    A dim that divides by the number of devices splits evenly under every
    layout, so a step's bytes are its size times a factor of the layouts alone;
    the dims that do not divide (often size-1 dims kept by a reduction) are part
    of the class. Between two shapes of one class every step's bytes then scale
    by the same ratio, and paths of equal bytes differ in time only by their
    latency terms. The cheapest step structure is the same for the whole class,
    so it is found once per (placement, class, layouts, cost model) and
    re-costed for each shape (sj.jit asks for many shapes of a few classes).
    All searches of a class run in one context (that of the first shape seen),
    so the moves of the layouts they share are generated once."""
    cls = _shape_class(ctx, placement, cm)
    if cls is None:
        return _search(ctx, src, dst)
    key = (cls, src, dst)
    if key not in _STRUCTURES:
        class_ctx = _CLASS_CTX.setdefault(cls, ctx)
        tree = _TREES.get((cls, src))
        if tree is None:
            tree = _TREES[cls, src] = _tree(class_ctx, src)
        _STRUCTURES[key] = _search_from(class_ctx, tree, src, dst)
        if class_ctx is ctx:
            return _STRUCTURES[key]
    return [ctx.restep(s) for s in _STRUCTURES[key]]


def _priced_search(
    ctx: _Ctx, src: Layout, dst: Layout, placement: Placement, cm: CostModel, steps, ring: bool = False
):
    """A path cheaper than ``steps`` (the fewest-bytes path) by bytes plus
    launches (``plan_boxing``'s ``launch_priced``; ``ring``: plus each
    collective's ring latency, ``ring_latency_bytes``), or None. Only a path of
    fewer collectives can be: for each count below ``steps``' the path of
    the fewest bytes is found once per class of shapes and pair of layouts
    (``_search_by_class``: bytes scale with the size, the path does not), and
    the cheapest of them at this size by bytes plus launches is taken."""
    fewer = sum(1 for st in steps if st.bytes > 0) - 1
    cls = _shape_class(ctx, placement, cm)
    search_ctx = ctx if cls is None else _CLASS_CTX.setdefault(cls, ctx)

    def search() -> list:
        return [_search(search_ctx, src, dst, collectives=k) for k in range(1, fewer + 1)]

    if cls is None:
        found = search()
    else:
        key = (cls, src, dst, fewer)
        if key not in _FEWER:
            _FEWER[key] = search()
        found = _FEWER[key]
    paths = [p for p in found if p is not None]
    # priced at this size without re-costing every step: bytes scale with it
    scale = 1.0
    if search_ctx is not ctx:
        scale = (math.prod(ctx.geom.shape) * ctx.itemsize) / (
            math.prod(search_ctx.geom.shape) * search_ctx.itemsize
        )

    def latency(st) -> float:
        if not ring:
            return step_launch_bytes(st, cm)
        return ring_latency_bytes(cm, placement, st.op, st.axes, st.rounds) if st.bytes > 0 else 0.0

    def price(path, scale=1.0) -> float:
        return sum(scale * st.bytes + latency(st) for st in path)

    best = min(paths, key=lambda p: price(p, scale), default=None)
    if best is None or price(best, scale) >= price(steps):
        return None
    return best if search_ctx is ctx else [ctx.restep(st) for st in best]


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
    partial max or min target (whose padding would want the op's identity)."""
    ordinary = plan_boxing(
        shape, dtype, placement, src_sbp, dst_sbp, cost_model=cost_model, launch_priced=launch_priced
    )
    L_src, L_dst = ordinary.src_layout, ordinary.dst_layout
    assert L_src is not None and L_dst is not None  # plan_boxing sets both layouts
    if ordinary.bytes == 0 or any(op != "sum" for _, op in L_dst.partial):
        return ordinary
    step = Step("zeros", (), 0, L_src, L_dst, n_axes=placement.ndim, axis_names=tuple(placement.axis_names))
    return dataclasses.replace(ordinary, steps=(step,), floor=None)


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
    fewest bytes received, ties broken by time.

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
    of fewer collectives (``sbpjax.compiler.solve.FEWER_COLLECTIVES``); there
    the 4x2 gradient above is all-reduced up to 1.6 MB, where the cost model
    times the one all-reduce faster."""
    shape = tuple(int(s) for s in shape)
    dtype = np.dtype(dtype)
    cm = cost_model or DEFAULT_COST_MODEL
    src = normalize_nd_sbp(src_sbp, placement.ndim, len(shape), "src_sbp")
    if dst_placement is not None and dst_placement == placement:
        dst_placement = None
    dpl = dst_placement or placement
    dst = normalize_nd_sbp(dst_sbp, dpl.ndim, len(shape), "dst_sbp")
    launch_priced = launch_priced if dst_placement is None else False
    key = (shape, dtype.str, placement, src, dst, dst_placement, repr(cm), launch_priced)
    if key in _CACHE:
        return _CACHE[key]
    if dst_placement is not None:
        # transfer.py builds on this module's planner (a cycle), so import it here
        from sbpjax.boxing.transfer import plan_transfer

        plan = plan_transfer(shape, dtype, placement, src, dpl, dst, cm)
    else:
        L_src = normalized_layout(src, len(shape), placement.shape)
        L_dst = normalized_layout(dst, len(shape), placement.shape)
        fill_ops = tuple(sorted({op for _, op in L_dst.partial}))
        ctx = _Ctx(shape, dtype.itemsize, placement, cm, fill_ops)
        steps = _search_by_class(ctx, L_src, L_dst, placement, cm)
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

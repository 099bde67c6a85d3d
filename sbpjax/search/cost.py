"""Costs of a strategy: redistribution, weight-gradient sync, memory; bytes and time.

Bytes follow OneFlow Table 2 (received, summed over devices); time the alpha-beta
model of AutoDDL Table 2 through :class:`sbpjax.CostModel` (per placement axis;
a group spanning several axes runs at the slowest). Per op ``Y = X W`` with
degrees (p0, p1, p2) and its output scattered onto dim ``d``:

* forward: reduce-scatter of the row partials, ``(p2-1)|Y|``; then the output
  boxed to the next op's input layout;
* backward: the dual of each (the next op's input gradient, partial over its
  column axes, boxed back to this output layout; an all-gather over the row axes
  to the layout both gradient products need), the same bytes;
* weight-gradient sync: an all-reduce over the data axes, ``2(p0-1)|W|``.

Two ways to price the boxing between ops. On a grid of real devices,
:func:`sbpjax.plan_boxing` prices it (exactly what ``sj.jit`` will run). On a grid
that is not here (128 or 4096 devices), closed forms: between layouts without
partials the planner reaches the floor (the bytes each device needs and does not
hold), which for fine axes of one prime size ``r`` counts in closed form: a
device's piece of dim ``d`` overlaps its target piece iff the leading split
coordinates agree, so with ``c`` classes of fine axes forced equal, ``r**c``
devices overlap by ``|T| / r**max-splits``. The backward boxing (partial to split)
is priced as the dual of the forward one; the planner reaches that in most cases
and moves up to 20% more in a few (it has no "exchange then add" move; the tests
bound how often and how much).
The time of such an exchange is ``(g-1) alpha + V beta`` (``V`` bytes received per
device, ``g`` devices in the group of fine axes that change), the all-to-all row
of AutoDDL Table 2.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.layout import Geometry, Layout
from sbpjax.search.layers import MatmulOp
from sbpjax.search.space import DATA, ROW, Choice, Grid


@dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Bytes per device: parameters times ``bytes_per_param`` (weights, gradients
    and optimizer state: 16 for Adam in fp32, or mixed precision with fp32 master
    weights) plus, with ``activations``, each op's saved input and output pieces."""

    bytes_per_param: float = 16.0
    activations: bool = True
    limit: float | None = None

    def __post_init__(self):
        def number(v) -> bool:
            return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)

        if not (
            number(self.bytes_per_param) and math.isfinite(self.bytes_per_param) and self.bytes_per_param > 0
        ):
            raise SBPError(
                f"MemoryModel: bytes_per_param={self.bytes_per_param!r}; give the bytes each parameter "
                "takes with its gradient and optimizer state (16 for Adam in fp32)."
            )
        if self.limit is not None and not (
            number(self.limit) and math.isfinite(self.limit) and self.limit > 0
        ):
            raise SBPError(
                f"memory budget {self.limit!r}: give bytes per device as a finite number > 0 "
                "(e.g. 8e9 for 8 GB), or None for no budget."
            )


def op_memory(op: MatmulOp, deg, memory: MemoryModel) -> float:
    p0, p1, p2 = deg
    total = op.w_elems / (p1 * p2) * memory.bytes_per_param
    if memory.activations:
        total += (op.x_elems / (p0 * p2) + op.y_elems / (p0 * p1 * p2)) * op.itemsize
    return total


# ---------------------------------------------------------------------------
# Closed forms
# ---------------------------------------------------------------------------


@functools.cache
def _layout(sbp, ndim=2) -> Layout:
    return Layout.from_nd_sbp(sbp, ndim)


@functools.cache
def scattered(choice: Choice, dim: int) -> Layout:
    """The layout a reduce-scatter of the row partials onto ``dim`` produces: the
    row axes appended, innermost, to ``dim``'s splits."""
    y = _layout(choice.y_sbp())
    rows = tuple(a for a, _ in y.partial)
    return Layout(tuple(axes + rows if d == dim else axes for d, axes in enumerate(y.dims)))


def out_dims(op: MatmulOp, choice: Choice, grid: Grid) -> list:
    """The dims the row partials may be scattered onto: the split must divide and
    the result must be an nd-SBP (row axes after the dim's other splits); None
    (all-reduce, output replicated over the row axes) only where no split works."""
    deg = choice.degrees(grid)
    if deg[2] == 1:
        return [None]
    ok = [d for d in (0, 1) if op.out_fits(d, *deg) and scattered(choice, d).canonical]
    return ok or [None]


def out_layout(choice: Choice, dim) -> Layout:
    if dim is None:
        return _layout(choice.dy_sbp())
    return scattered(choice, dim)


@functools.lru_cache(maxsize=1 << 20)
def floor_fraction(src: Layout, dst: Layout, grid: Grid) -> float:
    """Floor bytes of ``src -> dst`` (no partials, even splits) as a multiple of |T|."""
    n = grid.size
    sizes = grid.fine_sizes
    if len(set(sizes)) == 1:
        r, k = sizes[0], len(sizes)
        parent = list(range(k))

        def find(a):
            while parent[a] != a:
                parent[a] = parent[parent[a]]
                a = parent[a]
            return a

        for a_src, a_dst in zip(src.dims, dst.dims):
            for x, y in zip(a_src, a_dst):
                parent[find(x)] = find(y)
        classes = len({find(a) for a in range(k)})
        need = n / r ** sum(len(a) for a in dst.dims)
        held = r**classes / r ** sum(max(len(a), len(b)) for a, b in zip(src.dims, dst.dims))
        return need - held
    # fine axes of mixed primes: count device by device on a unit-sized shape
    shape = tuple(math.prod(sizes) for _ in src.dims)
    return Geometry(shape, sizes).floor_bytes(src, dst, 1) / math.prod(shape)


def exchange_time(src: Layout, dst: Layout, nbytes_per_device: float, grid: Grid) -> float:
    if nbytes_per_device <= 0:
        return 0.0
    g, alpha, beta = _exchange_group(src, dst, grid)
    return (g - 1) * alpha + nbytes_per_device * beta


@functools.lru_cache(maxsize=1 << 20)
def _exchange_group(src: Layout, dst: Layout, grid: Grid):
    """(devices, alpha, beta) of the group of fine axes whose SBP changes."""
    moved = [a for a in range(len(grid.fine_sizes)) if _axis_state(src, a) != _axis_state(dst, a)] or list(
        range(len(grid.fine_sizes))
    )
    g = math.prod(grid.fine_sizes[a] for a in moved)
    return (g, *grid.cost_model.group(grid.fine_axis_names(moved)))


def _axis_state(layout: Layout, axis: int):
    for d, axes in enumerate(layout.dims):
        if axis in axes:
            return ("S", d, axes.index(axis))
    return ("B",)


def _group_time(grid: Grid, op: str, choice: Choice, role: str, nbytes: float) -> float:
    axes = choice.fine_axes(role)
    g = math.prod(grid.fine_sizes[a] for a in axes)
    return grid.cost_model.collective_time(op, grid.fine_axis_names(axes), g, nbytes)


@dataclasses.dataclass(frozen=True)
class Price:
    """Bytes and seconds of one cost component."""

    bytes: float = 0.0
    time: float = 0.0

    def __add__(self, other: Price) -> Price:
        return Price(self.bytes + other.bytes, self.time + other.time)


ZERO = Price()


class ClosedForm:
    """Closed-form prices on an abstract grid (no devices needed)."""

    def __init__(self, grid: Grid):
        self.grid = grid

    def output(self, op: MatmulOp, c: Choice, dim) -> Price:
        """Forward reduce-scatter (or all-reduce) of the row partials plus its backward dual."""
        p0, p1, p2 = c.degrees(self.grid)
        if p2 == 1:
            return ZERO
        local = op.y_elems / (p0 * p1) * op.itemsize
        nbytes = 2 * (p2 - 1) * op.y_elems * op.itemsize
        if dim is None:
            return Price(nbytes, _group_time(self.grid, "all_reduce", c, ROW, local))
        return Price(
            nbytes,
            _group_time(self.grid, "reduce_scatter", c, ROW, local)
            + _group_time(self.grid, "all_gather", c, ROW, local),
        )

    def sync(self, op: MatmulOp, c: Choice) -> Price:
        p0, p1, p2 = c.degrees(self.grid)
        if p0 == 1:
            return ZERO
        local = op.w_elems / (p1 * p2) * op.itemsize
        return Price(
            2 * (p0 - 1) * op.w_elems * op.itemsize, _group_time(self.grid, "all_reduce", c, DATA, local)
        )

    def edge(self, op: MatmulOp, c: Choice, dim, nxt: Choice) -> Price:
        """The output of ``op`` boxed to the next op's input, forward and backward."""
        src = out_layout(c, dim)
        dst = _layout(nxt.x_sbp())
        frac = floor_fraction(src, dst, self.grid)
        nbytes = frac * op.edge_elems * op.itemsize
        t = exchange_time(src, dst, nbytes / self.grid.size, self.grid)
        return Price(2 * nbytes, 2 * t)


class Planned:
    """Prices from :func:`sbpjax.plan_boxing` on the fine placement of real devices:
    what ``sj.jit`` runs when the strategy's layouts are annotated."""

    def __init__(self, grid: Grid, placement):
        self.grid = grid
        self.fine = grid.fine_placement(placement)

    def _plan(self, shape, itemsize, src, dst) -> Price:
        import sbpjax as sj  # the boxing planner; imported late to keep this module light

        plan = sj.plan_boxing(
            shape,
            np.dtype(f"f{itemsize}") if itemsize in (2, 4, 8) else np.float32,
            self.fine,
            src,
            dst,
            cost_model=_fine_cost_model(self.grid),
        )
        return Price(plan.bytes, plan.time())

    def output(self, op: MatmulOp, c: Choice, dim) -> Price:
        if c.degrees(self.grid)[2] == 1:
            return ZERO
        out = c.out_sbp(dim) if dim is not None else c.dy_sbp()
        shape = (op.m, op.n)
        return self._plan(shape, op.itemsize, c.y_sbp(), out) + self._plan(
            shape, op.itemsize, out, c.dy_sbp()
        )

    def sync(self, op: MatmulOp, c: Choice) -> Price:
        return self._plan((op.k, op.n), op.itemsize, c.dw_sbp(), c.w_sbp())

    def edge(self, op: MatmulOp, c: Choice, dim, nxt: Choice) -> Price:
        out = c.out_sbp(dim) if dim is not None else c.dy_sbp()
        shape = (op.m, op.edge_n or op.n)
        return self._plan(shape, op.itemsize, out, nxt.x_sbp()) + self._plan(
            shape, op.itemsize, nxt.dx_sbp(), out
        )


def _fine_cost_model(grid: Grid):
    """The grid's cost model with every fine axis priced as its placement axis."""
    from sbpjax.boxing.cost import CostModel

    cm = grid.cost_model
    names = grid.fine_names
    owner = [grid.axis_names[a] for a in grid.fine_owner]
    return CostModel(
        alpha={f: cm.axis_alpha(o) for f, o in zip(names, owner)},
        beta={f: cm.axis_beta(o) for f, o in zip(names, owner)},
        default_alpha=cm.default_alpha,
        default_beta=cm.default_beta,
    )


# ---------------------------------------------------------------------------
# Tables for the search
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Tables:
    """Everything the search algorithms need, as arrays over choice indices.

    ``groups``: tie keys in first-use order; ``options[g]``: the group's choices;
    ``op_group[i]``: the group of op ``i``; per op ``i``: ``unary[i]`` (objective,
    over the group's choices, inf where infeasible), per edge ``i -> i+1``:
    ``pair[i]`` (objective, ``[c, c']``) and ``dims[i]`` (the output dim chosen);
    ``memory[i]``. ``parts`` keeps bytes and seconds per component for reports.
    """

    ops: list
    groups: list
    options: list
    op_group: np.ndarray
    unary: list
    pair: list
    dims: list
    memory: list
    parts: dict
    objective: str
    memory_limit: float | None


def build_tables(
    ops: Sequence[MatmulOp],
    grid: Grid,
    pricer,
    *,
    objective: str = "time",
    memory: MemoryModel | None = None,
    options: list | None = None,
) -> Tables:
    from sbpjax.search.space import choices

    memory = memory or MemoryModel()
    if objective not in ("time", "bytes"):
        raise SBPError(f"search: objective must be 'time' or 'bytes', got {objective!r}.")
    if not ops:
        raise SBPError("search: no layers given; pass a list of MatmulOp (sbpjax.search.dense, mlp, ...).")
    names = [op.name for op in ops]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise SBPError(
            f"search: layer names must be unique; {sorted(dup)} appear twice. Name repeated layers "
            "'layers.0', 'layers.1', ... and tie them with tie='layers.*'."
        )
    all_choices = options if options is not None else choices(grid)
    groups = list(dict.fromkeys(op.key for op in ops))
    op_group = np.asarray([groups.index(op.key) for op in ops])
    opts = []
    for g, key in enumerate(groups):
        members = [op for op, og in zip(ops, op_group) if og == g]
        shapes = {(op.m, op.k, op.n, op.batch, op.heads, op.edge_n) for op in members}
        if len(shapes) > 1:
            raise SBPError(
                f"search: tied layers {key!r} have different shapes {sorted(shapes, key=str)}; "
                "only identical layers can share a choice."
            )
        ok = [c for c in all_choices if all(op.fits(*c.degrees(grid)) for op in members)]
        if not ok:
            op = members[0]
            raise SBPError(
                f"search: no factorization of {grid!r} divides layer {op.name!r} "
                f"(m={op.m}, k={op.k}, n={op.n}); pad its dims to multiples of the device count."
            )
        opts.append(ok)
    pick = (lambda p: p.time) if objective == "time" else (lambda p: p.bytes)
    # tied ops have identical shapes: price each group, and each edge between two
    # groups, once, and share the arrays among the repetitions
    unary, pair, dims, mem = [], [], [], []
    parts: dict[str, list] = {"sync": [], "output": [], "edge": []}
    group_cache: dict = {}
    edge_cache: dict = {}
    for i, op in enumerate(ops):
        g = op_group[i]
        cs = opts[g]
        if g not in group_cache:
            sync = [pricer.sync(op, c) for c in cs]
            group_cache[g] = (
                sync,
                np.asarray([pick(x) for x in sync]),
                np.asarray([op_memory(op, c.degrees(grid), memory) for c in cs]),
            )
        sync, sync_cost, op_mem = group_cache[g]
        mem.append(op_mem)
        parts["sync"].append(sync)
        unary.append(sync_cost)
        if i + 1 < len(ops):
            h = op_group[i + 1]
            if (g, h) not in edge_cache:
                edge_cache[g, h] = _edge_table(op, cs, opts[h], grid, pricer, pick)
            cost, best_dim, detail = edge_cache[g, h]
            pair.append(cost)
            dims.append(best_dim)
            parts["edge"].append(detail)
            parts["output"].append(None)
        else:  # the last op's output goes to the loss: only its own reduction
            outs = []
            for c in cs:
                best = min(
                    ((pricer.output(op, c, d), d) for d in out_dims(op, c, grid)), key=lambda od: pick(od[0])
                )
                outs.append(best)
            unary[-1] = unary[-1] + np.asarray([pick(o) for o, _ in outs])
            parts["output"].append(outs)
    return Tables(list(ops), groups, opts, op_group, unary, pair, dims, mem, parts, objective, memory.limit)


def _edge_table(op: MatmulOp, cs, nxt, grid: Grid, pricer, pick):
    """Objective of every (choice, next choice) of one edge, the output dim that
    achieves it, and its (output, boxing) prices."""
    cost = np.full((len(cs), len(nxt)), np.inf)
    best_dim = np.empty((len(cs), len(nxt)), dtype=object)
    detail = {}
    for a, c in enumerate(cs):
        for d in out_dims(op, c, grid):
            o = pricer.output(op, c, d)
            for b, cn in enumerate(nxt):
                e = pricer.edge(op, c, d, cn)
                v = pick(o) + pick(e)
                if v < cost[a, b] - 1e-15 * max(1.0, abs(v)):
                    cost[a, b], best_dim[a, b] = v, d
                    detail[a, b] = (o, e)
    return cost, best_dim, detail

"""Prices of one pipeline configuration: per layer, per stage, per device group.

A configuration fixes the device groups (how many, and the shape of each), the
schedule, the microbatch count, remat and the intra-stage layouts. Layouts are
one of a few *candidates* per (stage grid, microbatch size): strategies of
:func:`sbpjax.search.search` over the whole chain's matmuls on the stage grid,
tied across alike layers: the fastest, the one with least memory, and the
fastest within the memory half way (geometrically) between them. Each layer
then costs:

* forward ``f``: its flops over the stage's devices at ``ComputeModel.flops_per_s``
  plus half of its matmuls' redistribution time (the search prices the forward
  boxings and their backward duals alike);
* backward ``b``: backward flops likewise, the other half of the redistribution,
  the weight-gradient sync; with remat also its forward again (``jax.checkpoint``);
* memory per device: parameters times ``MemoryModel.bytes_per_param`` (matmul
  weights at their layout's share, the rest replicated), and per microbatch in
  flight its saved activations (each matmul's input and output pieces, as
  :class:`sbpjax.search.MemoryModel` counts them, and what else the layer's
  VJP keeps, ``LayerProfile.saved_bytes``, split by its matmuls' least data
  degree) or, with remat, its input.

A stage adds ``ComputeModel.action_s`` per forward and per backward action (the
launch of a program and the runtime's messages), and moving its input between
stages costs ``CostModel.transfer_time`` of the boundary tensor (replicated on
both sides, each receiving device gets all of it).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.search.algorithms import Problem, coordinate_descent
from sbpjax.search.cost import ClosedForm, MemoryModel, Tables, build_tables, op_memory, out_dims
from sbpjax.search.profile import LayerProfile
from sbpjax.search.space import Grid, choices
from sbpjax.search.strategy import build


@dataclasses.dataclass(frozen=True)
class ComputeModel:
    """Compute speed of one device (``flops_per_s``) and the fixed cost of one
    pipeline action (``action_s``: dispatch of its program, the actor runtime's
    messages). :func:`sbpjax.search.calibrate_compute` measures both here."""

    flops_per_s: float = 1e12
    action_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Layouts:
    """One layout candidate on a stage grid: the strategy (None on one device or
    without matmuls) and, per layer, its communication and memory."""

    strategy: object
    comm_forward: np.ndarray  # seconds per microbatch, per layer
    comm_backward: np.ndarray
    param_bytes: np.ndarray  # per device, per layer
    act_bytes: np.ndarray  # per device, per layer, per microbatch in flight


def layout_candidates(
    profiles: list[LayerProfile], grid: Grid, memory: MemoryModel, restarts: int = 4
) -> list[Layouts]:
    """The layout candidates of the module docstring (fewer when they coincide);
    empty when no layout divides the layers on this grid."""
    ops = [op for p in profiles for op in p.ops]
    if not ops or grid.size == 1:
        return [_per_layer(profiles, None, grid, memory)]
    try:
        tables = chain_tables(profiles, grid, MemoryModel(memory.bytes_per_param, True, None))
    except SBPError:
        return []
    problem = Problem(tables)
    fastest, _ = coordinate_descent(problem, restarts, 0)
    least = problem.min_memory()
    picks = [fastest, least]
    mem = [sum(problem.memory[g][a] for g, a in enumerate(assign)) for assign in picks]
    if mem[1] < mem[0]:
        between = dataclasses.replace(tables, memory_limit=math.sqrt(mem[0] * mem[1]))
        try:
            picks.insert(1, coordinate_descent(Problem(between), restarts, 0)[0])
        except SBPError:
            pass
    out, seen = [], set()
    for assign in picks:
        if tuple(assign) not in seen:
            seen.add(tuple(assign))
            strategy = build(tables, assign, grid, "coordinate_descent", 0.0)
            out.append(_per_layer(profiles, strategy, grid, memory))
    return out


def chain_tables(profiles: list[LayerProfile], grid: Grid, memory: MemoryModel) -> Tables:
    """:func:`sbpjax.search.cost.build_tables` of every matmul of the chain, priced
    on a shorter chain: each run of four or more alike layers (one tie) is priced
    as three (first, middle, last), since its layers share their prices and so
    do the boxings between them; the tables are then laid out for every op."""
    ties = [p.tie if p.ops else None for p in profiles]
    short: list[int] = []  # the layers priced
    where: list[int] = []  # per layer, its stand-in's index in `short`
    i = 0
    while i < len(profiles):
        j = i
        while j + 1 < len(profiles) and ties[i] is not None and ties[j + 1] == ties[i]:
            j += 1
        if j - i >= 3:
            short += [i, i + 1, j]
            where += [len(short) - 3] + [len(short) - 2] * (j - i - 1) + [len(short) - 1]
        else:
            where += [len(short) + k for k in range(j - i + 1)]
            short += list(range(i, j + 1))
        i = j + 1
    ops = [op for p in profiles for op in p.ops]
    short_ops = [op for layer in short for op in profiles[layer].ops]
    tables = build_tables(short_ops, grid, ClosedForm(grid), memory=memory)
    if len(short_ops) == len(ops):
        return tables
    first = np.cumsum([0] + [len(profiles[layer].ops) for layer in short])  # first op of each stand-in
    op_of = [int(first[where[l]]) + q for l, p in enumerate(profiles) for q in range(len(p.ops))]
    # an op's edge to the next op is its stand-in's; from one middle layer of a run to
    # the next, the alike edge is the one into the middle stand-in (from the run's first)
    edge_of = [op_of[i] if op_of[i + 1] == op_of[i] + 1 else op_of[i + 1] - 1 for i in range(len(ops) - 1)]
    parts = tables.parts
    return dataclasses.replace(
        tables,
        ops=ops,
        op_group=np.asarray([tables.op_group[j] for j in op_of]),
        unary=[tables.unary[j] for j in op_of],
        memory=[tables.memory[j] for j in op_of],
        pair=[tables.pair[j] for j in edge_of],
        dims=[tables.dims[j] for j in edge_of],
        parts={
            "sync": [parts["sync"][j] for j in op_of],
            "output": [parts["output"][j] for j in op_of],
            "edge": [parts["edge"][j] for j in edge_of],
        },
    )


def _per_layer(profiles, strategy, grid: Grid, memory: MemoryModel) -> Layouts:
    plans = {lp.name: lp for lp in strategy.layers} if strategy is not None else {}
    n = len(profiles)
    fwd, bwd, params, acts = (np.zeros(n) for _ in range(4))
    for i, p in enumerate(profiles):
        rest = p.param_elems - p.op_param_elems
        params[i] = rest * memory.bytes_per_param
        if not p.ops:
            acts[i] = max(p.in_bytes + p.out_bytes, p.saved_bytes or 0.0) / grid.size
        else:
            # what the layer saves beyond its matmuls (norms' statistics, activations'
            # inputs) is split as its batch is, at most: by its matmuls' least data degree
            data = min(plans[op.name].choice.degrees(grid)[0] if op.name in plans else 1 for op in p.ops)
            acts[i] = p.other_saved_bytes / data
        for op in p.ops:
            deg = plans[op.name].choice.degrees(grid) if op.name in plans else (1, 1, 1)
            total = op_memory(op, deg, MemoryModel(memory.bytes_per_param, True, None))
            weights = op.w_elems / (deg[1] * deg[2]) * memory.bytes_per_param
            params[i] += weights
            acts[i] += total - weights
            if op.name in plans:
                lp = plans[op.name]
                fwd[i] += lp.redistribution.time / 2
                bwd[i] += lp.redistribution.time / 2 + lp.sync.time
    return Layouts(strategy, fwd, bwd, params, acts)


@dataclasses.dataclass
class ConfigCosts:
    """Everything a cut of one configuration is priced with: per layer ``f``,
    ``b`` (seconds, remat included), memory, and the transfer time of each
    boundary (``transfer[j]``: the tensor between layers ``j - 1`` and ``j``)."""

    f: np.ndarray
    b: np.ndarray
    param_bytes: np.ndarray
    stash_bytes: np.ndarray  # per layer, per microbatch in flight (activations, or the input with remat)
    kept_bytes: np.ndarray  # per layer, per microbatch between B and W (split schedules)
    recompute_bytes: float  # transient: one layer's activations during a remat backward
    transfer: np.ndarray
    action_s: float
    # tables derived from these prices alone, kept for every schedule priced with them
    # (:func:`sbpjax.search.cut_bounds.derived` fills it)
    derived: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def layers(self) -> int:
        return len(self.f)


def config_costs(
    profiles: list[LayerProfile],
    layouts: Layouts,
    devices: int,
    compute: ComputeModel,
    remat: bool,
    transfer_time,
) -> ConfigCosts:
    """Per-layer prices of one configuration (``profiles`` at the microbatch size;
    ``transfer_time(nbytes)`` prices a boundary)."""
    rate = compute.flops_per_s * devices
    f_compute = np.asarray([p.flops[0] for p in profiles]) / rate
    b_compute = np.asarray([p.flops[1] for p in profiles]) / rate
    f = f_compute + layouts.comm_forward
    b = b_compute + layouts.comm_backward + (f if remat else 0.0)
    inputs = np.asarray([p.in_bytes for p in profiles])
    stash = inputs if remat else layouts.act_bytes
    transfer = np.asarray([0.0] + [transfer_time(p.out_bytes) for p in profiles[:-1]])
    return ConfigCosts(
        f=f,
        b=b,
        param_bytes=layouts.param_bytes,
        stash_bytes=stash,
        kept_bytes=layouts.act_bytes,
        recompute_bytes=float(layouts.act_bytes.max()) if remat else 0.0,
        transfer=transfer,
        action_s=compute.action_s,
    )


def floor_layouts(profiles: list[LayerProfile], grid: Grid, memory: MemoryModel) -> Layouts:
    """What no layout on ``grid`` beats, for pruning before layouts are searched:
    every matmul's weight and activations shared by all the devices, and per
    matmul the cheapest weight-gradient sync and output reduction any of its
    choices has (the boxings between matmuls counted as free)."""
    n = len(profiles)
    fwd, bwd, params, acts = (np.zeros(n) for _ in range(4))
    pricer, options = ClosedForm(grid), choices(grid)
    seen: dict = {}
    for i, p in enumerate(profiles):
        params[i] = (p.param_elems - p.op_param_elems + p.op_param_elems / grid.size) * memory.bytes_per_param
        acts[i] = (
            (sum((op.x_elems + op.y_elems) * op.itemsize for op in p.ops) + p.other_saved_bytes) / grid.size
            if p.ops
            else max(p.in_bytes + p.out_bytes, p.saved_bytes or 0.0) / grid.size
        )
        for op in p.ops:
            shape = (op.m, op.k, op.n, op.batch, op.heads, op.edge_n, op.itemsize)
            if shape not in seen:
                priced = [
                    (pricer.output(op, c, d).time, pricer.sync(op, c).time)
                    for c in options
                    if op.fits(*c.degrees(grid))
                    for d in out_dims(op, c, grid)
                ]
                seen[shape] = (
                    min((o / 2 for o, _ in priced), default=0.0),
                    min((o / 2 + y for o, y in priced), default=0.0),
                )
            fwd[i] += seen[shape][0]
            bwd[i] += seen[shape][1]
    return Layouts(None, fwd, bwd, params, acts)

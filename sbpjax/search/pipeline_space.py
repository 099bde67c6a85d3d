"""The space of pipeline configurations, and their prices.

A configuration without its layouts and cut (:class:`Proto`): the device
groups and their shape, the microbatch count, the schedule and remat. Its
layout candidates (:func:`sbpjax.search.pipeline_cost.layout_candidates`) are
searched only when it is needed: a configuration is first priced with the
floor no layout beats (everything shared by the stage's devices, each matmul's
cheapest own communication, free boxings between matmuls), and one whose floor
cannot beat the best step found is dropped without searching its layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

from sbpjax._errors import SBPError
from sbpjax.pipeline import ActorGraph, Schedule, build_graph
from sbpjax.search.cost import MemoryModel
from sbpjax.search.cuts import Setting
from sbpjax.search.pipeline_cost import ComputeModel, Layouts, config_costs, floor_layouts, layout_candidates
from sbpjax.search.profile import LayerProfile
from sbpjax.search.space import Grid


def stage_shapes(grid: Grid) -> list[tuple[int, tuple[int, ...], tuple[str, ...]]]:
    """``(groups, stage shape, axes the groups span)`` for every box of the grid
    that tiles it, fewest groups first."""
    per_axis = [[t for t in range(1, s + 1) if s % t == 0] for s in grid.shape]
    out = []
    for shape in itertools.product(*per_axis):
        groups = math.prod(s // t for s, t in zip(grid.shape, shape))
        spans = tuple(n for n, s, t in zip(grid.axis_names, grid.shape, shape) if s > t)
        out.append((groups, tuple(shape), spans))
    return sorted(out, key=lambda r: (r[0], r[1]))


def sub_grid(grid: Grid, shape: tuple) -> Grid:
    """The grid of one device group: ``shape`` on the same axes and cost model,
    refined into prime axes as ``grid`` is (``Grid(..., refine=False)`` keeps
    every axis whole, in its groups too)."""
    refined = any(len(factors) > 1 for factors in grid.axis_factors)
    return Grid(shape, grid.axis_names, grid.cost_model, refine=refined)


@dataclasses.dataclass
class Proto:
    """A configuration without layouts and cut; ``floor``: its least bound with
    the floor layouts."""

    groups: int
    shape: tuple
    spans: tuple
    microbatches: int
    schedule: Schedule
    remat: bool
    where: list
    stash: list
    kept: list | None
    split: bool
    floor: float = math.inf


def _form(sched, groups: int, microbatches: int, layers: int):
    """``(where, stash, kept, split)`` of a schedule on ``groups`` device groups and
    ``microbatches``, or None when it cannot run them (its check refuses, or it
    has more stages than there are layers)."""
    n = sched.stages(groups)
    if n > layers:
        return None
    try:
        sched.check(groups, microbatches)
    except SBPError:
        return None
    kept_counts = getattr(sched, "kept_counts", None)
    return (
        [sched.device_of(s, groups) for s in range(n)],
        list(sched.stash_counts(groups, microbatches)),
        kept_counts(groups, microbatches) if kept_counts is not None else None,
        bool(getattr(sched, "split_backward", False)),
    )


class Space:
    """Every configuration of the search (see :func:`sbpjax.search.search_pipeline`)."""

    def __init__(
        self,
        profiles: list[LayerProfile],
        grid: Grid,
        batch: int,
        memory: MemoryModel,
        compute: ComputeModel,
        microbatches,
        schedules,
        remats,
        groups=None,
    ):
        self.profiles, self.grid, self.batch = profiles, grid, batch
        self.memory, self.compute = memory, compute
        self._scaled: dict = {}
        self._layouts: dict = {}
        self._floors: dict = {}
        self._grids: dict = {}
        self._graph_cache: dict = {}
        self._costs: dict = {}
        self.protos: list[Proto] = []
        shapes = [r for r in stage_shapes(grid) if groups is None or r[0] in set(groups)]
        forms: dict = {}  # (schedule, groups, microbatches) -> what the schedule makes of them
        for (count, shape, spans), m, sched, remat in itertools.product(
            shapes, microbatches, schedules, remats
        ):
            if self.scaled(m) is None:
                continue
            key = (id(sched), count, m)
            if key not in forms:
                # checking an action list plays it through: once per schedule, group count and
                # microbatch count, not again for every stage shape and remat
                forms[key] = _form(sched, count, m, len(profiles))
            if forms[key] is not None:
                self.protos.append(Proto(count, shape, spans, m, sched, remat, *forms[key]))

    def scaled(self, m: int) -> list[LayerProfile] | None:
        """The profiles at one microbatch of ``batch / m`` examples (None when a
        matmul's rows do not scale to it)."""
        if m not in self._scaled:
            try:
                self._scaled[m] = [p.at(self.batch // m) for p in self.profiles]
            except SBPError:
                self._scaled[m] = None
        return self._scaled[m]

    def stage_grid(self, proto: Proto) -> Grid:
        # one Grid object per shape: the price caches of sbpjax.search.cost are keyed
        # by the grid, and the same object is found without comparing grids
        if proto.shape not in self._grids:
            self._grids[proto.shape] = sub_grid(self.grid, proto.shape)
        return self._grids[proto.shape]

    def layouts(self, proto: Proto) -> list[Layouts]:
        """The layout candidates of the proto's stage grid and microbatch size (cached)."""
        key = (proto.shape, proto.microbatches)
        if key not in self._layouts:
            scaled = self.scaled(proto.microbatches)
            assert scaled is not None  # protos are made only where the profiles scale
            self._layouts[key] = layout_candidates(scaled, self.stage_grid(proto), self.memory)
        return self._layouts[key]

    def setting(self, proto: Proto, layouts: Layouts | None = None) -> Setting:
        """The proto priced with ``layouts`` (default: the floor layouts)."""
        scaled = self.scaled(proto.microbatches)
        assert scaled is not None
        devices = math.prod(proto.shape)
        if layouts is None:
            floor_key = (proto.shape, proto.microbatches)
            if floor_key not in self._floors:
                self._floors[floor_key] = floor_layouts(scaled, self.stage_grid(proto), self.memory)
            layouts = self._floors[floor_key]
        # by id: layouts are this space's own lists (``layouts()``, the floors), alive as long as it
        key = (proto.shape, proto.microbatches, proto.remat, id(layouts))
        if key not in self._costs:  # the same for every schedule

            def transfer(nbytes):
                return self.grid.cost_model.transfer_time(nbytes, proto.spans) if proto.spans else 0.0

            self._costs[key] = config_costs(scaled, layouts, devices, self.compute, proto.remat, transfer)
        costs = self._costs[key]
        return Setting(
            proto.schedule,
            proto.groups,
            proto.microbatches,
            costs,
            self.memory.limit,
            proto.stash,
            proto.kept,
            proto.where,
            proto.split,
            functools.partial(self.graph, proto),
        )

    def graph(self, proto: Proto) -> ActorGraph:
        """The actor graph of the proto's schedule, groups and microbatches (cached:
        building it checks the schedule's action lists, which every cut shares)."""
        key = (id(proto.schedule), proto.groups, proto.microbatches)
        if key not in self._graph_cache:
            self._graph_cache[key] = build_graph(proto.schedule, proto.groups, proto.microbatches)
        return self._graph_cache[key]

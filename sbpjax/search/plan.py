"""The result of a pipeline search: a configuration that runs.

plan = ss.search_pipeline(chain, grid, batch=64, memory=8e9)
plan.step_s, plan.memory            # predicted seconds per step; bytes per device, per group
pipe = plan.build(chain, loss_fn, optax.adam(1e-3))      # an sbpjax.pipeline.Pipeline
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import jax

from sbpjax._errors import SBPError
from sbpjax.boxing.plan import human_bytes
from sbpjax.search.pipeline_space import sub_grid
from sbpjax.search.space import Grid


@dataclasses.dataclass
class PipelinePlan:
    """A pipeline configuration and its predicted step time and memory.

    ``groups`` device groups of ``stage_shape`` (boxes of ``grid``, row-major);
    ``schedule`` (a :class:`sbpjax.pipeline.Schedule`) runs ``len(bounds)``
    stages, stage ``s`` on layers ``bounds[s][0] .. bounds[s][1] - 1`` and on
    group ``schedule.device_of(s, groups)``; ``microbatches``; ``remat`` (each
    layer under ``jax.checkpoint``); ``layouts``: the strategy of the matmuls on
    the stage grid (None: all replicated); ``step_s``: predicted seconds per
    step; ``memory``: predicted bytes per device of each group; ``proven``: the
    step is the best of the whole space (within the search's ``tolerance``):
    every cut a per-configuration simulation cap left unplayed is bounded at
    or above it."""

    grid: Grid
    placement_: Any
    stage_shape: tuple
    groups: int
    schedule: Any
    microbatches: int
    remat: bool
    layouts: object
    bounds: tuple
    step_s: float
    memory: tuple
    search_s: float
    proven: bool
    configurations: int
    simulations: int
    layer_names: tuple

    @property
    def stages(self) -> int:
        return len(self.bounds)

    @property
    def peak_memory(self) -> float:
        """Predicted bytes on the fullest device."""
        return max(self.memory)

    @property
    def stage_grid(self) -> Grid:
        return sub_grid(self.grid, self.stage_shape)

    def key(self) -> tuple:
        """What identifies the configuration (two plans with equal keys run alike)."""
        choices = (
            None if self.layouts is None else tuple(lp.choice.runs for lp in self.layouts.layers)  # type: ignore[attr-defined]
        )
        name = getattr(self.schedule, "name", repr(self.schedule))
        return (self.stage_shape, name, self.microbatches, self.remat, choices, self.bounds)

    # -- running it -------------------------------------------------------------------
    def group_placements(self, placement=None) -> list:
        """The device groups as placements: boxes of ``placement`` (default: the
        one searched on, else the first devices in a grid of ``grid.shape``)."""
        from sbpjax.placement import Placement
        from sbpjax.placement import placement as make_placement

        pl = placement or self.placement_ or make_placement(self.grid.shape, self.grid.axis_names)
        if tuple(pl.shape) != self.grid.shape:
            raise SBPError(
                f"PipelinePlan.build: the placement has shape {pl.shape}, the plan was searched for "
                f"{self.grid.shape}; pass a placement of that shape."
            )
        counts = [s // t for s, t in zip(self.grid.shape, self.stage_shape)]
        groups = []
        for index in itertools.product(*(range(c) for c in counts)):
            box = tuple(slice(i * t, (i + 1) * t) for i, t in zip(index, self.stage_shape))
            groups.append(Placement(pl.devices[box], pl.axis_names))
        return groups

    def _param_sbp(self, chain, layer: int, fine_ndim: int):
        """Layer ``layer``'s parameter layouts over the stage grid's fine axes."""
        from sbpjax.sbp import Broadcast

        rep = (Broadcast(),) * fine_ndim
        if self.layouts is None:
            return jax.tree_util.tree_map(lambda _: rep, chain[layer].params)
        prefix = f"{layer}:"
        mine = {
            lp.param: lp.w_sbp
            for lp in self.layouts.layers  # type: ignore[attr-defined]
            if lp.name.startswith(prefix) and lp.param
        }
        return jax.tree_util.tree_map_with_path(
            lambda path, _: mine.get(jax.tree_util.keystr(path), rep), chain[layer].params
        )

    def build(self, chain, loss_fn, optimizer, *, placement=None, **pipeline_options):
        """The :class:`sbpjax.pipeline.Pipeline` of this plan for ``chain`` (the
        :class:`sbpjax.pipeline.LayerChain` the plan was searched for).
        ``pipeline_options`` go to ``Pipeline`` (``check_finite``, ...)."""
        import sbpjax.pipeline as sjp

        names = tuple(layer.name for layer in chain.layers)
        if names != self.layer_names:
            raise SBPError(
                f"PipelinePlan.build: the chain's layers {names} are not the {len(self.layer_names)} layers the "
                "plan was searched for; build it for the same chain."
            )
        grid = self.stage_grid
        placements = []
        for pl in self.group_placements(placement):
            placements.append(grid.fine_placement(pl) if grid.size > 1 and self.layouts is not None else pl)
        stages = []
        for s, (lo, hi) in enumerate(self.bounds):
            pl = placements[self.schedule.device_of(s, self.groups)]
            stages.append(
                sjp.Stage(
                    chain.stage_fn(lo, hi, remat=self.remat),
                    [chain[i].params for i in range(lo, hi)],
                    pl,
                    param_sbp=[self._param_sbp(chain, i, pl.ndim) for i in range(lo, hi)],
                    name=f"stage{s}",
                )
            )
        return sjp.Pipeline(
            stages,
            loss_fn,
            optimizer,
            microbatches=self.microbatches,
            schedule=self.schedule,
            **pipeline_options,
        )

    # -- reports --------------------------------------------------------------------------
    def table(self) -> str:
        name = getattr(self.schedule, "name", repr(self.schedule))
        lines = [
            f"PipelinePlan on {self.grid!r}: {self.groups} device group(s) of {self.stage_shape}, {name}, "
            f"{self.microbatches} microbatches, remat {'on' if self.remat else 'off'}",
            f"  predicted step {self.step_s * 1e3:.4g} ms, memory {human_bytes(self.peak_memory)} per device "
            f"(fullest group); searched {self.configurations} configurations, {self.simulations} simulated "
            f"steps, in {self.search_s:.3g} s{'' if self.proven else ' (simulation cap hit: best found, not proven)'}",
        ]
        for s, (lo, hi) in enumerate(self.bounds):
            layers = self.layer_names[lo:hi]
            shown = ", ".join(layers) if len(layers) <= 4 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"
            lines.append(f"  stage {s} on group {self.schedule.device_of(s, self.groups)}: {shown}")
        if self.layouts is not None:
            labels = {lp.choice.label(self.layouts.grid) for lp in self.layouts.layers}  # type: ignore[attr-defined]
            lines.append(f"  layouts in each stage: {', '.join(sorted(labels))}")
        return "\n".join(lines)

    __str__ = table

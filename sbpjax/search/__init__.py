"""Strategy search: per-layer SBP layouts from a communication cost model (AutoDDL).

    import sbpjax.search as ss
    ops = ss.mlp("mlp", tokens=8192, dims=[32768, 16384, 4096, 2048, 512])
    grid = ss.Grid(4096, "x")                           # devices that need not exist
    best = ss.search(ops, grid, method="coordinate_descent")
    print(best)                                        # layouts, bytes, time, memory

On real devices, ``ss.search(ops, ss.Grid.from_placement(pl), placement=pl)``
prices every boxing with ``sj.plan_boxing`` and the result annotates ``sj.jit``
(``best.placement``, ``best.param_sbp(params)``, ``best.matmul``,
``best.synced``); ``best.rules()`` maps parameter paths to layouts.

Pipelines: ``ss.search_pipeline(chain, grid, batch=..., memory=...)`` searches
device groups, schedule, microbatches, remat, layouts and the stage cut at
once and returns a :class:`PipelinePlan` whose ``build(...)`` is a runnable
``sbpjax.pipeline.Pipeline``.
"""

from __future__ import annotations

import time

from sbpjax._errors import SBPError
from sbpjax.search.algorithms import (
    Problem,
    coordinate_descent,
    exhaustive,
    metropolis_hastings,
)
from sbpjax.search.calibrate import calibrate_compute, calibrate_transfer
from sbpjax.search.cost import ClosedForm, MemoryModel, Planned, Price, build_tables
from sbpjax.search.layers import (
    MatmulOp,
    attention,
    conv,
    dense,
    embedding,
    from_program,
    gpt,
    mlp,
    repeat,
    transformer,
)
from sbpjax.search.pipeline import PIPELINE_METHODS, schedule_names, search_pipeline
from sbpjax.search.pipeline_cost import ComputeModel
from sbpjax.search.pipeline_space import stage_shapes
from sbpjax.search.plan import PipelinePlan
from sbpjax.search.profile import LayerProfile, gpt_profiles, profile
from sbpjax.search.space import Choice, Grid, choices
from sbpjax.search.strategy import LayerPlan, Strategy, build, spearman

METHODS = ("exhaustive", "coordinate_descent", "metropolis_hastings")


def search(
    ops,
    grid: Grid,
    *,
    method: str = "coordinate_descent",
    objective: str = "time",
    memory: MemoryModel | None = None,
    placement=None,
    seed: int = 0,
    restarts: int = 8,
    steps: int = 2000,
    temperature: float = 0.05,
    progress: bool = False,
    tables=None,
) -> Strategy:
    """The cheapest per-layer layouts of ``ops`` (a list of :class:`MatmulOp`) on ``grid``.

    ``method``: "exhaustive" (every assignment; small cases), "coordinate_descent"
    (``restarts`` starts), "metropolis_hastings" (``steps`` proposals at
    ``temperature``). ``objective``: "time" (alpha-beta seconds of the grid's cost
    model) or "bytes". ``memory.limit``: bytes per device no layout may exceed.
    ``placement``: real devices of the grid's shape; the boxings are then priced
    by ``sj.plan_boxing`` (what ``sj.jit`` runs) instead of closed forms.
    ``tables``: prices built once by :func:`build_tables`, to compare methods.
    ``search_seconds`` on the result counts the algorithm only when tables are given.
    """
    if method not in METHODS:
        raise SBPError(f"search: unknown method {method!r}; use one of {METHODS}.")
    t0 = time.perf_counter()
    if tables is None:
        pricer = Planned(grid, placement) if placement is not None else ClosedForm(grid)
        tables = build_tables(ops, grid, pricer, objective=objective, memory=memory)
    problem = Problem(tables)
    if method == "exhaustive":
        assign, _ = exhaustive(problem, progress)
    elif method == "coordinate_descent":
        assign, _ = coordinate_descent(problem, restarts, seed, progress)
    else:
        assign, _ = metropolis_hastings(problem, steps, temperature, seed, progress)
    return build(tables, assign, grid, method, time.perf_counter() - t0, placement)


def tables_for(
    ops,
    grid: Grid,
    *,
    objective: str = "time",
    memory: MemoryModel | None = None,
    placement=None,
    options: list | None = None,
):
    """Prices of every choice (or of ``options`` only) of every op; reuse them across
    :func:`search` calls."""
    pricer = Planned(grid, placement) if placement is not None else ClosedForm(grid)
    return build_tables(ops, grid, pricer, objective=objective, memory=memory, options=options)


def evaluate(
    ops,
    grid: Grid,
    assignment: dict,
    *,
    objective: str = "time",
    memory: MemoryModel | None = None,
    placement=None,
    tables=None,
) -> Strategy:
    """The strategy (and its costs) of a hand-picked assignment ``{tie key or op name: Choice}``
    (e.g. Megatron's layouts, to compare with a search)."""
    if tables is None:  # price only the choices asked for
        tables = tables_for(
            ops,
            grid,
            objective=objective,
            memory=memory,
            placement=placement,
            options=list(dict.fromkeys(assignment.values())),
        )
    assign = []
    for key, opts in zip(tables.groups, tables.options):
        if key not in assignment:
            raise SBPError(f"evaluate: no choice for {key!r}; give one for each of {tables.groups}.")
        if assignment[key] not in opts:
            raise SBPError(
                f"evaluate: {assignment[key].label(grid)} is not a valid choice for {key!r} "
                "(its dims do not divide); see sbpjax.search.choices."
            )
        assign.append(opts.index(assignment[key]))
    return build(tables, assign, grid, "given", 0.0, placement)


__all__ = [
    "METHODS",
    "PIPELINE_METHODS",
    "ComputeModel",
    "LayerProfile",
    "PipelinePlan",
    "calibrate_compute",
    "calibrate_transfer",
    "gpt_profiles",
    "profile",
    "schedule_names",
    "search_pipeline",
    "stage_shapes",
    "Choice",
    "Grid",
    "LayerPlan",
    "MatmulOp",
    "MemoryModel",
    "Price",
    "Problem",
    "Strategy",
    "attention",
    "choices",
    "conv",
    "coordinate_descent",
    "dense",
    "embedding",
    "evaluate",
    "exhaustive",
    "from_program",
    "gpt",
    "metropolis_hastings",
    "mlp",
    "repeat",
    "search",
    "spearman",
    "tables_for",
    "transformer",
]

"""One search over pipeline configurations: device groups and their shape, the
schedule, the microbatch count, remat, the layouts inside each stage and the
cut, under a per-device memory budget.

    chain = sjp.LayerChain.from_model(model, sample=tokens)
    plan = ss.search_pipeline(chain, ss.Grid.from_placement(pl), batch=64, memory=ss.MemoryModel(limit=8e9),
                              compute=ss.calibrate_compute())
    print(plan)                                    # predicted step time and memory per device
    pipe = plan.build(chain, loss_fn, optax.adam(1e-3), placement=pl)
    pipe.step(tokens, labels)

The space: every number of device groups ``g`` that divides the grid, every
stage shape (a box of the grid; its axes keep their cost-model parameters),
every schedule the pipeline's registry names (what ``as_schedule`` accepts,
so schedules added there are searched too; a schedule with ``v`` chunks per
group cuts the model into ``g v`` stages), every microbatch count given
(default: the divisors of the batch up to 64), remat off and on, and the
layout candidates of :mod:`sbpjax.search.pipeline_cost` for the stage grid and
microbatch size. For each configuration :mod:`sbpjax.search.cuts` finds the
cuts that could win (branch and bound on the simulated step), and
configurations and cuts are taken from one queue, cheapest lower bound first
(a cut taken is simulated), so the search stops as soon as nothing left can
beat the best step found. ``method="exhaustive"``
simulates every cut of every configuration instead: the same space and the
same prices, for checking the search on small cases.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Iterable

import numpy as np

from sbpjax._errors import SBPError, is_count
from sbpjax.boxing.plan import human_bytes
from sbpjax.pipeline.balance import range_costs, suffix_table, walk
from sbpjax.pipeline.registry import as_schedule
from sbpjax.pipeline.schedule import Schedule
from sbpjax.search.cost import MemoryModel
from sbpjax.search.cuts import Setting, cut_candidates, evaluate, every_cut, group_memory, least_bound
from sbpjax.search.pipeline_cost import ComputeModel
from sbpjax.search.pipeline_space import Space, stage_shapes
from sbpjax.search.plan import PipelinePlan
from sbpjax.search.profile import LayerProfile, profile
from sbpjax.search.space import Grid

PIPELINE_METHODS = ("branch_and_bound", "exhaustive")


def schedule_names() -> list[str]:
    """Every schedule name :func:`sbpjax.pipeline.schedule.as_schedule` accepts:
    the names of the :class:`Schedule` classes it builds from a name."""
    found: list[str] = []
    pending = list(Schedule.__subclasses__())
    while pending:
        cls = pending.pop(0)
        pending += cls.__subclasses__()
        name = getattr(cls, "name", None)
        if isinstance(name, str) and name not in found:
            try:
                as_schedule(name)
            except (SBPError, TypeError):
                continue
            found.append(name)
    return found


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def _as_profiles(model) -> list[LayerProfile]:
    if isinstance(model, (list, tuple)) and model and all(isinstance(p, LayerProfile) for p in model):
        return list(model)
    from sbpjax.pipeline.chain import LayerChain

    if isinstance(model, LayerChain):
        return profile(model)
    raise SBPError(
        f"search_pipeline: {type(model).__name__} is neither a sbpjax.pipeline.LayerChain nor a list of "
        "LayerProfile; build one with sjp.LayerChain.from_model(model, sample) or ss.gpt_profiles(...)."
    )


def _as_grid(devices) -> tuple[Grid, object]:
    from sbpjax.placement import Placement

    if isinstance(devices, Grid):
        return devices, None
    if isinstance(devices, Placement):
        return Grid.from_placement(devices), devices
    if isinstance(devices, int):
        return Grid(devices, "x"), None
    raise SBPError(
        f"search_pipeline: devices={devices!r}; give an ss.Grid (devices that need not exist), an sj.Placement "
        "or a device count."
    )


# Cuts played per configuration before its best found stands (``search_pipeline``'s
# ``max_simulations``). Swept over 2, 4, 8, 16 and no limit: on the 40 random spaces
# of tests/search/test_joint.py's generator, 2 found the optimum of 38 (the worst
# 5.7% slower by the cost model) and 4 or more of all 40, in the same total time
# (8.9-9.8 s); the nanoGPT of benchmarks/pipeline_search.py needs 8 (2 and 4 stop at
# a cut 7% slower than exhaustive search's); and the 64-layer GPT on 64 devices,
# which no limit proves, takes 7.1 s at 2, 8.0 s at 8 and 10.7 s at 64 on a
# 2-core machine. 8: the least that found every optimum, within the 10 s the
# 64-device search is held to.
MAX_SIMULATIONS = 8


def _values(given) -> tuple:
    """A search dimension's values: one value (``remat=True``, ``groups=2``,
    ``schedules="zb-h1"``) searches that value alone, a collection each of
    its values (read once: a generator is used up)."""
    if isinstance(given, (str, bool, int, np.integer)) or not isinstance(given, Iterable):
        return (given,)
    return tuple(given)


def _check_choices(grid: Grid, scheds: list, remat, groups) -> None:
    """Refuse values to search that leave nothing to search (or are not
    values of their kind), naming which."""
    if not scheds:
        raise SBPError(
            f"search_pipeline: schedules=[] leaves nothing to search; give schedule names "
            f"(any of {schedule_names()}), or leave it out for all of them."
        )
    if not remat:
        raise SBPError(
            "search_pipeline: remat=() leaves nothing to search; give (False,), (True,) or (False, True)."
        )
    not_bools = [r for r in remat if not isinstance(r, (bool, np.bool_))]
    if not_bools:
        raise SBPError(f"search_pipeline: remat values {not_bools!r} are not True or False.")
    if groups is not None:
        tiling = sorted({g for g, _, _ in stage_shapes(grid)})
        wanted = list(groups)
        if not wanted or not set(wanted) & set(tiling):
            raise SBPError(
                f"search_pipeline: groups={wanted!r}: no such count of device groups tiles {grid!r} "
                f"({grid.size} devices); counts that tile it: {tiling}."
            )


def search_pipeline(
    model,
    devices,
    *,
    batch: int | None = None,
    memory: MemoryModel | float | None = None,
    compute: ComputeModel | None = None,
    microbatches=None,
    schedules=None,
    remat=(False, True),
    groups=None,
    method: str = "branch_and_bound",
    tolerance: float = 0.0,
    max_simulations: int = MAX_SIMULATIONS,
) -> PipelinePlan:
    """The fastest pipeline configuration of ``model`` (a :class:`LayerChain` or a
    list of :class:`LayerProfile`) on ``devices`` (an :class:`Grid`, an
    ``sj.Placement`` or a count) that fits ``memory`` (a :class:`MemoryModel`
    whose ``limit`` is the budget in bytes per device, or the budget itself).

    ``batch``: examples per step (default: the chain's sample). ``compute``:
    device speed and action cost (:func:`calibrate_compute`). ``microbatches``,
    ``schedules`` (names or :class:`Schedule` objects), ``remat`` (booleans) and
    ``groups`` (device group counts): the values to search, or one value to
    search alone (``remat=True``, ``schedules="zb-h1"``) (defaults in the
    module docstring; every count of groups that tiles the grid). ``method``:
    "branch_and_bound" or "exhaustive". ``tolerance``: branch and bound skips
    what its bounds put within this fraction of the best step found, so the
    plan's step is at most ``1 + tolerance`` times the best of the space (0:
    exact). ``max_simulations``: per configuration, the cuts played on its
    schedule (simulated, or for a schedule with action lists first bounded
    along them), after which its cut is the best found (``plan.proven`` says
    whether the plan's step is still proven the best: every cut left unplayed
    bounded at or above it). Of plans with equal steps, the one holding less
    memory per device is chosen (:data:`STEP_TIE`)."""
    t0 = time.perf_counter()
    if method not in PIPELINE_METHODS:
        raise SBPError(f"search_pipeline: unknown method {method!r}; use one of {PIPELINE_METHODS}.")
    profiles = _as_profiles(model)
    grid, placement = _as_grid(devices)
    memory = memory if isinstance(memory, MemoryModel) else MemoryModel(limit=memory)
    compute = compute or ComputeModel()
    if batch is not None and not is_count(batch):
        raise SBPError(
            f"search_pipeline: batch={batch!r}; give the number of examples per step, an int >= 1."
        )
    batch = int(batch if batch is not None else profiles[0].examples)
    ms = sorted(set(_values(microbatches))) if microbatches is not None else _divisors(batch, 64)
    not_counts = [m for m in ms if not is_count(m)]
    if not_counts:
        raise SBPError(f"search_pipeline: microbatch counts {not_counts} are not ints >= 1.")
    ms = [int(m) for m in ms]
    bad = [m for m in ms if batch % m]
    if bad:
        raise SBPError(
            f"search_pipeline: microbatch counts {bad} do not divide the batch of {batch} examples into equal "
            f"microbatches; use divisors of {batch}."
        )
    scheds = [as_schedule(s) for s in (_values(schedules) if schedules is not None else schedule_names())]
    remat = _values(remat)
    groups = None if groups is None else _values(groups)
    _check_choices(grid, scheds, remat, groups)
    space = Space(profiles, grid, batch, memory, compute, ms, scheds, remat, groups)
    if not space.protos:
        n = len(profiles)
        limit = f", device-group counts {list(groups)}" if groups is not None else ""
        raise SBPError(
            f"search_pipeline: no configuration of {n} layers on {grid!r} with microbatches {ms}{limit} "
            f"and schedules {[getattr(s, 'name', repr(s)) for s in scheds]} can run: a microbatch's rows "
            f"must scale to whole rows, and every stage needs at least one layer ({n} layers make at most "
            f"{n} stages, on as many device groups; a schedule with two stages per group, such as interleaved "
            f"or zb-v, on at most {n // 2}). Use a larger batch or other microbatch counts"
            + (", or fewer device groups." if groups is not None else ".")
        )
    if isinstance(max_simulations, bool) or not isinstance(max_simulations, int) or max_simulations < 1:
        raise SBPError(
            f"search_pipeline: max_simulations={max_simulations!r}; give the cuts to play per configuration "
            f"before its best found stands, an int >= 1 (default {MAX_SIMULATIONS})."
        )
    if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
        raise SBPError(f"search_pipeline: tolerance={tolerance!r}; give a fraction >= 0 (0: exact).")
    best, proven, sims = _search(space, method, max_simulations, tolerance)
    if best is None:
        raise SBPError(_over_budget(space))
    proto, layouts, result = best
    return PipelinePlan(
        grid=grid,
        placement_=placement,
        stage_shape=proto.shape,
        groups=proto.groups,
        schedule=proto.schedule,
        microbatches=proto.microbatches,
        remat=proto.remat,
        layouts=layouts.strategy,
        bounds=result.bounds,
        step_s=result.step_s,
        memory=result.memory,
        search_s=time.perf_counter() - t0,
        proven=proven,
        configurations=len(space.protos),
        simulations=sims,
        layer_names=tuple(p.name for p in profiles),
    )


# Steps within this fraction of each other are equal, and the one that holds
# less memory per device wins: with one device group, say, every schedule runs
# the same step, and 1F1B holds less than interleaved 1F1B. Simulated steps
# are sums of the same prices in other orders, so equal steps differ by
# rounding (about 1e-16 of the step); a real difference is an action's price
# or more (1e-6 of the step for an action among a million). 1e-9 lies
# between the two by three orders of magnitude on each side.
STEP_TIE = 1e-9


def _better(r, best) -> bool:
    """Whether the priced cut ``r`` beats ``best`` (``(proto, layouts,
    Evaluated)`` or None): a shorter step, or an equal one (:data:`STEP_TIE`)
    holding less memory."""
    if best is None:
        return True
    step = best[2].step_s
    if r.step_s < step * (1 - STEP_TIE):
        return True
    return r.step_s <= step * (1 + STEP_TIE) and r.peak_memory < best[2].peak_memory


def _search(space: Space, method: str, max_simulations: int, tolerance: float):
    """``((proto, layouts, Evaluated) or None, proven, simulations)``."""
    best: tuple | None = None
    best_step, sims = math.inf, 0
    unseen: list[float] = []  # per configuration cut short by the cap: the least bound left unseen
    if method == "exhaustive":
        for proto in space.protos:
            for layouts in space.layouts(proto):
                st = space.setting(proto, layouts)
                for bounds in every_cut(st.costs.layers, st.stages):
                    sims += 1
                    r = evaluate(st, bounds)
                    if r is not None and _better(r, best):
                        best = (proto, layouts, r)
        return best, True, sims
    # best first over one queue: a configuration without layouts enters at its floor;
    # taken out, its layout candidates enter at their own bounds; a priced one taken
    # out is searched for up to max_simulations cuts that could win, which enter at
    # their bounds; a cut taken out is simulated. Whatever is left is bounded above
    # the best step; so are the cuts a cap left unseen where the plan is proven.
    queue: list = []
    entered = itertools.count()  # ties go to what entered first

    def push(bound, proto, what):
        if math.isfinite(bound):
            heapq.heappush(queue, (bound, next(entered), proto, what))

    for proto in space.protos:
        proto.floor = least_bound(space.setting(proto))
        push(proto.floor, proto, ("configuration",))
    # a bound equal to the best step may still win the tie on memory: explored
    while queue and queue[0][0] * (1 + tolerance) < best_step * (1 + STEP_TIE):
        _, _, proto, what = heapq.heappop(queue)
        if what[0] == "configuration":  # its layout candidates
            for layouts in space.layouts(proto):
                st = space.setting(proto, layouts)
                push(least_bound(st), proto, ("priced", st, layouts))
        elif what[0] == "priced":  # its cuts that could win
            _, st, layouts = what
            found, rest = cut_candidates(st, best_step * (1 + STEP_TIE), max_simulations, tolerance)
            for bound, bounds in found:
                push(bound, proto, ("cut", st, layouts, bounds))
            if rest < math.inf:
                unseen.append(rest)
        else:  # a cut
            _, st, layouts, bounds = what
            sims += 1
            r = evaluate(st, bounds)
            if r is not None and _better(r, best):
                best, best_step = (proto, layouts, r), r.step_s
    proven = all(rest * (1 + tolerance) >= best_step for rest in unseen)
    return best, proven, sims


def _over_budget(space: Space) -> str:
    """The error for a budget nothing fits, with a configuration that would fit
    a larger one: the least any configuration needs where each device group
    runs one stage (exact), else the least of the cuts that balance each
    configuration's stages (a budget that surely fits, though a cut that
    balances the groups' sums may need less: the message says which). The
    least is exact only where every configuration was priced exactly: a
    configuration with several stages per group, priced at its balanced cut,
    may need less than the least found."""
    least, where, exact = math.inf, None, True
    for proto in space.protos:
        for layouts in space.layouts(proto):
            st = dataclasses.replace(space.setting(proto, layouts), budget=None)
            bounds = _least_memory_cut(st)
            need = max(group_memory(st, bounds))
            exact = exact and st.one_stage_per_group
            if need < least:
                least, where = need, (proto, bounds)
    if where is None:
        return (
            "search_pipeline: no layout of the layers divides evenly on any stage grid; use a batch and "
            "layer sizes that are multiples of the device counts."
        )
    proto, bounds = where
    what = "The least any configuration needs is" if exact else "A configuration that fits needs"
    return (
        f"search_pipeline: no configuration fits the memory budget of {human_bytes(space.memory.limit or 0)} per "
        f"device. {what} {human_bytes(least)} per device ({math.ceil(least)} bytes: "
        f"{proto.groups} device groups of {proto.shape}, schedule {_name(proto.schedule)}, "
        f"{proto.microbatches} microbatches, remat {proto.remat}, layers per stage "
        f"{[b - a for a, b in bounds]}). "
        + (
            "Raise the budget to at least that"
            if exact
            else "A budget of that fits (with several stages per group, another cut may need less)"
        )
        + ", or use more devices, more microbatches or smaller layers."
    )


def _least_memory_cut(st: Setting) -> list:
    """The cut whose fullest stage holds least (exact when each group runs one
    stage; with several, the cut that balances the stages)."""
    costs = st.costs
    params, stash, kept = (range_costs(a) for a in (costs.param_bytes, costs.stash_bytes, costs.kept_bytes))

    def table(s):
        held = params + st.stash[s] * stash
        return held + st.kept[s] * kept if st.kept is not None else held

    return walk(suffix_table(table, costs.layers, st.stages)[1])


def _name(schedule) -> str:
    return getattr(schedule, "name", repr(schedule))

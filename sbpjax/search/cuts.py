"""The cut of one pipeline configuration: exact branch and bound over layer
boundaries, the step time from the pipeline simulator.

A cut's step time is the makespan of the schedule's actor graph on the
simulated clock (:func:`sbpjax.pipeline.simulate`) with each stage's forward,
backward and transfer durations; no formula stands in for the schedule. The
search avoids simulating most cuts with a lower bound that holds for every
schedule. For stage ``s`` (of ``n``) on layers ``a .. b-1``, with ``m``
microbatches:

    LB_s = head_s + m (F_s + B_s + k_s T_s) + tail_s

``head_s``: the first microbatch's forwards and transfers before stage ``s``
(its first action cannot start sooner; the transfer into ``s`` is one of its
own actions); ``m (...)``: the stage's own actions,
serial on its device group (``k_s`` transfers land on it per microbatch);
``tail_s``: the last microbatch's backwards after it, down to stage 0 (zero
for schedules that split the backward: their last action may be a W, which
nothing waits for). A device group with several stages is bounded the same
way by all its stages' actions. The makespan is at least every bound.

A second bound counts the stash: the stage keeps at most ``k_s`` microbatches
between their forward and their backward (the schedule's register count), so
before its first backward it runs at most ``k_s`` forwards, and that backward
waits for a round trip through the later stages:

    LB'_s = head_s + F_s + trip_s + m B_s + max(0, m - k_s) F_s + tail_s

(for schedules that run each backward whole; a uniform 1F1B pipeline meets
both bounds with equality).

``head_s``, ``tail_s`` and ``trip_s`` depend on the earlier stages only through the sums
of layer costs before ``a`` and after ``b`` (the transfers in them are
bounded by the cheapest boundary), so ``max_s LB_s`` is minimized over all cuts by the
dynamic program of :mod:`sbpjax.pipeline.balance`. Its table also bounds
every completion of a partial cut, so a depth-first walk over cuts, cheapest
bound first, that stops where the bound reaches the best simulated step,
simulates only cuts that could still win: the result is the exact optimum
over all cuts, usually after one or a few simulations.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from sbpjax.pipeline import simulate
from sbpjax.pipeline.balance import range_costs, suffix_table
from sbpjax.search.pipeline_cost import ConfigCosts


@dataclasses.dataclass
class Setting:
    """A configuration without its cut: ``where[s]`` is stage ``s``'s device group."""

    schedule: object
    groups: int
    microbatches: int
    costs: ConfigCosts
    budget: float | None
    stash: list
    kept: list | None
    where: list
    split: bool

    @property
    def stages(self) -> int:
        return len(self.where)

    @property
    def one_stage_per_group(self) -> bool:
        return self.stages == self.groups


@dataclasses.dataclass(frozen=True)
class Evaluated:
    """A priced cut: the simulated step, and the bytes each device group holds."""

    bounds: tuple
    step_s: float
    memory: tuple

    @property
    def peak_memory(self) -> float:
        return max(self.memory)


def stage_prices(st: Setting, bounds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per stage: forward and (whole) backward seconds of one microbatch, and the
    transfer time of each action landing on it (its input boundary; the first
    stage's gradient arrives over its output boundary)."""
    c = st.costs
    f = np.asarray([c.f[a:b].sum() for a, b in bounds]) + c.action_s
    b_ = np.asarray([c.b[a:b].sum() for a, b in bounds]) + c.action_s
    t = np.asarray(
        [c.transfer[a] if s else (c.transfer[b] if b < c.layers else 0.0) for s, (a, b) in enumerate(bounds)]
    )
    return f, b_, t


def group_memory(st: Setting, bounds) -> tuple:
    """Bytes per device of every device group: parameters, and the residuals of
    the microbatches its registers can hold (the schedule's stash counts; for
    split schedules also the values B keeps for W)."""
    c = st.costs
    out = [0.0] * st.groups
    for s, (a, b) in enumerate(bounds):
        held = c.param_bytes[a:b].sum() + st.stash[s] * c.stash_bytes[a:b].sum()
        if st.kept is not None:
            held += st.kept[s] * c.kept_bytes[a:b].sum()
        out[st.where[s]] += float(held)
    return tuple(v + c.recompute_bytes for v in out)


def lower_bound(st: Setting, bounds) -> float:
    """The largest of the stage and device-group bounds of the module docstring."""
    f, b, t = stage_prices(st, bounds)
    n, m = st.stages, st.microbatches
    lands = np.asarray([(s > 0) + (s < n - 1) for s in range(n)])
    work = m * (f + b + lands * t)
    # transfers into stage s run on its own device group: they are in its work, not its head
    into = np.concatenate([[0.0], t[1:]])
    head = np.concatenate([[0.0], np.cumsum(f[:-1] + into[:-1])])
    tail = np.zeros(n) if st.split else np.concatenate([[0.0], np.cumsum(b[:-1] + t[:-1])])
    best = float(np.max(head + work + tail))
    if not st.split:  # the stash bound (module docstring)
        grads = np.where(np.arange(n) < n - 1, t, 0.0)  # the gradient lands on every stage but the last
        trip = _after(f + b + into) + _after(grads) + grads
        ahead = np.maximum(0, m - np.asarray(st.stash))
        best = max(best, float(np.max(head + f + trip + m * b + ahead * f + tail)))
    for g in range(st.groups):
        mine = [s for s in range(n) if st.where[s] == g]
        if mine:
            first = min(mine)
            best = max(best, float(head[first] + work[mine].sum() + tail[first]))
    return best


def _after(v: np.ndarray) -> np.ndarray:
    """``out[s]``: the sum of ``v`` over the stages after ``s``."""
    return np.concatenate([np.cumsum(v[::-1])[::-1][1:], [0.0]])


def durations(st: Setting, bounds):
    """``(kind, stage, microbatch) -> seconds`` for the simulator."""
    f, b, t = stage_prices(st, bounds)
    action = st.costs.action_s

    def duration(kind, stage, microbatch):
        if kind == "forward":
            return f[stage]
        if kind == "backward":
            return b[stage]
        if kind.startswith("backward"):
            # B (input cotangent) and W (weight cotangent) of a split backward: the
            # profiles do not price them apart yet, so each takes half of the
            # backward's work (and its own launch)
            return (b[stage] - action) / 2 + action
        if kind == "transfer":
            return t[stage]
        return 0.0  # data loading, host-to-device puts and the optimizer update

    return duration


def evaluate(st: Setting, bounds) -> Evaluated | None:
    """The simulated step of one cut, or None when a device group is over budget."""
    memory = group_memory(st, bounds)
    if st.budget is not None and max(memory) > st.budget:
        return None
    timeline = simulate(st.schedule, st.groups, st.microbatches, durations(st, bounds))
    return Evaluated(tuple(bounds), float(timeline.makespan), memory)


def _bound_tables(st: Setting):
    """Per stage ``s``, ``C_s[a, b]``: the decomposable bound of stage ``s`` on layers
    ``a .. b-1`` (``inf`` where its group would be over budget, when every group
    runs one stage). What does not depend on ``s`` is computed once."""
    c, n, m = st.costs, st.stages, st.microbatches
    L = c.layers
    ov = c.action_s
    F, B = range_costs(c.f) + ov, range_costs(c.b) + ov
    pre_f = np.concatenate([[0.0], np.cumsum(c.f)])[:, None]
    pre_b = np.concatenate([[0.0], np.cumsum(c.b)])[:, None]
    t_min = float(c.transfer[1:].min()) if L > 1 else 0.0
    by_end = np.append(c.transfer, 0.0)  # by_end[j]: the boundary before layer j (none at the end)
    t_in, t_out = (
        m * by_end[:, None],
        m * by_end[None, :],
    )  # stage s > 0: its input (at a); 0: its output (at b)
    edges = pre_f + (0.0 if st.split else pre_b)  # the head's and tail's layers
    work = edges + m * (F + B)
    if not st.split:
        after = (pre_f[L, 0] - pre_f + pre_b[L, 0] - pre_b).T  # the later stages' layers, by end b
        stashed = edges + F + after + m * B
    if st.budget is not None and st.one_stage_per_group:
        params, stash = range_costs(c.param_bytes) + c.recompute_bytes, range_costs(c.stash_bytes)
        kept = range_costs(c.kept_bytes) if st.kept is not None else None

    def table(s: int) -> np.ndarray:
        lands = (s > 0) + (s < n - 1)
        # the head's and tail's actions and transfers (the transfers bounded by the cheapest)
        chains = s * ov + max(s - 1, 0) * t_min + (0.0 if st.split else s * (ov + t_min))
        bound = work + chains
        if lands:
            bound = bound + (t_in if s > 0 else t_out) * (lands if s > 0 else 1)
        if not st.split:
            ahead = max(0, m - st.stash[s])
            trip = (n - 1 - s) * (2 * ov + 2 * t_min)
            bound = np.maximum(bound, stashed + (chains + trip) + (ahead * F if ahead else 0.0))
        if st.budget is not None and st.one_stage_per_group:
            held = params + st.stash[s] * stash
            if kept is not None and st.kept is not None:
                held = held + st.kept[s] * kept
            bound = np.where(held > st.budget, np.inf, bound)
        return bound

    return table


def least_bound(st: Setting) -> float:
    """The least bound any cut of this configuration has (``inf``: none fits)."""
    G, _ = suffix_table(_bound_tables(st), st.costs.layers, st.stages)
    return float(G[0][0])


def branch_and_bound(
    st: Setting, incumbent: float = math.inf, max_simulations: int = 64, tolerance: float = 0.0
):
    """The best cut of ``st`` simulating under ``incumbent``, as ``(Evaluated or
    None, proven, simulations)``: a cut is skipped when its bound is within
    ``tolerance`` of the best step found (``bound * (1 + tolerance) >= best``), so
    the result is at most ``1 + tolerance`` times the optimum. ``proven`` is False
    when ``max_simulations`` ran out before every cut that could still win was
    simulated."""
    table = _bound_tables(st)
    L, n = st.costs.layers, st.stages
    tables = [table(s) for s in range(n)]
    G, _ = suffix_table(lambda s: tables[s], L, n)
    best: list = [None, incumbent]
    state = {"simulations": 0, "proven": True}

    def leaf(bounds):
        if lower_bound(st, bounds) * (1 + tolerance) >= best[1]:
            return
        if state["simulations"] >= max_simulations:
            state["proven"] = False
            return
        state["simulations"] += 1
        result = evaluate(st, bounds)
        if result is not None and result.step_s < best[1]:
            best[0], best[1] = result, result.step_s

    def walk(s: int, a: int, so_far: float, bounds: list):
        if not state["proven"]:
            return  # out of simulations: the best found stands
        if s == n - 1:
            leaf([*bounds, (a, L)])
            return
        ends = np.arange(a + 1, L - (n - 1 - s) + 1)
        keys = np.maximum(so_far, np.maximum(tables[s][a, ends], G[s + 1][ends]))
        for i in np.argsort(keys, kind="stable"):
            if keys[i] * (1 + tolerance) >= best[1] or not np.isfinite(keys[i]):
                break
            b = int(ends[i])
            walk(s + 1, b, max(so_far, float(tables[s][a, b])), [*bounds, (a, b)])

    if np.isfinite(G[0][0]) and G[0][0] * (1 + tolerance) < incumbent:
        walk(0, 0, 0.0, [])
    return best[0], state["proven"], state["simulations"]


def every_cut(layers: int, stages: int):
    """All ``C(layers - 1, stages - 1)`` cuts into non-empty contiguous stages."""
    for inner in itertools.combinations(range(1, layers), stages - 1):
        edges = (0, *inner, layers)
        yield [(edges[i], edges[i + 1]) for i in range(stages)]

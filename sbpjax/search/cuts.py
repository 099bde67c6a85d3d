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
finds only cuts that could still win (:func:`cut_candidates`); simulated
cheapest bound first while they can, they give the exact optimum over all
cuts, usually after one or a few simulations.

Where a device group runs several stages (interleaved, V-shaped schedules),
the stage tables see one stage of a group, and a group's bound is a sum over
stages far apart in the cut: the tables alone leave a walk over almost every
balanced cut. The walk then also bounds each partial cut by its groups
(:class:`~sbpjax.search.cut_bounds.GroupBounds`): what the stages placed give each group is known, and
the layers left must go to the stages left, each at least one, in whole
layers, and no more to a group than its memory holds. Every group's mean load
bounds the configuration as a whole. The walk prices at most a fixed number
of partial cuts per simulation allowed (:func:`_bound_budget`); past it, the
best cut found stands and the result says it is not proven.

A schedule with action lists fixes each device's order, which the bounds
above do not know (an order planned for other durations can leave a device
idle for long): a cut that gets past them is played along its lists with
clocks (:func:`list_bound`), which costs a small part of a simulation and
comes close to it (the simulator adds the transfers' turns on the devices),
and is simulated only if that bound can still win.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np

from sbpjax._errors import SBPError
from sbpjax.pipeline import ActorGraph, Schedule, build_graph, simulate_graph
from sbpjax.pipeline.balance import suffix_table
from sbpjax.search.cut_bounds import GroupBounds, PartialCut, Tables
from sbpjax.search.pipeline_cost import ConfigCosts


@dataclasses.dataclass
class Setting:
    """A configuration without its cut: ``where[s]`` is stage ``s``'s device group.
    ``graph``: the actor graph of its schedule (one for every cut: only the
    durations differ), or None to build it for each simulation."""

    schedule: Schedule
    groups: int
    microbatches: int
    costs: ConfigCosts
    budget: float | None
    stash: list
    kept: list | None
    where: list
    split: bool
    graph: Callable[[], ActorGraph] | None = None

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


_KIND = {"forward": 0, "backward": 1, "backward_input": 2, "backward_weight": 3}


def list_order(st: Setting) -> list | None:
    """A schedule's action lists as ``(kind, stage, previous, waits)`` per action,
    each after what it waits for: ``previous`` the index of the action before it
    on its device (-1: none), ``waits`` the indices of the actions of other
    stages it waits for (a forward the previous stage's, a backward the next
    stage's), the transfer into its stage between them. None for schedules
    whose order emerges from register counts."""
    lists = st.schedule.action_lists(st.groups, st.microbatches)
    if lists is None:
        return None
    n = st.stages
    index: dict = {}
    order: list[tuple] = []
    cursor, last = dict.fromkeys(lists, 0), dict.fromkeys(lists, -1)
    left = sum(len(seq) for seq in lists.values())
    while left:
        before = left
        for d, seq in lists.items():
            while cursor[d] < len(seq):
                kind, s, k = seq[cursor[d]]
                if kind == "forward":
                    waits = [("forward", s - 1, k)] if s > 0 else []
                    needs = waits
                elif kind == "backward_weight":
                    waits, needs = [], [("backward_input", s, k)]
                else:
                    waits = [(kind, s + 1, k)] if s < n - 1 else []
                    needs = [*waits, ("forward", s, k)]
                if not all(a in index for a in needs):
                    break
                index[(kind, s, k)] = len(order)
                order.append((_KIND[kind], s, last[d], [index[a] for a in waits]))
                last[d] = len(order) - 1
                cursor[d] += 1
                left -= 1
        if left == before:
            raise SBPError(
                f"search_pipeline: the action lists of {st.schedule!r} on {st.groups} device groups and "
                f"{st.microbatches} microbatches cannot run to the end; check them with "
                "schedule.check(devices, microbatches), which names the action that waits."
            )
    return order


def list_bound(st: Setting, order: list, bounds) -> float:
    """A lower bound on the simulated step of a schedule with action lists: each
    device runs its list in order, and an action starts no sooner than what it
    waits for ends plus the transfer into its stage (the simulator also runs
    that transfer on the receiving device's thread, which can only delay)."""
    f, b, t = stage_prices(st, bounds)
    half = (b - st.costs.action_s) / 2 + st.costs.action_s  # B and W, as :func:`durations` prices them
    took = (f, b, half, half)
    end = [0.0] * len(order)
    for i, (kind, s, previous, waits) in enumerate(order):
        start = end[previous] if previous >= 0 else 0.0
        for j in waits:
            start = max(start, end[j] + t[s])
        end[i] = start + took[kind][s]
    return max(end, default=0.0)


def evaluate(st: Setting, bounds) -> Evaluated | None:
    """The simulated step of one cut, or None when a device group is over budget."""
    memory = group_memory(st, bounds)
    if st.budget is not None and max(memory) > st.budget:
        return None
    graph = st.graph() if st.graph is not None else build_graph(st.schedule, st.groups, st.microbatches)
    timeline = simulate_graph(graph, durations(st, bounds))
    return Evaluated(tuple(bounds), float(timeline.makespan), memory)


def least_bound(st: Setting) -> float:
    """The least bound any cut of this configuration has (``inf``: none fits)."""
    tb = Tables(st)
    tables = [tb.bound(s) for s in range(st.stages)]
    G, _ = suffix_table(lambda s: tables[s], st.costs.layers, st.stages)
    least = max(float(G[0][0]), tb.mean_load())
    if np.isfinite(least) and not st.one_stage_per_group:
        # every cut's first stage ends somewhere: the least of the walk's first bounds
        ends = np.arange(1, st.costs.layers - st.stages + 2)
        keys, _ = GroupBounds(tb).extend(PartialCut.empty(st.groups), 0, 0, ends)
        least = max(least, float(np.maximum(np.maximum(tables[0][0, ends], G[1][ends]), keys).min()))
    return least


def cut_candidates(
    st: Setting,
    incumbent: float = math.inf,
    max_plays: int = 64,
    tolerance: float = 0.0,
):
    """The cuts of ``st`` that could beat ``incumbent``, as ``([(bound, cut)],
    rest)``, the caller to simulate them cheapest bound first while they can
    still win. A cut is skipped when its bound is within ``tolerance`` of the
    incumbent (``bound * (1 + tolerance) >= incumbent``), so the best simulated
    is at most ``1 + tolerance`` times the optimum. A cut that gets past the
    bounds is played on the schedule, for a schedule with action lists along
    them (:func:`list_bound`), which tightens its bound. ``rest`` is the least
    bound of the cuts left unseen when ``max_plays`` cuts were played or the
    bounds they pay for (:func:`_bound_budget`) ran out (``math.inf`` when
    every cut that could win was seen): the caller's best step proves the
    search once it is at most ``rest`` (a cap hit while nothing was known,
    ``incumbent`` infinite, is proven harmless by the step found later)."""
    tb = Tables(st)
    L, n = st.costs.layers, st.stages
    tables = [tb.bound(s) for s in range(n)]
    G, _ = suffix_table(lambda s: tables[s], L, n)
    groups = None if st.one_stage_per_group else GroupBounds(tb)
    found: list = []
    state = {"played": 0, "proven": True, "priced": 0, "rest": math.inf}
    order = list_order(st)
    budget = max_plays * _bound_budget(st)

    def leaf(bounds):
        if st.budget is not None and max(group_memory(st, bounds)) > st.budget:
            return  # never simulated
        bound = lower_bound(st, bounds)
        if bound * (1 + tolerance) >= incumbent:
            return
        if state["played"] >= max_plays:
            state["proven"] = False
            state["rest"] = min(state["rest"], bound)
            return
        state["played"] += 1
        if order:
            bound = max(bound, list_bound(st, order, bounds))
        if bound * (1 + tolerance) < incumbent:
            found.append((bound, bounds))

    def walk(s: int, a: int, so_far: float, bounds: list, part: PartialCut | None):
        if not state["proven"]:
            return  # out of plays or bounds: the cuts found stand
        if s == n - 1:
            leaf([*bounds, (a, L)])
            return
        ends = np.arange(a + 1, L - (n - 1 - s) + 1)
        keys = np.maximum(so_far, np.maximum(tables[s][a, ends], G[s + 1][ends]))
        child = None
        if groups is not None and part is not None:
            # the group bound only for the ends the stage tables leave
            live = keys * (1 + tolerance) < incumbent
            ends, keys = ends[live], keys[live]
            state["priced"] += len(ends)
            if state["priced"] > budget:
                state["proven"] = False
                state["rest"] = min(state["rest"], float(keys.min(initial=math.inf)))
                return
            if not len(ends):
                return
            group_keys, child = groups.extend(part, s, a, ends)
            keys = np.maximum(keys, group_keys)
        for i in np.argsort(keys, kind="stable"):
            if keys[i] * (1 + tolerance) >= incumbent or not np.isfinite(keys[i]):
                break
            if not state["proven"]:  # out of plays or bounds below: what is left here starts at this key
                state["rest"] = min(state["rest"], float(keys[i]))
                break
            b = int(ends[i])
            below = None if child is None else child(i)
            walk(s + 1, b, max(so_far, float(tables[s][a, b])), [*bounds, (a, b)], below)

    least = max(float(G[0][0]), tb.mean_load())
    if np.isfinite(least) and least * (1 + tolerance) < incumbent:
        walk(0, 0, 0.0, [], None if groups is None else PartialCut.empty(st.groups))
    return found, state["rest"]


def _bound_budget(st: Setting) -> int:
    """Partial cuts the group bound may price per cut played: as many as the
    stage tables have (stage, first layer) entries a cut can use (one walk
    down that prices every end of every stage), per cut it may play.
    Where a group runs one stage the stage tables alone bound the walk, which
    then reaches a cut to simulate within a few steps of each."""
    return st.stages * (st.costs.layers - st.stages + 1)


def every_cut(layers: int, stages: int):
    """All ``C(layers - 1, stages - 1)`` cuts into non-empty contiguous stages."""
    for inner in itertools.combinations(range(1, layers), stages - 1):
        edges = (0, *inner, layers)
        yield [(edges[i], edges[i + 1]) for i in range(stages)]

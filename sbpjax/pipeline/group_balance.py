"""Cutting layers into stages where a device group runs several of them.

Interleaved 1F1B, ZB-V and DualPipeV put ``v`` stages on each device group.
Balancing each stage alone (:func:`sbpjax.pipeline.balance`) leaves the
groups' loads uneven: on ZB-V with 2 groups and 8 microbatches, an embedding
of cost 0.1, five blocks of 1 and a head of 0.9 were cut as embedding | 2
blocks | 2 blocks | 1 block + head; group 0 ran the first and last stages
(2.0) and group 1 the middle two (4.0), and the simulated step took 32.0
where the best cut takes 25.1 (a layer's forward a third of its cost).

Decision: the step's simulated makespan is the target, not the largest
group sum. Cutting for the group sums alone (exact, over every cut) moved
the simulated makespan the wrong way on a third of random cases (on ZB-V with
3 groups and 12 layers, 19% slower than the stage-balanced cut): with few
microbatches the warm-up and cool-down run stage by stage. The makespan
depends on the microbatch count, so the cut is refined only when it is given
(``cut(..., microbatches=m)``).

:func:`refined` tries every cut where there are no more than
``SIMULATIONS`` of them (``math.comb(layers - 1, stages - 1)``: up to 12
layers in 6 stages, 17 in 4), and keeps the one whose step simulates
shortest (then the smallest slowest stage, then the first): the best cut.
Elsewhere it descends from two starts, the stage-balanced cut and that cut
moved to even group sums (no simulation): it makes the move (``_moves``)
that shortens the simulated step most (then the slowest stage), and stops
when none does or ``SIMULATIONS`` are spent. That result is never slower on
the simulated clock than the stage-balanced cut, and a local optimum: the
stage-balanced cut was up to 37.5% slower than the best cut on 240 random
small cases (4.6% on average), the descent up to 6.7% (DualPipeV on 2
groups, 8 microbatches, layer costs 1.52, 0.26, 0.91, 0.85, 0.48, 1.88,
0.28: no move improved on the stage-balanced cut, 29.44 against 27.58),
which is why small cuts are now tried in full.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np

from sbpjax.pipeline.balance import Balance, range_costs
from sbpjax.pipeline.graph import build_graph
from sbpjax.pipeline.simulate import simulate_graph

# How far a move of one stage boundary shifts it (layers); moves of several
# boundaries shift each by one. Each move is priced by a simulation of the
# whole step, so the moves tried per pass stay few (``_moves``).
REACH = 2

# Simulations the descent from each start may run, and the most cuts tried in full:
# an effort limit, not a clock, so the cut is the same on every machine. The descent
# on 240 random cuts (6-11 layers, 2-3 groups) ran at most 149 of them (44 on
# average); a 66-layer ZB-V cut into 16 stages (32 microbatches) runs about 22 ms
# per simulation: 13 s per start at the limit.
SIMULATIONS = 600

# Forward : backward time of a layer, the backward split evenly into B (input
# gradient) and W (weight gradient): the split simulate() and the pipeline
# benchmark price schedules with.
_SHARE = {"forward": 1 / 3, "backward": 2 / 3, "backward_input": 1 / 3, "backward_weight": 1 / 3}


def refined(
    costs: Sequence[float] | np.ndarray, balanced: Balance, schedule, groups: int, microbatches: int
) -> Balance:
    """``balanced`` (a cut of layers with these ``costs``), or a nearby cut
    whose step on ``groups`` device groups with ``microbatches`` simulates
    shorter under ``schedule`` (see the module docstring)."""
    n = len(balanced.bounds)
    if schedule.stages(groups) != n or n == groups:
        return balanced
    table = range_costs(costs)
    graph = build_graph(schedule, groups, microbatches)
    layers = len(costs)
    owner = [schedule.device_of(s, groups) for s in range(n)]

    def stages(ends: tuple) -> list:
        edges = (0, *ends, layers)
        return [float(table[a, b]) for a, b in zip(edges[:-1], edges[1:])]

    def group_sums(ends: tuple) -> tuple:
        stage, load = stages(ends), [0.0] * groups
        for s, c in enumerate(stage):
            load[owner[s]] += c
        return (max(load), max(stage))

    def simulated_within(budget: int):
        left = [budget]

        def simulated(ends: tuple) -> tuple:
            if left[0] <= 0:  # the effort spent: no further cut is taken
                return (math.inf, math.inf)
            left[0] -= 1
            stage = stages(ends)
            return (_simulated(graph, stage), max(stage))

        return simulated

    if math.comb(layers - 1, n - 1) <= SIMULATIONS:
        every = itertools.combinations(range(1, layers), n - 1)
        ends = min(every, key=lambda e: (_simulated(graph, stages(e)), max(stages(e))))
        return _balance(table, ends, layers)
    start = tuple(b for _, b in balanced.bounds[:-1])
    # two starts, the stage-balanced cut and the cut descended to even group
    # sums (no simulation), each descended with SIMULATIONS of its own: each
    # descent prices its start first and only moves to a shorter step, so the
    # better of the two is never slower than the stage-balanced cut
    starts = sorted({start, _descend(group_sums, start, layers)[1]})
    ends = min(_descend(simulated_within(SIMULATIONS), e, layers) for e in starts)[1]
    return _balance(table, ends, layers)


def _balance(table, ends: tuple, layers: int) -> Balance:
    """The cut whose stages end at ``ends`` (and the last at ``layers``)."""
    edges = (0, *ends, layers)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    return Balance(bounds, tuple(float(table[a, b]) for a, b in bounds))


def _simulated(graph, stage: list) -> float:
    """The makespan of ``graph`` with stage ``s``'s actions taking their share of ``stage[s]``."""

    def duration(kind, s, k):
        return 0.0 if s is None else _SHARE.get(kind, 0.0) * stage[s]

    return simulate_graph(graph, duration).makespan


def _descend(key, ends: tuple, layers: int) -> tuple:
    """``(key, ends)`` where moving from ``ends`` (``_moves``) stops lowering ``key``."""
    current = key(ends)
    while True:
        best = min(((key(m), m) for m in _moves(ends, layers)), default=None)  # ties: first boundaries first
        if best is None or not best[0] < current:
            return current, ends
        current, ends = best


def _moves(ends: tuple, layers: int) -> list:
    """The cuts one move away: a boundary shifted by up to ``REACH`` layers;
    a stage widened or narrowed by a layer on each side; a run of consecutive boundaries
    shifted by one layer together (a layer handed on through several stages,
    which moves of one or two boundaries cannot do where each is worse alone)."""
    out = set()
    k = len(ends)
    shifts = [d for d in range(-REACH, REACH + 1) if d]
    for i in range(k):
        for d in shifts:
            out.add(ends[:i] + (ends[i] + d,) + ends[i + 1 :])
        if i + 1 < k:
            for d in (-1, 1):  # a stage widened or narrowed on both sides
                out.add(ends[:i] + (ends[i] - d, ends[i + 1] + d) + ends[i + 2 :])
        for j in range(i + 1, k):
            for d in (-1, 1):
                out.add(ends[:i] + tuple(e + d for e in ends[i : j + 1]) + ends[j + 1 :])
    edges = [(0, *m, layers) for m in out if m != ends]
    return sorted(e[1:-1] for e in edges if all(a < b for a, b in zip(e[:-1], e[1:])))  # no empty stage


def makespan(costs: Sequence[float] | np.ndarray, bounds, schedule, groups: int, microbatches: int) -> float:
    """The simulated step of the cut ``bounds`` (for tests and reports)."""
    table = range_costs(costs)
    return _simulated(build_graph(schedule, groups, microbatches), [float(table[a, b]) for a, b in bounds])

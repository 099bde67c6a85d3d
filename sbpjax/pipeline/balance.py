"""Cutting a chain of layers into contiguous stages: an exact dynamic program.

    b = sjp.balance([3.0, 1.0, 1.0, 4.0, 2.0], stages=2)
    b.bounds        # ((0, 3), (3, 5)): stage 0 runs layers 0-2, stage 1 layers 3-4
    b.slowest       # 6.0, the least any cut can make its slowest stage

For ``L`` layers and ``p`` stages, ``G[s][a]`` is the least slowest-stage cost
over every way to cut layers ``a .. L-1`` into stages ``s .. p-1``, each
non-empty: ``G[p-1][a] = cost(p-1, a, L)`` and ``G[s][a] = min over b of
max(cost(s, a, b), G[s+1][b])``. ``G[0][0]`` is the optimum, found in
``O(p L^2)`` without trying the ``C(L-1, p-1)`` cuts. A stage's cost may depend
on its position as well as its layers (the joint search prices a stage by where
it sits in the pipeline: its warm-up and cool-down), which is why the table is
built from a function of ``(stage, first layer, end)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from sbpjax._errors import SBPError, is_count


@dataclasses.dataclass(frozen=True)
class Balance:
    """A cut: stage ``s`` runs layers ``bounds[s][0] .. bounds[s][1] - 1``."""

    bounds: tuple[tuple[int, int], ...]
    stage_costs: tuple[float, ...]

    @property
    def slowest(self) -> float:
        return max(self.stage_costs)

    def __repr__(self):
        parts = ", ".join(f"{lo}-{hi - 1}" for lo, hi in self.bounds)
        return f"Balance(layers per stage: {parts}; slowest {self.slowest:.4g})"


def range_costs(costs: Sequence[float] | np.ndarray) -> np.ndarray:
    """``C[a, b]``: the cost of layers ``a .. b - 1`` summed left to right,
    ``inf`` where ``b <= a`` (an empty stage)."""
    c = np.asarray(costs, dtype=np.float64)
    n = len(c)
    # row a holds c[j] from j = a on: its running sum adds them left to right
    sums = np.cumsum(np.where(np.arange(n)[None, :] >= np.arange(n)[:, None], c[None, :], 0.0), axis=1)
    table = np.full((n + 1, n + 1), np.inf)
    table[:n, 1:] = np.where(np.arange(1, n + 1)[None, :] > np.arange(n)[:, None], sums, np.inf)
    return table


def suffix_table(stage_cost: Callable[[int], np.ndarray], layers: int, stages: int):
    """``(G, ends)`` of the module docstring for ``stage_cost(s) -> C_s`` (an
    ``(L+1, L+1)`` array, ``C_s[a, b]`` the cost of stage ``s`` on layers ``a .. b-1``,
    ``inf`` where it may not run them). ``ends[s][a]``: the end of stage ``s`` in
    an optimal cut of ``a .. L-1`` (the first such end)."""
    G = np.full((stages, layers + 1), np.inf)
    ends = np.zeros((stages, layers + 1), dtype=np.int64)
    G[stages - 1] = stage_cost(stages - 1)[:, layers]
    ends[stages - 1] = layers
    for s in range(stages - 2, -1, -1):
        both = np.maximum(stage_cost(s), G[s + 1][None, :])
        ends[s] = np.argmin(both, axis=1)
        G[s] = both[np.arange(layers + 1), ends[s]]
    return G, ends


def walk(ends: np.ndarray, start: int = 0, first_stage: int = 0) -> list[tuple[int, int]]:
    """The stage bounds an ``ends`` table gives from layer ``start`` on."""
    bounds, a = [], start
    for s in range(first_stage, len(ends)):
        b = int(ends[s][a])
        bounds.append((a, b))
        a = b
    return bounds


def check_stages(stages, layers: int, where: str) -> None:
    if not is_count(stages):
        raise SBPError(f"{where}: stages={stages!r}; give the number of stages, an int >= 1.")
    if stages > layers:
        raise SBPError(
            f"{where}: {stages} stages for {layers} layers; every stage needs at least one layer. Use at most "
            f"{layers} stages (fewer, larger device groups), or split the model into more layers."
        )


def balance(costs: Sequence[float] | np.ndarray, stages: int) -> Balance:
    """The contiguous cut of layers with these ``costs`` into ``stages`` non-empty
    stages whose slowest stage is as cheap as any cut's (exact; ties go to the
    cut whose stage ends come first)."""
    if np.ndim(costs) != 1:
        raise SBPError(
            f"balance: costs has shape {np.shape(costs)}; give one number per layer (a list or a 1-D array)."
        )
    costs = [float(c) for c in costs]
    bad = [i for i, c in enumerate(costs) if not np.isfinite(c) or c < 0]
    if bad:
        raise SBPError(
            f"balance: layer costs must be finite and >= 0; layer(s) {bad} have {[costs[i] for i in bad]}."
        )
    check_stages(stages, len(costs), "balance")
    table = range_costs(costs)
    _, ends = suffix_table(lambda s: table, len(costs), int(stages))
    bounds = walk(ends)
    return Balance(tuple(bounds), tuple(float(table[a, b]) for a, b in bounds))

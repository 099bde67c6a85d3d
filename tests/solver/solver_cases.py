"""Random small problems and their brute-force optimum, for the solver's property tests."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np

from sbpjax.solver import Problem

ROOT = Path(__file__).resolve().parents[2]
INSTANCES = ROOT / "benchmarks" / "iopddl"


def random_problem(
    rng: np.random.Generator,
    n: int,
    m: int,
    kmax: int = 3,
    forbid: float = 0.1,
    memory: bool = False,
    follow: float = 0.2,
) -> Problem:
    """``n`` nodes, ``m`` edges between random pairs (repeats allowed: multi-edges), costs
    0-19, a share ``forbid`` of costs inf, a share ``follow`` of edges that make one end
    a function of the other (the reductions merge those), optional memory."""
    k = rng.integers(1, kmax + 1, n)
    costs = [np.where(rng.random(x) < forbid, np.inf, rng.integers(0, 20, x).astype(float)) for x in k]
    edges = []
    for _ in range(m if n > 1 else 0):
        u, v = (int(x) for x in rng.choice(n, 2, replace=False))
        mat = rng.integers(0, 20, (k[u], k[v])).astype(float)
        if rng.random() < follow:
            f = rng.integers(0, k[v], k[u])
            mat = np.where(np.arange(k[v])[None, :] == f[:, None], mat, np.inf)
        else:
            mat[rng.random(mat.shape) < forbid] = np.inf
        edges.append((u, v, mat))
    if not memory:
        return Problem(costs, edges)
    usages = [rng.integers(0, 10, x).astype(float) for x in k]
    intervals = np.sort(rng.integers(0, 6, (n, 2)), axis=1)
    return Problem(costs, edges, usages, intervals, float(rng.integers(5, 30)))


def brute_force(problem: Problem) -> tuple[float, np.ndarray | None]:
    """The least feasible cost and one solution reaching it (inf, None: none feasible)."""
    best, arg = np.inf, None
    for s in itertools.product(*[range(int(x)) for x in problem.num_strategies]):
        cost, feasible, _ = problem.evaluate(np.array(s))
        if feasible and cost < best:
            best, arg = cost, np.array(s)
    return best, arg


def close(a: float, b: float) -> bool:
    """Equal costs, up to float rounding scaled to their size (inf equals inf)."""
    if np.isinf(a) or np.isinf(b):
        return a == b
    return abs(a - b) <= 1e-9 * (1.0 + abs(a) + abs(b))
